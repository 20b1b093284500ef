"""A test-side HF -> GGUF converter: what llama.cpp's converter does to a checkpoint, for tiny models.

Names come from gguf-py's own table (``gguf.get_tensor_name_map``), not from fastgen's maps, so
a wrong name on either side fails the parity tests. The transformations are llama.cpp's, as its
converter applies them: Q/K rows interleaved for the ``llama`` architecture (Mixtral included),
routed experts stacked into 3-D ``*_exps`` tensors (or, ``per_expert``, the older
``ffn_gate.E`` tensors), Phi-2's q/k/v fused into ``attn_qkv``, Falcon's grouped
``query_key_value`` reordered to all q heads, then k, then v, Phi-3's LongRoPE factors as
tensors. The metadata keys are gguf-py's ``Keys``; the tokenizer is a byte-level BPE of 255
byte tokens, one merge and ``<|endoftext|>`` (257 = the tiny configs' vocabulary).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np


def _interleave_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's half-split RoPE rows -> llama.cpp's interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    # 255 bytes (not 0xff), one merged token, the end token: 257, the tiny configs' vocabulary
    return [chars[b] for b in range(255)] + [chars[32] * 2, "<|endoftext|>"]


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``...experts.E.w1.weight`` (E = 0..n-1) -> ``...experts.w1.weight`` [n, rows, cols]."""
    groups: dict[str, dict[int, np.ndarray]] = {}
    out = {}
    for name, w in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+\.weight)", name)
        if m:
            groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = w
        else:
            out[name] = w
    for name, per in groups.items():
        out[name] = np.stack([per[e] for e in range(len(per))])
    return out


def _metadata(writer, arch: str, hf) -> None:
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_head_count(heads)
    theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(theta)
    if arch == "falcon":
        writer.add_feed_forward_length(hf.ffn_hidden_size)
        writer.add_head_count_kv(hf.num_kv_heads if hf.new_decoder_architecture else 1)
        writer.add_layer_norm_eps(hf.layer_norm_epsilon)
        return
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count_kv(getattr(hf, "num_key_value_heads", None) or heads)
    if arch == "phi2":
        writer.add_layer_norm_eps(hf.layer_norm_eps)
        writer.add_rope_dimension_count(int(head_dim * hf.rope_parameters["partial_rotary_factor"]))
        return
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if arch == "llama":
        writer.add_expert_count(hf.num_local_experts)
        writer.add_expert_used_count(hf.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(hf.num_experts)
        writer.add_expert_used_count(hf.num_experts_per_tok)
        writer.add_expert_feed_forward_length(hf.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(hf.shared_expert_intermediate_size)
    if arch == "qwen3moe":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "phi3" and hf.rope_parameters.get("rope_type") == "longrope":
        original = hf.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = hf.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))


def convert(hf_folder: str | Path, path: str | Path, arch: str, *, qtype: str | None = None,
            per_expert: bool = False) -> None:
    """Write the GGUF file of the HF folder's model at ``path`` as llama.cpp's converter would.
    ``qtype`` ("Q8_0", "Q4_0"): every 2-D/3-D weight except the embedding stored in that type."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(hf_folder)
    tensors = {}
    for f in sorted(Path(hf_folder).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    tensors = {k: v.astype(np.float32) for k, v in tensors.items()}
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    if arch == "phi2":   # older Phi-2 files: one fused qkv (all q, then k, then v) with its bias
        for i in range(hf.num_hidden_layers):
            for kind in ("weight", "bias"):
                parts = [tensors.pop(f"model.layers.{i}.self_attn.{p}_proj.{kind}") for p in "qkv"]
                tensors[f"transformer.h.{i}.mixer.Wqkv.{kind}"] = np.concatenate(parts)
    if arch == "falcon":   # per KV group [g q heads, k, v] -> [all q heads, all k, all v]
        kv = hf.num_kv_heads if hf.new_decoder_architecture else 1
        for name in [n for n in tensors if "query_key_value" in n]:
            w = tensors[name]
            g = w.reshape(kv, heads // kv + 2, head_dim, *w.shape[1:])
            tensors[name] = np.concatenate([g[:, :-2].reshape(-1, *w.shape[1:]), g[:, -2].reshape(-1, *w.shape[1:]),
                                            g[:, -1].reshape(-1, *w.shape[1:])])
    if not per_expert:
        tensors = _stack_experts(tensors)
    table = gguf.get_tensor_name_map({n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}[arch], hf.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    _metadata(writer, arch, hf)
    tokens = _byte_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL])
    writer.add_token_merges([f"{tokens[32]} {tokens[32]}"])   # two spaces
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)
    if arch == "phi3" and hf.rope_parameters.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(hf.rope_parameters[f"{kind}_factor"], dtype=np.float32))
    for name, w in tensors.items():
        base, _, kind = name.rpartition(".")
        expert = None
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)", base)
        if m:   # the older layout: the per-expert name of the stacked tensor's llama.cpp name, + .E
            base, expert = f"{m.group(1)}.{m.group(3)}", m.group(2)
        gguf_name = table.get_name(base)
        assert gguf_name is not None, f"gguf-py has no {arch} name for {name}"
        if expert is not None:
            gguf_name = gguf_name.removesuffix("_exps") + f".{expert}"
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            w = _interleave_qk(w, heads if gguf_name.endswith("attn_q") else hf.num_key_value_heads)
        if gguf_name.endswith("ffn_gate_inp_shexp"):
            w = w.reshape(-1)   # llama.cpp's shared-expert gate is one vector [hidden]
        if qtype is not None and w.ndim >= 2 and w.shape[-1] % 32 == 0 and gguf_name != "token_embd":
            t = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(f"{gguf_name}.{kind}", gguf.quants.quantize(w, t), raw_dtype=t)
        else:
            writer.add_tensor(f"{gguf_name}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def round_to(qtype: str, w: np.ndarray) -> np.ndarray:
    """``w`` on the grid of ``qtype`` (quantized and dequantized): values that a second
    quantization keeps exactly, so that an HF folder and a quantized GGUF hold one model."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.dequantize(gguf.quants.quantize(w, t), t).reshape(w.shape)
