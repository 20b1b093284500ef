"""What the HTTP handlers know of the engine: one immutable record, built once on the engine thread
right after the engine loads (before ``/health`` says ready), and never the engine thread's
:class:`~fastgen.engine.Engine` itself.

The record holds numbers (limits, sizes, EOS ids), the model's sampling defaults, and two
thread-safe services the handlers use off the engine thread: the tokenizer (encode, decode, the
chat template) and the grammar compiler's ``compile`` (a constraint is compiled, and refused with a
400, before it is queued; the engine finds it in the compiler's cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class EngineFacts:
    model_name: str                  # the name the server answers to (--served-model-name, or the path's)
    model_path: str
    max_model_len: int               # the context: prompt + generated tokens of one request
    max_total_tokens: int            # the context, or the KV pool if smaller
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_blocks: int
    block_size: int
    budget_tokens: int
    max_seqs: int
    num_threads: int
    max_prompt_chars: int            # no longer text can fit in the context (see :meth:`of`)
    generation_defaults: Any         # GenerationDefaults of the model's files, or None
    tokenizer: Any                   # thread-safe: encode / decode / chat template
    compile_grammar: Callable[[Any], Any]

    @classmethod
    def of(cls, engine, model_name: str) -> "EngineFacts":
        """The facts of a loaded ``engine`` (call it on the thread that loaded it).

        ``max_prompt_chars``: no token spells more characters than the vocabulary's longest entry
        (x4 where the tokenizer normalizes first, as composing can fold three characters into one),
        so no longer text fits in the context, whatever it says."""
        cfg, tokenizer = engine.config, engine.tokenizer
        backend = tokenizer.backend_tokenizer
        longest = max(map(len, backend.get_vocab(with_added_tokens=True)))
        return cls(
            model_name=model_name, model_path=cfg.model_path, max_model_len=cfg.max_model_len,
            max_total_tokens=min(cfg.max_model_len, cfg.cache.num_blocks * cfg.cache.block_size),
            vocab_size=engine.model_config.vocab_size, eos_token_ids=frozenset(engine.eos_token_ids),
            num_blocks=cfg.cache.num_blocks, block_size=cfg.cache.block_size,
            budget_tokens=cfg.scheduler.budget_tokens, max_seqs=cfg.scheduler.max_seqs,
            num_threads=cfg.num_threads,
            max_prompt_chars=cfg.max_model_len * longest * (1 if backend.normalizer is None else 4),
            generation_defaults=engine.generation_defaults, tokenizer=tokenizer,
            compile_grammar=engine.grammars.compile)

    def dashboard_info(self) -> dict[str, int]:
        """The numbers the dashboard's ``hello`` record carries."""
        return {"budget_tokens": self.budget_tokens, "num_blocks": self.num_blocks, "block_size": self.block_size,
                "max_seqs": self.max_seqs}
