"""fastgen's command line: ``generate`` (one prompt, in-process), ``serve`` (the OpenAI-compatible
server), ``bench`` (the serving benchmark), ``eval-ppl`` (precision modes) and ``trace`` (a
--trace-file drawn as a PNG)."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import typing

from .config import EngineOptions
from .errors import FastgenError
from .request import SamplingParams


# help of EngineOptions' fields (its docstring leaves them to docs/architecture.md)
_ENGINE_HELP = {
    "dtype": "auto (bf16 on AMX/AVX512-BF16 CPUs and CUDA, else fp32) | float32 | bfloat16 | float16",
    "device": "cpu or cuda[:N] (default: cuda when available, else cpu)",
    "num_threads": "torch threads (default: the cores this process may use)",
    "block_size": "tokens per KV cache block",
    "num_blocks": "KV cache blocks (default: as many as --kv-cache-bytes holds)",
    "kv_cache_bytes": "memory for the KV cache when --num-blocks is not given",
    "budget_tokens": "tokens per forward pass; auto = measured at start-up against --target-itl-ms",
    "target_itl_ms": "inter-token latency the auto budget aims at",
    "max_seqs": "sequences running (holding KV blocks) at once",
    "reserve_blocks": "free blocks kept back when admitting a prompt, so decodes can grow",
    "max_model_len": "context length cap (default: the model's)",
    "scheduler": "splitfuse (Dynamic SplitFuse) | the baselines of fastgen.scheduler",
    "prompt_order": "arrival (first come, first served) | deadline (earliest TTFT deadline first: arrival + "
                    "prompt tokens / 512 per s, the paper's TTFT SLA)",
    "kernels": "auto | native (fastgen's CPU kernels) | torch",
    "quantization": "auto (a GGUF's weights as shipped) | none | int8 | int4",
    "kv_cache_dtype": "auto (the KV cache in the model's dtype) | int8 (a byte a value and a scale a token and KV "
                      "head: half the memory and the decodes' reads of bf16, attention slightly less exact)",
    "int8_activations": "int8 activations (VNNI) for prompt rows of quantized layers, and for decode rows where "
                        "qgemv has no bf16 dot products (faster, less exact; default: on unless --dtype "
                        "float32 is given)",
    "cuda_graphs": "on a GPU, steps replayed as CUDA graphs captured at start-up (decode steps whole, others in "
                   "per-layer pieces around attention); --no-cuda-graphs runs "
                   "every step eagerly (vLLM's --enforce-eager); no effect on a CPU",
    "tensor_parallel_size": "ranks of one replica, each holding 1/N of the weights and KV cache (one process "
                            "per rank, started by fastgen, or by torchrun across machines)",
}


_SAMPLING_HELP = {  # SamplingParams' docstring leaves these to their usual meanings
    "temperature": "softmax temperature of sampling",
    "top_p": "nucleus sampling: sample among the most likely tokens holding this probability mass",
    "top_k": "sample among the k most likely tokens (0 = off)",
    "min_p": "drop tokens less likely than min_p times the most likely one (0 = off)",
}


def _field_help(cls: type) -> dict[str, str]:
    """``name: text`` entries of a dataclass docstring (continued on indented lines), by field."""
    if cls.__name__ == "EngineOptions":
        return _ENGINE_HELP
    out: dict[str, str] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    current: list[str] | None = None
    for line in (cls.__doc__ or "").splitlines():
        head, sep, text = line.strip().partition(": ")
        keys = [k.strip() for k in head.split("/")]
        if sep and keys and all(k in names for k in keys):
            current = [text.strip()]
            for k in keys:
                out[k] = current  # type: ignore[assignment]
        elif current is not None and line.startswith("        ") and line.strip():
            current.append(line.strip())
        else:
            current = None
    helps = {k: " ".join(v).replace("%", "%%") for k, v in out.items()}
    return {**_SAMPLING_HELP, **helps} if cls.__name__ == "SamplingParams" else helps


def _add_dataclass_options(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One ``--flag`` per field of ``cls``; only flags given on the command line are passed on."""
    hints = typing.get_type_hints(cls)
    helps = _field_help(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint)
        default = f.default if f.default is not dataclasses.MISSING else None
        text = helps.get(f.name, "")
        help_text = f"{text} (default: {default})" if text and default not in (None, ()) else (text or None)
        if int in args and str in args:  # a number or "auto"
            parser.add_argument(flag, type=_int_or_auto, default=argparse.SUPPRESS, metavar="N|auto", help=help_text)
        elif base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        elif typing.get_origin(hint) is tuple:
            parser.add_argument(flag, action="append", default=argparse.SUPPRESS, metavar="STR",
                                help=f"{text} (may be repeated)" if text else "may be repeated")
        else:
            parser.add_argument(flag, type=base if base in (int, float) else str, default=argparse.SUPPRESS,
                                help=help_text)


def _int_or_auto(value: str) -> int | str:
    return value if value == "auto" else int(value)


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


def api_keys(given: list[str] | None, key_file: str | None, env_value: str | None) -> tuple[str, ...]:
    """The server's keys: ``--api-key`` (repeatable) and ``--api-key-file`` (one key per line;
    blank lines and ``#`` comments skipped); ``FASTGEN_API_KEY`` (newline-separated) when neither
    is given."""
    keys = list(given or ())
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                lines = [ln.strip() for ln in f]
        except OSError as e:
            raise FastgenError(f"--api-key-file: cannot read {key_file}: {e.strerror}") from None
        file_keys = [ln for ln in lines if ln and not ln.startswith("#")]
        if not file_keys:
            raise FastgenError(f"--api-key-file: {key_file} holds no key")
        keys += file_keys
    if not keys and env_value:
        keys = [k.strip() for k in env_value.splitlines() if k.strip()]
    return tuple(dict.fromkeys(keys))


def cmd_serve(ns: argparse.Namespace) -> int:
    from .server.config import RayConfig, ServerConfig
    from .server.launch import API_KEY_ENV, run_server

    if _torchrun_rank() > 0:  # torchrun started this process as a non-zero tensor-parallel rank
        from .config import resolve_device
        from .parallel.replica import serve_rank

        logging.basicConfig(level=logging.INFO, format=f"fastgen rank {os.environ['RANK']}: %(message)s")
        return serve_rank(resolve_device(getattr(ns, "device", None)))
    config = ServerConfig(
        model=ns.model, host=ns.host, port=ns.port, served_model_name=ns.served_model_name,
        api_keys=api_keys(ns.api_key, ns.api_key_file, os.environ.get(API_KEY_ENV)), max_queue=ns.max_queue,
        request_timeout_s=ns.request_timeout_s, drain_timeout_s=ns.drain_timeout_s, replicas=ns.replicas,
        upstreams=tuple(ns.upstream or ()), engine_options=tuple(_split(ns, EngineOptions).items()),
        log_level=ns.log_level, trace_file=ns.trace_file, body_timeout_s=ns.body_timeout_s)
    ray_options = _split(ns, RayConfig)
    if ns.ray:
        from .server.ray_app import run_ray

        return run_ray(config, RayConfig(**ray_options))
    if ray_options:
        raise FastgenError(f"--{next(iter(ray_options)).replace('_', '-')} needs --ray")
    return run_server(config)


def _torchrun_rank() -> int:
    """This process's rank when a launcher (torchrun) set ``RANK``/``WORLD_SIZE``, else 0."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return 0


def _add_serve_parser(sub) -> None:
    from .server.config import DEFAULT_MAX_QUEUE, DEFAULT_PORT, RayConfig

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (and fastgen's own /generate)")
    serve.add_argument("model", nargs="?", default=None,
                       help="HF model folder, .gguf file or packaged model name (gemma3-270m); default: embedded SmolLM2")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients send as `model` (default: the model file's stem)")
    serve.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require `Authorization: Bearer KEY`; may be repeated, each key is its own "
                            "prefix-cache tenant (or set FASTGEN_API_KEY, one key per line)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="API keys, one per line (blank lines and # comments skipped)")
    serve.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                       help="sequences that may wait to be scheduled before requests get 429")
    serve.add_argument("--request-timeout-s", type=float, default=None,
                       help="default deadline of a request from its arrival (finish_reason 'timeout')")
    serve.add_argument("--drain-timeout-s", type=float, default=30.0,
                       help="on SIGTERM, how long in-flight requests may finish before they are cancelled")
    serve.add_argument("--body-timeout-s", type=float, default=30.0,
                       help="a request body not all received this long after reading began is answered 408")
    serve.add_argument("--replicas", type=int, default=1,
                       help="engine processes behind a load-aware balancer (each gets cores/N threads); with --ray, Serve replicas")
    serve.add_argument("--upstream", nargs="+", metavar="URL", default=None,
                       help="balance over these `fastgen serve` URLs instead of running an engine")
    serve.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--trace-file", default=None, metavar="PATH",
                       help="write every engine step record and request event as JSON lines "
                            "(`fastgen trace PATH` draws them; with --replicas, PATH.0, PATH.1, ...)")
    serve.add_argument("--ray", action="store_true",
                       help="run the --replicas on Ray Serve, behind its proxy on --host:--port "
                            "(pip install 'fastgen[ray]'; docs/server.md)")
    _add_dataclass_options(serve, RayConfig)  # --ray-address, --num-cpus-per-replica, ...: only with --ray
    _add_dataclass_options(serve, EngineOptions)
    serve.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="fastgen", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fastgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt with an in-process engine")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None,
                     help="HF model folder, .gguf file or packaged model name (gemma3-270m); default: embedded SmolLM2")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print text as it is generated (default on)")
    _add_dataclass_options(gen, SamplingParams)
    _add_dataclass_options(gen, EngineOptions)
    gen.set_defaults(func=cmd_generate)
    _add_serve_parser(sub)
    # `fastgen bench ...` is handed to fastgen.bench whole (see main); listed here for --help
    sub.add_parser("bench", add_help=False,
                   help="the serving benchmark (paper methodology); `fastgen bench --help` for its options")
    sub.add_parser("eval-ppl", add_help=False,
                   help="perplexity and greedy agreement of each precision mode; `fastgen eval-ppl --help`")
    sub.add_parser("trace", add_help=False,
                   help="draw a --trace-file's batch composition over time as a PNG; `fastgen trace --help`")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if argv is None:   # run as the command: a faster allocator first (fastgen/launcher.py)
        from .launcher import reexec_with_allocator

        reexec_with_allocator([sys.executable, "-m", "fastgen.cli", *sys.argv[1:]])
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["bench"]:
        from .bench import cli_main

        return cli_main(args[1:])
    if args[:1] == ["trace"]:
        from .trace import main as trace_main

        return trace_main(args[1:])
    if args[:1] == ["eval-ppl"]:
        from .evaluate import main as eval_main

        return eval_main(args[1:])
    ns = build_parser().parse_args(args)
    try:
        return ns.func(ns)
    except FastgenError as e:
        print(f"fastgen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
