"""The sampler on its own: filters, mixed batches, seeds, logprobs (no model)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastgen import kernels
from fastgen.request import SamplingParams
from fastgen.sampling import NATIVE_SAMPLER_ENV, SamplingRow, argmax_decides, argmax_tokens, sample


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


# -- the filters' distribution, by frequency ----------------------------------------------------

PROBS = [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02]   # a tiny vocabulary, clear gaps between tokens


def expected_distribution(probs: list[float], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                          min_p: float = 0.0) -> dict[int, float]:
    """The filtered, renormalised distribution as transformers defines it (temperature -> top-k ->
    top-p -> min-p), written plainly with a sort: the reference the sampler's draws must follow."""
    weights = [p ** (1.0 / temperature) for p in probs]
    q = {t: w / sum(weights) for t, w in enumerate(weights)}
    order = sorted(q, key=lambda t: -q[t])
    if top_k:
        order = order[:top_k]
        total = sum(q[t] for t in order)
        q = {t: q[t] / total for t in order}
    if top_p < 1.0:
        nucleus, mass = [], 0.0
        for t in order:
            nucleus.append(t)
            mass += q[t]
            if mass >= top_p:
                break
        order = nucleus
    if min_p:
        order = [t for t in order if q[t] >= min_p * max(q.values())]
    total = sum(q[t] for t in order)
    return {t: q[t] / total for t in order}


@pytest.fixture(params=["native", "torch"])
def sampler_path(request, monkeypatch):
    """Both ways sample() draws: fastgen's native sampler (where the kernels load) and the torch path."""
    if request.param == "native":
        assert kernels.load(), "fastgen's native CPU kernels did not build"
        monkeypatch.delenv(NATIVE_SAMPLER_ENV, raising=False)
    else:
        monkeypatch.setenv(NATIVE_SAMPLER_ENV, "0")
    return request.param


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.75), dict(min_p=0.25),
                                     dict(temperature=0.7, top_k=6, top_p=0.9, min_p=0.1),
                                     dict(temperature=1.5, top_k=5, top_p=0.95)])
def test_filtered_draws_follow_the_renormalised_distribution(filters, sampler_path):
    """20,000 seeded draws of one row's filters: every kept token's frequency is within 5 standard
    errors of its renormalised probability, and a token the filters exclude is never drawn."""
    num_draws = 20_000
    want = expected_distribution(PROBS, **filters)
    assert 1 < len(want) < len(PROBS)   # the filters do something, and it is not greedy
    logits = torch.tensor(PROBS).log().repeat(num_draws, 1)
    params = dict(filters, top_p=filters.get("top_p", 1.0))
    rows = [SamplingRow(SamplingParams(**params), [1], [], None, ())] * num_draws
    tokens, _ = sample(logits, rows, torch.Generator().manual_seed(1234))
    counts = torch.bincount(torch.tensor(tokens), minlength=len(PROBS)).tolist()
    for t, count in enumerate(counts):
        if t not in want:
            assert count == 0, f"token {t} is excluded by {filters} but was drawn {count} times"
            continue
        q = want[t]
        bound = 5 * (q * (1 - q) / num_draws) ** 0.5
        assert abs(count / num_draws - q) <= bound, (t, count / num_draws, q, filters)


def test_a_row_with_nothing_to_sample_gets_no_token_and_its_batch_mates_are_untouched(sampler_path):
    """Every logit -inf (an output constraint that allows nothing) or NaN: argmax used to return
    index 0 and the draw its clamp, the last index, as if sampled. Now such a row gets NO_TOKEN."""
    from fastgen.sampling import NO_TOKEN

    lg = logits(6)
    good = lg.clone()
    lg[1] = float("-inf")
    lg[2, 7] = float("nan")
    lg[4] = float("-inf")
    lg[5, 3] = float("nan")
    rows = [row(do_sample=False), row(do_sample=False), row(do_sample=False),
            row(seed=1), row(seed=1), row(seed=1, top_k=5, logprobs=2)]
    toks, lps = sample(lg, rows)
    assert toks[1] == toks[2] == toks[4] == toks[5] == NO_TOKEN
    assert lps[5] is None
    alone, _ = sample(good[[0, 3]].clone(), [row(do_sample=False), row(seed=1)])
    assert [toks[0], toks[3]] == alone


@pytest.mark.parametrize("params", [dict(), dict(top_p=1.0), dict(top_k=40), dict(top_k=3, top_p=0.5),
                                    dict(temperature=0.6, top_p=0.95, min_p=0.05), dict(temperature=2.0, top_p=0.99),
                                    dict(min_p=0.2, top_p=1.0), dict(top_k=1000, top_p=0.8)])
def test_the_native_sampler_draws_the_torch_paths_tokens(params, monkeypatch):
    """Seeded draws of 64 rows of a 49,152-token vocabulary (peaked and flat rows): the native
    sampler's token equals the torch path's in every row: the same filters, the same uniform
    numbers, the same inverse-CDF lookup (their sums differ only in the last bits)."""
    assert kernels.load(), "fastgen's native CPU kernels did not build"
    g = torch.Generator().manual_seed(5)
    scale = torch.tensor([0.5, 2.0, 4.0, 8.0]).repeat(16)[:, None]
    lg = torch.randn(64, 49_152, generator=g) * scale
    rows = [row(seed=s, **params) for s in range(64)]
    native, _ = sample(lg.clone(), rows)
    monkeypatch.setenv(NATIVE_SAMPLER_ENV, "0")
    rows = [row(seed=s, **params) for s in range(64)]
    ref, _ = sample(lg.clone(), rows)
    assert native == ref



@settings(max_examples=60, deadline=None)
@given(params=st.fixed_dictionaries({}, optional={
           "do_sample": st.booleans(), "temperature": st.sampled_from([0.0, 0.7, 1.0]),
           "repetition_penalty": st.sampled_from([1.0, 1.3]), "presence_penalty": st.sampled_from([0.0, 0.5]),
           "frequency_penalty": st.sampled_from([0.0, -0.4]), "logprobs": st.sampled_from([None, 0, 2])}),
       suppress=st.sampled_from([(), (3,)]), special=st.sampled_from(["none", "nan", "-inf", "tie", "+inf"]),
       seed=st.integers(0, 2**16))
def test_rows_the_argmax_decides_sample_the_argmax_tokens(params, suppress, special, seed):
    """The engine hands a step's rows to the output head's fused argmax only where
    ``argmax_decides`` says sample() would return that argmax: then ``argmax_tokens`` of the
    argmax and its value must be sample()'s tokens, NaN, -inf and ties included, and the rows it
    refuses are exactly those with a logits processor, a draw or logprobs."""
    lg = logits(3, vocab=200, seed=seed)
    if special == "nan":
        lg[1, 17] = float("nan")
    elif special == "-inf":
        lg[1] = float("-inf")
    elif special == "tie":
        lg[1, 40] = lg[1, 90] = lg[1].max() + 1
    elif special == "+inf":
        lg[1, 5] = float("inf")
    rows = [SamplingRow(SamplingParams(**params), [1, 2], [4, 4, 9], torch.Generator().manual_seed(1), suppress)
            for _ in range(3)]
    p = rows[0].params
    plain = p.greedy and p.logprobs is None and not p.has_penalties and not suppress
    assert argmax_decides(rows[0]) == plain
    if plain:
        idx = lg.argmax(-1)
        best = lg.gather(1, idx[:, None]).squeeze(1)
        toks, lps = sample(lg.clone(), rows)
        assert argmax_tokens(idx, best) == toks and lps == [None] * 3
