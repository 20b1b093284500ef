"""The sampler on its own: filters, mixed batches, seeds, logprobs (no model)."""
from __future__ import annotations

import torch

from fastgen.request import SamplingParams
from fastgen.sampling import SamplingRow, sample


def row(seed=None, **kw) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(**kw), [1, 2], [], gen, ())


def logits(n: int, vocab: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_huge_top_k_beside_a_small_one_is_no_crash_and_each_row_keeps_its_filter():
    lg = logits(2)
    top5 = set(lg[1].topk(5).indices.tolist())
    for s in range(20):
        toks, _ = sample(lg.clone(), [row(seed=s, top_k=2**64, top_p=1.0), row(seed=s, top_k=5, top_p=1.0)])
        assert toks[1] in top5


def test_rows_without_top_p_do_not_widen_the_nucleus_search_and_tiny_top_p_is_greedy():
    lg = logits(3)
    toks, _ = sample(lg.clone(), [row(seed=1, top_p=1.0), row(seed=2, top_p=1e-6), row(seed=3, top_p=0.5)])
    assert toks[1] == lg[1].argmax().item()


def test_temperature_below_the_floor_is_greedy():
    lg = logits(2)
    toks, _ = sample(lg.clone(), [row(seed=1, temperature=1e-45), row(do_sample=False)])
    assert toks == lg.argmax(-1).tolist()


def test_seeded_row_draws_do_not_depend_on_batch_mates():
    lg = logits(4)
    alone, _ = sample(lg[2:3].clone(), [row(seed=42, top_p=0.95)])
    mates = [row(seed=7), row(do_sample=False), row(seed=42, top_p=0.95), row(top_k=3)]
    together, _ = sample(lg.clone(), mates)
    assert together[2] == alone[0]


def test_logprobs_are_of_the_model_distribution():
    lg = logits(1)
    toks, lps = sample(lg.clone(), [row(do_sample=False, logprobs=3, repetition_penalty=2.0)])
    ref = torch.log_softmax(lg[0], -1)
    assert lps[0].token_id == toks[0]
    assert abs(lps[0].logprob - ref[toks[0]].item()) < 1e-5
    assert set(lps[0].top) == set(ref.topk(3).indices.tolist())
