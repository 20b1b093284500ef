"""Workloads as in the paper: prompt and generation lengths drawn from Normal(mean, 0.3 * mean).

A :class:`Workload` names the two means. :func:`build_requests` draws request ``i``'s lengths
from a generator seeded by ``(seed, i)``, so request ``i`` is the same whatever the size of
the run, and cuts its prompt from real English text (:class:`Corpus`) so that it has exactly
the drawn number of tokens: the text is tokenized once with the model's tokenizer and a
window of token ids is kept only if its decoded text tokenizes back to the same ids. The
in-process target sends the ids, an HTTP target the text; both stand for the same tokens.

Two workload shapes share prompt prefixes, for prefix caching: a *shared system prompt*
(every request starts with the same ``shared_prefix_tokens`` tokens, then its own
question) and *multi-turn chats* (conversations of ``turns`` turns; each turn's prompt is
the previous turn's prompt plus new tokens standing for the previous answer and the next
question, so the history grows turn by turn). Token counts stay exact: a continuation is
kept only if prefix and new text tokenize back to the prefix's ids followed by the new ones.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources
from typing import Any

REL_STD = 0.3                  # the paper: std = 0.3 * mean for both lengths
MAX_WINDOW_TRIES = 256
CORPUS_FILE = "shakespeare.txt"


class WorkloadError(ValueError):
    """A workload that cannot be built (unknown preset, text too short, a tokenizer that never
    round-trips)."""


@dataclass(frozen=True)
class Workload:
    """Mean prompt and generation lengths in tokens; each is Normal(mean, rel_std * mean)."""

    name: str
    prompt_mean_tokens: int
    gen_mean_tokens: int
    rel_std: float = REL_STD
    note: str = ""
    shared_prefix_tokens: int = 0    # every prompt starts with this one prefix; prompt_mean counts the rest
    turns: int = 1                   # > 1: chats of this many turns; prompt_mean is what each turn adds
    conversations: int = 8           # chats in flight: requests go turn by turn over this many

    def describe(self) -> str:
        shape = ""
        if self.shared_prefix_tokens:
            shape = f"a shared {self.shared_prefix_tokens}-token prefix, then "
        if self.turns > 1:
            shape = f"{self.conversations} chats x {self.turns} turns, each turn adding "
        return (f"{self.name}: {shape}prompt ~ N({self.prompt_mean_tokens}, {self.rel_std * self.prompt_mean_tokens:g}), "
                f"generation ~ N({self.gen_mean_tokens}, {self.rel_std * self.gen_mean_tokens:g}) tokens"
                + (f" ({self.note})" if self.note else ""))


PRESETS: dict[str, Workload] = {w.name: w for w in (
    Workload("paper-1200-60", 1200, 60, note="the paper's long-prompt workloads"),
    Workload("paper-1200-128", 1200, 128),
    Workload("paper-2600-60", 2600, 60),
    Workload("paper-2600-128", 2600, 128),
    Workload("short-256-256", 256, 256, note="short prompts: the paper expects the policies to be close"),
    Workload("cpu-300-30", 300, 30, note="the quickest long-prompt case for a 2-core CPU"),
    Workload("cpu-600-30", 600, 30, note="1200/60 at half the length, for a 2-core CPU"),
    Workload("cpu-600-60", 600, 60, note="1200/128 at about half the length, for a 2-core CPU"),
    Workload("cpu-128-128", 128, 128, note="the short-prompt case scaled down for a 2-core CPU"),
    Workload("shared-1000-64-30", 64, 30, shared_prefix_tokens=1000,
             note="one 1,000-token system prompt before every question (prefix caching)"),
    Workload("chat-6x200-30", 200, 30, turns=6,
             note="multi-turn chats whose history grows ~200 tokens a turn (prefix caching)"),
)}


def workload_from_args(name: str | None, prompt_mean: int | None, gen_mean: int | None) -> Workload:
    """A preset by name, or a custom workload from the two means (which override the preset's)."""
    if name is not None and name not in PRESETS:
        raise WorkloadError(f"unknown workload {name!r}; presets: {', '.join(PRESETS)}")
    base = PRESETS[name] if name is not None else None
    if base is None and (prompt_mean is None or gen_mean is None):
        raise WorkloadError("give --workload NAME, or both --prompt-mean and --gen-mean")
    p = prompt_mean if prompt_mean is not None else base.prompt_mean_tokens
    g = gen_mean if gen_mean is not None else base.gen_mean_tokens
    if p < 1 or g < 1:
        raise WorkloadError(f"mean lengths must be >= 1 token, got prompt {p}, generation {g}")
    if base is not None and (p, g) == (base.prompt_mean_tokens, base.gen_mean_tokens):
        return base
    return Workload(f"custom-{p}-{g}", p, g)


def _request_rng(seed: int, index: int, stream: str) -> random.Random:
    # str seeds are hashed deterministically (sha512) by random.Random, unlike hash() of a tuple
    return random.Random(f"fastgen-bench/{seed}/{index}/{stream}")


def sample_lengths(workload: Workload, num_requests: int, seed: int,
                   max_model_len: int) -> list[tuple[int, int]]:
    """``(num_prompt_tokens, max_new_tokens)`` per request, rounded and clipped so that
    ``1 <= prompt <= max_model_len - 1`` and ``1 <= generation <= max_model_len - prompt``."""
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len must be >= 2, got {max_model_len}")
    lengths = []
    for i in range(num_requests):
        rng = _request_rng(seed, i, "lengths")
        p = round(rng.gauss(workload.prompt_mean_tokens, workload.rel_std * workload.prompt_mean_tokens))
        g = round(rng.gauss(workload.gen_mean_tokens, workload.rel_std * workload.gen_mean_tokens))
        p = min(max(p, 1), max_model_len - 1)
        g = min(max(g, 1), max_model_len - p)
        lengths.append((p, g))
    return lengths


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: its exact prompt (ids and text) and how many tokens to generate."""

    index: int
    prompt_token_ids: tuple[int, ...]
    prompt_text: str
    max_new_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Corpus:
    """Real English text tokenized once, from which prompts of an exact token count are cut.

    ``tokenizer`` is a Hugging Face tokenizer (callable, with ``decode``); the ids of a prompt
    are what ``tokenizer(text)`` gives for its text, special tokens included, which is what an
    engine or server computes from the text.
    """

    def __init__(self, text: str, tokenizer: Any, source: str = "") -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.token_ids: list[int] = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        probe = "a"
        self.num_special_tokens = (len(tokenizer(probe, add_special_tokens=True)["input_ids"])
                                   - len(tokenizer(probe, add_special_tokens=False)["input_ids"]))

    @classmethod
    def shipped(cls, tokenizer: Any) -> "Corpus":
        """The public-domain text shipped in ``fastgen/bench/data`` (see its README)."""
        text = resources.files("fastgen.bench").joinpath("data", CORPUS_FILE).read_text(encoding="utf-8")
        return cls(text, tokenizer, source=f"fastgen/bench/data/{CORPUS_FILE}")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def prompt(self, num_tokens: int, rng: random.Random) -> tuple[tuple[int, ...], str]:
        """Ids and text of a prompt of exactly ``num_tokens`` tokens (special tokens included).

        Tries random windows of the text until one decodes to text that tokenizes back to
        ``num_tokens`` ids (a window may not, where it cuts a word the tokenizer would merge)."""
        body = num_tokens - self.num_special_tokens
        if body < 1:
            raise WorkloadError(f"a prompt of {num_tokens} tokens leaves no room for text after "
                                f"{self.num_special_tokens} special token(s)")
        if body > len(self.token_ids):
            raise WorkloadError(f"a prompt of {num_tokens} tokens is longer than the corpus "
                                f"({len(self.token_ids)} tokens)")
        for _ in range(MAX_WINDOW_TRIES):
            start = rng.randrange(len(self.token_ids) - body + 1)
            text = self.tokenizer.decode(self.token_ids[start:start + body])
            ids = self.encode(text)
            if len(ids) == num_tokens:
                return tuple(ids), text
        raise WorkloadError(f"no window of {num_tokens} tokens of the corpus tokenized back to "
                            f"{num_tokens} tokens in {MAX_WINDOW_TRIES} tries")

    def continuation(self, prefix_ids: tuple[int, ...], num_tokens: int,
                     rng: random.Random) -> tuple[tuple[int, ...], str]:
        """Ids and text of ``prefix_ids`` followed by ``num_tokens`` more tokens of the corpus:
        the text tokenizes back to exactly ``prefix_ids`` + the new ids (so a server that gets the
        text sees the very prefix, and its cached blocks)."""
        if num_tokens > len(self.token_ids):
            raise WorkloadError(f"{num_tokens} tokens is longer than the corpus ({len(self.token_ids)} tokens)")
        body = list(prefix_ids[self.num_special_tokens:])
        for _ in range(MAX_WINDOW_TRIES):
            start = rng.randrange(len(self.token_ids) - num_tokens + 1)
            text = self.tokenizer.decode(body + self.token_ids[start:start + num_tokens])
            ids = self.encode(text)
            if len(ids) == len(prefix_ids) + num_tokens and tuple(ids[:len(prefix_ids)]) == tuple(prefix_ids):
                return tuple(ids), text
        raise WorkloadError(f"no continuation of {num_tokens} tokens kept the prefix's tokens "
                            f"in {MAX_WINDOW_TRIES} tries")


def build_requests(workload: Workload, num_requests: int, corpus: Corpus, *, seed: int,
                   max_model_len: int) -> list[BenchRequest]:
    """The first ``num_requests`` requests of ``workload`` under ``seed`` (a prefix of any longer run)."""
    if workload.turns > 1:
        return _chat_requests(workload, num_requests, corpus, seed, max_model_len)
    if workload.shared_prefix_tokens:
        return _shared_prefix_requests(workload, num_requests, corpus, seed, max_model_len)
    out = []
    for i, (p, g) in enumerate(sample_lengths(workload, num_requests, seed, max_model_len)):
        p = max(p, corpus.num_special_tokens + 1)
        ids, text = corpus.prompt(p, _request_rng(seed, i, "prompt"))
        out.append(BenchRequest(index=i, prompt_token_ids=ids, prompt_text=text, max_new_tokens=g))
    return out


def _shared_prefix_requests(workload: Workload, num_requests: int, corpus: Corpus, seed: int,
                            max_model_len: int) -> list[BenchRequest]:
    shared = workload.shared_prefix_tokens
    if shared + 2 > max_model_len:
        raise WorkloadError(f"a {shared}-token shared prefix does not fit max_model_len={max_model_len}")
    prefix, _ = corpus.prompt(max(shared, corpus.num_special_tokens + 1), _request_rng(seed, -1, "shared-prefix"))
    out = []
    for i, (p, g) in enumerate(sample_lengths(workload, num_requests, seed, max_model_len - len(prefix))):
        ids, text = corpus.continuation(prefix, p, _request_rng(seed, i, "prompt"))
        out.append(BenchRequest(index=i, prompt_token_ids=ids, prompt_text=text, max_new_tokens=g))
    return out


def _chat_requests(workload: Workload, num_requests: int, corpus: Corpus, seed: int,
                   max_model_len: int) -> list[BenchRequest]:
    """Request ``i`` is turn ``t`` of chat ``c``: turns go round-robin over blocks of
    ``conversations`` chats, so a chat's next turn is sent about when its previous one is done."""
    k, turns = workload.conversations, workload.turns
    lengths = sample_lengths(workload, num_requests, seed, max_model_len)
    history: dict[int, tuple[int, ...]] = {}
    out = []
    for i, (p, g) in enumerate(lengths):
        block, r = divmod(i, k * turns)
        turn, chat = r // k, block * k + r % k
        prev = history.get(chat)
        if prev is None:
            ids, text = corpus.prompt(max(p, corpus.num_special_tokens + 1), _request_rng(seed, i, "prompt"))
        else:
            p = min(p, max_model_len - 1 - g - len(prev))
            if p < 1:
                raise WorkloadError(f"turn {turn + 1} of a chat outgrows max_model_len={max_model_len}")
            ids, text = corpus.continuation(prev, p, _request_rng(seed, i, "prompt"))
        history[chat] = ids
        g = max(1, min(g, max_model_len - len(ids)))
        out.append(BenchRequest(index=i, prompt_token_ids=ids, prompt_text=text, max_new_tokens=g))
    return out
