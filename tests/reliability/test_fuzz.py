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
import socket
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
    from hypothesis.errors import Unsatisfiable
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
            mode_checks = checks + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])

            @given(case=op.as_strategy(generation_mode=mode), model=st.sampled_from(["tiny", "tiny", "tiny", None]))
            @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def run(case, model) -> None:
                if time.monotonic() - start > FUZZ_BUDGET_S:
                    return
                if model and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = model  # most cases name the served model, so they reach the engine
                response = case.call(base_url=fuzz_server.url, headers=auth(KEY), timeout=60)
                statuses[(op.label, mode.value, response.status_code)] += 1
                our_checks(f"{op.label} ({mode.value})", case, response)
                try:
                    case.validate_response(response, checks=mode_checks, headers=auth(KEY))
                except Exception as e:  # noqa: BLE001 - every check failure is reported, then the test fails
                    failures.append(f"{op.label} ({mode.value}): {str(e)[:1500]}")

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid in a GET without parameters or a key
                assert mode is GenerationMode.NEGATIVE and op.path in ("/health", "/metrics"), op.label
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
