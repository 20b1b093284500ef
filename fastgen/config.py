"""Frozen configuration records, one per component, and the one place "auto" is resolved.

Each component receives only its own record: the cache gets :class:`CacheConfig`, the
scheduler :class:`SchedulerConfig`. :func:`resolve_engine_config` turns user options
(which may say ``"auto"``) into concrete values once, at engine construction.
Environment variables are read here and nowhere else.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from .errors import InvalidRequestError

if TYPE_CHECKING:   # the resolvers import torch; building and validating options does not
    import torch

# The budget used where it is not measured ("auto" is the default; fastgen.calibrate):
# on the 2-core AMX CPU, forward time per token flattens out near 256 tokens per step for
# SmolLM2-135M in bf16 (docs/architecture.md, "Choosing the token budget").
DEFAULT_BUDGET_TOKENS = 256
# budget_tokens="auto" picks the largest step that stays under this (fastgen.calibrate):
# 150 ms per step keeps every running stream above 6.7 tokens/s, 10% above the strictest of
# the paper's per-token SLAs (R = 6 tokens/s; R = 2 and 4 are looser) and above reading
# speed; a step of fresh prompt tokens is calibrated, so long contexts leave that margin
# to attention (docs/architecture.md, "Choosing the token budget").
DEFAULT_TARGET_ITL_MS = 150.0
DEFAULT_MAX_SEQS = 64
DEFAULT_BLOCK_SIZE = 32
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3

SCHEDULERS = ("splitfuse", "prefill-first", "static")
PROMPT_ORDERS = ("arrival", "deadline")
KERNELS = ("auto", "native", "torch")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# the KV cache's storage: "auto" holds the model's dtype; "int8" one byte a value and an fp32 scale
# per (token, KV head) row (fastgen/cache/pool.py), as vLLM's --kv-cache-dtype or llama.cpp's -ctk/-ctv
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """Shape of the KV block pool. ``num_blocks`` is resolved from a byte budget when not given.
    ``prefix_caching``: full blocks are content-addressed and shared by requests with the same
    prefix (fastgen.cache.prefix)."""

    block_size: int
    num_blocks: int
    prefix_caching: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the scheduler.

    budget_tokens: tokens (prompt chunks + decode tokens) one forward pass carries at most.
    max_seqs: sequences that may be running (admitted, holding KV blocks) at once.
    reserve_blocks: free blocks kept back when admitting a new prompt, so that running
        decodes can keep growing without an immediate preemption.
    policy: name of the scheduling policy.
    prompt_order: the order in which prompt work is served: "arrival" (first come, first served)
        or "deadline" (earliest TTFT deadline first, over the waiting prompts and, with SplitFuse,
        those already being split; see fastgen.scheduler.queues and .splitfuse).
    """

    budget_tokens: int
    max_seqs: int
    reserve_blocks: int
    policy: str = "splitfuse"
    prompt_order: str = "arrival"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, fully resolved (no "auto" left)."""

    model_path: str
    dtype: torch.dtype
    device: torch.device
    num_threads: int
    cache: CacheConfig
    scheduler: SchedulerConfig
    max_model_len: int
    kernels: str = "torch"   # "native" (fastgen's CPU kernels) or "torch"
    quantization: str = "none"   # "auto" (a GGUF as shipped), "none", "int8", "int4"
    kv_cache_dtype: str = "auto"   # "auto" (the model's dtype) or "int8" (KV_CACHE_DTYPES)
    int8_activations: bool = False
    cuda_graphs: bool = True   # decode steps as CUDA graphs where they apply (fastgen/model/cuda_graphs.py)
    tensor_parallel_size: int = 1   # ranks of this replica (fastgen.parallel); num_threads is per rank


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none); read once.
    The one reader of the host's ISA: dtype "auto", the kernel build key, the budget cache
    key and the benchmark's ISA line all use it."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_fast_bf16() -> bool:
    """True when this CPU has native bf16 matrix support (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}   # name -> torch attribute


def _is_torch_dtype(value) -> bool:
    """A ``torch.dtype`` can only come from a caller that imported torch already."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 on CUDA or on a CPU with AVX512-BF16/AMX, else fp32."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16()):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise InvalidRequestError(
            f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}", param="dtype")
    return getattr(torch, _DTYPES[dtype])


def cache_dir() -> Path:
    """Where fastgen keeps derived files: ``FASTGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastgen``."""
    explicit = os.environ.get("FASTGEN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastgen"


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``auto`` -> the ``FASTGEN_DEVICE`` variable, else CUDA when present, else CPU."""
    import torch

    if device is None or device == "auto":
        device = os.environ.get("FASTGEN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)


@dataclass(frozen=True)
class EngineOptions:
    """What a user may pass to ``pipeline(...)`` / ``fastgen serve``; "auto" allowed."""

    dtype: str = "auto"
    device: str | None = None
    num_threads: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    budget_tokens: int | str = "auto"
    target_itl_ms: float = DEFAULT_TARGET_ITL_MS
    max_seqs: int = DEFAULT_MAX_SEQS
    reserve_blocks: int | None = None
    max_model_len: int | None = None
    scheduler: str = "splitfuse"
    prompt_order: str = "arrival"
    kernels: str = "auto"
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    # int8 activations where they pay (VNNI; see fastgen.model.quant.QuantWeight). None (auto): on,
    # except when dtype float32 is asked for by name, which promises the exact products of the
    # shipped weights (greedy parity with transformers); on since they took prompt rows: serving
    # 1.02-1.13x, prompt perplexity +0.03% against bf16's own (docs/architecture.md)
    int8_activations: bool | None = None
    prefix_caching: bool = True
    tensor_parallel_size: int = 1
    # steps replayed as CUDA graphs on a GPU (fastgen/model/cuda_graphs.py); False runs every
    # step eagerly (vLLM's --enforce-eager); no effect on a CPU
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        """Reject bad values when the options are built, before any model is loaded."""
        for name in ("num_threads", "block_size", "num_blocks", "kv_cache_bytes", "max_seqs", "max_model_len",
                     "tensor_parallel_size"):
            _positive(name, getattr(self, name))
        if self.budget_tokens != "auto":
            _positive("budget_tokens", self.budget_tokens)
        if (not isinstance(self.target_itl_ms, (int, float)) or isinstance(self.target_itl_ms, bool)
                or not self.target_itl_ms > 0):
            raise InvalidRequestError(f"target_itl_ms must be a positive number, got {self.target_itl_ms!r}",
                                      param="target_itl_ms")
        if self.reserve_blocks is not None and (not isinstance(self.reserve_blocks, int) or self.reserve_blocks < 0):
            raise InvalidRequestError("reserve_blocks must be an integer >= 0", param="reserve_blocks")
        if self.scheduler not in SCHEDULERS:
            raise InvalidRequestError(
                f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}", param="scheduler")
        if self.prompt_order not in PROMPT_ORDERS:
            raise InvalidRequestError(
                f"prompt_order must be one of {PROMPT_ORDERS}, got {self.prompt_order!r}", param="prompt_order")
        if not isinstance(self.prefix_caching, bool):
            raise InvalidRequestError("prefix_caching must be true or false", param="prefix_caching")
        if not isinstance(self.cuda_graphs, bool):
            raise InvalidRequestError("cuda_graphs must be true or false", param="cuda_graphs")
        if self.int8_activations is not None and not isinstance(self.int8_activations, bool):
            raise InvalidRequestError("int8_activations must be true, false or unset (auto)",
                                      param="int8_activations")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
                                      param="quantization")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
                                      param="kv_cache_dtype")
        if self.kernels not in KERNELS:
            raise InvalidRequestError(f"kernels must be one of {KERNELS}, got {self.kernels!r}", param="kernels")
        if self.dtype not in ("auto", *_DTYPES) and not _is_torch_dtype(self.dtype):
            raise InvalidRequestError(
                f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}", param="dtype")

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "EngineOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s) {unknown}; known: {sorted(names)}", param=unknown[0])
        return cls(**kwargs)


def resolve_int8_activations(int8_activations: bool | None, dtype: "str | torch.dtype") -> bool:
    """None (auto): int8 activations, unless float32 was asked for by name (exact products)."""
    import torch

    if int8_activations is not None:
        return int8_activations
    return not (dtype == "float32" or dtype is torch.float32)


def resolve_engine_config(model_path: str, options: EngineOptions, *, kv_elems_per_token: int,
                          model_max_len: int, head_dim: int = 0) -> EngineConfig:
    """Resolve every "auto" in ``options`` against the machine and the loaded model."""
    import torch

    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    num_threads = options.num_threads or int(os.environ.get("FASTGEN_NUM_THREADS", 0)) \
        or len(os.sched_getaffinity(0))
    from .cache.pool import int8_layout_error, token_bytes

    if options.kv_cache_dtype == "int8":
        if error := int8_layout_error(head_dim, options.block_size):
            raise InvalidRequestError(error, param="kv_cache_dtype")
        if device.type == "cuda" and options.cuda_graphs:
            raise InvalidRequestError("kv_cache_dtype='int8' runs eagerly on a GPU: pass cuda_graphs=False "
                                      "(--no-cuda-graphs) with it", param="kv_cache_dtype")
    bytes_per_block = token_bytes(kv_elems_per_token, head_dim, dtype, options.kv_cache_dtype) * options.block_size
    num_blocks = options.num_blocks or max(1, options.kv_cache_bytes // bytes_per_block)
    max_model_len = min(options.max_model_len or model_max_len, model_max_len)
    reserve = options.reserve_blocks if options.reserve_blocks is not None \
        else min(num_blocks // 16, options.max_seqs)
    kernels = resolve_kernels(options.kernels, device, dtype)
    return EngineConfig(
        model_path=model_path, dtype=dtype, device=device, num_threads=num_threads,
        cache=CacheConfig(block_size=options.block_size, num_blocks=num_blocks,
                          prefix_caching=options.prefix_caching),
        scheduler=SchedulerConfig(budget_tokens=DEFAULT_BUDGET_TOKENS if options.budget_tokens == "auto"
                                  else options.budget_tokens, max_seqs=options.max_seqs,
                                  reserve_blocks=reserve, policy=options.scheduler,
                                  prompt_order=options.prompt_order),
        max_model_len=max_model_len, kernels=kernels,
        quantization=resolve_quantization(options.quantization, kernels),
        kv_cache_dtype=options.kv_cache_dtype,
        int8_activations=resolve_int8_activations(options.int8_activations, options.dtype),
        tensor_parallel_size=options.tensor_parallel_size, cuda_graphs=options.cuda_graphs,
    )


def resolve_quantization(quantization: str, kernels: str) -> str:
    """Quantized weights run on the native kernels: without them "auto" is "none" and
    "int8"/"int4" are an error."""
    if kernels == "native":
        return quantization
    if quantization in ("int8", "int4"):
        raise InvalidRequestError(f"quantization={quantization!r} needs fastgen's native CPU kernels "
                                  f"(kernels='native' on a CPU in fp32/bf16)", param="quantization")
    return "none"


def wants_native_kernels(kernels: str, device: str | torch.device | None) -> bool:
    """Whether :func:`resolve_kernels` would try fastgen's CPU kernels for these options (before the
    dtype is known): what a first start may build early (fastgen.kernels.load_in_background)."""
    if kernels == "auto":
        kernels = os.environ.get("FASTGEN_KERNELS", "auto")
    try:
        return kernels in ("auto", "native") and resolve_device(device).type == "cpu"
    except Exception:   # a bad device: resolve_engine_config names the problem
        return False


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> "native" where fastgen's CPU kernels cover the device and dtype and build
    on this host (once; see fastgen.kernels), else "torch". "native" where they cannot run
    is an error. ``FASTGEN_KERNELS`` overrides ``auto``."""
    from .kernels import load
    from .kernels.ops import native_supported

    if kernels == "auto":
        kernels = os.environ.get("FASTGEN_KERNELS", "auto")
        if kernels not in KERNELS:
            raise InvalidRequestError(f"FASTGEN_KERNELS must be one of {KERNELS}, got {kernels!r}",
                                      param="kernels")
    if kernels == "torch":
        return "torch"
    ok = native_supported(device, dtype) and load()
    if kernels == "native" and not ok:
        raise InvalidRequestError(f"kernels='native' needs a CPU, fp32 or bf16, and a C++ compiler; "
                                  f"have {device.type}, {dtype}", param="kernels")
    return "native" if ok else "torch"
