"""The native layer stack (fastgen/model/stack.py) runs exactly what the layers' closures run."""
from __future__ import annotations

import pytest
import torch

from fastgen import kernels
from fastgen.model.llama import ModelConfig
from fastgen.model.loader import load_hf_config, load_model
from fastgen.model.stack import NativeStack

from .ragged import ragged_logits
from .test_parity import TINY, _tiny_configs, random_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not kernels.load():
        pytest.fail("fastgen's native kernels did not build on this host")


def _checkpoint(name: str, tmp_path) -> str:
    random_checkpoint(_tiny_configs()[name], tmp_path)
    return str(tmp_path)


def _logits(model, cfg, sequences, max_chunk: int, use_stack: bool, monkeypatch,
            kv_dtype: str = "auto") -> tuple[list, int]:
    """Per-position logits through random ragged schedules, and how many forwards took the stack."""
    calls = []
    real_run = NativeStack.run

    def counted(self, x, residual, step):
        calls.append(x.shape[0])
        return real_run(self, x, residual, step)

    monkeypatch.setattr(NativeStack, "run", counted)
    monkeypatch.setenv("FASTGEN_LAYER_STACK", "1" if use_stack else "0")
    model.__dict__["_stack"] = None
    return ragged_logits(model, cfg, sequences, block_size=4, seed=3, max_chunk=max_chunk,
                         kv_dtype=kv_dtype), len(calls)


# llama: dense or quantized rows, GQA; mistral-window-13: a sliding window inside a block; qwen2: a
# QKV bias (added after qgemv, or by the GEMV); llama-tied-llama3-rope: a tied head and RoPE scaling
@pytest.mark.parametrize("name", ["llama", "mistral-window-13", "qwen2", "llama-tied-llama3-rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["none", "int4", "int8"])
def test_the_stack_gives_the_closures_logits_bit_for_bit(name, dtype, quantization, tmp_path, monkeypatch):
    path = _checkpoint(name, tmp_path)
    model = load_model(path, dtype=dtype, device=torch.device("cpu"), max_positions=256, kernels="native",
                       quantization=quantization)
    cfg = ModelConfig.from_hf(load_hf_config(path))
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (3, 9, 17, 30, 41)]
    want, closures_calls = _logits(model, cfg, sequences, 1, False, monkeypatch)   # decodes of 1-5 rows
    got, stack_calls = _logits(model, cfg, sequences, 1, True, monkeypatch)
    assert closures_calls == 0 and stack_calls > 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # prompt chunks (more rows than the one-row kernels take) run the closures, the decodes the stack
    want, _ = _logits(model, cfg, sequences, 12, False, monkeypatch)
    got, stack_calls = _logits(model, cfg, sequences, 12, True, monkeypatch)
    assert stack_calls > 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_the_stack_takes_only_rows_its_products_send_to_their_one_row_kernels(tmp_path):
    path = _checkpoint("llama", tmp_path)
    model = load_model(path, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=256,
                       kernels="native", quantization="int4")
    stack = model._native_stack()
    limits = {m.format.max_qgemv_rows_bf16 for m in model.layers.modules() if hasattr(m, "format")}
    assert stack is not None and stack.max_rows == min(limits)
    assert stack.takes(stack.max_rows) and not stack.takes(stack.max_rows + 1)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "mixtral"])
def test_layers_the_stack_does_not_run_keep_their_closures(name, tmp_path):
    """q/k norms (Qwen3), Gemma 3's own layers, experts (Mixtral): no stack; the closures serve."""
    path = _checkpoint(name, tmp_path)
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu"), max_positions=256, kernels="native")
    assert model._native_stack() is None


def test_torch_kernels_and_the_off_switch_take_no_stack(tmp_path, monkeypatch):
    path = _checkpoint("llama", tmp_path)
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu"), max_positions=256, kernels="torch")
    assert model._native_stack() is None
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu"), max_positions=256, kernels="native")
    monkeypatch.setenv("FASTGEN_LAYER_STACK", "0")
    model.__dict__["_stack"] = None
    assert model._native_stack() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_past_qgemv_the_stack_calls_the_many_row_kernels_the_closures_call(dtype, tmp_path, monkeypatch):
    """With int8 activations qgemm_a8 has a few-row path (up to 32 rows of 4- or 8-bit weights) that beats
    qgemv from a few rows: where the measured limits send such batches to it, the stack still runs
    them, calling qgemm (below qgemm_a8's limit) or qgemm_a8 with the bias in fp32, as the closures
    do, and gives their logits bit for bit (qwen2: a QKV bias)."""
    from fastgen.model.quant import QuantWeight
    from fastgen.row_limits import a8_formats, apply_limits

    from .test_quant import _skip_without_int8

    _skip_without_int8(4)
    path = _checkpoint("qwen2", tmp_path)
    model = load_model(path, dtype=dtype, device=torch.device("cpu"), max_positions=256, kernels="native",
                       quantization="int4", int8_activations=True)
    cfg = ModelConfig.from_hf(load_hf_config(path))
    formats = a8_formats(model)
    assert formats
    apply_limits(model, formats, 2, 4)   # qgemv up to 2 rows, qgemm for 3, qgemm_a8 from 4
    model.__dict__["_stack"] = None
    stack = model._native_stack()
    assert stack is not None and stack.max_rows == QuantWeight.A8_FEW_ROWS
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in range(3, 20)]
    calls = []
    real_run = NativeStack.run
    monkeypatch.setattr(NativeStack, "run", lambda self, x, r, s: calls.append(x.shape[0]) or real_run(self, x, r, s))
    monkeypatch.setenv("FASTGEN_LAYER_STACK", "0")
    model.__dict__["_stack"] = None
    want = ragged_logits(model, cfg, sequences, block_size=4, seed=3, max_chunk=1)
    assert not calls
    monkeypatch.setenv("FASTGEN_LAYER_STACK", "1")
    model.__dict__["_stack"] = None
    got = ragged_logits(model, cfg, sequences, block_size=4, seed=3, max_chunk=1)
    assert {3, 16} <= set(calls) or (3 in calls and max(calls) > 4), sorted(set(calls))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stack_gives_the_closures_logits_over_an_int8_kv_cache(dtype, tmp_path, monkeypatch):
    """With kv_cache_dtype="int8" the stack calls the 8-bit pool's ops (rope_write_kv_i8,
    paged_attention_i8) as the closures do: the same logits, bit for bit."""
    path = _checkpoint("llama", tmp_path)
    model = load_model(path, dtype=dtype, device=torch.device("cpu"), max_positions=256, kernels="native",
                       quantization="int4")
    cfg = ModelConfig.from_hf(load_hf_config(path))
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (5, 19, 33)]
    want, closures_calls = _logits(model, cfg, sequences, 1, False, monkeypatch, kv_dtype="int8")
    got, stack_calls = _logits(model, cfg, sequences, 1, True, monkeypatch, kv_dtype="int8")
    assert closures_calls == 0 and stack_calls > 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("kernels_name", ["native", "torch"])
def test_an_int8_kv_cache_keeps_the_logits_close_on_both_backends(kernels_name, tmp_path):
    """The whole model over an int8 pool, through random ragged schedules (decodes, fresh and
    continuing chunks, GQA, head dim 64 so that the native decodes read the pool in place): its
    logits stay near those over an fp32 pool, on the native kernels (paged attention) and on the
    torch ops (SDPA over gathered, dequantized blocks). A wrong layout or scale moves them by far
    more than the rounding does."""
    from transformers import LlamaConfig

    from .test_parity import random_checkpoint

    cfg_hf = LlamaConfig(**{**TINY, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
                         tie_word_embeddings=False)
    random_checkpoint(cfg_hf, tmp_path)
    model = load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"), max_positions=256,
                       kernels=kernels_name, quantization="none")
    cfg = ModelConfig.from_hf(load_hf_config(str(tmp_path)))
    assert cfg.head_dim == 64
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (7, 40, 90)]
    want = ragged_logits(model, cfg, sequences, block_size=8, seed=4, max_chunk=12)
    got = ragged_logits(model, cfg, sequences, block_size=8, seed=4, max_chunk=12, kv_dtype="int8")
    for g, w in zip(got, want):
        scale = w.abs().max().item()
        assert (g - w).abs().max().item() < 0.05 * scale, ((g - w).abs().max().item(), scale)
        assert (g - w).abs().mean().item() < 0.01 * scale
