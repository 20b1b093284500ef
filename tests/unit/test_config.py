"""Engine options: "auto" resolution and validation before anything loads."""
from __future__ import annotations

import pytest
import torch

from fastgen.config import EngineOptions, cpu_has_fast_bf16, resolve_dtype, resolve_engine_config
from fastgen.errors import InvalidRequestError


def test_auto_dtype_follows_the_cpu():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16


@pytest.mark.parametrize("kwargs, param", [
    (dict(dtype="int4"), "dtype"),
    (dict(budget_tokens=0), "budget_tokens"),
    (dict(max_seqs=-1), "max_seqs"),
    (dict(block_size=1.5), "block_size"),
    (dict(reserve_blocks=-2), "reserve_blocks"),
    (dict(scheduler="fifo"), "scheduler"),
    (dict(prompt_order="shortest"), "prompt_order"),
    (dict(tokens_per_step=3), "tokens_per_step"),
    (dict(int8_activations="yes"), "int8_activations"),
])
def test_bad_engine_options_are_named(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        EngineOptions.from_kwargs(kwargs)
    assert e.value.param == param


def test_pool_is_sized_from_bytes_or_blocks():
    per_token = 30 * 2 * 3 * 64   # SmolLM2: layers x (k, v) x kv heads x head dim
    cfg = resolve_engine_config("m", EngineOptions(dtype="bfloat16", kv_cache_bytes=2**30, block_size=32),
                                kv_elems_per_token=per_token, model_max_len=8192)
    assert cfg.cache.num_blocks == 2**30 // (per_token * 2 * 32)
    assert cfg.scheduler.reserve_blocks == min(cfg.cache.num_blocks // 16, 64)
    cfg = resolve_engine_config("m", EngineOptions(dtype="float32", num_blocks=10, max_model_len=99999),
                                kv_elems_per_token=per_token, model_max_len=8192)
    assert cfg.cache.num_blocks == 10 and cfg.max_model_len == 8192 and cfg.dtype == torch.float32
    assert cfg.scheduler.prompt_order == "arrival"
    cfg = resolve_engine_config("m", EngineOptions(dtype="float32", num_blocks=10, prompt_order="deadline"),
                                kv_elems_per_token=per_token, model_max_len=8192)
    assert cfg.scheduler.prompt_order == "deadline"


@pytest.mark.parametrize("asked, dtype, want", [
    (None, "auto", True), (None, "bfloat16", True), (None, torch.bfloat16, True),
    (None, "float32", False), (None, torch.float32, False),   # fp32 by name: exact products
    (True, "float32", True), (False, "auto", False), (False, "bfloat16", False),
])
def test_int8_activations_are_on_unless_fp32_is_asked_for(asked, dtype, want):
    cfg = resolve_engine_config("m", EngineOptions(dtype=dtype, int8_activations=asked, num_blocks=4),
                                kv_elems_per_token=64, model_max_len=256)
    assert cfg.int8_activations is want


def test_server_argv_round_trips_through_the_cli():
    """A replica is started from ``to_argv``: bools become --flag / --no-flag, keys never appear."""
    from fastgen.cli import build_parser
    from fastgen.server.config import ServerConfig

    config = ServerConfig(api_keys=("k1", "k2"), replicas=2, body_timeout_s=7.5,
                          engine_options=(("prefix_caching", False), ("int8_activations", True),
                                          ("budget_tokens", 64)))
    argv = config.to_argv()
    assert "k1" not in argv and "--no-prefix-caching" in argv and "--int8-activations" in argv
    ns = build_parser().parse_args(["serve", *argv])
    assert (ns.prefix_caching, ns.int8_activations, ns.budget_tokens, ns.replicas) == (False, True, 64, 2)
    assert ns.body_timeout_s == 7.5


def test_api_keys_from_flags_file_and_environment(tmp_path):
    from fastgen.cli import api_keys
    from fastgen.errors import FastgenError

    f = tmp_path / "keys"
    f.write_text("# ops team\nalpha\n\n  beta  \nalpha\n")
    assert api_keys(["gamma"], str(f), "ignored") == ("gamma", "alpha", "beta")
    assert api_keys(None, None, "one\ntwo\n") == ("one", "two")
    assert api_keys(None, None, None) == ()
    (tmp_path / "empty").write_text("# nothing\n")
    for path in (str(tmp_path / "empty"), str(tmp_path / "missing")):
        with pytest.raises(FastgenError, match="api-key-file"):
            api_keys(None, path, None)


def test_cuda_graphs_option_flows_from_the_cli_to_the_engine_config():
    from fastgen.cli import build_parser
    from fastgen.errors import InvalidRequestError

    ns = build_parser().parse_args(["serve", "--no-cuda-graphs"])
    assert ns.cuda_graphs is False
    assert not hasattr(build_parser().parse_args(["serve"]), "cuda_graphs")   # only flags given pass on
    for asked in (True, False):
        cfg = resolve_engine_config("m", EngineOptions(cuda_graphs=asked, num_blocks=4), kv_elems_per_token=64,
                                    model_max_len=256)
        assert cfg.cuda_graphs is asked
    with pytest.raises(InvalidRequestError, match="cuda_graphs"):
        EngineOptions(cuda_graphs="no")
