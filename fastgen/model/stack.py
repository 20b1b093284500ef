"""A Llama-family decoder stack run natively for decode steps: the layers' ops without Python between them.

A batch-1 decode step of SmolLM2 calls ~270 kernels, about ten a layer, each from Python. On the
2-core Zen 4 host (AVX512-BF16, 2.6 GHz) perf put the main thread's time in Python, pybind11 and
torch's dispatch at ~25% of a decode step; its second thread spun in OpenMP's wait for most of
that. :class:`NativeStack` holds each layer's weights and settings once (``direct().LayerStack``,
fastgen/kernels/csrc/direct.cpp) and runs the 30 layers in one call: the same ops, in the same
order, with the same arguments as the layers' closures (:meth:`DecoderLayer.bind`), so the
logits are the closures' bit for bit (tests/model/test_stack.py); the GIL is released meanwhile.

It is a second way to run layers the closures already run, taken only where it changes nothing:
every layer a plain :class:`~fastgen.model.llama.DecoderLayer` (no q/k norms, SiLU), every product
a :class:`~fastgen.model.layers.GemvDenseWeight` or :class:`~fastgen.model.quant.QuantWeight`
(a tensor-parallel shard, say, is not), fastgen's native ops and paged attention, and no more
rows than each product sends through its one-row kernel (GEMV / qgemv): decode steps of up to
6-12 sequences. Other steps, and other models, run the closures. ``FASTGEN_LAYER_STACK=0`` turns
it off (A/B measurements).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..kernels import direct
from ..kernels.ops import NativeOps
from .attention import PagedAttention, PagedPlan
from .layers import GemvDenseWeight, Linear
from .quant import QuantWeight

ENV = "FASTGEN_LAYER_STACK"


def _product(d, linear: Linear, dtype: torch.dtype) -> tuple[Any, int] | None:
    """``(direct().Product, row limit)`` of ``linear``'s decode-row kernel, as its format calls
    it for ``dtype`` rows; None for a format the stack does not run."""
    fmt = linear.format
    if type(fmt) is GemvDenseWeight:
        return d.product(0, fmt.weight, None, None, fmt.bias, False), fmt.MAX_GEMV_ROWS
    if type(fmt) is QuantWeight:
        q = fmt.quant
        limit, act_int8 = fmt.decode_plan(dtype)
        # past qgemv's limit, up to the few-row path of qgemm_a8 (QuantWeight.stack_rows), the
        # stack calls the many-row kernel matmul would call
        a8_rows = fmt.min_a8_rows if fmt.act_int8 else QuantWeight.MAX_A8_ROWS   # qgemm_a8 only where it serves the kind
        return (d.product(q.kind, q.qweight, q.scales, q.mins, fmt.bias, act_int8, limit, a8_rows),
                fmt.stack_rows(dtype))
    return None


class NativeStack:
    """The model's layers as one native call for up to :attr:`max_rows` rows."""

    def __init__(self, stack: Any, max_rows: int) -> None:
        self._stack, self.max_rows = stack, max_rows

    @classmethod
    def build(cls, model) -> "NativeStack | None":
        """The stack of ``model`` (a :class:`~fastgen.model.llama.LlamaForCausalLM`, prepared), or
        None where it would not run exactly what the layers' closures run (see the module)."""
        from .llama import MLP, Attention, DecoderLayer

        d = direct()
        if (d is None or not hasattr(d, "LayerStack") or os.environ.get(ENV, "1") == "0"
                or type(model.ops) is not NativeOps or type(model.attention) is not PagedAttention):
            return None
        dtype = model.dtype
        layers = list(model.layers)
        stack, max_rows = d.LayerStack(), 1 << 30
        for i, layer in enumerate(layers):
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not MLP
                    or attn.q_norm is not None or mlp.act != "silu"):
                return None
            products = [_product(d, lin, dtype) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                           mlp.down_proj)]
            if any(p is None for p in products):
                return None
            max_rows = min(max_rows, *(limit for _, limit in products))
            post = layer.post_attention_layernorm
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
            rope = model.ropes[attn.rope_index]
            stack.add_layer(*(p for p, _ in products), post.weight, post.eps, nxt.weight, nxt.eps, rope.cos,
                            rope.sin, attn.layer, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                            attn.window)
        return cls(stack, max_rows) if layers else None

    def takes(self, num_rows: int) -> bool:
        return num_rows <= self.max_rows

    def run(self, x: torch.Tensor, residual: torch.Tensor, step) -> torch.Tensor:
        """What the layers' closures return for ``x`` (the first input norm of ``residual``),
        updating ``residual`` as they do."""
        batch, plan, pool = step.batch, step.plan, step.pool
        assert isinstance(plan, PagedPlan)
        return self._stack.run(x, residual, batch.positions, batch.slots, pool.keys, pool.values, plan.q_starts,
                               plan.start_pos, plan.block_tables, pool.key_scales, pool.value_scales)
