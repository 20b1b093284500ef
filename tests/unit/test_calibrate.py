"""budget_tokens="auto": the choice rule on measured-looking curves, and the option's validation."""
from __future__ import annotations

import pytest

from fastgen.calibrate import choose_budget
from fastgen.config import EngineOptions
from fastgen.errors import InvalidRequestError

# (tokens per step, ms per step) as measured on two 2-core hosts (rounded)
AMX_BF16 = [(16, 15), (32, 20), (64, 30), (128, 52), (192, 78), (256, 103), (384, 171), (512, 256)]
VNNI_FP32 = [(16, 40), (32, 62), (64, 110), (128, 215), (192, 330), (256, 450), (384, 690), (512, 930)]


def test_largest_budget_under_the_target():
    assert choose_budget(AMX_BF16, 100) == (192, 64)
    assert choose_budget(AMX_BF16, 260) == (512, 64)


def test_never_below_the_efficiency_floor():
    # no step meets 50 ms on the slow host: the budget stays at the floor, where throughput is
    # already 80% of the best, instead of collapsing to 16 tokens
    budget, floor = choose_budget(VNNI_FP32, 50)
    assert budget == floor
    rates = {n: n / ms for n, ms in VNNI_FP32}
    assert rates[floor] >= 0.8 * max(rates.values())
    smaller = [n for n in rates if n < floor]
    assert all(rates[n] < 0.8 * max(rates.values()) for n in smaller)


def test_unsorted_curve_and_empty_curve():
    assert choose_budget(list(reversed(AMX_BF16)), 100) == (192, 64)
    with pytest.raises(ValueError):
        choose_budget([], 100)


@pytest.mark.parametrize("bad", [dict(budget_tokens=0), dict(budget_tokens="fast"), dict(target_itl_ms=0),
                                 dict(target_itl_ms="x"), dict(kernels="cuda")])
def test_bad_options_name_the_parameter(bad):
    with pytest.raises(InvalidRequestError) as e:
        EngineOptions(**bad)
    assert e.value.param == next(iter(bad))


def _as_if_quiet(monkeypatch) -> None:
    """Caching as on a quiet machine: what else the CI machine runs (a Ray cluster an earlier test
    left winding down) must not decide whether these tests' calibrations are cached. The guard
    itself is tested on its own (test_a_calibration_beside_other_work_is_not_cached)."""
    from fastgen import calibrate

    monkeypatch.setattr(calibrate.OtherLoad, "too_busy", property(lambda self: False))


def _tiny_model_to_calibrate(tmp_path, monkeypatch):
    """A real tiny model (torch kernels) and calibrate_budget's arguments for it, with the cache
    folder under tmp_path."""
    import torch

    from fastgen.model.loader import load_model

    from ..model.test_parity import _tiny_configs, random_checkpoint

    random_checkpoint(_tiny_configs()["llama"], tmp_path / "ckpt")
    model = load_model(str(tmp_path / "ckpt"), dtype=torch.float32, device=torch.device("cpu"), max_positions=600,
                       kernels="torch")
    monkeypatch.setenv("FASTGEN_CACHE_DIR", str(tmp_path / "cache"))
    kw = dict(model_path=str(tmp_path / "ckpt"), target_itl_ms=100.0, kernels="torch", num_threads=1,
              max_tokens=512, model_config=model.config, num_kv_heads=model.config.num_kv_heads, block_size=16,
              dtype=torch.float32, device=torch.device("cpu"))
    return model, kw


def test_a_curve_cut_short_is_not_cached(tmp_path, monkeypatch):
    """A calibration stopped by its time limit (a slow or busy host) picks this start's budget
    from what it measured but is not cached: the next start measures the whole curve, and caches
    that. A real tiny model is measured; only the time limit is shortened."""
    from fastgen import calibrate

    model, kw = _tiny_model_to_calibrate(tmp_path, monkeypatch)
    _as_if_quiet(monkeypatch)
    monkeypatch.setattr(calibrate, "MAX_MEASURE_S", 0.0)
    short = calibrate.calibrate_budget(model, **kw)
    assert len(short.curve) == 1 and not short.cached
    assert not list((tmp_path / "cache").glob("budget/*.json"))
    monkeypatch.setattr(calibrate, "MAX_MEASURE_S", 60.0)
    whole = calibrate.calibrate_budget(model, **kw)
    assert [n for n, _ in whole.curve] == list(calibrate.LADDER) and not whole.cached
    again = calibrate.calibrate_budget(model, **kw)
    assert again.cached and again.curve == whole.curve


def test_the_cache_key_follows_the_native_kernels_build(tmp_path, monkeypatch):
    """A budget curve or row limits measured through one build of the native kernels are not read
    back after the kernels change (their speed, hence the curve, changed with them); the torch
    path's key does not depend on that build."""
    import torch

    from fastgen import calibrate, kernels

    model = tmp_path / "m.gguf"
    model.write_bytes(b"0")
    args = (str(model), torch.bfloat16)
    rest = (2, 32, torch.device("cpu"))
    monkeypatch.setattr(kernels, "build_name", lambda: "fastgen_cpu_kernels_aaaa")
    native_a, torch_a = calibrate._host_key(*args, "native", *rest), calibrate._host_key(*args, "torch", *rest)
    monkeypatch.setattr(kernels, "build_name", lambda: "fastgen_cpu_kernels_bbbb")
    native_b, torch_b = calibrate._host_key(*args, "native", *rest), calibrate._host_key(*args, "torch", *rest)
    assert native_a != native_b
    assert torch_a == torch_b
    assert native_b == calibrate._host_key(*args, "native", *rest)


def test_the_curve_climbs_past_the_ladder_while_steps_stay_under_the_target(tmp_path, monkeypatch):
    """Past the ladder's top the curve doubles while the last step stayed under the target (a GPU,
    where big steps cost little more than small ones), up to max_tokens; a cached curve that stopped
    climbing for a lower target is measured again for a higher one."""
    import torch

    from fastgen import calibrate
    from fastgen.model.loader import load_model

    from ..model.test_parity import _tiny_configs, random_checkpoint

    random_checkpoint(_tiny_configs()["llama"], tmp_path / "ckpt")
    model = load_model(str(tmp_path / "ckpt"), dtype=torch.float32, device=torch.device("cpu"), max_positions=1100,
                       kernels="torch")
    monkeypatch.setenv("FASTGEN_CACHE_DIR", str(tmp_path / "cache"))
    _as_if_quiet(monkeypatch)
    kw = dict(model_path=str(tmp_path / "ckpt"), kernels="torch", num_threads=1, max_tokens=1100,
              model_config=model.config, num_kv_heads=model.config.num_kv_heads, block_size=16,
              dtype=torch.float32, device=torch.device("cpu"))
    low = calibrate.calibrate_budget(model, target_itl_ms=1e-6, **kw)      # every step over the target
    assert [n for n, _ in low.curve] == list(calibrate.LADDER)
    high = calibrate.calibrate_budget(model, target_itl_ms=1e6, **kw)     # every step under it
    assert not high.cached and [n for n, _ in high.curve] == [*calibrate.LADDER, 1024]
    assert high.budget_tokens == 1024
    assert calibrate.calibrate_budget(model, target_itl_ms=1e6, **kw).cached


def test_other_processes_load_is_measured_apart_from_this_ones():
    """OtherLoad counts the CPU time the machine spent outside this process during a block: a child
    process spinning beside it is counted, this process's own work is not."""
    import os
    import subprocess
    import sys
    import time

    from fastgen.calibrate import OtherLoad

    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat: this platform does not report the machine's CPU time")
    with OtherLoad() as own:
        end = time.perf_counter() + 0.6
        while time.perf_counter() < end:   # this process busy: not "other" load
            pass
    assert own.cpus is not None   # /proc/stat read and parsed
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)   # the child running
        with OtherLoad() as other:
            time.sleep(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert other.cpus > 0.6 and other.too_busy
    assert own.cpus < other.cpus - 0.4


def test_a_calibration_beside_other_work_is_not_cached(tmp_path, monkeypatch):
    """A budget curve or row limits measured while other processes kept the CPUs busy serve this
    start only: caching them would give every later start the slow curve (a budget too small) or
    the wrong kernels."""
    from fastgen import calibrate

    model, kw = _tiny_model_to_calibrate(tmp_path, monkeypatch)
    monkeypatch.setattr(calibrate.OtherLoad, "too_busy", property(lambda self: True))
    busy = calibrate.calibrate_budget(model, **kw)
    assert [n for n, _ in busy.curve] == list(calibrate.LADDER) and not busy.cached
    assert not list((tmp_path / "cache").glob("budget/*.json"))
    _as_if_quiet(monkeypatch)
    calibrate.calibrate_budget(model, **kw)
    assert calibrate.calibrate_budget(model, **kw).cached
