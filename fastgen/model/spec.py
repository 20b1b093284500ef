"""What a model family tells the rest of fastgen: its numbers and its checkpoint names.

The engine sizes the KV pool and stops on EOS from a :class:`ModelConfig`; the loader maps
GGUF tensor names through the family's :class:`GgufNames`. Neither asks which family it
holds: a family is a :class:`Family` record (fastgen/model/registry.py lists them), kept
beside its model in one file of fastgen/model/.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts of a mixture-of-experts family (fastgen/model/moe.py)."""

    num_experts: int
    top_k: int
    expert_size: int                     # each routed expert's intermediate size
    norm_topk_prob: bool                 # renormalise the top-k probabilities to sum to 1
    shared_expert_size: int = 0          # a shared expert behind a sigmoid gate (Qwen2-MoE); 0: none
    sparse_layers: tuple[bool, ...] = () # per layer: routed experts (True) or the dense MLP


@dataclass(frozen=True)
class ModelConfig:
    """The numbers of one model. The engine reads the first block (pool shape, limits, EOS);
    the layers read the rest."""

    model_type: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # -- the decoder's shape --
    hidden_size: int
    intermediate_size: int
    num_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str                      # "silu" or "gelu_pytorch_tanh" (gated); "relu" (OPT)
    qk_norm: bool = False                # RMSNorm of each q and k head before RoPE (Qwen3, Gemma 3)
    layer_windows: tuple[int, ...] = ()  # per layer: sliding window in tokens, 0 = the whole context
    attn_scale: float | None = None      # softmax scale; None = head_dim ** -0.5
    moe: MoeConfig | None = None         # routed experts in place of the MLP (where sparse_layers says)

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """The config of a transformers config, built by its family (fastgen.model.registry);
        :class:`~fastgen.errors.ModelLoadError` for an unsupported ``model_type``."""
        from .registry import model_config

        return model_config(hf)

    @property
    def kv_elems_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0


@dataclass(frozen=True)
class Split:
    """A llama.cpp tensor that fuses checkpoint tensors along its rows (Phi-2's and Falcon's
    ``attn_qkv``, Phi-3's ``ffn_up`` = gate then up): their names and row counts, in order."""

    names: tuple[str, ...]
    rows: Callable[[ModelConfig], tuple[int, ...]]


def qkv_rows(cfg: ModelConfig) -> tuple[int, int, int]:
    """Rows of a fused QKV tensor laid out as all q heads, then k, then v."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return q, kv, kv


QKV = Split(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), qkv_rows)


@dataclass(frozen=True)
class GgufNames:
    """llama.cpp's layout of a family: its architecture, tensor names, what its converter did.

    ``arch``: ``general.architecture`` of the family's files; ``experts``: whether they hold
    routed experts (``{arch}.expert_count`` > 0; llama.cpp's ``llama`` serves Llama and Mixtral).
    ``layer``: name after ``blk.N.`` -> name after ``model.layers.N.`` (a :class:`Split` for a
    fused tensor; ``{e}`` in a name: one tensor per expert, cut from a 3-D ``*_exps`` tensor
    ``[experts, rows, cols]`` or named ``blk.N.part.E`` in older files); ``top``: the other
    tensors (without ``.weight``/``.bias``). The names are the model's own (``load_weights``,
    ``attach_quantized``), HF names where the family keeps them. ``unpermute_qk``: llama.cpp
    interleaved the Q/K rows of its ``llama`` architecture for its RoPE; undone at load.
    ``norm_shift``: added to every ``*norm`` tensor (Gemma's converter stores ``1 + w``).
    ``config``: the transformers config built from the file's metadata
    (fastgen.model.gguf_file.GgufHeader); None where transformers' own GGUF config mapping is
    complete for the family (Llama, Qwen2/3, Gemma 3).
    """

    arch: str
    layer: Mapping[str, "str | Split"]
    top: Mapping[str, str]
    unpermute_qk: bool = False
    norm_shift: float = 0.0
    experts: bool = False
    config: Callable[[Any], Any] | None = None


@dataclass(frozen=True)
class Family:
    """One registry entry: the model class, its config builder, its GGUF names (None: the
    family has no GGUF layout in llama.cpp)."""

    model_class: type
    config: Callable[[Any], ModelConfig]          # transformers config -> ModelConfig
    gguf: GgufNames | None = field(default=None)


def local_kv_heads(model: Any, model_config: ModelConfig) -> int:
    """KV heads of the pool ``model`` reads: its own config's (a tensor-parallel rank holds a
    share of them), else the model's."""
    local = getattr(model, "config", None)
    return local.num_kv_heads if isinstance(local, ModelConfig) else model_config.num_kv_heads


def eos_ids(hf: Any) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def layer_windows(hf: Any) -> tuple[int, ...]:
    """Per layer, the sliding window the transformers implementation applies (0: none).

    ``layer_types`` (Qwen2/3, Gemma 3) names each layer's kind; without it (Mistral) a set
    ``sliding_window`` applies to every layer. ``use_sliding_window=False`` turns it off.
    """
    window = getattr(hf, "sliding_window", None) or 0
    if not window or not getattr(hf, "use_sliding_window", True):
        return (0,) * hf.num_hidden_layers
    kinds = getattr(hf, "layer_types", None)
    if kinds is None:
        return (window,) * hf.num_hidden_layers
    unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if unknown:
        from ..errors import ModelLoadError

        raise ModelLoadError(f"layer types {unknown} are not supported; supported: sliding_attention, "
                             f"full_attention")
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
