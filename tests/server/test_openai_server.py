"""One real `fastgen serve` (float32, like the session's pipeline) driven by the official `openai`
client and raw HTTP: completions, chat, streaming, n, stop, seed, logprobs, usage, greedy equality
with the in-process pipeline, concurrency, metrics, disconnects, deadlines, auth and bad input."""
from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

import fastgen
from fastgen import FinishReason, InvalidRequestError

from .conftest import serving, wait_until

KEY = "test-key"
KEY2 = "second-tenant-key"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
CHAT = [{"role": "user", "content": "Name three rivers in Europe."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# tenants, one key per line\n\n{KEY2}\n")
    yield from serving("--dtype", "float32", "--num-blocks", "64", "--api-key", KEY, "--api-key-file", str(key_file))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers=headers, timeout=120)


def test_health_models_and_tokenize(server, model):
    assert server.saw_loading  # the port answers (503) while the model loads
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    toks = post(server, "/tokenize", {"prompt": "hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) == 2 and toks["max_model_len"] == 8192
    assert post(server, "/detokenize", {"tokens": toks["tokens"]}).json() == {"prompt": "hello world"}
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["count"] > 10


def test_greedy_completions_equal_the_pipeline(client, model, smollm2_pipe):
    expected = smollm2_pipe(PROMPTS, max_new_tokens=12, do_sample=False)
    r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [e.generated_text for e in expected]
    assert [c.finish_reason for c in r.choices] == [e.finish_reason.value for e in expected]
    assert r.usage.prompt_tokens == sum(e.prompt_length for e in expected)
    assert r.usage.completion_tokens == sum(e.generated_length for e in expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_chat_equals_the_pipeline_and_streams_the_same(client, model, smollm2_pipe):
    [expected] = smollm2_pipe([CHAT], max_new_tokens=20, do_sample=False)
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == expected.generated_text
    assert r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (expected.prompt_length, expected.generated_length)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.generated_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason.value
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == expected.generated_length


def test_stream_ends_with_done(server, model):
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def test_n_seed_and_stop(client, model):
    kwargs = dict(model=model, prompt="My favourite animal is the", max_tokens=8, temperature=1.0, n=3, seed=11)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert len(a.choices) == 3 and sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]          # same seed, same text
    assert len({c.text for c in a.choices}) > 1                               # choice i uses seed + i
    free = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    stop = free.choices[0].text[3:6]
    cut = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free.choices[0].text[:free.choices[0].text.index(stop)]


def test_logprobs(client, model):
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    assert all(t <= 0 for t in lp.token_logprobs)
    c = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 3 for e in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy: the top one


def test_streamed_logprobs_equal_the_non_streamed(client, model):
    kwargs = dict(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)]
    got = {k: sum((getattr(p, k) for p in parts if p is not None), [])
           for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert (got["tokens"], got["text_offset"]) == (whole.tokens, whole.text_offset)
    assert got["token_logprobs"] == pytest.approx(whole.token_logprobs, abs=1e-4)
    assert [t.keys() for t in got["top_logprobs"]] == [t.keys() for t in whole.top_logprobs]
    assert [list(t.values()) for t in got["top_logprobs"]] == \
        [pytest.approx(list(t.values()), abs=1e-4) for t in whole.top_logprobs]

    kwargs = dict(model=model, messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    got = [e for c in client.chat.completions.create(**kwargs, stream=True)
           if c.choices and c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in got] == [(e.token, e.bytes) for e in whole]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in got] == [[t.token for t in e.top_logprobs] for e in whole]


def test_16_concurrent_streams_complete_with_the_right_text(client, model, smollm2_pipe):
    prompts = [f"Here is fact number {i} about the ocean:" for i in range(16)]
    expected = [r.generated_text for r in smollm2_pipe(prompts, max_new_tokens=8, do_sample=False)]
    texts: list[str | None] = [None] * 16
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            stream = client.completions.create(model=model, prompt=prompts[i], max_tokens=8, temperature=0,
                                               stream=True)
            texts[i] = "".join(c.choices[0].text for c in stream)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and texts == expected


def test_metrics_parse_and_move(server, client, model):
    before = server.metrics()
    client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.metrics()
    assert after["fastgen_generation_tokens_total"] - before["fastgen_generation_tokens_total"] == 6
    assert after["fastgen_requests_finished_total{finish_reason=\"length\"}"] > \
        before.get("fastgen_requests_finished_total{finish_reason=\"length\"}", 0)
    assert after["fastgen_time_to_first_token_seconds_count"] == before["fastgen_time_to_first_token_seconds_count"] + 1
    assert after["fastgen_inter_token_latency_seconds_count"] == before["fastgen_inter_token_latency_seconds_count"] + 5
    assert after["fastgen_steps_total"] > before["fastgen_steps_total"]
    assert after["fastgen_step_decode_tokens_sum"] > before["fastgen_step_decode_tokens_sum"]
    assert after["fastgen_kv_blocks_used"] == 0 and after["fastgen_kv_blocks_free"] == 64
    for name in ("fastgen_requests_waiting", "fastgen_requests_running", "fastgen_requests_queued",
                 "fastgen_preemptions_total", "fastgen_e2e_request_latency_seconds_count",
                 "fastgen_step_prompt_tokens_count", "fastgen_prompt_tokens_total"):
        assert name in after


def test_disconnected_client_frees_its_kv_blocks(server, model):
    aborted = 'fastgen_requests_finished_total{finish_reason="abort"}'
    before = server.metrics().get(aborted, 0)
    body = {"model": model, "prompt": PROMPTS[2], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line.startswith("data: "))
        assert server.metrics()["fastgen_kv_blocks_used"] > 0
    assert wait_until(lambda: server.metrics()["fastgen_kv_blocks_used"] == 0, timeout_s=20)
    assert server.metrics()[aborted] == before + 1


def test_client_giving_up_on_a_non_streamed_request_aborts_it(server, model):
    aborted = 'fastgen_requests_finished_total{finish_reason="abort"}'
    before = server.metrics().get(aborted, 0)
    body = {"model": model, "prompt": PROMPTS[2], "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(10, read=1.0))
    assert wait_until(lambda: server.metrics().get(aborted, 0) == before + 1, timeout_s=20)
    assert server.metrics()["fastgen_kv_blocks_used"] == 0


def test_deadline_ends_the_request_with_timeout(client, model):
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1500,
                                  extra_body={"request_timeout_s": 0.5, "ignore_eos": True})
    assert r.choices[0].finish_reason == "timeout"
    assert 0 < r.usage.completion_tokens < 1500


def test_api_key_is_required(server, model):
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    for key in (None, "wrong"):
        r = post(server, "/v1/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # open, for load balancers


def test_prefix_cache_is_per_tenant_and_salt(server, model):
    """Each API key is a tenant: the same prompt from another key finds nothing cached, the same
    key's repeat is a hit; a cache_salt partitions further within the key."""
    prompt = "You are a meticulous librarian who catalogues rare books. " * 12 + "Describe a first edition."
    n = len(post(server, "/tokenize", {"prompt": prompt}).json()["tokens"])

    def cached(key: str, stream: bool = False, **extra) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
            r = post(server, "/v1/completions", body, key=key)
            chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
            return chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        r = post(server, "/v1/completions", body, key=key)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    before = server.metrics()
    assert cached(KEY) == 0
    hit = cached(KEY)
    assert hit == (n - 1) // 32 * 32 >= 96                 # every whole 32-token block before the last token
    assert cached(KEY2) == 0                               # another tenant: nothing shared
    assert cached(KEY2, stream=True) == hit                # its own repeat hits (and streams usage)
    assert cached(KEY, cache_salt="alpha") == 0
    assert cached(KEY, cache_salt="alpha") == hit
    assert cached(KEY2, cache_salt="alpha") == 0          # the same salt under another key
    after = server.metrics()
    assert after["fastgen_prefix_cache_hits_total"] - before.get("fastgen_prefix_cache_hits_total", 0) == 3 * hit
    assert after["fastgen_prefix_cache_queries_total"] > before.get("fastgen_prefix_cache_queries_total", 0)
    assert "fastgen_kv_blocks_cached_free" in after
    oai = openai.OpenAI(base_url=server.v1, api_key=KEY2, max_retries=0, timeout=120)
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == hit
    bad = post(server, "/v1/completions", {"model": model, "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and "cache_salt" in bad.text


M = "SmolLM2-135M-Instruct.Q4_1"
BAD_INPUTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "a"}, 400, "model"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
    ("/v1/completions", {"model": M, "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": M, "prompt": "a", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": M, "prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": M, "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": M, "prompt": "a", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"model": M, "prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": M, "prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": M, "prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": M, "prompt": "a", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/completions", {"model": M, "prompt": "a", "presence_penalty": 9}, 400, "presence_penalty"),
    ("/v1/completions", {"model": M, "prompt": "a", "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": M, "prompt": "a", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": M, "prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"model": M, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": M, "prompt": [1] * 9000}, 400, "prompt"),
    ("/v1/completions", {"model": M, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": M, "prompt": "a", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": M, "prompt": "a", "request_timeout_s": 0}, 400, "request_timeout_s"),
    ("/v1/chat/completions", {"model": M, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": M, "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": M, "messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": M, "messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/generate", {"prompts": "a", "max_new_tokenz": 3}, 400, "max_new_tokenz"),
    ("/generate", {"prompts": "a", "top_p": 2}, 400, "top_p"),
    ("/generate", {"prompts": [], "max_new_tokens": 3}, 400, "prompts"),
    ("/generate", {"prompts": ["a", "b"], "stream": True}, 400, "stream"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS,
                         ids=[f"{p}-{s}-{param}-{i}" for i, (p, _, s, param) in enumerate(BAD_INPUTS)])
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_bad_input_leaves_the_server_serving(server, client, model):
    assert httpx.get(server.v1 + "/completions", headers={"Authorization": f"Bearer {KEY}"}).status_code == 405
    r = client.completions.create(model=model, prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_python_client_returns_the_pipelines_responses(server, smollm2_pipe):
    c = fastgen.client(server.url, api_key=KEY)
    prompts = [PROMPTS[0], CHAT]
    got = c.generate(prompts, max_new_tokens=6, do_sample=False, logprobs=1)
    expected = smollm2_pipe(prompts, max_new_tokens=6, do_sample=False, logprobs=1)
    for g, e in zip(got, expected):
        assert isinstance(g, fastgen.Response)
        assert (g.generated_text, g.token_ids, g.prompt_length, g.generated_length, g.finish_reason) == \
            (e.generated_text, e.token_ids, e.prompt_length, e.generated_length, e.finish_reason)
        assert [lp.token_id for lp in g.logprobs] == [lp.token_id for lp in e.logprobs]
        assert g.timings.time_to_first_token_s <= g.timings.e2e_s
    assert "".join(c.stream(PROMPTS[0], max_new_tokens=6, do_sample=False)) == expected[0].generated_text
    [t] = c.generate(PROMPTS[0], max_new_tokens=1500, ignore_eos=True, request_timeout_s=0.3)
    assert t.finish_reason is FinishReason.TIMEOUT and t.generated_length < 1500
    with pytest.raises(InvalidRequestError) as e:
        c.generate(PROMPTS[0], max_new_tokenz=3)
    assert e.value.param == "max_new_tokenz"
    c.terminate()  # a client it did not start: closes the connection, the server stays up
    assert httpx.get(server.url + "/health").status_code == 200
