"""Building blocks of Llama-family models.

A :class:`Linear` holds its weight as loaded (``weight``, ``bias``) until
:meth:`Linear.prepare` hands it to a *weight format*: the object that owns the
stored layout and the product kernel (:class:`DenseWeight`, :class:`PackedWeight`; quantized
formats and tensor-parallel shards plug in here). The model calls ``layer(x)`` and never
asks which format it holds.

The layers are laid out for tensor parallelism: :class:`ColumnLinear` (fused QKV, fused
gate/up) splits its *output* features into named parts, each of which a rank would shard
along dim 0; :class:`RowLinear` (attention output, down projection) would shard its *input*
features and all-reduce its output. With one rank, both are plain products.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import fast_op


class WeightFormat(Protocol):
    name: str

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T (+ b)`` for x ``[T, in]`` -> ``[T, out]``."""

    @property
    def num_bytes(self) -> int:
        """Memory the format holds."""

    @property
    def stream_bytes(self) -> int:
        """Bytes read from memory for a one-row product (a decode step's share)."""


class DenseWeight:
    """The weight as a plain tensor; ``F.linear``. Every device and dtype."""

    name = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def num_bytes(self) -> int:
        return _nbytes(self.weight) + _nbytes(self.bias)

    @property
    def stream_bytes(self) -> int:
        return self.num_bytes


class PackedWeight:
    """bf16 weight reordered once into oneDNN's blocked layout (CPU).

    Measured on the 2-core AMX CPU with SmolLM2's shapes: 1.2-1.7x faster products for 1 to
    256 rows (the reorder otherwise happens in every call), equal at 512.
    """

    name = "onednn-packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._bytes = _nbytes(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = bias

    @staticmethod
    def supported(device: torch.device, dtype: torch.dtype) -> bool:
        # oneDNN packs bf16 weights only where the CPU has AVX512-BW/VL/DQ or AVX-NE-CONVERT
        # (an AVX2-only host raises "bf16 path needs the cpu support ...")
        return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @property
    def num_bytes(self) -> int:
        return self._bytes + _nbytes(self.bias)

    @property
    def stream_bytes(self) -> int:
        return self.num_bytes


class GemvDenseWeight(DenseWeight):
    """A plain weight; up to ``MAX_GEMV_ROWS`` rows (decode steps) go through fastgen's native
    GEMV, which streams the weight once near the memory's rate; more rows go through the
    oneDNN-packed copy where bf16 packing exists (a second copy of the weight), else ``F.linear``.

    Measured on the 2-core Zen 5 host (AVX512-BF16), SmolLM2's 120 linear weights, one row:
    bf16 native GEMV 4.6 ms (46 GB/s) against oneDNN-packed 6.5 ms and ``F.linear`` 9.3 ms;
    fp32 9.7 ms against 25 ms; GEMV still wins at 8 rows (bf16 8.9 ms against 10.4 ms). From
    16 rows on, the packed copy is faster than ``F.linear`` on the plain weight (a 16-token
    forward: 15 ms against 22 ms), so bf16 keeps both.
    """

    name = "dense+gemv"
    MAX_GEMV_ROWS = 8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight.contiguous(), bias)
        self._gemv, self._gemv_argmax = fast_op("gemv"), fast_op("gemv_argmax")
        self._packed = PackedWeight(weight, bias) if PackedWeight.supported(weight.device, weight.dtype) else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.MAX_GEMV_ROWS:
            return self._gemv(x, self.weight, self.bias)
        if self._packed is not None:
            return self._packed.matmul(x)
        return F.linear(x, self.weight, self.bias)

    def matmul_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(y, argmax of each row of y, its value in fp32)`` for rows the GEMV takes, with greedy
        decoding's choice taken inside the product (``gemv_argmax``); None for more rows."""
        if x.shape[0] > self.MAX_GEMV_ROWS:
            return None
        return self._gemv_argmax(x, self.weight, self.bias)

    @property
    def num_bytes(self) -> int:
        return super().num_bytes + (self._packed.num_bytes if self._packed is not None else 0)

    @property
    def stream_bytes(self) -> int:  # one row goes through the GEMV on the plain weight
        return _nbytes(self.weight) + _nbytes(self.bias)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def default_format(weight: torch.Tensor, bias: torch.Tensor | None, kernels: str = "torch") -> WeightFormat:
    """The fastest format for this device, dtype and kernel set that needs no extra choice
    from the user."""
    if kernels == "native":
        return GemvDenseWeight(weight, bias)
    if PackedWeight.supported(weight.device, weight.dtype):
        return PackedWeight(weight, bias)
    return DenseWeight(weight, bias)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``. Loaded into ``weight``/``bias``; computed by its weight format."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.format: WeightFormat | None = None
        self.in_features, self.out_features = in_features, out_features
        self.quant_parts: dict[int, object] = {}   # part -> fastgen.model.quant.QuantRows

    @property
    def num_parts(self) -> int:
        return 1

    def quant_rows(self):
        """The whole weight's QuantRows when every part was loaded quantized, else None."""
        if len(self.quant_parts) != self.num_parts:
            return None
        from .quant import QuantRows

        parts = [self.quant_parts[i] for i in range(self.num_parts)]
        return parts[0] if len(parts) == 1 else QuantRows.cat(parts)

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features

    @property
    def stream_bytes(self) -> int:
        """Bytes a one-row product reads (the format's, once prepared)."""
        if self.format is not None:
            return self.format.stream_bytes
        return _nbytes(self.weight) + _nbytes(self.bias)

    @property
    def resident_bytes(self) -> int:
        if self.format is not None:
            return self.format.num_bytes
        return _nbytes(self.weight) + _nbytes(self.bias)

    def prepare(self, make_format=default_format) -> None:
        """Hand the loaded weight to its format (after loading and moving to the device)."""
        self.format = make_format(self.weight.data, None if self.bias is None else self.bias.data)
        self.quant_parts = {}   # a quantized format holds the parts' rows fused: free the parts
        if self.format.name != "dense":  # the format holds its own copy: free the loaded one
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                       requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format is None:
            return F.linear(x, self.weight, self.bias)
        return self.format.matmul(x)

    def forward_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(forward(x), argmax of each row, its value in fp32)`` where the weight format takes the
        argmax inside the product (``matmul_argmax``: the native decode-row kernels); else None."""
        fused = getattr(self.format, "matmul_argmax", None)
        return fused(x) if fused is not None else None

    # The hot path skips nn.Module.__call__ (its hook checks cost ~2 us a call, and a decode
    # step of SmolLM2 makes 121 of these calls): forward hooks on a Linear are not run.
    # Hooks on any other module (an MLP, an expert, a layer) work as usual.
    __call__ = forward


class ColumnLinear(Linear):
    """A :class:`Linear` whose output is the concatenation of ``output_sizes`` parts."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    @property
    def num_parts(self) -> int:
        return len(self.output_sizes)

    def load_part(self, part: int, name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor ``name`` ("weight"/"bias") into output part ``part``."""
        start = sum(self.output_sizes[:part])
        target = getattr(self, name)
        if target is None:
            raise ValueError(f"checkpoint has a {name} this layer was not built with")
        dst = target.data[start:start + self.output_sizes[part]]
        if dst.shape != tensor.shape:
            raise ValueError(f"shape mismatch for part {part} {name}: {tuple(tensor.shape)} vs {tuple(dst.shape)}")
        dst.copy_(tensor)


class RowLinear(Linear):
    """A :class:`Linear` of which a tensor-parallel rank would hold a slice of the input features."""


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps


class LayerNorm(nn.Module):
    """LayerNorm with a weight and a bias (OPT, Phi-2, Falcon); no fused kernel, ``F.layer_norm``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[max_positions, head_dim]`` (fp32) for every position, built once.

    ``inv_freq`` and ``attention_scaling`` come from transformers' RoPE functions so that
    every scaling type the config may ask for (linear, llama3, yarn, ...) matches the
    reference exactly.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int) -> None:
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.float().cpu())
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights ``model`` holds: each linear layer's format (quantized rows, dense
    and packed copies), a quantized embedding unless it shares the head's rows, and every other
    parameter (embedding, norms), each tensor once."""
    from .quant import QuantEmbedding

    seen: set[int] = set()
    total = 0
    quant_rows: set[int] = set()    # data pointers of quantized rows held by linear formats
    for m in model.modules():
        if isinstance(m, Linear):
            total += m.resident_bytes
            fmt = getattr(m.format, "inner", m.format)     # a tensor-parallel format wraps its own
            rows = getattr(fmt, "quant", None)
            if rows is not None:
                quant_rows.add(rows.qweight.data_ptr())
            if m.format is not None and m.format.name != "dense":
                continue            # its parameter is an empty placeholder or the shared embedding
            seen.update(id(p) for p in m.parameters(recurse=False))
    for m in model.modules():
        if isinstance(m, QuantEmbedding) and m.rows.qweight.data_ptr() not in quant_rows:
            total += m.num_bytes
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
