"""The reliability suite runs on a tiny random-weight model (tests/tiny_model.py): what it checks is
the server's and the engine's behaviour under faults and load, not the text."""
from __future__ import annotations

import pytest

from ..tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")))
