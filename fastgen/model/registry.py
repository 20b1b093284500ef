"""HF ``model_type`` -> its :class:`~fastgen.model.spec.Family`; a GGUF file's architecture ->
the family whose :class:`~fastgen.model.spec.GgufNames` claims it. Adding an architecture is one
file in fastgen/model/ (its model, or only its spec where an existing model fits) plus one
entry here; docs/architecture.md, "Adding a model family", says which test to add."""
from __future__ import annotations

from typing import Any

from ..errors import ModelLoadError
from .falcon import FALCON
from .gemma3 import GEMMA3
from .llama import LLAMA, QWEN2
from .moe import MIXTRAL, QWEN2_MOE, QWEN3_MOE
from .opt import OPT
from .phi import PHI
from .phi3 import PHI3
from .qwen3 import QWEN3
from .spec import Family, ModelConfig

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "gemma3_text": GEMMA3,
    "mixtral": MIXTRAL,
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": QWEN3_MOE,
    "phi3": PHI3,
    "opt": OPT,
    "phi": PHI,
    "falcon": FALCON,
}


def family(model_type: str) -> Family:
    """The family of ``model_type``; :class:`ModelLoadError` naming it and the supported ones."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}") from None


def gguf_family(header: Any) -> Family:
    """The family of a GGUF file (fastgen.model.gguf_file.GgufHeader): the one whose llama.cpp
    architecture it names, with or without routed experts as the file has them;
    :class:`ModelLoadError` naming the architecture and the supported ones otherwise."""
    arch = header.arch
    claims = [f for f in FAMILIES.values() if f.gguf is not None and f.gguf.arch == arch]
    if not claims:
        archs = sorted({f.gguf.arch for f in FAMILIES.values() if f.gguf is not None})
        hf_only = sorted(t for t, f in FAMILIES.items() if f.gguf is None)
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: {archs} (and "
                             f"{hf_only} from Hugging Face folders only: llama.cpp defines no GGUF layout for them)")
    experts = bool(header.key(f"{arch}.expert_count", 0))
    match = [f for f in claims if f.gguf.experts == experts]
    if not match:
        raise ModelLoadError(f"GGUF architecture {arch!r} {'with' if experts else 'without'} routed experts "
                             f"({arch}.expert_count) is not supported")
    return match[0]


def model_class(model_type: str) -> type:
    return family(model_type).model_class


def model_config(hf_config: Any) -> ModelConfig:
    """The :class:`ModelConfig` (what the engine and the layers read) of a transformers config."""
    return family(hf_config.model_type).config(hf_config)
