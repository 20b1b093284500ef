"""HF ``model_type`` -> its :class:`~fastgen.model.spec.Family`. Adding an architecture is one
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


def model_class(model_type: str) -> type:
    return family(model_type).model_class


def model_config(hf_config: Any) -> ModelConfig:
    """The :class:`ModelConfig` (what the engine and the layers read) of a transformers config."""
    return family(hf_config.model_type).config(hf_config)
