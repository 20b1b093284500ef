"""The fake engines of the server and bench tests satisfy the same Protocol as the real Engine,
method by method and parameter by parameter (names, kinds, defaults)."""
from __future__ import annotations

import inspect

import pytest

from fastgen.engine import Engine
from fastgen.engine_protocol import StepEngine

from ..server.test_units import FailingEngine, FakeEngine as ServerFakeEngine
from .test_bench_targets import FakeEngine as BenchFakeEngine

MEMBERS = [name for name, value in vars(StepEngine).items() if inspect.isfunction(value) and not name.startswith("_")]


def shape(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    """A signature without its annotations (the fakes need not import the engine's types)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_protocol_names_what_the_drivers_call():
    assert MEMBERS == ["add_request", "has_unfinished", "step", "abort", "response", "stats"]


@pytest.mark.parametrize("cls", [Engine, ServerFakeEngine, FailingEngine, BenchFakeEngine])
def test_engines_and_fakes_satisfy_the_protocol(cls):
    assert issubclass(cls, StepEngine)
    for name in MEMBERS:
        assert shape(getattr(cls, name)) == shape(getattr(StepEngine, name)), f"{cls.__name__}.{name}"


def test_a_fake_that_drifts_is_caught():
    class Drifted(ServerFakeEngine):
        def abort(self, rid: str) -> None:  # lost the reason the engine loop passes on timeouts
            super().abort(rid)

    assert shape(Drifted.abort) != shape(StepEngine.abort)
