"""The kernels' row limits measured per host (fastgen/row_limits.py): the choice from the points,
an engine that measures, applies and caches them, and the limits deciding the kernel."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fastgen import kernels
from fastgen.model.quant import QuantWeight
from fastgen.row_limits import A8_KERNEL_ROWS, A8_LADDER, NEVER, RowLimits, a8_formats, apply_limits, choose_limits

from .test_calibrate import _as_if_quiet


@pytest.fixture(autouse=True)
def _a8_kernel_restored():
    """An engine that measures its row limits sets qgemm_a8's many-row kernel for the process:
    each test here leaves the choice as it found it."""
    if not kernels.load():
        yield
        return
    was = torch.ops.fastgen.set_a8_lanes(True)
    torch.ops.fastgen.set_a8_lanes(was)
    yield
    torch.ops.fastgen.set_a8_lanes(was)


def _vnni_or_skip() -> None:
    if not kernels.load():
        pytest.fail("fastgen's native kernels did not build on this host")
    if 4 not in torch.ops.fastgen.a8_kinds():
        pytest.skip("no int8-activation kernel for 4-bit rows on this CPU")


@pytest.mark.parametrize("qgemv,a8,want", [
    # (rows, qgemv ms, other ms), (rows, qgemm_a8 ms, qgemm ms) -> (max_qgemv_rows, min_a8_rows, max_a8_rows)
    ([(2, 1, 5), (4, 2, 5), (8, 4, 5), (12, 6, 5)], [(16, 9, 8), (32, 9, 10), (64, 9, 10)], (8, 32, NEVER)),
    ([(2, 6, 5)], [(16, 9, 10), (32, 9, 10)], (1, 16, NEVER)),                # qgemv never wins: one row only
    ([(2, 1, 5), (4, 2, 5)], [(16, 9, 8), (32, 11, 10)], (4, NEVER, NEVER)),  # qgemm_a8 never wins
    # qgemv's limit: a win below a loss does not count. qgemm_a8's run: the points where it saves
    # the most in all, a loss inside it taken where the wins on both sides outweigh it ...
    ([(2, 1, 5), (4, 6, 5), (6, 1, 5)], [(16, 8, 10), (32, 11, 10), (64, 9, 10)], (2, 16, NEVER)),
    # ... and not where it costs more than the wins on one side save
    ([(2, 1, 5)], [(16, 9, 10), (32, 14, 10), (64, 7, 10)], (2, 64, NEVER)),
    # the Zen 4 host's points before the few-row path's even passes (12-06): 2-16 rows won by 2-11
    # ms, 32 lost by 2.5: every row count from 2 takes qgemm_a8
    ([(2, 3.0, 2.98)], [(2, 3.0, 14.1), (4, 3.6, 14.0), (8, 4.7, 14.1), (12, 6.2, 14.1), (16, 12.7, 14.4),
                        (32, 24.2, 21.7), (64, 30.2, 36.7), (128, 53.3, 67.7)], (1, 2, NEVER)),
    # qgemm overtakes qgemm_a8 past a few dozen rows (bf16 on AMX tiles): qgemm_a8 keeps the middle
    ([(2, 1, 5)], [(2, 5, 30), (4, 5, 30), (32, 17, 18), (64, 24, 20), (128, 44, 27)], (2, 2, 32)),
    # ... and from where its run saves the most: a small loss at 2 rows leaves 2 rows to qgemm
    ([(2, 1, 5)], [(2, 5, 4), (4, 5, 30), (16, 9, 8), (32, 17, 18), (64, 24, 20)], (2, 4, 32)),
])
def test_the_limits_are_where_one_kernel_stays_ahead(qgemv, a8, want):
    assert choose_limits(qgemv, a8) == want


def test_the_limits_decide_which_kernel_takes_a_product():
    _vnni_or_skip()
    g = torch.Generator().manual_seed(7)
    from fastgen.model.quant import quantize

    fmt = QuantWeight(quantize(torch.randn(48, 128, generator=g), 4), None, int8_activations=True)
    calls = []
    for name in ("_qgemv", "_qgemm", "_qgemm_a8"):
        real = getattr(fmt, name)
        setattr(fmt, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))

    class Holder(torch.nn.Module):
        pass

    apply_limits(Holder(), [fmt], 3, 16, 24)
    x = torch.randn(30, 128, generator=g).bfloat16()
    for rows, kernel in ((3, "_qgemv"), (4, "_qgemm"), (15, "_qgemm"), (16, "_qgemm_a8"), (20, "_qgemm_a8"),
                         (24, "_qgemm_a8"), (25, "_qgemm"), (30, "_qgemm")):
        calls.clear()
        fmt.matmul(x[:rows])
        assert calls == [kernel], rows
    assert fmt.decode_plan(torch.bfloat16) == (3, True) and fmt.decode_plan(torch.float32) == (3, True)


def test_an_engine_measures_its_row_limits_applies_them_and_caches_them(tmp_path, monkeypatch):
    """A real engine on a tiny int4 model with int8 activations measures the limits at start-up,
    sets them on every 4-bit layer format (the native stack follows), and a second start reads them
    from the cache; ``FASTGEN_ROW_LIMITS=fixed`` measures nothing and keeps the constants."""
    _vnni_or_skip()
    from fastgen.engine import Engine

    from ..tiny_model import make_tiny_model

    make_tiny_model(str(tmp_path / "ckpt"))
    monkeypatch.setenv("FASTGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FASTGEN_ROW_LIMITS", "auto")
    _as_if_quiet(monkeypatch)   # what else CI runs must not decide the caching; the guard has its own test
    opts = dict(quantization="int4", dtype="bfloat16", kernels="native", budget_tokens=64, num_threads=2)
    engine = Engine.from_pretrained(str(tmp_path / "ckpt"), **opts)
    limits = engine.row_limits
    assert limits is not None and not limits.cached
    assert [n for n, _, _ in limits.a8_points] == list(A8_LADDER)
    assert limits.qgemv_points and limits.qgemv_points[0][0] == 2
    assert (limits.max_qgemv_rows, limits.min_a8_rows, limits.max_a8_rows) == choose_limits(limits.qgemv_points,
                                                                                            limits.a8_points)
    formats = a8_formats(engine.model)
    assert formats and all(f.max_qgemv_rows == limits.max_qgemv_rows and f.min_a8_rows == limits.min_a8_rows
                           and f.max_a8_rows == limits.max_a8_rows for f in formats)
    stack = engine.model._native_stack()
    # the output head (int4 here, int8 activations) is measured apart and gets its own limits
    from fastgen.row_limits import HEAD_LADDER, head_format

    head = head_format(engine.model)
    assert head is not None and limits.head is not None
    assert [n for n, _, _ in limits.head.a8_points] == list(HEAD_LADDER)
    assert (limits.head.max_qgemv_rows, limits.head.min_a8_rows, limits.head.max_a8_rows) == choose_limits(
        limits.head.qgemv_points, limits.head.a8_points)
    assert (head.max_qgemv_rows, head.min_a8_rows, head.max_a8_rows) == (
        limits.head.max_qgemv_rows, limits.head.min_a8_rows, limits.head.max_a8_rows)
    assert "output head" in limits.describe() and "head<=" in limits.key
    # past qgemv's limit the stack also takes what qgemm_a8's few-row path takes, where it is the choice
    few = (min(QuantWeight.A8_FEW_ROWS, limits.max_a8_rows) if limits.min_a8_rows <= QuantWeight.A8_FEW_ROWS
           else 0)
    assert stack is not None and stack.max_rows == max(limits.max_qgemv_rows, few)
    assert list((tmp_path / "cache" / "row-limits").glob("*.json"))

    again = Engine.from_pretrained(str(tmp_path / "ckpt"), **opts).row_limits
    assert again.cached and again.a8_points == limits.a8_points and again.qgemv_points == limits.qgemv_points
    assert again.head is not None and again.head.qgemv_points == limits.head.qgemv_points

    # qgemm_a8's many-row kernel: measured where the build has both, the faster set for the process
    if torch.ops.fastgen.have_a8_lanes():
        assert limits.a8_kernel is not None and limits.a8_kernel[0] == A8_KERNEL_ROWS
        assert limits.a8_lanes == (limits.a8_kernel[1] <= limits.a8_kernel[2])
        assert torch.ops.fastgen.a8_lanes() == limits.a8_lanes
        assert ("a8=lanes" if limits.a8_lanes else "a8=blocks") in limits.key
        assert again.a8_kernel == limits.a8_kernel
    else:
        assert limits.a8_kernel is None and again.a8_kernel is None and not torch.ops.fastgen.a8_lanes()

    monkeypatch.setenv("FASTGEN_ROW_LIMITS", "fixed")
    fixed = Engine.from_pretrained(str(tmp_path / "ckpt"), **opts)
    assert fixed.row_limits is None
    assert all(f.max_qgemv_rows == QuantWeight.MAX_QGEMV_ROWS_A8 and f.min_a8_rows == QuantWeight.MIN_A8_ROWS
               for f in a8_formats(fixed.model))


@pytest.mark.parametrize("lanes_ms,blocks_ms,want", [(9.0, 4.0, False), (4.0, 9.0, True), (5.0, 5.0, True)])
def test_the_faster_of_qgemm_a8s_many_row_kernels_serves_the_process(tmp_path, monkeypatch, lanes_ms, blocks_ms,
                                                                      want):
    """Where the build has both of qgemm_a8's many-row kernels (AVX-512), the engine's start sets
    the one that measured faster (ties: the lane kernel) for the process, the ladders run through
    it, and the budget's cache key names it. Both give the same bits, so a prompt forward's logits
    do not depend on the choice."""
    _vnni_or_skip()
    from fastgen import row_limits
    if not torch.ops.fastgen.have_a8_lanes():   # AVX2: nothing to choose, nothing measured or set
        torch.ops.fastgen.set_a8_lanes(want)
        assert row_limits.measure_a8_kernel([], torch.bfloat16) is None and not torch.ops.fastgen.a8_lanes()
        return
    from fastgen.engine import Engine

    from ..tiny_model import make_tiny_model

    make_tiny_model(str(tmp_path / "ckpt"))
    monkeypatch.setenv("FASTGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FASTGEN_ROW_LIMITS", "auto")
    _as_if_quiet(monkeypatch)
    seen = []

    def measured(formats, dtype, progress=None, rows=A8_KERNEL_ROWS):
        if progress is not None:
            progress()
        return rows, lanes_ms, blocks_ms

    real_points = row_limits.measure_points

    def points(*args, **kwargs):   # the ladders run through the chosen kernel
        seen.append(torch.ops.fastgen.a8_lanes())
        return real_points(*args, **kwargs)

    monkeypatch.setattr(row_limits, "measure_a8_kernel", measured)
    monkeypatch.setattr(row_limits, "measure_points", points)
    torch.ops.fastgen.set_a8_lanes(not want)
    engine = Engine.from_pretrained(str(tmp_path / "ckpt"), quantization="int4", dtype="bfloat16",
                                    kernels="native", budget_tokens=64, num_threads=2)
    limits = engine.row_limits
    assert limits.a8_kernel == (A8_KERNEL_ROWS, lanes_ms, blocks_ms) and limits.a8_lanes == want
    assert seen and seen[0] == want and torch.ops.fastgen.a8_lanes() == want
    assert ("a8=lanes" if want else "a8=blocks") in limits.key
    assert ("lane kernel" if want else "block kernels") in limits.describe()
    # the same prompt's logits through either kernel (its 40 rows past the few-row path)
    from fastgen.batch import SeqInput, build_batch

    for f in a8_formats(engine.model):
        f.min_a8_rows, f.max_a8_rows = 2, NEVER
    engine.model.__dict__["_stack"] = None
    pool = engine.new_pool(4)
    bs = engine.config.cache.block_size
    batch = build_batch([SeqInput(list(range(3, 43)), 0, list(range(-(-40 // bs))), 40)], bs, engine.config.device)
    logits = []
    for lanes in (True, False):
        torch.ops.fastgen.set_a8_lanes(lanes)
        logits.append(engine.model(batch, pool))
    assert torch.equal(logits[0], logits[1])


def test_the_kernel_choice_follows_the_measurement():
    base = dict(max_qgemv_rows=4, min_a8_rows=16, qgemv_points=(), a8_points=())
    lanes, blocks = RowLimits(**base, a8_kernel=(128, 3.0, 6.0)), RowLimits(**base, a8_kernel=(128, 6.0, 3.0))
    assert lanes.a8_lanes and not blocks.a8_lanes and lanes.key != blocks.key
    assert not RowLimits(**base).a8_lanes and "a8=" not in RowLimits(**base).key.split(",a8<=")[1]


def test_row_limits_measured_beside_other_work_serve_this_start_only(tmp_path, monkeypatch):
    """Row limits measured while other processes kept the CPUs busy are applied to this start and
    not cached (a busy machine makes the kernels' crossovers wrong)."""
    _vnni_or_skip()
    from fastgen import calibrate
    from fastgen.engine import Engine

    from ..tiny_model import make_tiny_model

    make_tiny_model(str(tmp_path / "ckpt"))
    monkeypatch.setenv("FASTGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FASTGEN_ROW_LIMITS", "auto")
    monkeypatch.setattr(calibrate.OtherLoad, "too_busy", property(lambda self: True))
    engine = Engine.from_pretrained(str(tmp_path / "ckpt"), quantization="int4", dtype="bfloat16", kernels="native",
                                    budget_tokens=64, num_threads=2)
    limits = engine.row_limits
    assert limits is not None and not limits.cached and limits.a8_points
    assert all(f.max_qgemv_rows == limits.max_qgemv_rows for f in a8_formats(engine.model))
    assert not list((tmp_path / "cache").glob("row-limits/*.json"))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 50), st.floats(0.5, 50)), min_size=1, max_size=8))
def test_qgemm_a8_keeps_the_run_of_points_that_saves_the_most(times):
    """Whatever the measured points, the rows qgemm_a8 keeps are a run of ladder points that saves
    at least as much time as any other run, and none where it saves nothing."""
    ladder = [2 ** (i + 1) for i in range(len(times))]
    a8 = [(n, a, b) for n, (a, b) in zip(ladder, times)]
    _, lo, hi = choose_limits([], a8)

    def saved(i, j):
        return sum(b - a for _, a, b in a8[i:j + 1])

    best = max(saved(i, j) for i in range(len(a8)) for j in range(i, len(a8)))
    if best <= 0:
        assert (lo, hi) == (NEVER, NEVER)
        return
    i = ladder.index(lo)
    j = len(a8) - 1 if hi == NEVER else ladder.index(hi)
    assert i <= j and saved(i, j) >= best - 1e-9
