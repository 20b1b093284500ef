"""Default sampling parameters a model ships with: ``generation_config.json`` in a Hugging Face
folder, or the ``general.sampling.*`` keys of a GGUF file.

The HTTP server applies them to a request that leaves the parameter out (as vLLM does with
``--generation-config auto``); a parameter the request gives always wins. A model without
them (the embedded SmolLM2 GGUF has none) keeps OpenAI's defaults: temperature 1, top_p 1.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)

_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass(frozen=True)
class GenerationDefaults:
    """Each field ``None`` when the model's files do not set it. ``source`` names the file."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    source: str | None = None

    def as_dict(self) -> dict[str, float | int]:
        """The parameters that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) is not None}

    def describe(self) -> str:
        values = self.as_dict()
        if not values:
            return "none in the model's files (OpenAI's: temperature 1, top_p 1)"
        return ", ".join(f"{k}={v}" for k, v in values.items()) + f" (from {self.source})"


def _valid(name: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return {"temperature": 0 <= value <= 2, "top_p": 0 < value <= 1, "top_k": value >= 0 and value == int(value),
            "min_p": 0 <= value <= 1, "repetition_penalty": 0.01 <= value <= 100}[name]


def _build(values: dict[str, Any], source: str) -> GenerationDefaults:
    kept = {}
    for name, value in values.items():
        if value is None:
            continue
        if not _valid(name, value):
            log.warning("ignoring %s=%r from %s (out of range)", name, value, source)
            continue
        kept[name] = int(value) if name == "top_k" else float(value)
    if kept.get("top_k") == 0:
        del kept["top_k"]  # 0 means off, as no value
    return GenerationDefaults(**kept, source=source if kept else None)


def read_generation_defaults(path: str) -> GenerationDefaults:
    """The defaults of the model at ``path`` (a HF folder or a .gguf file); empty if none or unreadable."""
    try:
        if os.path.isdir(path):
            file = os.path.join(path, "generation_config.json")
            if not os.path.isfile(file):
                return GenerationDefaults()
            with open(file, encoding="utf-8") as f:
                cfg = json.load(f)
            if not isinstance(cfg, dict):
                return GenerationDefaults()
            return _build({k: cfg.get(k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
                          "generation_config.json")
        if path.endswith(".gguf"):
            # the scalar metadata only: gguf.GGUFReader parsed the whole vocabulary first (~12 s of
            # Gemma 3's load for its 262k tokens)
            from .model.gguf_file import read_header

            meta = read_header(path).meta
            return _build({name: meta.get(key) for key, name in _GGUF_KEYS.items()},
                          f"{os.path.basename(path)} general.sampling.*")
    except Exception as e:  # defaults are a convenience: a bad file must not stop the model loading
        log.warning("cannot read the generation defaults of %s: %s", path, e)
    return GenerationDefaults()
