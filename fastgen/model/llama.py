"""The Llama-family decoder, driven by its config: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM.

Differences between the family members are config facts: grouped-query attention
(``num_key_value_heads``), a bias on the QKV projection (Qwen2), RMSNorm of each q and k
head (Qwen3), tied input/output embeddings (SmolLM, small Qwen2), RoPE scaling (Llama 3.x),
sliding windows (Mistral; per layer through ``layer_types``). Other families (Gemma 3)
reuse these layers and override the few methods where they differ.

Checkpoint names are the Hugging Face ones; :data:`STACKED` maps the separate q/k/v and
gate/up projections onto the fused layers. The registry entries of this file are
:data:`LLAMA` and :data:`QWEN2` (their GGUF layouts differ in llama.cpp's Q/K permutation).
"""
from __future__ import annotations

import itertools

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..batch import RaggedBatch
from ..cache import KVPool
from ..errors import ModelLoadError
from ..kernels.ops import NativeOps, Ops, TorchOps, native_supported
from .attention import AttentionBackend, PagedAttention, SdpaAttention
from .layers import ColumnLinear, LayerNorm, Linear, RMSNorm, RotaryEmbedding, RowLinear, default_format
from .quant import QuantEmbedding, QuantRows, QuantWeight
from .spec import Family, GgufNames, ModelConfig, MoeConfig, eos_ids, layer_windows

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def llama_config(hf: Any, *, qkv_bias: bool | None = None, qk_norm: bool = False,
                 act: str | None = None, attn_scale: float | None = None,
                 moe: MoeConfig | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama-shaped transformers config (keywords: what a
    family fixes rather than reads)."""
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    act = act or getattr(hf, "hidden_act", "silu")
    act = "silu" if act == "swish" else act
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"unsupported activation {act!r} for {hf.model_type}; supported: {ACTIVATIONS}")
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        model_type=hf.model_type, vocab_size=hf.vocab_size, num_layers=hf.num_hidden_layers,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads, head_dim=head_dim,
        max_position_embeddings=hf.max_position_embeddings,
        bos_token_id=getattr(hf, "bos_token_id", None), eos_token_ids=eos_ids(hf),
        hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size, num_heads=num_heads,
        rms_norm_eps=hf.rms_norm_eps, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias, o_bias=attention_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)), hidden_act=act, qk_norm=qk_norm,
        layer_windows=layer_windows(hf), attn_scale=attn_scale, moe=moe)


def rope_parameters(hf: Any, layer_type: str | None = None, max_positions: int | None = None,
                    ) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` for the config's RoPE, via transformers' own functions.
    ``layer_type``: the key of per-layer-type RoPE parameters (Gemma 3's local and global layers).
    ``max_positions``: the longest context served (LongRoPE's factors depend on it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0)
    if partial != 1.0:   # the RoPE ops rotate whole heads
        raise ModelLoadError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rope_type == "longrope":
        # transformers uses the short factors while a sequence is within the original context and
        # switches to the long ones past it (for the whole sequence, keys already cached
        # included); a KV cache cannot follow that switch, so serve within the original context
        original = (params.get("original_max_position_embeddings")
                    or getattr(hf, "original_max_position_embeddings", None) or hf.max_position_embeddings)
        if max_positions is not None and max_positions > original:
            raise ModelLoadError(f"LongRoPE switches to its long factors past original_max_position_embeddings="
                                 f"{original}, which a KV cache cannot follow; set max_model_len <= {original} "
                                 f"(asked for {max_positions})")
    elif rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"RoPE type {rope_type!r} is not supported (its frequencies change "
                             f"with the sequence length); supported: default, linear, llama3, yarn, longrope")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"), **extra)
    return inv, float(scaling)


@dataclass(frozen=True)
class Step:
    """What every layer reads in one forward pass (built once per step)."""

    batch: RaggedBatch
    pool: KVPool
    plan: Any                 # the attention backend's metadata for this batch
    ops: Ops
    attention: AttentionBackend
    ropes: tuple[RotaryEmbedding, ...]   # the model's RoPE tables; a layer reads one of them


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope_index: int = 0) -> None:
        super().__init__()
        self.layer, self.rope_index, self.window = layer, rope_index, cfg.window(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnLinear(cfg.hidden_size, [q, kv, kv], bias=cfg.qkv_bias)
        self.o_proj = RowLinear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5

    def _norm_heads(self, qkv: torch.Tensor, ops: Ops) -> None:
        """In place: RMSNorm of every q head and every k head of ``qkv`` (before RoPE)."""
        t, q, kv = qkv.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for norm, lo, hi in ((self.q_norm, 0, q), (self.k_norm, q, q + kv)):
            heads = qkv[:, lo:hi].reshape(-1, self.head_dim).contiguous()   # [T * heads, D], a copy
            qkv[:, lo:hi] = ops.rms_norm(heads, norm.weight, norm.eps).view(t, hi - lo)

    def bind_parts(self) -> tuple[Callable, Callable, Callable]:
        """``forward`` in three closures over this module's parts and settings: ``project(x,
        step) -> (q, k, v)`` (QKV product, head norms, RoPE, the KV write into the pool),
        ``attend(q, k, v, step) -> o`` (the step's attention backend) and ``finish(o) ->
        o_proj(o)``. CUDA graphs capture the first and last and run attention between them
        (fastgen/model/cuda_graphs.py)."""
        qkv_proj, o_proj, norm_heads = self.qkv_proj, self.o_proj, self.q_norm is not None
        layer, rope_index, scale, window = self.layer, self.rope_index, self.scale, self.window
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim

        def project(x: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            qkv = qkv_proj(x)                                           # [T, (H + 2 KVH) * D]
            if norm_heads:
                self._norm_heads(qkv, step.ops)
            rope, batch = step.ropes[rope_index], step.batch
            return step.ops.rope_write_kv(qkv, batch.positions, rope.cos, rope.sin, batch.slots, step.pool,
                                          layer, heads, kv_heads, head_dim)   # [T, H, D], [T, KVH, D] x 2

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
            return step.attention(layer, q, k, v, step.plan, step.pool, scale, window)   # [T, H, D]

        def finish(o: torch.Tensor) -> torch.Tensor:
            return o_proj(o.reshape(o.shape[0], -1))
        return project, attend, finish

    def bind(self) -> Callable[[torch.Tensor, Step], torch.Tensor]:
        """``forward`` as a closure over this module's parts and settings (see
        :meth:`LlamaForCausalLM.forward`: the step's loop runs the closures)."""
        project, attend, finish = self.bind_parts()

        def run(x: torch.Tensor, step: Step) -> torch.Tensor:
            return finish(attend(*project(x, step), step))
        return run

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        return self.bind()(x, step)


class MLP(nn.Module):
    """The gated MLP; ``intermediate_size`` overrides the config's (an expert's, a shared expert's)."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = ColumnLinear(cfg.hidden_size, [inter] * 2, bias=cfg.mlp_bias)
        self.down_proj = RowLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act

    def bind(self) -> Callable[[torch.Tensor, Ops], torch.Tensor]:
        """``forward`` as a closure over this module's parts (as :meth:`Attention.bind`)."""
        gate_up_proj, down_proj, act = self.gate_up_proj, self.down_proj, self.act
        # a weight format that applies the activation itself as it stores the product (quantized
        # rows, prompt chunks); None where it does not
        fused = getattr(gate_up_proj.format, "matmul_silu_mul", None) if act == "silu" else None

        def feed(x: torch.Tensor, ops: Ops) -> torch.Tensor:
            if fused is not None:
                h = fused(x)                                            # [T, I] or None
                if h is not None:
                    return down_proj(h)
            gate_up = gate_up_proj(x)                                   # [T, 2I]
            if act == "silu":
                return down_proj(ops.silu_mul(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)   # GELU (tanh approximation): no fused kernel
            return down_proj(F.gelu(gate, approximate="tanh") * up)
        return feed

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        return self.bind()(x, ops)


def bound(module: nn.Module) -> Callable:
    """``module.bind()`` where its class is one whose ``bind`` is its forward (Attention, MLP);
    else a call of the module itself (an MoE block, a family's own attention), hooks included."""
    if type(module) in (Attention, MLP):
        return module.bind()
    return lambda *args: module(*args)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope_index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rope_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def bind(self, next_norm: RMSNorm) -> Callable[[torch.Tensor, torch.Tensor, Step], torch.Tensor]:
        """``forward`` as a closure over this layer's parts, parameters and settings, taken once
        (:meth:`LlamaForCausalLM.forward` runs the closures): the same operations without a
        module attribute lookup or a module call for each part, which were 0.5 ms of SmolLM2's
        4.6 ms one-token forward (~450 lookups and 60 calls through nn.Module's machinery).
        Hooks on this layer and on its attention are not run; on its MLP (or MoE block) they are
        unless it is a plain MLP (see :func:`bound`)."""
        attend, post = bound(self.self_attn), self._post(None, next_norm)

        def run(normed: torch.Tensor, residual: torch.Tensor, step: Step) -> torch.Tensor:
            return post(attend(normed, step), residual, step)
        return run

    def bind_parts(self, next_norm: RMSNorm) -> tuple[Callable, Callable, Callable]:
        """:meth:`bind` split around attention (a plain :class:`Attention` only):
        ``pre(normed, step) -> (q, k, v)``, ``attend(q, k, v, step) -> o`` and
        ``post(o, residual, step) -> next normed`` (the output product, both residual adds and
        norms, the MLP). CUDA graphs capture ``pre`` and ``post`` (fastgen/model/cuda_graphs.py)."""
        project, attend, finish = self.self_attn.bind_parts()
        return project, attend, self._post(finish, next_norm)

    def _post(self, finish: Callable | None, next_norm: RMSNorm) -> Callable:
        """``post(a, residual, step) -> next normed``: ``finish(a)`` (the attention's output
        product, where ``a`` is not its result yet), the residual add and norm, the MLP, the
        residual add and ``next_norm``."""
        feed = bound(self.mlp)
        post_norm = self.post_attention_layernorm
        post_w, post_eps, next_w, next_eps = post_norm.weight, post_norm.eps, next_norm.weight, next_norm.eps

        def post(a: torch.Tensor, residual: torch.Tensor, step: Step) -> torch.Tensor:
            if finish is not None:
                a = finish(a)
            step.ops.add_rms_norm_(a, residual, post_w, post_eps)
            m = feed(a, step.ops)
            step.ops.add_rms_norm_(m, residual, next_w, next_eps)
            return m
        return post

    def forward(self, normed: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm, step: Step) -> torch.Tensor:
        """``normed`` = this layer's input norm of ``residual``; updates ``residual`` in place
        and returns ``next_norm`` of it (the next layer's input norm, or the final norm)."""
        return self.bind(next_norm)(normed, residual, step)


# HF checkpoint name fragment -> (fused module attribute, part index)
STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def stacked_name(name: str) -> tuple[str, int] | None:
    """A checkpoint name of a fused layer's part (``...q_proj.weight``) as the fused layer's name
    (``...qkv_proj.weight``) and the part's index; None for any other name."""
    frag = next((f for f in STACKED if f".{f}." in name), None)
    if frag is None:
        return None
    target, part = STACKED[frag]
    return name.replace(frag, target), part


GreedyChoice = tuple[torch.Tensor, torch.Tensor]   # per logits row: argmax (int64), its value (fp32)


def head_logits(head: nn.Module, x: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, GreedyChoice | None]:
    """The output head's logits of rows ``x`` in fp32 and, when ``greedy`` asks and the head's
    weight format takes it inside the product (``Linear.forward_argmax``: the native decode-row
    kernels), each row's argmax and its value, torch.argmax's answer over the logits returned.
    The choice comes from each block of the head's outputs while it is in cache: read back after
    the product, the logits come from memory (the head's weight stream pushed them out)."""
    fused = getattr(head, "forward_argmax", None) if greedy else None
    got = fused(x) if fused is not None else None
    if got is None:
        return head(x).float(), None
    y, idx, best = got
    return y.float(), (idx, best)


class LlamaForCausalLM(nn.Module):
    """``forward(batch, pool) -> logits [len(batch.logits_indices), vocab]`` in fp32.

    A family that differs in its layers or its embedding overrides :meth:`make_layer`,
    :meth:`rope_tables` or :meth:`embed` (see fastgen/model/gemma3.py)."""

    def __init__(self, cfg: ModelConfig, hf_config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        # filled by the loader: no random init (1 s for Gemma 3's 262k x 640 embedding)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else RowLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.ropes = nn.ModuleList(RotaryEmbedding(inv_freq, scaling, max_positions)
                                   for inv_freq, scaling in self.rope_tables(hf_config, max_positions))
        self.head: Linear | None = None  # output projection; set by prepare()
        self._embed_quant = None         # the tied embedding's QuantRows (GGUF), for the head
        self.ops: Ops = TorchOps()
        self.attention: AttentionBackend | None = None

    def make_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return DecoderLayer(cfg, layer)

    def rope_tables(self, hf_config: Any, max_positions: int) -> list[tuple[torch.Tensor, float]]:
        """``(inv_freq, attention_scaling)`` of each RoPE table; a layer's ``rope_index`` picks one."""
        return [rope_parameters(hf_config, max_positions=max_positions)]

    def embed(self, batch: RaggedBatch) -> torch.Tensor:
        return self.embed_tokens(batch.token_ids)                   # [T, hidden]

    def prepare(self, kernels: str = "torch", int8_activations: bool = False) -> None:
        """After loading and moving: give every linear layer its weight format, pick the
        output projection, and the small-op and attention implementations (``kernels``:
        "native" = fastgen's CPU kernels, already loaded; "torch" = plain PyTorch)."""
        def formatter(layer: Linear):
            quant = layer.quant_rows() if kernels == "native" else None

            def make_format(weight, bias):
                if quant is None:
                    return default_format(weight, bias, kernels)
                return QuantWeight(quant, bias, int8_activations)
            return make_format

        if self.lm_head is not None:
            self.head = self.lm_head
        else:  # tied: the output projection gets its own format; the embedding gather keeps the plain one
            emb = self.embed_tokens.weight
            self.head = RowLinear(emb.shape[1], emb.shape[0], bias=False).to(emb.device)
            self.head.weight = nn.Parameter(emb.data, requires_grad=False)
            if self._embed_quant is not None:
                self.head.quant_parts[0] = self._embed_quant
        self.__dict__["_runs"] = None      # the layers' closures are bound again on the next forward
        self.__dict__["_stack"] = None     # and the native stack built again (fastgen/model/stack.py)
        self.__dict__["_graphs"] = None    # and the CUDA graphs (fastgen/model/cuda_graphs.py)
        for m in self.modules():
            if isinstance(m, Linear):
                m.prepare(formatter(m))
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        if kernels == "native" and self._embed_quant is not None:
            # the embedding as its quantized rows (shared with a tied head): no dense copy; a
            # tensor-parallel slice (fastgen/parallel/layers.py) holds them itself
            quant = QuantEmbedding(self._embed_quant, dtype)
            if hasattr(self.embed_tokens, "hold_quantized"):
                self.embed_tokens.hold_quantized(quant)
            elif self._gathers_from_rows():
                self.embed_tokens = quant
        if kernels == "native":
            if not native_supported(device, dtype):
                raise ValueError(f"native kernels cover CPU fp32/bf16, not {device.type} {dtype}")
            self.ops, self.attention = NativeOps(), PagedAttention(dtype, device, self.config.layer_windows)
        else:
            self.ops, self.attention = TorchOps(), SdpaAttention(dtype, device, self.config.layer_windows)

    @property
    def kernels(self) -> str:
        return self.ops.name

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and the KV cache (the embedding may be held quantized)."""
        return self.norm.weight.dtype

    def step(self, batch: RaggedBatch, pool: KVPool) -> Step:
        return Step(batch, pool, self.attention.plan(batch), self.ops, self.attention, tuple(self.ropes))

    def forward(self, batch: RaggedBatch, pool: KVPool) -> torch.Tensor:
        """The logits of ``batch``'s rows that want them, ``[num_logits, vocab]`` fp32."""
        return self._forward(batch, pool, False)[0]

    @property
    def fuses_greedy(self) -> bool:
        """Whether :meth:`forward_greedy` can take greedy decoding's choice inside the head's
        product (its weight format has ``matmul_argmax``; steps not run as CUDA graphs)."""
        fmt = getattr(self.head, "format", None)
        return hasattr(fmt, "matmul_argmax") and self._step_graphs() is None

    def forward_greedy(self, batch: RaggedBatch, pool: KVPool) -> tuple[torch.Tensor, GreedyChoice | None]:
        """:meth:`forward`'s logits and, where the head's kernel takes it inside the product
        (:func:`head_logits`), greedy decoding's choice for each of their rows; else None."""
        return self._forward(batch, pool, True)

    @torch.inference_mode()
    def _forward(self, batch: RaggedBatch, pool: KVPool, greedy: bool) -> tuple[torch.Tensor, GreedyChoice | None]:
        graphs = self._step_graphs()
        shape = graphs.fit(batch, pool) if graphs is not None else None
        if shape is not None:
            return graphs.run(batch, pool, shape), None            # as CUDA graphs (fastgen/model/cuda_graphs.py)
        step = self.step(batch, pool)
        residual, x = self.embed_normed(batch, self.ops)           # [T, hidden] each
        stack = self._native_stack()
        if stack is not None and stack.takes(x.shape[0]):
            x = stack.run(x, residual, step)                       # the same ops, without Python between
        else:
            for run in self._layer_runs():
                x = run(x, residual, step)                         # x = the next norm of residual
        return head_logits(self.head, batch.logits_rows(x), greedy)   # [num_logits, vocab]

    def embed_normed(self, batch: RaggedBatch, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual, x)``: the embedding of ``batch``'s tokens and the first layer's input norm of it
        (what every layer loop starts from: the eager forward, fastgen/model/cuda_graphs.py's)."""
        residual = self.embed(batch)
        first = self.layers[0].input_layernorm
        return residual, ops.rms_norm(residual, first.weight, first.eps)

    def next_norms(self) -> list[RMSNorm]:
        """The norm that follows each layer: the next layer's input norm, the final norm after the last."""
        layers = list(self.layers)
        return [layer.input_layernorm for layer in layers[1:]] + [self.norm]

    def _step_graphs(self):
        """CUDA graphs of steps (fastgen/model/cuda_graphs.py), built once after prepare(); None where
        they do not apply (a CPU, other ops or layers, the engine option ``cuda_graphs=False``,
        ``FASTGEN_CUDA_GRAPHS=0``)."""
        if not self.__dict__.get("use_cuda_graphs", True):   # the engine's cuda_graphs=False
            return None
        graphs = self.__dict__.get("_graphs")
        if graphs is None:
            from .cuda_graphs import StepGraphs
            graphs = StepGraphs.build(self) or False
            self.__dict__["_graphs"] = graphs
        return graphs or None

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether steps run as CUDA graphs: the engine's pool then has a spare block."""
        return self._step_graphs() is not None

    def _native_stack(self):
        """The layers as one native call for decode rows (fastgen/model/stack.py), built once after
        prepare(); False where this model's layers cannot run that way."""
        stack = self.__dict__.get("_stack")
        if stack is None:
            from .stack import NativeStack
            stack = NativeStack.build(self) or False
            self.__dict__["_stack"] = stack
        return stack or None

    def _layer_runs(self) -> list[Callable]:
        """Each layer bound to the norm that follows it (DecoderLayer.bind), made once after
        prepare() (which drops them, as anything that replaces a module must)."""
        runs = self.__dict__.get("_runs")
        if runs is None:
            runs = [layer.bind(norm) for layer, norm in zip(self.layers, self.next_norms())]
            self.__dict__["_runs"] = runs
        return runs

    def _gathers_from_rows(self) -> bool:
        """Whether prepare() gives the embedding its quantized rows: a plain nn.Embedding (then
        replaced) or a tensor-parallel slice (which holds them); a family's own embedding keeps
        its dense weight."""
        return hasattr(self.embed_tokens, "hold_quantized") or type(self.embed_tokens) is nn.Embedding

    def _quant_target(self, name: str) -> tuple[str, int] | None:
        """``(module name, part)`` that holds HF-named weight ``name`` (no ``model.`` prefix)
        quantized: a linear layer's part, or ``("embed_tokens", 0)``; None for any other tensor."""
        if name == "embed_tokens.weight":
            return "embed_tokens", 0
        name, part = stacked_name(name) or (name, 0)
        module_name, _, kind = name.rpartition(".")
        if kind != "weight":
            return None
        try:
            module = self.get_submodule(module_name)
        except AttributeError:
            return None
        return (module_name, part) if isinstance(module, Linear) else None

    def accepts_quantized(self, kinds: dict[str, int]) -> set[str]:
        """Of ``kinds`` (HF name -> QuantRows kind of a tensor that can come quantized), the names
        this model holds quantized and never dense: each linear layer's weight whose parts all
        come in one kind, and the embedding where it is gathered from its rows (see prepare)."""
        by_module: dict[str, dict[int, tuple[str, int]]] = {}
        for name, kind in kinds.items():
            target = self._quant_target(name.removeprefix("model."))
            if target is not None:
                by_module.setdefault(target[0], {})[target[1]] = (name, kind)
        accepted = set()
        for module_name, parts in by_module.items():
            if module_name == "embed_tokens":
                if not self._gathers_from_rows():
                    continue
            elif len(parts) != self.get_submodule(module_name).num_parts:
                continue
            if len({kind for _, kind in parts.values()}) == 1:
                accepted.update(name for name, _ in parts.values())
        return accepted

    def attach_quantized(self, quant: dict) -> None:
        """Hand HF-named :class:`~fastgen.model.quant.QuantRows` to their layers (and parts)."""
        for name, rows in quant.items():
            name, rows = self.checkpoint_quant(name.removeprefix("model."), rows)
            target = self._quant_target(name)
            if target is None:
                continue
            if target[0] == "embed_tokens":
                self._embed_quant = rows
            else:
                self.get_submodule(target[0]).quant_parts[target[1]] = rows

    def quantize_linear(self, bits: int, quantize) -> None:
        """Quantize every linear weight and the output head at load (HF checkpoints), handing
        the QuantRows to the layers directly; the loaded weights are replaced by their
        dequantized values so that prompt chunks and decodes compute the same model."""
        for name, module in self.named_modules():
            if not isinstance(module, Linear):
                continue
            rows = quantize(module.weight.data, bits)
            with torch.no_grad():
                module.weight.copy_(rows.dequantize().to(module.weight.dtype))
            module.quant_parts = {}
            if isinstance(module, ColumnLinear):
                start = 0
                for i, size in enumerate(module.output_sizes):
                    module.quant_parts[i] = rows.rows(start, start + size)
                    start += size
            else:
                module.quant_parts[0] = rows
        if self.lm_head is None:
            emb = self.embed_tokens.weight
            self._embed_quant = quantize(emb.data, bits)
            with torch.no_grad():
                emb.copy_(self._embed_quant.dequantize().to(emb.dtype))

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        """A checkpoint tensor as this model stores it (Gemma: its norms' ``1 + w``)."""
        return name, tensor

    def checkpoint_quant(self, name: str, quant: QuantRows) -> tuple[str, QuantRows]:
        """A quantized checkpoint tensor as this model stores it: what :meth:`checkpoint_tensor`
        does to the dense one, for the row reorderings a family applies (Phi-2's rotary)."""
        return name, quant

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], held: Iterable[str] = ()) -> None:
        """Load HF-named tensors; raises :class:`ModelLoadError` on a missing or unknown one.
        ``held``: HF names that are not in ``weights`` because the model holds them quantized
        (:meth:`accepts_quantized`); they count as loaded, their dense parameters stay unread."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in itertools.chain(weights, ((n, None) for n in held)):
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the output projection
            if "rotary_emb" in name:
                continue
            if tensor is not None:
                name, tensor = self.checkpoint_tensor(name, tensor)
            fused = stacked_name(name)
            if fused is not None:
                module_name, _, kind = fused[0].rpartition(".")
                part = fused[1]
                module = self.get_submodule(module_name)
                if tensor is not None:
                    with torch.no_grad():
                        module.load_part(part, kind, tensor.to(module.weight.dtype))
                loaded.add(f"{module_name}.{kind}#{part}")
                continue
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} does not belong to a {self.config.model_type} model")
            if tensor is not None:
                if params[name].shape != tensor.shape:
                    raise ModelLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                         f"model expects {tuple(params[name].shape)}")
                with torch.no_grad():
                    params[name].copy_(tensor)
            loaded.add(name)
            module_name, _, kind = name.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, ColumnLinear):   # shipped fused (Phi-3's qkv_proj, gate_up_proj)
                loaded.update(f"{name}#{i}" for i in range(module.num_parts))
        expected = set()
        for pname, p in params.items():
            module_name, _, kind = pname.rpartition(".")
            module = self.get_submodule(module_name)
            if isinstance(module, ColumnLinear):
                expected.update(f"{pname}#{i}" for i in range(len(module.output_sizes)))
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")


class LayerNormCausalLM(LlamaForCausalLM):
    """Families whose layers are plain residual blocks over LayerNorm (OPT, Phi-2, Falcon): a
    layer is ``forward(x, step) -> x``, and the final norm is a LayerNorm applied to the rows
    that produce logits."""

    def __init__(self, cfg: ModelConfig, hf_config: Any, max_positions: int) -> None:
        super().__init__(cfg, hf_config, max_positions)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @torch.inference_mode()
    def _forward(self, batch: RaggedBatch, pool: KVPool, greedy: bool) -> tuple[torch.Tensor, GreedyChoice | None]:
        step = self.step(batch, pool)
        x = self.embed(batch)                                      # [T, hidden]
        for layer in self.layers:
            x = layer(x, step)
        return head_logits(self.head, self.norm(batch.logits_rows(x)), greedy)   # [num_logits, vocab]


_TOP_GGUF = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_GGUF = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
QK_NORM_GGUF = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

LLAMA = Family(LlamaForCausalLM, llama_config, GgufNames("llama", _LAYER_GGUF, _TOP_GGUF, unpermute_qk=True))
QWEN2 = Family(LlamaForCausalLM, lambda hf: llama_config(hf, qkv_bias=True), GgufNames("qwen2", _LAYER_GGUF, _TOP_GGUF))
