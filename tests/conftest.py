"""Shared fixtures. The real SmolLM2 is loaded once per session, in fp32, for exact comparisons."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(len(os.sched_getaffinity(0)))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from fastgen.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_pipe():
    import fastgen

    return fastgen.pipeline(dtype="float32")


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' own GGUF loader and model: the reference implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32)
    return model.eval()
