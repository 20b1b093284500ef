"""The published schema, and the API fuzzed against it.

One `fastgen serve` on the tiny model with a 256-token context (so that no fuzzed request can ask
for much work) and a 2 s body timeout. Schemathesis generates requests from ``/openapi.json``,
valid (positive) and invalid (negative) for every operation, a bounded number each; every answer
must be no 5xx, must match the schema (status, content type, body, each streamed event) and, for
an error, must be an OpenAI-style body whose ``param`` names a field. Then hand-made attacks:
malformed and oversized bodies, absurd numbers, thousands of stop strings, and slowloris clients
while other clients keep being served.
"""
from __future__ import annotations

import collections
import json
import re
import shutil
import socket
import subprocess
import threading
import time

import httpx
import jsonschema
import pytest

from ..server.conftest import start_server
from .conftest import SERVE_ARGS, auth

KEY = "fuzz-key"
CONTEXT = 256
BODY_TIMEOUT_S = 2.0
EXAMPLES_PER_MODE = 60        # per operation, positive and negative: ~700 requests in all
FUZZ_BUDGET_S = 150.0         # past this, cases are generated but no longer sent
ERROR_KEYS = {"message", "type", "param", "code"}
# headers that HTTP's framing owns, and RFC 9110's token (a header name's characters)
FRAMING_HEADERS = {"transfer-encoding", "content-length", "connection", "host", "te", "upgrade", "expect",
                   "trailer", "keep-alive"}
HEADER_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


@pytest.fixture(scope="module")
def fuzz_server(tiny_model):
    srv = start_server(tiny_model, *SERVE_ARGS, "--api-key", KEY, "--served-model-name", "tiny",
                       "--max-model-len", str(CONTEXT), "--body-timeout-s", str(BODY_TIMEOUT_S))
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def openapi(fuzz_server) -> dict:
    r = httpx.get(fuzz_server.url + "/openapi.json", timeout=10)  # open, like vLLM's, even with --api-key
    assert r.status_code == 200, r.text
    return r.json()


def post(srv, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **kw.pop("headers", {})}
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def assert_error_body(r: httpx.Response) -> dict:
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], r.text
    return err


def validate(openapi: dict, name: str, instance) -> None:
    """``instance`` against the component ``name``, its refs resolved in the published document."""
    jsonschema.validate(instance, {**openapi, "$ref": f"#/components/schemas/{name}"},
                        cls=jsonschema.Draft202012Validator)


def events(r: httpx.Response) -> list:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# -- the schema ---------------------------------------------------------------------------------------

def test_the_schema_publishes_every_endpoint_with_its_models(openapi):
    ops = {(path, method) for path, item in openapi["paths"].items() for method in item}
    assert ops == {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/generate", "post"),
                   ("/tokenize", "post"), ("/detokenize", "post"), ("/v1/models", "get"), ("/health", "get"),
                   ("/metrics", "get")}  # the dashboard (a page and its feed) and /docs are not API
    schemas = openapi["components"]["schemas"]
    for path, item in openapi["paths"].items():
        for op in item.values():
            for status, response in op["responses"].items():
                for media in response.get("content", {}).values():
                    refs = json.dumps(media["schema"])
                    for name in refs.split('"#/components/schemas/')[1:]:
                        assert name.split('"')[0] in schemas, (path, status)
            if "requestBody" in op:
                assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("Request")
                assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
            open_route = path in ("/health", "/metrics")
            assert ("security" in op) != open_route, path
    assert openapi["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    # the request schemas are the validators' own: strict fields, no unknown keys
    completion = schemas["CompletionRequest"]
    assert completion["additionalProperties"] is False and {"model", "prompt"} <= set(completion["required"])
    assert schemas["GenerateRequest"]["additionalProperties"] is False
    assert "max_new_tokens" in schemas["GenerateRequest"]["properties"]  # SamplingParams' fields, listed


def test_docs_work_offline_and_are_open(fuzz_server):
    page = httpx.get(fuzz_server.url + "/docs", timeout=10)
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assert "http://" not in page.text and "https://" not in page.text   # nothing from a CDN
    for asset, kind in (("swagger-ui-bundle.js", "javascript"), ("swagger-ui.css", "css"), ("favicon.png", "png")):
        r = httpx.get(f"{fuzz_server.url}/docs/{asset}", timeout=10)
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.content) > 1000, asset
    assert httpx.get(fuzz_server.url + "/v1/models", timeout=10).status_code == 401  # the API itself stays keyed


def _chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium on this machine (Debian: apt-get install chromium)")
def test_headless_chromium_renders_every_operation_with_no_other_host_reachable(fuzz_server, openapi, tmp_path):
    out = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                          "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--enable-logging=stderr",
                          "--v=0", "--dump-dom", fuzz_server.url + "/docs"],
                         capture_output=True, text=True, timeout=90, cwd=tmp_path)
    shown = set(re.findall(r'data-path="([^"]+)"', out.stdout))
    assert shown == set(openapi["paths"]), out.stdout[-2000:]
    assert "Uncaught" not in out.stderr, out.stderr[-2000:]


def test_real_answers_match_the_published_schema(fuzz_server, openapi):
    chat = [{"role": "user", "content": "hi"}]
    validate(openapi, "CompletionResponse", post(fuzz_server, "/v1/completions", {
        "model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "logprobs": 2}).json())
    validate(openapi, "ChatCompletionResponse", post(fuzz_server, "/v1/chat/completions", {
        "model": "tiny", "messages": chat, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}).json())
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    called = post(fuzz_server, "/v1/chat/completions", {"model": "tiny", "messages": chat, "tools": [tool],
                                                        "tool_choice": "required", "max_tokens": 60}).json()
    validate(openapi, "ChatCompletionResponse", called)
    for path, body, chunk in (
            ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 4, "logprobs": 1}, "CompletionChunk"),
            ("/v1/chat/completions", {"model": "tiny", "messages": chat, "max_tokens": 4, "logprobs": True},
             "ChatCompletionChunk"),
            ("/v1/chat/completions", {"model": "tiny", "messages": chat, "tools": [tool], "max_tokens": 60,
                                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
             "ChatCompletionChunk")):
        got = events(post(fuzz_server, path, {**body, "stream": True, "stream_options": {"include_usage": True}}))
        assert got[-1]["usage"]["total_tokens"] > 0
        for e in got:
            validate(openapi, chunk, e)
    native = post(fuzz_server, "/generate", {"prompts": ["a", chat], "max_new_tokens": 3, "logprobs": 1,
                                             "prompt_logprobs": 1}).json()
    validate(openapi, "GenerateResponse", native)
    streamed = events(post(fuzz_server, "/generate", {"prompts": "a", "max_new_tokens": 3, "stream": True}))
    for e in streamed[:-1]:
        validate(openapi, "GenerateTextEvent", e)
    validate(openapi, "GenerateFinalEvent", streamed[-1])
    validate(openapi, "TokenizeResponse", post(fuzz_server, "/tokenize", {"messages": chat}).json())
    validate(openapi, "DetokenizeResponse", post(fuzz_server, "/detokenize", {"tokens": [1, 2]}).json())
    validate(openapi, "ModelList", httpx.get(fuzz_server.v1 + "/models", headers=auth(KEY)).json())
    validate(openapi, "Health", httpx.get(fuzz_server.url + "/health").json())
    for r in (post(fuzz_server, "/v1/completions", {"model": "tiny", "prompt": "a", "n": 0}),
              post(fuzz_server, "/v1/completions", {"model": "nope", "prompt": "a"}),
              post(fuzz_server, "/v1/completions", {}, key="wrong")):
        validate(openapi, "ErrorResponse", r.json())
    with pytest.raises(jsonschema.ValidationError):  # the check can fail: a field the models do not declare
        validate(openapi, "CompletionResponse", {**post(fuzz_server, "/v1/completions", {
            "model": "tiny", "prompt": "a", "max_tokens": 1}).json(), "system_fingerprint": "x"})


# -- schemathesis ---------------------------------------------------------------------------------------

def test_schemathesis_finds_no_5xx_and_every_error_names_its_field(fuzz_server, openapi):
    """Positive and negative cases for every operation; the schemathesis checks plus ours."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, ignored_auth, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)

    schema = schemathesis.openapi.from_dict(openapi)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              ignored_auth]
    statuses: collections.Counter = collections.Counter()
    failures: list[str] = []
    start = time.monotonic()

    def our_checks(label: str, case, response) -> None:
        if response.status_code >= 500:
            failures.append(f"{label}: {response.status_code} {response.text[:300]}")
            return
        if response.status_code < 400:
            return
        try:
            err = response.json()["error"]
        except Exception:
            failures.append(f"{label}: {response.status_code} not an OpenAI error body: {response.text[:300]}")
            return
        if set(err) != ERROR_KEYS or not err["message"]:
            failures.append(f"{label}: malformed error body {err}")
        if response.status_code == 400 and err["code"] not in ("invalid_json",):
            fields = set(case.body) if isinstance(case.body, dict) else set()
            body_schema = openapi["paths"][case.operation.path][case.operation.method.lower()].get("requestBody", {})
            ref = body_schema.get("content", {}).get("application/json", {}).get("schema", {}).get("$ref", "")
            fields |= set(openapi["components"]["schemas"].get(ref.rsplit("/", 1)[-1], {}).get("properties", {}))
            if err["param"] not in fields:
                failures.append(f"{label}: 400 whose param {err['param']!r} names no field: {err['message']}")

    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and op.path in ("/health", "/metrics"):
                continue  # a GET without parameters or a key: nothing to make invalid
            mode_checks = checks + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

            @given(case=op.as_strategy(generation_mode=mode), model=st.sampled_from(["tiny", "tiny", "tiny", None]))
            @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def run(case, model) -> None:
                if time.monotonic() - start > FUZZ_BUDGET_S:
                    return
                if model and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = model  # most cases name the served model, so they reach the engine
                if case.headers:
                    # negative cases may add headers that break HTTP itself (a Transfer-Encoding the
                    # parser does not know, a name that is not a token): the HTTP layer (uvicorn's
                    # h11) answers those with its own plain-text 400 before any route runs, as for
                    # vLLM's server; the API is what is fuzzed here, so they are left out
                    for name in list(case.headers):
                        if name.lower() in FRAMING_HEADERS or not HEADER_TOKEN.fullmatch(name):
                            del case.headers[name]
                response = case.call(base_url=fuzz_server.url, headers=auth(KEY), timeout=60)
                statuses[(op.label, mode.value, response.status_code)] += 1
                our_checks(f"{op.label} ({mode.value})", case, response)
                try:
                    case.validate_response(response, checks=mode_checks, headers=auth(KEY))
                except Exception as e:  # noqa: BLE001 - every check failure is reported, then the test fails
                    failures.append(f"{op.label} ({mode.value}): {str(e)[:1500]}")

            run()
    elapsed = time.monotonic() - start
    total = sum(statuses.values())
    by_status = collections.Counter()
    for (_, _, status), n in statuses.items():
        by_status[status] += n
    print(f"\nschemathesis: {total} cases in {elapsed:.0f} s over {len({k[0] for k in statuses})} operations; "
          f"statuses {dict(sorted(by_status.items()))}")
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n\n".join(failures[:5])
    assert total >= 200, statuses                            # the budget let a real number run
    assert by_status[200] >= 50 and by_status[400] >= 50    # both valid and invalid requests were sent
    assert httpx.get(fuzz_server.url + "/health").json() == {"status": "ok"}


# -- hand-made attacks ------------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "hi"}]
ATTACKS = [  # (name, path, body, status, param, code)
    ("truncated JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ("not an object", "/v1/chat/completions", b'"hello"', 400, None, "invalid_json"),
    ("invalid UTF-8", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe\xc3"}', 400, None, "invalid_json"),
    ("lone surrogate", "/tokenize", b'{"prompt": "\\ud800"}', 400, None, "invalid_json"),
    ("nesting 100k deep", "/generate", b'{"prompts": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
     "invalid_json"),
    ("NaN", "/v1/completions", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', 400, "temperature", None),
    ("Infinity", "/v1/chat/completions", b'{"model": "tiny", "messages": [], "top_p": Infinity}', 400, "top_p", None),
    ("1e999", "/v1/completions", b'{"model": "tiny", "prompt": "a", "presence_penalty": -1e999}', 400,
     "presence_penalty", None),
    ("huge max_tokens", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 10**40}, 400, "max_tokens",
     "context_length_exceeded"),
    ("huge n", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "n": 10**40}, 400, "n", None),
    ("huge seed", "/v1/completions", {"model": "tiny", "prompt": "a", "seed": 10**40}, 400, "seed", None),
    ("huge token id", "/v1/completions", {"model": "tiny", "prompt": [10**40]}, 400, "prompt", None),
    ("huge detokenize id", "/detokenize", {"tokens": [1, 10**40]}, 400, "tokens", None),
    ("huge timeout", "/v1/completions", {"model": "tiny", "prompt": "a", "request_timeout_s": 1e308,
                                         "max_tokens": 10**40}, 400, "max_tokens", "context_length_exceeded"),
    ("negative top_k", "/v1/completions", {"model": "tiny", "prompt": "a", "top_k": -5}, 400, "top_k", None),
    ("negative min_tokens", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "min_tokens": -1}, 400,
     "min_tokens", None),
    ("negative logprobs", "/generate", {"prompts": "a", "logprobs": -1}, 400, "logprobs", None),
    ("negative top_logprobs", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "logprobs": True,
                                                       "top_logprobs": -1}, 400, "top_logprobs", None),
    ("prompt an object", "/v1/completions", {"model": "tiny", "prompt": {"a": 1}}, 400, "prompt", None),
    ("messages a string", "/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages", None),
    ("stream a string", "/v1/completions", {"model": "tiny", "prompt": "a", "stream": "yes"}, 400, "stream", None),
    ("prompts a number", "/generate", {"prompts": 5}, 400, "prompts", None),
    ("tokens a string", "/detokenize", {"tokens": "abc"}, 400, "tokens", None),
    ("temperature a string", "/generate", {"prompts": "a", "temperature": "hot"}, 400, "temperature", None),
    ("5000 stop strings", "/v1/completions", {"model": "tiny", "prompt": "a", "stop": [f"s{i}" for i in range(5000)]},
     400, "stop", None),
    ("5000 stop strings, native", "/generate", {"prompts": "a", "stop": [f"s{i}" for i in range(5000)]}, 400, "stop",
     None),
    ("a 1 MB stop string", "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "stop": "x" * 2**20}, 400,
     "stop", None),
    ("a 5 MB prompt", "/v1/completions", {"model": "tiny", "prompt": "a" * 5_000_000}, 400, "prompt",
     "context_length_exceeded"),
    ("a 5 MB chat", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a" * 5_000_000}]},
     400, "messages", "context_length_exceeded"),
    ("a 5 MB native prompt", "/generate", {"prompts": ["a", "b" * 5_000_000]}, 400, "prompts",
     "context_length_exceeded"),
    ("a 5 MB tokenize", "/tokenize", {"prompt": "a" * 5_000_000}, 400, "prompt", "context_length_exceeded"),
    ("20000 messages", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}] * 20_000}, 400,
     "messages", "context_length_exceeded"),
    ("a 2M-token prompt", "/v1/completions", {"model": "tiny", "prompt": [1] * 2_000_000}, 400, "prompt",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("name, path, body, status, param, code", ATTACKS, ids=[a[0] for a in ATTACKS])
def test_malformed_and_absurd_input_is_a_quick_4xx_naming_the_field(fuzz_server, name, path, body, status, param, code):
    start = time.monotonic()
    r = post(fuzz_server, path, body)
    assert r.status_code == status, r.text[:500]
    err = assert_error_body(r)
    assert (err["param"], err["code"]) == (param, code), err
    if param is not None:
        assert param in err["message"], err
    assert time.monotonic() - start < 5.0, f"{name} took {time.monotonic() - start:.1f} s"


def test_native_caps_stay_caps_however_large(fuzz_server):
    """/generate keeps the pipeline's meaning (MII's): max_new_tokens is a cap, and the context ends
    the answer first, with finish_reason length (the OpenAI endpoints answer 400 instead)."""
    r = post(fuzz_server, "/generate", {"prompts": "a", "max_new_tokens": 10**40, "ignore_eos": True})
    assert r.status_code == 200, r.text
    got = r.json()["responses"][0]
    assert got["finish_reason"] == "length" and got["prompt_length"] + got["generated_length"] == CONTEXT


def test_the_longest_stops_allowed_are_served(fuzz_server):
    r = post(fuzz_server, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 8,
                                              "stop": [chr(65 + i) * 256 for i in range(16)]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def raw_request(srv, head: bytes, body: bytes = b"", timeout_s: float = 20.0) -> tuple[int, dict]:
    """Send ``head`` and as much of ``body`` as the server takes; read the answer (a server may
    answer and close before the body is all sent)."""
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(head + body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_answer(s)


def read_answer(s: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on ``s`` (headers and body may come in pieces)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.split(b"\r\n\r\n", 1)[1])


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def _head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def test_a_10_mb_body_is_a_413_before_it_is_read(fuzz_server):
    body = json.dumps({"model": "tiny", "prompt": "a" * 10_000_000}).encode()
    start = time.monotonic()
    status, answer = raw_request(fuzz_server, _head("/v1/completions", f"Content-Length: {len(body)}\r\n"), body)
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[i:i + 2**20] for i in range(0, len(body), 2**20)))
    status, answer = raw_request(fuzz_server, _head("/generate", "Transfer-Encoding: chunked\r\n"), chunked + b"0\r\n\r\n")
    assert status == 413 and answer["error"]["code"] == "request_too_large", answer   # counted, not declared
    assert time.monotonic() - start < 10.0


def test_the_server_keeps_serving_through_slowloris_and_huge_prompts(fuzz_server):
    """150 clients stall mid-body and 50 mid-headers while two clients send 5 MB prompts in a loop:
    another client's requests still finish quickly; the body stallers get a 408 after the body
    timeout; the header stallers hold only their own connections (uvicorn has no header timeout)."""
    port = int(fuzz_server.url.rsplit(":", 1)[1])
    body_stallers, header_stallers = [], []
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = _head("/v1/completions", "Content-Length: 1000\r\n")
        if i < 150:
            s.sendall(head + b'{"model": "tiny", "prompt": "a')
            body_stallers.append(s)
        else:
            s.sendall(head[:40])
            header_stallers.append(s)
    stalled_at = time.monotonic()
    stop = threading.Event()
    num_refused = collections.Counter()

    def flood() -> None:
        huge = json.dumps({"model": "tiny", "prompt": "hello world " * 400_000, "max_tokens": 4})
        while not stop.is_set():
            num_refused[post(fuzz_server, "/v1/completions", huge).status_code] += 1

    floods = [threading.Thread(target=flood, daemon=True) for _ in range(2)]
    for t in floods:
        t.start()
    latencies = []
    try:
        for i in range(20):
            start = time.monotonic()
            r = post(fuzz_server, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 4,
                                                           "stream": i % 2 == 1}, timeout=30)
            assert r.status_code == 200, r.text
            latencies.append(time.monotonic() - start)
    finally:
        stop.set()
        for t in floods:
            t.join(30)
    print(f"\nduring the attack: {len(latencies)} requests, slowest {max(latencies):.3f} s; floods refused {dict(num_refused)}")
    assert max(latencies) < 5.0, latencies
    assert num_refused[400] >= 4 and set(num_refused) == {400}, num_refused
    answers = collections.Counter()
    for s in body_stallers:
        s.settimeout(max(1.0, stalled_at + BODY_TIMEOUT_S + 15 - time.monotonic()))
        status, body = read_answer(s)
        answers[(status, body["error"]["code"])] += 1
        s.close()
    assert answers == {(408, "request_timeout"): len(body_stallers)}, answers
    for s in header_stallers:
        s.close()
    r = post(fuzz_server, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2})
    assert r.status_code == 200 and httpx.get(fuzz_server.url + "/health").json() == {"status": "ok"}
