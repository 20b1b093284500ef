"""The workload generator: seeded length distributions, clipping, and prompts of exact token counts."""
from __future__ import annotations

import random
import statistics
from importlib import resources

import pytest

from fastgen.bench.workload import (PRESETS, Corpus, Workload, WorkloadError, build_requests, sample_lengths,
                                    workload_from_args)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from fastgen.model.loader import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def word_tokenizer():
    """A tiny word-level tokenizer that adds a BOS token, as Llama's do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = "the a of and to in is it that was he for on are with as his they be at one have this".split()
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")


def test_presets_hold_the_paper_workloads():
    pairs = {(w.prompt_mean_tokens, w.gen_mean_tokens) for w in PRESETS.values()}
    assert {(1200, 60), (1200, 128), (2600, 60), (2600, 128), (256, 256)} <= pairs
    assert all(w.rel_std == 0.3 for w in PRESETS.values())


def test_workload_from_args():
    assert workload_from_args("paper-1200-60", None, None) is PRESETS["paper-1200-60"]
    custom = workload_from_args(None, 500, 40)
    assert (custom.prompt_mean_tokens, custom.gen_mean_tokens) == (500, 40)
    assert workload_from_args("paper-1200-60", None, 20).gen_mean_tokens == 20
    with pytest.raises(WorkloadError):
        workload_from_args("nope", None, None)
    with pytest.raises(WorkloadError):
        workload_from_args(None, 500, None)


@pytest.mark.parametrize("prompt_mean,gen_mean", [(1200, 60), (2600, 128), (256, 256)])
def test_lengths_are_normal_with_std_0_3_mean(prompt_mean, gen_mean):
    w = Workload("w", prompt_mean, gen_mean)
    lengths = sample_lengths(w, 4000, seed=1, max_model_len=100_000)
    for values, mean in ((([p for p, _ in lengths]), prompt_mean), (([g for _, g in lengths]), gen_mean)):
        assert statistics.fmean(values) == pytest.approx(mean, rel=0.02)
        assert statistics.stdev(values) == pytest.approx(0.3 * mean, rel=0.05)
        # Normal: about 68% within one standard deviation
        assert sum(abs(v - mean) <= 0.3 * mean for v in values) / len(values) == pytest.approx(0.683, abs=0.03)


def test_lengths_are_seeded_and_prefix_stable():
    w = PRESETS["paper-1200-60"]
    a = sample_lengths(w, 50, seed=3, max_model_len=8192)
    assert a == sample_lengths(w, 50, seed=3, max_model_len=8192)
    assert a[:10] == sample_lengths(w, 10, seed=3, max_model_len=8192)   # request i is request i
    assert a != sample_lengths(w, 50, seed=4, max_model_len=8192)


def test_lengths_are_clipped_to_the_context():
    w = Workload("w", 1200, 600)
    lengths = sample_lengths(w, 2000, seed=0, max_model_len=1000)
    assert all(1 <= p <= 999 and 1 <= g and p + g <= 1000 for p, g in lengths)
    assert any(p == 999 for p, _ in lengths)
    tiny = sample_lengths(Workload("w", 1, 1), 500, seed=0, max_model_len=2)
    assert all(p == 1 and g == 1 for p, g in tiny)


def test_shipped_corpus_is_real_text_under_2_mb():
    data = resources.files("fastgen.bench").joinpath("data")
    text = data.joinpath("shakespeare.txt").read_text(encoding="utf-8")
    assert 100_000 < len(text.encode()) < 2_000_000
    assert "To be, or not to be" in text
    readme = " ".join(data.joinpath("README.md").read_text(encoding="utf-8").lower().split())
    assert "public domain" in readme


def test_prompts_have_exact_token_counts_smollm2(smollm2_tokenizer):
    corpus = Corpus.shipped(smollm2_tokenizer)
    assert len(corpus.token_ids) > 100_000 and corpus.num_special_tokens == 0
    w = PRESETS["paper-1200-60"]
    requests = build_requests(w, 12, corpus, seed=0, max_model_len=8192)
    lengths = sample_lengths(w, 12, seed=0, max_model_len=8192)
    for req, (p, g) in zip(requests, lengths):
        assert req.num_prompt_tokens == p and req.max_new_tokens == g
        # what an engine or server computes from the text is exactly the ids sent
        assert smollm2_tokenizer(req.prompt_text)["input_ids"] == list(req.prompt_token_ids)
    assert len({r.prompt_text for r in requests}) == len(requests)


def test_requests_are_deterministic(smollm2_tokenizer):
    corpus = Corpus.shipped(smollm2_tokenizer)
    w = PRESETS["cpu-300-30"]
    a = build_requests(w, 6, corpus, seed=5, max_model_len=8192)
    assert a == build_requests(w, 6, corpus, seed=5, max_model_len=8192)
    assert a[:3] == build_requests(w, 3, corpus, seed=5, max_model_len=8192)
    assert a != build_requests(w, 6, corpus, seed=6, max_model_len=8192)


def test_prompts_count_special_tokens(word_tokenizer):
    corpus = Corpus("the cat sat on the mat and it was one of the best . " * 40, word_tokenizer)
    assert corpus.num_special_tokens == 1
    rng = random.Random(0)
    for n in (2, 7, 50):
        ids, text = corpus.prompt(n, rng)
        assert len(ids) == n and ids[0] == 1
        assert word_tokenizer(text)["input_ids"] == list(ids)
    with pytest.raises(WorkloadError):
        corpus.prompt(1, rng)          # only room for the BOS token
    with pytest.raises(WorkloadError):
        corpus.prompt(10_000, rng)     # longer than the text


def test_shared_prefix_workload_starts_every_prompt_with_the_same_tokens(smollm2_tokenizer):
    corpus = Corpus.shipped(smollm2_tokenizer)
    w = PRESETS["shared-1000-64-30"]
    reqs = build_requests(w, 12, corpus, seed=3, max_model_len=4096)
    prefix = reqs[0].prompt_token_ids[:1000]
    assert len({r.prompt_token_ids for r in reqs}) == 12
    for r in reqs:
        assert r.prompt_token_ids[:1000] == prefix and r.num_prompt_tokens > 1000
        assert tuple(smollm2_tokenizer(r.prompt_text)["input_ids"]) == r.prompt_token_ids  # the text is exact
    assert build_requests(w, 5, corpus, seed=3, max_model_len=4096) == reqs[:5]
    assert build_requests(w, 5, corpus, seed=4, max_model_len=4096)[0].prompt_token_ids[:1000] != prefix


def test_chat_workload_grows_each_history_turn_by_turn(smollm2_tokenizer):
    corpus = Corpus.shipped(smollm2_tokenizer)
    w = Workload("chat", 40, 8, turns=3, conversations=4)
    reqs = build_requests(w, 24, corpus, seed=1, max_model_len=2048)   # 2 blocks of 4 chats x 3 turns
    for i, r in enumerate(reqs):
        block, rest = divmod(i, 12)
        if rest >= 4:                                   # turn 2 or 3: extends the same chat's last turn
            prev = reqs[i - 4].prompt_token_ids
            assert r.prompt_token_ids[:len(prev)] == prev and r.num_prompt_tokens > len(prev)
        else:                                           # a chat's first turn shares nothing with the others
            assert all(r.prompt_token_ids[:8] != q.prompt_token_ids[:8] for q in reqs[:i] if q is not r)
        assert tuple(smollm2_tokenizer(r.prompt_text)["input_ids"]) == r.prompt_token_ids
    assert build_requests(w, 7, corpus, seed=1, max_model_len=2048) == reqs[:7]
    with pytest.raises(WorkloadError, match="outgrows"):
        build_requests(Workload("long", 400, 8, turns=6), 48, corpus, seed=0, max_model_len=1024)
