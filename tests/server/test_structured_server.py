"""Structured outputs and tool calling through a real `fastgen serve` (SmolLM2, float32) and the
official `openai` client: response_format, vLLM's structured_outputs, tools with every tool_choice,
streamed tool calls, and 400s naming the field for constraints that cannot be honoured."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from .conftest import serving

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_ARGS}}
TIME_ARGS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"]}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the local time in a timezone",
                                         "parameters": TIME_ARGS}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server():
    yield from serving("--dtype", "float32", "--num-blocks", "128")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=180)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_named_and_required_tool_calls_parse_into_tool_calls(client, model):
    schemas = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                           max_tokens=64, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls, c
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if choice is named:
            assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]


def test_a_streamed_tool_call_assembles_like_openai_streams_it(client, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        calls: dict[int, dict] = {}
        reasons = []
        for chunk in client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                                    max_tokens=64, temperature=0, stream=True):
            c = chunk.choices[0]
            if c.finish_reason:
                reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or (d.function.name if d.function else None)
                call["arguments"] += (d.function.arguments or "") if d.function else ""
        assert reasons == ["tool_calls"] and calls
        for call in calls.values():
            assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
            jsonschema.validate(json.loads(call["arguments"]), WEATHER_ARGS if call["name"] == "get_weather" else TIME_ARGS)


def test_auto_and_none_show_the_tools_or_not(client, model):
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0)
    none = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=24, temperature=0)
    auto = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=24, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the template got the tools
    c = auto.choices[0]  # the 135M model answers in words here; what it says is content
    assert c.finish_reason in ("stop", "length") and c.message.content and not c.message.tool_calls


def test_response_format_json_schema_and_json_object(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person."}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": 'Reply with a JSON object with the key "answer" whose '
                                                            "value is the capital of France."}],
        max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=model, prompt="A person, as JSON:", max_tokens=64, n=2, seed=3,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": PERSON}}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), PERSON)


def test_structured_outputs_like_vllm(client, model):
    r = client.completions.create(model=model, prompt="Is the sky blue? Answer:", max_tokens=8, n=3, seed=1,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in r.choices)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me a date."}],
                                       max_tokens=16, extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].message.content)
    r = client.completions.create(model=model, prompt="A person, as JSON:", max_tokens=64, temperature=0,
                                  extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    stream = client.completions.create(model=model, prompt="Count:", max_tokens=16, stream=True,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= [1-9] (", " [1-9]){2}'}})
    assert re.fullmatch(r"[1-9](, [1-9]){2}", "".join(c.choices[0].text for c in stream))


M = "SmolLM2-135M-Instruct.Q4_1"
CHAT = [{"role": "user", "content": "hi"}]
BAD = [
    ({"model": M, "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {}}}}}}}, "response_format", "'not'"),
    ({"model": M, "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "minProperties": 3}}}}, "response_format", "cannot be compiled"),
    ({"model": M, "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"model": M, "messages": CHAT, "response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"model": M, "prompt": "a", "structured_outputs": {"regex": "(ab"}}, "structured_outputs", "cannot be compiled"),
    ({"model": M, "prompt": "a", "structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "compiled"),
    ({"model": M, "prompt": "a", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
    ({"model": M, "prompt": "a", "structured_outputs": {"json": {"type": "string", "format": "zip"}}},
     "structured_outputs", "zip"),
    ({"model": M, "prompt": "a", "structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern"),
    ({"model": M, "prompt": "a", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
    ({"model": M, "prompt": "a", "ignore_eos": True, "structured_outputs": {"regex": "a"}}, "ignore_eos", "ignore_eos"),
    ({"model": M, "messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "no tool named"),
    ({"model": M, "messages": CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"model": M, "messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array", "uniqueItems": True}}}]}, "tools", "uniqueItems"),
    ({"model": M, "messages": CHAT, "tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"model": M, "messages": CHAT, "tools": [WEATHER], "stream": True, "logprobs": True}, "logprobs", "logprobs"),
]


@pytest.mark.parametrize("body, param, words", BAD, ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(BAD)])
def test_constraints_that_cannot_be_honoured_are_400s_naming_the_field(server, body, param, words):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_native_generate_takes_constraints(server):
    r = httpx.post(server.url + "/generate", json={"prompts": ["a", "b"], "max_new_tokens": 8, "choice": ["x", "y"]},
                   timeout=60)
    assert r.status_code == 200 and all(x["generated_text"] in ("x", "y") for x in r.json()["responses"])
    r = httpx.post(server.url + "/generate", json={"prompts": "a", "regex": "(x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex"
