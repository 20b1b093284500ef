"""HF ``model_type`` -> model class. Adding an architecture is one file plus one entry here."""
from __future__ import annotations

from ..errors import ModelLoadError
from .llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}


def model_class(model_type: str) -> type:
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ModelLoadError(
            f"model_type {model_type!r} is not supported; supported: {sorted(MODEL_REGISTRY)}") from None
