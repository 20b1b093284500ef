"""The pipeline API on the real SmolLM2: generate kwargs, stop strings, seeds, logprobs, bad input."""
from __future__ import annotations

import math

import pytest

import fastgen
from fastgen import FinishReason, InvalidRequestError, ModelLoadError, PromptTooLongError
from fastgen.text import TextStream

PROMPT = "Write a list of fruits: apple, banana,"


def test_responses_in_input_order_with_counts_and_timings(smollm2_pipe):
    prompts = ["One", "The quick brown fox jumps over the lazy dog. " * 4, "Hello there"]
    rs = smollm2_pipe(prompts, max_new_tokens=5, do_sample=False, ignore_eos=True)
    tok = smollm2_pipe.tokenizer
    for p, r in zip(prompts, rs):
        assert r.prompt_length == len(tok(p).input_ids)
        assert r.generated_length == len(r.token_ids) == 5
        assert r.finish_reason is FinishReason.LENGTH
        t = r.timings
        assert 0 <= t.queue_wait_s <= t.time_to_first_token_s <= t.e2e_s
        assert len(t.token_times_s) == 5 and list(t.token_times_s) == sorted(t.token_times_s)
        assert r.generated_text == tok.decode(list(r.token_ids), skip_special_tokens=True)


def test_stop_string_across_token_boundaries_is_cut(smollm2_pipe):
    [free] = smollm2_pipe([PROMPT], max_new_tokens=20, do_sample=False, ignore_eos=True)
    text = free.generated_text
    # a stop string from the middle of one multi-character token into the next tokens
    tok = smollm2_pipe.tokenizer
    pieces = [tok.decode([t]) for t in free.token_ids]
    assert "".join(pieces) == text
    k = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 3)
    start = len("".join(pieces[:k])) + len(pieces[k]) - 2
    stop = text[start:start + 4]
    assert len(pieces[k + 1]) < 3 and stop not in text[:start]
    [r] = smollm2_pipe([PROMPT], max_new_tokens=20, do_sample=False, ignore_eos=True, stop=[stop, "zzzz"])
    assert r.finish_reason is FinishReason.STOP
    assert r.generated_text == text[:text.index(stop)]
    assert stop not in r.generated_text


def test_text_stream_holds_back_partial_stop(smollm2_pipe):
    tok = smollm2_pipe.tokenizer
    ids = tok("hello world, hello moon").input_ids
    ts = TextStream(tok.backend_tokenizer, ("o w",))
    released = []
    stopped = False
    for t in ids:
        delta, stopped = ts.push(t, check_stop=True)
        released.append(delta)
        if stopped:
            break
    assert stopped and "".join(released) == "hell" == ts.text


def test_min_and_max_new_tokens(smollm2_pipe):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    [short] = smollm2_pipe([chat], max_new_tokens=64, do_sample=False)
    assert short.finish_reason is FinishReason.STOP and short.generated_length < 20
    eos = smollm2_pipe.engine.eos_token_ids
    assert short.token_ids[-1] in eos
    n = short.generated_length + 5
    [forced] = smollm2_pipe([chat], max_new_tokens=64, min_new_tokens=n, do_sample=False)
    assert forced.generated_length >= n and not set(forced.token_ids[:n]) & eos
    [capped] = smollm2_pipe([chat], max_new_tokens=3, do_sample=False)
    assert capped.generated_length == 3 and capped.finish_reason is FinishReason.LENGTH
    [by_len] = smollm2_pipe(["one two three"], max_length=5, do_sample=False, ignore_eos=True)
    assert by_len.prompt_length + by_len.generated_length == 5
    [full] = smollm2_pipe(["one two three"], max_new_tokens=2, do_sample=False, return_full_text=True)
    assert full.generated_text.startswith("one two three")


def test_stop_does_not_disable_eos(smollm2_pipe):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    [r] = smollm2_pipe([chat], max_new_tokens=64, do_sample=False, stop=["qqqq"])
    assert r.finish_reason is FinishReason.STOP and r.token_ids[-1] in smollm2_pipe.engine.eos_token_ids


def test_seed_gives_same_output_whatever_the_batch(smollm2_pipe):
    kw = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    [alone] = smollm2_pipe([PROMPT], **kw)
    crowd = smollm2_pipe(["Tell me a joke", PROMPT, "Count to ten: one,", "Why is the sky blue?"],
                         max_new_tokens=16, seed=1234, temperature=0.9, top_p=0.95, top_k=50)
    assert crowd[1].token_ids == alone.token_ids
    [other] = smollm2_pipe([PROMPT], **{**kw, "seed": 99})
    assert other.token_ids != alone.token_ids


def test_filters_at_their_greedy_limits_give_the_greedy_text(smollm2_pipe):
    """The limits only (top_k=1, a tiny top_p, min_p=1): each must reduce to greedy. That the filters
    draw from the right renormalised distribution otherwise is tests/unit/test_sampling.py's
    frequency test."""
    [greedy] = smollm2_pipe([PROMPT], max_new_tokens=8, do_sample=False, ignore_eos=True)
    [top1] = smollm2_pipe([PROMPT], max_new_tokens=8, top_k=1, seed=3, ignore_eos=True)
    [tiny_p] = smollm2_pipe([PROMPT], max_new_tokens=8, top_p=1e-6, seed=4, ignore_eos=True)
    [hi_min_p] = smollm2_pipe([PROMPT], max_new_tokens=8, min_p=1.0, top_p=1.0, seed=5, ignore_eos=True)
    assert greedy.token_ids == top1.token_ids == tiny_p.token_ids == hi_min_p.token_ids


def test_penalties_change_greedy_output(smollm2_pipe):
    prompt = "repeat after me: la la la la la la"
    [plain] = smollm2_pipe([prompt], max_new_tokens=12, do_sample=False, ignore_eos=True)
    [rep] = smollm2_pipe([prompt], max_new_tokens=12, do_sample=False, ignore_eos=True, repetition_penalty=1.5)
    [freq] = smollm2_pipe([prompt], max_new_tokens=12, do_sample=False, ignore_eos=True, frequency_penalty=2.0)
    assert rep.token_ids != plain.token_ids
    assert freq.token_ids != plain.token_ids
    assert len(set(freq.token_ids)) > len(set(plain.token_ids))


def test_logprobs_and_prompt_logprobs(smollm2_pipe):
    [r] = smollm2_pipe([PROMPT], max_new_tokens=4, do_sample=False, ignore_eos=True, logprobs=3,
                       prompt_logprobs=2)
    assert len(r.logprobs) == 4
    for lp, tok in zip(r.logprobs, r.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert max(lp.top.values()) == pytest.approx(lp.logprob)   # greedy picks the top token
        assert sum(math.exp(v) for v in lp.top.values()) <= 1 + 1e-5
    assert len(r.prompt_logprobs) == r.prompt_length - 1
    assert all(len(p.top) == 2 and p.logprob <= 0 for p in r.prompt_logprobs)


def test_stream_yields_utf8_deltas_equal_to_the_text(smollm2_pipe):
    prompt = [{"role": "user", "content": "Write three emoji and the word café."}]
    deltas = list(smollm2_pipe.stream(prompt, max_new_tokens=24, do_sample=False))
    [r] = smollm2_pipe([prompt], max_new_tokens=24, do_sample=False)
    assert "".join(deltas) == r.generated_text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_length=0), "max_length"),
    (dict(min_new_tokens=10, max_new_tokens=5), "min_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(logprobs=50), "logprobs"),
    (dict(seed="x"), "seed"),
    (dict(do_sample="yes"), "do_sample"),
    (dict(num_beams=4), "num_beams"),
])
def test_bad_generate_kwargs_name_the_problem(smollm2_pipe, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        smollm2_pipe(["hi"], **kwargs)
    assert e.value.param == param and param in str(e.value)


def test_bad_prompts_name_the_problem(smollm2_pipe):
    with pytest.raises(InvalidRequestError, match="empty"):
        smollm2_pipe([""])
    with pytest.raises(InvalidRequestError, match="empty"):
        smollm2_pipe([[]])
    with pytest.raises(InvalidRequestError, match="token ids"):
        smollm2_pipe([[1, 2, 10**9]])
    too_long = "word " * (smollm2_pipe.engine.config.max_model_len + 10)
    with pytest.raises(PromptTooLongError, match="prompt has"):
        smollm2_pipe([too_long])
    with pytest.raises(PromptTooLongError):
        smollm2_pipe(["one two three four"], max_length=3)


def test_one_bad_prompt_queues_nothing_and_the_engine_goes_on(smollm2_pipe):
    with pytest.raises(InvalidRequestError):
        smollm2_pipe(["fine", "", "also fine"], max_new_tokens=2)
    assert not smollm2_pipe.engine.has_unfinished()
    [ok] = smollm2_pipe(["still works"], max_new_tokens=2, do_sample=False)
    assert ok.generated_length == 2


def test_abort_frees_blocks(smollm2_pipe):
    engine = smollm2_pipe.engine
    free = engine.allocator.num_free_blocks
    stream = smollm2_pipe.stream("Tell me a very long story about dragons.", max_new_tokens=200, ignore_eos=True)
    next(stream)
    assert engine.allocator.num_free_blocks < free
    stream.close()
    assert engine.allocator.num_free_blocks == free and not engine.has_unfinished()


def test_bad_model_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        fastgen.pipeline(str(tmp_path / "nope.gguf"))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        fastgen.pipeline(str(corrupt))
    (tmp_path / "folder").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        fastgen.pipeline(str(tmp_path / "folder"))
    with pytest.raises(InvalidRequestError, match="unknown engine option"):
        fastgen.pipeline(None, budget=3)


def test_interleaved_streams_both_finish_with_their_own_text(smollm2_pipe):
    kw = dict(max_new_tokens=12, do_sample=False, ignore_eos=True)
    a = smollm2_pipe.stream("The capital of France is", **kw)
    b = smollm2_pipe.stream("def fibonacci(n):", **kw)
    text_a = next(a)
    text_b = "".join(b)          # runs every step; a's deltas wait in its outbox
    text_a += "".join(a)
    [ra, rb] = smollm2_pipe(["The capital of France is", "def fibonacci(n):"], **kw)
    assert (text_a, text_b) == (ra.generated_text, rb.generated_text)
    assert not smollm2_pipe.engine.has_unfinished()


def test_caller_chosen_ids_do_not_collide_with_automatic_ones(smollm2_pipe):
    from fastgen.request import SamplingParams

    engine = smollm2_pipe.engine
    params = SamplingParams(max_new_tokens=1)
    probe = engine.add_request("hi", params)          # an automatic id shows the scheme: "req-<n>"
    prefix, number = probe.rsplit("-", 1)
    taken = [f"{prefix}-{int(number) + k}" for k in (1, 2, 3)]   # the next automatic ids, claimed first
    for rid in taken:
        engine.add_request("hi", params, request_id=rid)
    auto = engine.add_request("hi", params)
    assert auto not in taken and auto != probe
    while engine.has_unfinished():
        engine.step()
    for rid in (probe, *taken, auto):
        engine.response(rid)


def test_plain_greedy_steps_take_the_heads_argmax_and_the_same_tokens(smollm2_pipe, monkeypatch):
    """Steps whose every sampling row is plain greedy take the argmax the output head's kernel
    computes inside the product (Engine._forward, ``forward_greedy``): the same tokens as the
    path that samples from the logits afterwards. A batch mate that draws, wants logprobs or a
    penalty, or is held below min_new_tokens, sends its steps down that path."""
    import fastgen.engine
    from fastgen.request import SamplingParams

    eng = smollm2_pipe.engine
    cls = type(eng.model)
    fused = []
    orig = cls.forward_greedy

    def spy(self, batch, pool):
        out = orig(self, batch, pool)
        fused.append(out[1] is not None)
        return out

    monkeypatch.setattr(cls, "forward_greedy", spy)
    prompts = [PROMPT, "The capital of France is", "def add(a, b):"]
    got = smollm2_pipe(prompts, max_new_tokens=10, do_sample=False, ignore_eos=True)
    assert len(fused) >= 10 and all(fused)            # batches of 3 and 1 decode, and the prompts' last steps

    fused.clear()
    with monkeypatch.context() as m:
        m.setattr(fastgen.engine, "argmax_decides", lambda row: False)
        want = smollm2_pipe(prompts, max_new_tokens=10, do_sample=False, ignore_eos=True)
    assert not fused
    assert [r.token_ids for r in got] == [r.token_ids for r in want]

    greedy = SamplingParams(max_new_tokens=6, do_sample=False, ignore_eos=True)
    for mate in (dict(do_sample=True, seed=3), dict(do_sample=False, logprobs=1),
                 dict(do_sample=False, repetition_penalty=1.3), dict(do_sample=False, min_new_tokens=6)):
        fused.clear()
        ids = [eng.add_request(PROMPT, greedy), eng.add_request(PROMPT, SamplingParams(max_new_tokens=6, **mate))]
        while eng.has_unfinished():
            eng.step()
        [eng.response(i) for i in ids]
        assert not any(fused), mate
