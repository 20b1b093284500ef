"""The small ops around the weight products, behind one seam with two implementations.

:class:`TorchOps` is plain PyTorch (any device, the reference). :class:`NativeOps` calls
fastgen's fused CPU kernels (``torch.ops.fastgen``), which round exactly where the eager
code rounds, so both give the same values up to float summation order. The model calls
only these five methods and never asks which implementation it holds.

Measured on the 2-core Zen 5 host (AVX512-BF16, no AMX), SmolLM2-135M bf16, batch-1 decode:
the eager path issues ~5,100 PyTorch ops per step (~170 per layer), the fused path 749 (~25).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..cache import KVPool


class Ops(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x) * weight`` for x ``[T, n]``; a new tensor."""

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """In place: ``residual += x`` then ``x = rms_norm(residual) * weight``."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [T, 2I]`` (gate first) -> ``[T, I]``."""

    def rope_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      slots: torch.Tensor, pool: KVPool, layer: int, num_heads: int, num_kv_heads: int,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate q and k of the fused QKV output ``[T, (H + 2 KVH) * D]``, store k and v into
        ``pool`` at ``slots``; returns ``q [T, H, D], k [T, KVH, D], v [T, KVH, D]``.
        ``cos``/``sin``: the full ``[max_positions, D]`` fp32 tables."""


class TorchOps:
    name = "torch"

    def rms_norm(self, x, weight, eps):
        return F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm_(self, x, residual, weight, eps):
        residual.add_(x)
        x.copy_(F.rms_norm(residual, weight.shape, weight, eps))

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def __init__(self) -> None:
        self._positions: torch.Tensor | None = None    # the step whose tables are cached
        self._tables: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _rope_tables(self, positions, cos, sin, dtype):
        """cos and sign-folded sin ``[T, 1, D]`` for the step's positions, built once per step
        and RoPE table (Gemma 3's local and global layers have one each; the step's positions
        tensor is held, so a new step's cannot share its identity)."""
        if positions is not self._positions:
            self._positions, self._tables = positions, {}
        key = (id(cos), dtype)
        if key not in self._tables:
            c = cos[positions].to(dtype).unsqueeze(1)
            s = sin[positions].to(dtype).unsqueeze(1)
            half = s.shape[-1] // 2
            self._tables[key] = (c, torch.cat((-s[..., :half], s[..., half:]), dim=-1))
        return self._tables[key]

    def rope_write_kv(self, qkv, positions, cos, sin, slots, pool, layer, num_heads, num_kv_heads, head_dim):
        t, h, kvh, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
        c, signed_sin = self._rope_tables(positions, cos, sin, qkv.dtype)   # [T, 1, D] each
        half = d // 2
        x = qkv[:, :(h + kvh) * d].view(t, h + kvh, d)                      # q and k rotated together
        swapped = x.reshape(t, h + kvh, 2, half).flip(2).view(t, h + kvh, d)
        qk = torch.addcmul(x * c, swapped, signed_sin)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
        pool.write(layer, slots, k, v)
        return q, k, v


class NativeOps:
    name = "native"

    def __init__(self) -> None:
        # direct calls (fastgen.kernels.direct): ~1 us less a call than torch.ops' overloads, which
        # were ~0.25 us less than their packets (~150 such calls a decode step)
        from . import fast_op
        self._rms_norm, self._add_rms_norm_ = fast_op("rms_norm"), fast_op("add_rms_norm_")
        self._silu_mul, self._rope_write_kv = fast_op("silu_mul"), fast_op("rope_write_kv")
        self._rope_write_kv_i8 = fast_op("rope_write_kv_i8")

    def rms_norm(self, x, weight, eps):
        return self._rms_norm(x, weight, eps)

    def add_rms_norm_(self, x, residual, weight, eps):
        self._add_rms_norm_(x, residual, weight, eps)

    def silu_mul(self, gate_up):
        return self._silu_mul(gate_up)

    def rope_write_kv(self, qkv, positions, cos, sin, slots, pool, layer, num_heads, num_kv_heads, head_dim):
        if pool.quantized:
            q, k = self._rope_write_kv_i8(qkv, positions, cos, sin, slots, pool.keys[layer], pool.values[layer],
                                          pool.key_scales[layer], pool.value_scales[layer], num_heads,
                                          num_kv_heads, head_dim)
        else:
            q, k = self._rope_write_kv(qkv, positions, cos, sin, slots, pool.keys[layer], pool.values[layer],
                                       num_heads, num_kv_heads, head_dim)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(qkv.shape[0], num_kv_heads, head_dim)
        return q, k, v


def native_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """The native kernels cover CPU tensors in fp32 and bf16."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
