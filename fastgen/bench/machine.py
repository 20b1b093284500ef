"""What the machine and the model allow: matmul peaks and read bandwidth (best of N), the model's
FLOPs and weight bytes, the CPU's name, and whether other processes keep the cores busy."""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, replace
from typing import Mapping

import torch

from ..calibrate import OtherLoad
from ..model.layers import Linear
from .timing import Sizes, Summary, time_calls

FLOPS_FORMULA = (
    "FLOPs(prefill of T tokens from position 0) = 2*P_linear*T + 2*V*d*num_logits "
    "+ 2*L*H*Dh*T*(T+1); P_linear = weights of every linear layer except the output head, "
    "V*d = output head (lm_head or tied embedding), num_logits = 1 (the sampled token), "
    "last term = causal attention (QK^T and PV, 2 FLOPs per multiply-add, key count t+1 for "
    "query t); norms, RoPE, SiLU and softmax are not counted")
WEIGHT_BYTES_FORMULA = (
    "weight bytes read per decode step = every linear weight and bias + the output head "
    "(lm_head or tied embedding), in the model dtype; the embedding gather, norms and KV "
    "cache reads are not counted")
BANDWIDTH_BOUND_RULE = (
    "decode bound bandwidth = the highest read-only bandwidth measured (sum of a big tensor, "
    "1 GiB or 64 MiB with --quick, fp32 and bf16, and of a tensor as large as the weights, fp32 "
    "and model dtype, the latter also on 2 MiB pages where the host gives them, as the weights lie; "
    "the weight-sized read in the model dtype (both kinds of pages) and in fp32 again just before "
    "and after batch-1 decode's steps); the copy is shown for reference only")
BUSY_CPUS_WARNING = 0.25


# -- the model's costs ------------------------------------------------------------------

@dataclass(frozen=True)
class ModelCosts:
    num_linear_params: int           # every linear weight except the output head
    num_head_params: int             # vocab * hidden
    num_attention_dims: int          # num_layers * num_heads * head_dim
    weight_bytes: int                # read per decode step (see WEIGHT_BYTES_FORMULA)

    def prefill_flops(self, num_tokens: int, num_logits: int = 1) -> float:
        t = num_tokens
        return (2.0 * self.num_linear_params * t + 2.0 * self.num_head_params * num_logits
                + 2.0 * self.num_attention_dims * t * (t + 1))

    def chunk_attention_flops(self, num_tokens: int, start: int) -> float:
        """Causal attention of ``num_tokens`` queries at positions ``start``.. (query t sees t + 1
        keys): QK^T and PV, 2 FLOPs a multiply-add. From position 0: prefill_flops' last term."""
        keys = num_tokens * start + num_tokens * (num_tokens + 1) / 2
        return 4.0 * self.num_attention_dims * keys

    def chunk_flops(self, num_tokens: int, start: int, num_logits: int = 1) -> float:
        """A prompt chunk of ``num_tokens`` at position ``start`` (its keys before it cached)."""
        return (2.0 * self.num_linear_params * num_tokens + 2.0 * self.num_head_params * num_logits
                + self.chunk_attention_flops(num_tokens, start))


def model_costs(engine) -> ModelCosts:
    mc = engine.model_config
    head = engine.model.head
    linear_params = linear_bytes = 0
    for module in engine.model.modules():
        if not isinstance(module, Linear) or module is head:
            continue
        linear_params += module.num_params
        linear_bytes += module.stream_bytes
    return ModelCosts(num_linear_params=linear_params, num_head_params=head.num_params,
                      num_attention_dims=mc.num_layers * mc.num_heads * mc.head_dim,
                      weight_bytes=linear_bytes + head.stream_bytes)


# -- machine limits -----------------------------------------------------------------------

@dataclass(frozen=True)
class MatmulPeak:
    dtype: str
    n: int
    gflops: float                    # best of N
    median_gflops: float
    times: Summary


@dataclass(frozen=True)
class Bandwidth:
    kind: str                        # "sum (read)" or "copy (read + write)"
    label: str
    dtype: str
    bytes: int                       # bytes moved per call
    gbps: float                      # best of N
    times: Summary


@dataclass(frozen=True)
class MachineLimits:
    num_threads: int
    matmul: Mapping[str, MatmulPeak]  # by str(dtype)
    bandwidth: tuple[Bandwidth, ...]  # the reads, then the copy
    decode_bound_gbps: float          # see BANDWIDTH_BOUND_RULE
    bandwidth_rule: str = BANDWIDTH_BOUND_RULE


def _measure_product(label: str, product, n: int, device: torch.device, sizes: Sizes) -> MatmulPeak:
    """Best and median rate of ``product()``, an n x n x n matrix product (2 n^3 operations)."""
    with torch.inference_mode():
        times = time_calls(product, device, num_warmup=2, num_repeats=4 * sizes.num_repeats,
                           max_s=sizes.max_measure_s, desc=f"matmul {label}")
    flops = 2.0 * n ** 3
    return MatmulPeak(label, n, flops / min(times) / 1e9, flops / statistics.median(times) / 1e9,
                      Summary.of(times))


def measure_matmul(dtype: torch.dtype, n: int, device: torch.device, sizes: Sizes) -> MatmulPeak:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    out = torch.empty(n, n, dtype=dtype, device=device)
    return _measure_product(str(dtype), lambda: torch.matmul(a, b, out=out), n, device, sizes)


class PairedRates:
    """The dtype's matmul rate (and _int_mm's, with ``int8``) measured again in a few calls
    (:func:`_measure_product`'s best, GFLOP/s): the limit measured right beside each timed prompt
    run (paired_ratio in prefill_decode.py). The operands are made once."""

    def __init__(self, dtype: torch.dtype, n: int, device: torch.device, int8: bool, sizes: Sizes) -> None:
        self.a = torch.randn(n, n, dtype=dtype, device=device)
        self.b = torch.randn(n, n, dtype=dtype, device=device)
        self.out = torch.empty(n, n, dtype=dtype, device=device)
        self.ia = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device) if int8 else None
        self.ib = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device) if int8 else None
        self.n, self.device = n, device
        self.sizes = replace(sizes, num_repeats=1, max_measure_s=1.0)   # 2 warm-up calls, 4 timed

    def __call__(self) -> tuple[float, float | None]:
        """(the dtype's GFLOP/s, _int_mm's GOP/s or None)"""
        rate = _measure_product("again", lambda: torch.matmul(self.a, self.b, out=self.out), self.n, self.device,
                                self.sizes).gflops
        if self.ia is None:
            return rate, None
        return rate, _measure_product("int8 again", lambda: torch._int_mm(self.ia, self.ib), self.n, self.device,
                                      self.sizes).gflops


def measure_int_mm(n: int, device: torch.device, sizes: Sizes) -> MatmulPeak:
    """int8 x int8 -> int32 products (``torch._int_mm``, n x n): the rate of the integer products
    that prompt rows take with int8 activations (GOP/s, reported as GFLOP/s)."""
    a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
    return _measure_product("int8 (_int_mm)", lambda: torch._int_mm(a, b), n, device, sizes)


def prompt_roofline(costs: "ModelCosts", num_tokens: int, products_gflops: float, attention_gflops: float,
                    start: int = 0) -> float:
    """The rate a prompt chunk of ``num_tokens`` at position ``start`` (0: a whole prefill) would
    run at if its products ran at ``products_gflops`` and its attention at ``attention_gflops``:
    its FLOPs over the sum of the two parts' times at those rates (the roofline when the two take
    different products)."""
    attention = costs.chunk_attention_flops(num_tokens, start)
    total = costs.chunk_flops(num_tokens, start)
    return total / ((total - attention) / products_gflops + attention / attention_gflops)


def _read(x: torch.Tensor, device: torch.device, sizes: Sizes, label: str, dtype: torch.dtype) -> Bandwidth:
    """Read bandwidth of ``x.sum()``; bytes moved = x's bytes."""
    with torch.inference_mode():
        times = time_calls(x.sum, device, num_warmup=1, num_repeats=3 * sizes.num_repeats,
                           max_s=sizes.max_measure_s, desc=f"read {label}")
    moved = x.numel() * x.element_size()
    return Bandwidth("sum (read)", label, str(dtype), moved, moved / min(times) / 1e9, Summary.of(times))


def measure_read(num_bytes: int, dtype: torch.dtype, device: torch.device, sizes: Sizes,
                 label: str) -> Bandwidth:
    """Read bandwidth: ``x.sum()`` over ``num_bytes`` of ``dtype``; bytes moved = num_bytes."""
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    return _read(torch.ones(num_bytes // elem_bytes, dtype=dtype, device=device), device, sizes, label, dtype)


def measure_read_huge_pages(num_bytes: int, dtype: torch.dtype, device: torch.device, sizes: Sizes,
                            label: str) -> Bandwidth | None:
    """:func:`measure_read` of a buffer on 2 MiB pages, as the weights a decode step streams lie
    (fastgen/model/huge_pages.py); None where the host gives none (not CPU, not Linux, no THP)."""
    if device.type != "cpu":
        return None
    from ..model.huge_pages import huge_page_buffer

    elem_bytes = torch.empty((), dtype=dtype).element_size()
    buf = huge_page_buffer(num_bytes // elem_bytes * elem_bytes)
    if buf is None:
        return None
    return _read(buf.view(dtype).fill_(1), device, sizes, f"{label}, 2 MiB pages", dtype)


def read_beside(engine, costs: "ModelCosts", sizes: Sizes) -> float:
    """GB/s of the weight-sized read as batch-1 decode's bound takes it again just before and after
    a run of steps (BANDWIDTH_BOUND_RULE): the highest of the model's dtype on both kinds of pages
    (:func:`measure_read`, :func:`measure_read_huge_pages`) and of fp32, whose sum reads the same
    bytes faster where bf16 is widened in software (26-30 GB/s against fp32's 35-46, Zen 3)."""
    dtype, device, label = engine.config.dtype, engine.config.device, "weight-sized, beside batch-1 decode"
    reads = (measure_read(costs.weight_bytes, dtype, device, sizes, label),
             measure_read_huge_pages(costs.weight_bytes, dtype, device, sizes, label),
             None if dtype == torch.float32 else measure_read(costs.weight_bytes, torch.float32, device, sizes, label))
    return max(r.gbps for r in reads if r is not None)


def measure_copy(num_bytes: int, device: torch.device, sizes: Sizes) -> Bandwidth:
    """Copy bandwidth of fp32: bytes moved = 2 * num_bytes (read source + write destination)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    with torch.inference_mode():
        times = time_calls(lambda: dst.copy_(src), device, num_warmup=1,
                           num_repeats=3 * sizes.num_repeats, max_s=sizes.max_measure_s, desc="copy")
    moved = 2 * src.numel() * 4
    return Bandwidth("copy (read + write)", "big fp32", "torch.float32", moved, moved / min(times) / 1e9,
                     Summary.of(times))


def prompt_rows_int8(engine) -> bool:
    """Whether the engine's prompt rows take int8 products (quantized layers, int8 activations)."""
    from ..model.quant import QuantWeight

    return any(isinstance(getattr(m, "format", None), QuantWeight) and m.format.act_int8
               for m in engine.model.modules())


def measure_machine(engine, costs: ModelCosts, sizes: Sizes) -> MachineLimits:
    device, dtype = engine.config.device, engine.config.dtype
    matmul_dtypes = list(dict.fromkeys([torch.bfloat16, torch.float32, dtype]))
    matmul = {str(d): measure_matmul(d, sizes.matmul_n, device, sizes) for d in matmul_dtypes}
    if prompt_rows_int8(engine):
        matmul["int8"] = measure_int_mm(sizes.matmul_n, device, sizes)
    reads = measure_reads(engine, costs, sizes)
    copy = measure_copy(sizes.bandwidth_bytes, device, sizes)
    return MachineLimits(torch.get_num_threads(), matmul, (*reads, copy), max(r.gbps for r in reads))


def measure_reads(engine, costs: ModelCosts, sizes: Sizes) -> list[Bandwidth]:
    """The reads whose highest is the decode bound (BANDWIDTH_BOUND_RULE, before the reads beside
    the steps): a big tensor in fp32 and bf16, one of the weights' size in fp32 and the model's dtype."""
    device, dtype = engine.config.device, engine.config.dtype
    reads = [measure_read(sizes.bandwidth_bytes, torch.float32, device, sizes, "big fp32"),
             measure_read(sizes.bandwidth_bytes, torch.bfloat16, device, sizes, "big bf16"),
             measure_read(costs.weight_bytes, torch.float32, device, sizes, "weight-sized fp32")]
    if dtype != torch.float32:
        reads.append(measure_read(costs.weight_bytes, dtype, device, sizes, f"weight-sized {dtype}"))
    # the weights lie on 2 MiB pages where the host gives them: so does one read of their size
    # (a 4 KiB-page read of 256 MB measured 0.93x the rate of the same read on 2 MiB pages, Zen 4)
    huge = measure_read_huge_pages(costs.weight_bytes, dtype, device, sizes, f"weight-sized {dtype}")
    if huge is not None:
        reads.append(huge)
    return reads


# -- the host -------------------------------------------------------------------------------

def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def busy_cpus(interval_s: float = 0.5) -> float | None:
    """CPUs kept busy by other processes during ``interval_s`` while this one sleeps (Linux;
    :class:`fastgen.calibrate.OtherLoad`, which the engine's calibrations take too).

    Other work on the cores makes every figure meaningless: the engine's threads wait on
    each other, and one forward can take ten times longer."""
    with OtherLoad() as load:
        time.sleep(interval_s)
    return load.cpus


def warn_if_busy(busy: float | None, when: str) -> None:
    if busy is not None and busy > BUSY_CPUS_WARNING:
        print(f"   warning: other processes kept {busy:.1f} CPUs busy {when}; the numbers are noisy")
