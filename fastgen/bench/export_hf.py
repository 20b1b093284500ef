"""Write a GGUF model as a plain Hugging Face folder (safetensors), for peers that load only those.

    python -m fastgen.bench.export_hf OUT_DIR [--gguf PATH]     # default: the embedded SmolLM2

transformers reads the GGUF (dequantized) but a GGUF-loaded model refuses ``save_pretrained``,
so a plain model is built from its config without ``quantization_config`` and given the
loaded state dict. The weights are the same dequantized values fastgen computes with
(``quantization="none"``), so both engines serve the same model.
"""
from __future__ import annotations

import argparse
import os

import torch


def export(gguf_path: str, out_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(src.state_dict())
    plain.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)


def main() -> None:
    from ..model.loader import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--gguf", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ns = ap.parse_args()
    export(ns.gguf or default_model_path(), ns.out_dir)
    print(f"wrote {ns.out_dir}")


if __name__ == "__main__":
    main()
