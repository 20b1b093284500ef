"""The KV block pool: one preallocated key and value tensor per layer.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of
a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat *slot* is ``block_id * block_size + offset``. Everything
is allocated once, in the constructor; the hot path only writes into and reads from
these tensors.

With ``kv_dtype="int8"`` (``kv_cache_dtype`` of the engine) each (token, KV head) row of K
and V is stored as int8 values ``q`` and one fp32 scale ``s``: ``x ~ q * s``, ``s = max|x| / 127``,
``q = round(x / s)`` (a row of zeros: ``q = 0, s = 0``). The keys and values tensors keep
their nominal shape, but their bytes are laid out per block for the native decode kernel
(fastgen/kernels/csrc/cpu_kernels.cpp, ``KvI8``): K as ``[num_kv_heads, head_dim / 4,
block_size, 4]``, V as ``[num_kv_heads, block_size / 4, head_dim, 4]``; the scales are
``[num_blocks, num_kv_heads, block_size]``. :meth:`write` and :meth:`gather` know these
layouts, so a backend that gathers (SDPA) reads the dequantized values.
"""
from __future__ import annotations

import torch

from ..config import KV_CACHE_DTYPES


def int8_layout_error(head_dim: int, block_size: int) -> str | None:
    """Why an int8 pool cannot take this head dim and block size (its layouts group values and keys
    by four), or None."""
    if head_dim <= 0 or head_dim % 4 or block_size % 4:
        return (f"kv_cache_dtype='int8' needs a head dim and block_size divisible by 4, got {head_dim} and "
                f"{block_size}")
    return None


def token_bytes(kv_elems_per_token: int, head_dim: int, dtype: torch.dtype, kv_dtype: str) -> int:
    """Bytes a token takes in a pool: its keys' and values' elements in ``dtype``, or with
    ``kv_dtype="int8"`` a byte each and an fp32 scale per row of ``head_dim``."""
    if kv_dtype == "int8":
        return kv_elems_per_token + kv_elems_per_token // head_dim * 4
    return kv_elems_per_token * torch.empty((), dtype=dtype).element_size()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., d]`` -> int8 ``q [..., d]`` and fp32 scales ``s [...]``, per row: ``s = max|x| / 127``,
    ``q = round(x / s)`` to nearest even (``0`` where ``s = 0``): the native write's arithmetic
    (``rope_write_kv_i8``), so either path stores the same bytes."""
    xf = x.float()
    s = xf.abs().amax(-1) / 127.0
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s[..., None] > 0, torch.round(xf / safe[..., None]), torch.zeros_like(xf))
    return q.clamp(-127, 127).to(torch.int8), s


class KVPool:
    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, spare_blocks: int = 0,
                 kv_dtype: str = "auto") -> None:
        """``spare_blocks`` more blocks past ``num_blocks``, never handed out by the allocator: where
        the padding rows of a CUDA-graphed decode step write their keys and values
        (fastgen/model/cuda_graphs.py). ``dtype``: the model's; ``kv_dtype``: "auto" (the pool
        holds ``dtype``) or "int8" (see the module)."""
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_CACHE_DTYPES}, got {kv_dtype!r}")
        self.quantized = kv_dtype == "int8"
        if self.quantized and (error := int8_layout_error(head_dim, block_size)):
            raise ValueError(error)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.spare_blocks = spare_blocks
        self.dtype = dtype
        n = num_blocks + spare_blocks
        shape = (n, block_size, num_kv_heads, head_dim)
        store = torch.int8 if self.quantized else dtype
        self.keys = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        scales = (n, num_kv_heads, block_size)
        layers = range(num_layers) if self.quantized else ()   # the scales: an int8 pool's only
        self.key_scales = [torch.zeros(scales, dtype=torch.float32, device=device) for _ in layers]
        self.value_scales = [torch.zeros(scales, dtype=torch.float32, device=device) for _ in layers]

    @property
    def spare_slot(self) -> int | None:
        """The first slot of the spare blocks, or None without them."""
        return self.num_blocks * self.block_size if self.spare_blocks else None

    @classmethod
    def for_model(cls, config, *, num_kv_heads: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device, spare_blocks: int = 0, kv_dtype: str = "auto") -> "KVPool":
        """The one place a model's numbers become a pool's shape: ``config.num_layers`` layers
        (a ModelConfig's) of ``[num_blocks, block_size, num_kv_heads, config.head_dim]``;
        ``num_kv_heads`` is what this rank holds (all of them without tensor parallelism)."""
        return cls(num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
                   num_kv_heads=num_kv_heads, head_dim=config.head_dim, dtype=dtype, device=device,
                   spare_blocks=spare_blocks, kv_dtype=kv_dtype)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values + self.key_scales
                   + self.value_scales)

    def _k5(self, layer: int) -> torch.Tensor:   # int8 keys [n, kvh, d/4, bs, 4]
        n, bs, kvh, d = self.keys[layer].shape
        return self.keys[layer].view(n, kvh, d // 4, bs, 4)

    def _v5(self, layer: int) -> torch.Tensor:   # int8 values [n, kvh, bs/4, d, 4]
        n, bs, kvh, d = self.values[layer].shape
        return self.values[layer].view(n, kvh, bs // 4, d, 4)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v`` (shape ``[num_tokens, num_kv_heads, head_dim]``) at flat ``slots``."""
        if self.quantized:
            blk, off = slots // self.block_size, slots % self.block_size
            kq, ks = quantize_rows(k)
            vq, vs = quantize_rows(v)
            t, kvh, d = kq.shape
            self._k5(layer)[blk, :, :, off, :] = kq.view(t, kvh, d // 4, 4)
            self._v5(layer)[blk, :, off // 4, :, off % 4] = vq
            self.key_scales[layer][blk, :, off] = ks
            self.value_scales[layer][blk, :, off] = vs
            return
        kf = self.keys[layer].view(-1, *self.keys[layer].shape[2:])
        vf = self.values[layer].view(-1, *self.values[layer].shape[2:])
        kf.index_copy_(0, slots, k)
        vf.index_copy_(0, slots, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of whole blocks for each row of ``block_tables`` ``[num_seqs, max_blocks]``.

        Returns two tensors ``[num_seqs, max_blocks * block_size, num_kv_heads, head_dim]``;
        positions past a sequence's length hold stale data and must be masked.
        """
        n, m = block_tables.shape
        if self.quantized:   # dequantized, in the model's dtype
            idx = block_tables.reshape(-1)
            _, bs, kvh, d = self.keys[layer].shape
            kq = self._k5(layer).index_select(0, idx).permute(0, 3, 1, 2, 4).reshape(n * m, bs, kvh, d)
            vq = self._v5(layer).index_select(0, idx).permute(0, 2, 4, 1, 3).reshape(n * m, bs, kvh, d)
            ks = self.key_scales[layer].index_select(0, idx).transpose(1, 2).unsqueeze(-1)
            vs = self.value_scales[layer].index_select(0, idx).transpose(1, 2).unsqueeze(-1)
            k, v = (kq.float() * ks).to(self.dtype), (vq.float() * vs).to(self.dtype)
            return k.reshape(n, m * bs, kvh, d), v.reshape(n, m * bs, kvh, d)
        k = self.keys[layer].index_select(0, block_tables.reshape(-1))
        v = self.values[layer].index_select(0, block_tables.reshape(-1))
        return (k.view(n, m * self.block_size, *k.shape[2:]),
                v.view(n, m * self.block_size, *v.shape[2:]))
