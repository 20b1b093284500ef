"""Vectorised sampling over the rows of one step, each row with its own parameters.

The logits processors run at one seam, :func:`process_logits`, on the rows that sample only:
the output constraint's grammar mask (fastgen/structured.py) -> penalties -> suppressed tokens
(min_new_tokens masks EOS). Then, as in transformers: greedy argmax, or temperature -> top-k ->
top-p -> min-p -> one draw. A draw is an inverse-CDF lookup
with a single uniform number per row, taken from the request's own generator when it
has a seed, so a seeded request's tokens do not depend on its batch mates. Top-p never
sorts the vocabulary: it widens a top-k window until the window holds ``top_p`` of the
mass (a full sort of 49k logits per row costs more than the forward pass).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import kernels
from .request import SamplingParams, TokenLogprob
from .structured import GrammarState, apply_grammar_masks


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    suppress_token_ids: tuple[int, ...]     # e.g. EOS while below min_new_tokens
    grammar: GrammarState | None = None     # the output constraint, for constrained requests


def process_logits(logits: torch.Tensor, rows: list[SamplingRow], grammar_bias: torch.Tensor | None = None) -> None:
    """In place, the logits processors of every row: grammar masks first (so penalties and
    temperature only ever redistribute mass among allowed tokens), penalties, suppressed tokens.
    ``grammar_bias``: the grammar rows' masks, when already computed (structured.grammar_bias)."""
    apply_grammar_masks(logits, [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None], grammar_bias)
    if any(r.params.has_penalties for r in rows):
        apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        if r.suppress_token_ids:
            logits[i, list(r.suppress_token_ids)] = float("-inf")


def argmax_decides(row: SamplingRow) -> bool:
    """Whether ``row``'s token is the plain argmax of its logits, which :func:`sample` would neither
    change (no logits processor of :func:`process_logits` applies: no output constraint, no
    penalty, nothing suppressed) nor need beyond the argmax (greedy, no logprobs): such rows can
    take the argmax the output head's kernel computes (fastgen/model/llama.py, ``head_logits``)."""
    p = row.params
    return (p.greedy and p.logprobs is None and row.grammar is None and not p.has_penalties
            and not row.suppress_token_ids)


def argmax_tokens(idx: torch.Tensor, best: torch.Tensor) -> list[int]:
    """:func:`sample`'s tokens for rows that :func:`argmax_decides`, from each row's argmax and its
    value: :data:`NO_TOKEN` where that value is NaN or -inf (the row holds no finite choice), as
    :func:`sample` decides it."""
    return [NO_TOKEN if v != v or v == float("-inf") else t for t, v in zip(idx.tolist(), best.tolist())]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: repetition (prompt + output), presence and frequency (output) penalties."""
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(row.prompt_token_ids + row.output_token_ids, device=logits.device).unique()
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(row.output_token_ids, device=logits.device).unique(return_counts=True)
            logits[i, ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability kept by nucleus sampling. probs: [n, V], top_p: [n]."""
    vocab = probs.shape[-1]
    k = min(64, vocab)
    while True:
        vals = probs.topk(k, dim=-1).values                     # [n, k], descending
        mass = vals.cumsum(-1)
        covered = mass[:, -1] >= top_p
        if bool(covered.all()) or k == vocab:
            # first index whose cumulative mass reaches top_p (last index if none does)
            idx = (mass < top_p[:, None]).sum(-1).clamp(max=k - 1)
            return vals.gather(1, idx[:, None]).squeeze(1)
        k = min(k * 4, vocab)


NATIVE_SAMPLER_ENV = "FASTGEN_NATIVE_SAMPLER"   # "0": the torch path (tests, A/B measurements)
NO_TOKEN = -1   # sample()'s id for a row that has nothing to sample (see sample())


def _uniforms(rows: list[SamplingRow], generator: torch.Generator | None) -> torch.Tensor:
    """One uniform number in [0, 1) per row (fp64): from the request's own generator where it has a
    seed, else from the step's."""
    u = torch.rand(len(rows), generator=generator, dtype=torch.float64)
    for i, row in enumerate(rows):
        if row.generator is not None:
            u[i] = torch.rand(1, generator=row.generator, dtype=torch.float64)[0]
    return u


def _native_sampler(logits: torch.Tensor):
    """fastgen's native sampler (``torch.ops.fastgen.sample_rows``: the torch path's steps in a few
    passes over each row, ~1 ms -> ~0.1 ms a row of 49k logits at top_p 0.9) for fp32 CPU logits
    where the kernels are loaded and ``FASTGEN_NATIVE_SAMPLER`` is not 0; else None (the torch path)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or os.environ.get(NATIVE_SAMPLER_ENV) == "0":
        return None
    return kernels.fast_op("sample_rows") if kernels.direct() is not None else None


def _draw(probs: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None) -> torch.Tensor:
    """One inverse-CDF draw per row of (unnormalised) ``probs``; :data:`NO_TOKEN` for a row whose
    mass is not a positive finite number (every logit -inf or NaN: there is nothing to draw)."""
    u = _uniforms(rows, generator)
    cdf = probs.double().cumsum(-1)                             # [n, V]
    target = (u.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
    total = cdf[:, -1]
    return torch.where(torch.isfinite(total) & (total > 0), drawn, NO_TOKEN)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the same indices, NaN and ties included), through the native kernel
    for fp32 CPU rows where it is loaded: torch's CPU argmax took 30 us for one row of SmolLM2's
    49,152 logits and 516 us for 32 rows."""
    direct = kernels.direct()
    if direct is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.shape[1] > 0:
        return direct.argmax_rows(logits)
    return logits.argmax(-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None,
           grammar_bias: torch.Tensor | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [n, V] fp32, one row per request that samples this step; ``grammar_bias``: see
    :func:`process_logits`.

    Returns the chosen token ids and, for rows that asked for them, their logprobs
    (of the model's distribution, before penalties and temperature). A row left with no token
    to choose, because every logit is -inf or NaN after the processors (an output constraint
    that allows nothing, or logits that are not numbers), gets :data:`NO_TOKEN`: the caller
    ends that request with an error. Without this check torch picked index 0 (argmax) or the
    last index (the draw's clamp) and the token went out as if sampled.
    """
    n, vocab = logits.shape
    want_lp = [r.params.logprobs is not None for r in rows]
    raw_logprobs = torch.log_softmax(logits[want_lp], dim=-1) if any(want_lp) else None
    process_logits(logits, rows, grammar_bias)

    chosen = argmax_rows(logits)
    sample_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    native = _native_sampler(logits) if sample_idx else None
    if native is not None:
        srows = [rows[i] for i in sample_idx]
        params = [[r.params.temperature, r.params.top_k if 0 < r.params.top_k < vocab else 0, r.params.top_p,
                   r.params.min_p] for r in srows]
        chosen = native(chosen, logits, torch.tensor(sample_idx, dtype=torch.int64),
                        torch.tensor(params, dtype=torch.float32), _uniforms(srows, generator))
    elif sample_idx:
        srows = [rows[i] for i in sample_idx]
        dev = logits.device

        def col(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=dev)

        temp = col([r.params.temperature for r in srows])
        probs = torch.softmax(logits[sample_idx] / temp[:, None], dim=-1)   # [s, V]
        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in srows]  # 0: off
        if any(top_k):
            kth = probs.topk(max(top_k), dim=-1).values                       # [s, max k]
            idx = torch.tensor([max(k, 1) - 1 for k in top_k], device=dev)
            thr = torch.where(torch.tensor([k > 0 for k in top_k], device=dev),
                              kth.gather(1, idx[:, None]).squeeze(1), 0.0)
            probs = torch.where(probs >= thr[:, None], probs, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        p_rows = [i for i, r in enumerate(srows) if r.params.top_p < 1]
        if p_rows:
            thr = _top_p_threshold(probs[p_rows], col([srows[i].params.top_p for i in p_rows]))
            probs[p_rows] = torch.where(probs[p_rows] >= thr[:, None], probs[p_rows], 0.0)
        if any(r.params.min_p > 0 for r in srows):
            thr = col([r.params.min_p for r in srows]) * probs.max(-1).values
            probs = torch.where(probs >= thr[:, None], probs, 0.0)
        chosen[sample_idx] = _draw(probs, srows, generator)

    # the chosen logits (one per row, no copy of the rows): argmax takes the first NaN, or index 0
    # of an all -inf row, and neither is a choice (a draw's own NO_TOKEN is gathered at index 0)
    picked = logits.gather(1, (chosen.clamp(min=0) if sample_idx else chosen)[:, None]).squeeze(1).tolist()
    token_ids = [NO_TOKEN if v != v or v == float("-inf") else t for t, v in zip(chosen.tolist(), picked)]
    logprobs: list[TokenLogprob | None] = [None] * n
    if raw_logprobs is not None:
        lp_rows = [i for i in range(n) if want_lp[i]]
        for j, i in enumerate(lp_rows):
            if token_ids[i] == NO_TOKEN:
                continue
            logprobs[i] = token_logprob(raw_logprobs[j], token_ids[i], rows[i].params.logprobs)
    return token_ids, logprobs


def token_logprob(logprobs_row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """The chosen token's logprob and the ``num_top`` most likely alternatives."""
    top: dict[int, float] = {}
    if num_top:
        vals, ids = logprobs_row.topk(num_top)
        top = dict(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(logprobs_row[token_id]), top=top)
