"""Shared fixtures. The real SmolLM2 is loaded once per session, in fp32, for exact comparisons."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(len(os.sched_getaffinity(0)))
# the kernels' fixed row limits, whatever this host measures (fastgen/row_limits.py): which
# kernel takes a product stays the same on every host; tests/unit/test_row_limits.py measures
os.environ.setdefault("FASTGEN_ROW_LIMITS", "fixed")


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
