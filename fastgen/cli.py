"""``fastgen generate`` (and later ``serve`` / ``bench``): the command line over the public API."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
import typing

from .config import EngineOptions
from .errors import FastgenError
from .request import SamplingParams


def _add_dataclass_options(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field of ``cls``; only flags given on the command line are passed on."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint)
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        elif typing.get_origin(hint) is tuple:
            parser.add_argument(flag, action="append", default=argparse.SUPPRESS, metavar="STR",
                                help="may be repeated")
        else:
            parser.add_argument(flag, type=base if base in (int, float) else str, default=argparse.SUPPRESS)


def _split(ns: argparse.Namespace, cls: type) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(ns).items() if k in names}


def cmd_generate(ns: argparse.Namespace) -> int:
    from .pipeline import pipeline

    gen_kwargs = _split(ns, SamplingParams)
    SamplingParams.from_kwargs(gen_kwargs)  # reject bad arguments before the model loads
    pipe = pipeline(ns.model, **_split(ns, EngineOptions))
    prompt = [{"role": "user", "content": ns.prompt}] if ns.chat else ns.prompt
    if ns.stream and not gen_kwargs.get("return_full_text") and gen_kwargs.get("logprobs") is None:
        start = time.perf_counter()
        for delta in pipe.stream(prompt, **gen_kwargs):
            print(delta, end="", flush=True)
        print()
        print(f"[{time.perf_counter() - start:.2f} s]", file=sys.stderr)
        return 0
    [r] = pipe([prompt], **gen_kwargs)
    print(r.generated_text)
    t = r.timings
    print(f"[{r.prompt_length} prompt + {r.generated_length} generated tokens, finish={r.finish_reason.value}, "
          f"ttft={t.time_to_first_token_s:.3f} s, total={t.e2e_s:.2f} s]", file=sys.stderr)
    if r.logprobs:
        for lp in r.logprobs:
            print(f"{lp.token_id}\t{lp.logprob:.4f}\t{lp.top}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastgen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt with an in-process engine")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="HF model folder or .gguf file (default: embedded SmolLM2)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print text as it is generated (default on)")
    _add_dataclass_options(gen, SamplingParams)
    _add_dataclass_options(gen, EngineOptions)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except FastgenError as e:
        print(f"fastgen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
