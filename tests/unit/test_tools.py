"""Tool calling without a model: plans, the required-call schema, parsing, streaming, templates."""
from __future__ import annotations

import json

import jsonschema
import pytest

from fastgen.server.errors import APIError
from fastgen.server.tools import (NamedFunction, NamedToolChoice, Tool, ToolCallStream, ToolPlan,
                                  parse_call_blocks, with_tools)

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}})
TREE = Tool.model_validate({"type": "function", "function": {
    "name": "plant", "parameters": {"$defs": {"node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}}},
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"]}}})
NOARGS = Tool.model_validate({"type": "function", "function": {"name": "ping"}})


def test_plans_and_their_refusals():
    assert ToolPlan.build(None, None, None).mode == "none"
    assert ToolPlan.build([WEATHER], None, None).mode == "auto"
    named = ToolPlan.build([WEATHER, TREE], NamedToolChoice(type="function", function=NamedFunction(name="plant")), None)
    assert named.mode == "named" and named.json_schema() == TREE.function.parameters
    for tools, choice, param in [([WEATHER], NamedToolChoice(type="function", function=NamedFunction(name="x")),
                                  "tool_choice"),
                                 (None, "required", "tool_choice"), ([WEATHER, WEATHER], "auto", "tools")]:
        with pytest.raises(APIError) as e:
            ToolPlan.build(tools, choice, None)
        assert e.value.param == param
    bad = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {"not": {}}}})
    with pytest.raises(APIError, match=r"tools\[0\]\.function\.parameters.*'not'"):
        ToolPlan.build([bad], "required", None)


def test_the_required_schema_accepts_calls_of_each_tool_and_nothing_else():
    plan = ToolPlan.build([WEATHER, TREE, NOARGS], "required", None)
    schema = plan.json_schema()
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}},
             {"name": "plant", "arguments": {"root": {"kids": [{"kids": []}, {}]}}},
             {"name": "ping", "arguments": {}}]
    jsonschema.validate(calls, schema)
    for wrong in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                  [{"name": "plant", "arguments": {"root": {"kids": [1]}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = ToolPlan.build([WEATHER], "required", False).json_schema()
    assert single["maxItems"] == 1
    _, parsed = plan.parse(json.dumps(calls))
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]
    assert len({c.id for c in parsed}) == 3 and all(c.id.startswith("call_") for c in parsed)


def test_auto_parses_call_blocks_and_leaves_anything_else_as_content():
    names = {"get_weather"}
    content, calls = parse_call_blocks('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                       '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": '
                                       '"{\\"city\\": \\"Rome\\"}"}', names)
    assert content == "Sure." and [json.loads(c.arguments)["city"] for c in calls] == ["Oslo", "Rome"]
    for text in ("no calls here", '<tool_call>{"name": "other", "arguments": {}}</tool_call>',
                 "<tool_call>{not json</tool_call>", '<tool_call>{"name": "get_weather", "arguments": 3}'):
        assert parse_call_blocks(text, names) == (text, [])


def test_streams_of_each_mode():
    auto = ToolCallStream(ToolPlan.build([WEATHER], "auto", None))
    out = [auto.push(t) for t in ("Hello <", "tool", "_call>", '{"name": "get_weather", ', '"arguments": {}}')]
    assert out[0] == [{"content": "Hello "}] and out[1:] == [[], [], [], []]
    [call] = auto.finish()
    assert call["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"} and auto.called
    text = ToolCallStream(ToolPlan.build([WEATHER], "auto", None))
    assert text.push("a <b") == [{"content": "a <b"}]
    assert text.push("<t") == [] and text.push("ea") == [{"content": "<tea"}]
    assert text.push(" <tool") == [{"content": " "}] and text.finish() == [{"content": "<tool"}] and not text.called
    named = ToolCallStream(ToolPlan.build([WEATHER], NamedToolChoice(type="function",
                                                                     function=NamedFunction(name="get_weather")), None))
    head = named.push('{"ci')
    assert head[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert named.push('ty": "x"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "x"}'}}]}]
    assert named.finish() == [] and named.called


def test_templates_receive_tools(smollm2_path):
    from fastgen.model.loader import load_tokenizer
    from fastgen.pipeline import apply_chat_template

    tok = load_tokenizer(smollm2_path)
    plan = ToolPlan.build([WEATHER], "auto", None)
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    # SmolLM2-135M's template ignores tools: they go into a system message, calls into the text
    messages, tools = with_tools(history, plan, tok.chat_template)
    assert tools is None and messages[0]["role"] == "system" and '"get_weather"' in messages[0]["content"]
    text = apply_chat_template(tok, messages, tools)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tools>" in text and "12 C" in text
    # a template that reads tools gets them, and the messages as they are
    aware = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    messages, tools = with_tools(history, plan, aware)
    assert messages == history and tools[0]["function"]["name"] == "get_weather"
    # the loader caches a GGUF's tokenizer for the process: the template goes back afterwards (left
    # set, every later test's chat request in this process met it and failed)
    original = tok.chat_template
    tok.chat_template = aware
    try:
        assert apply_chat_template(tok, messages, tools).startswith("[get_weather]user:Weather in Oslo?;")
    finally:
        tok.chat_template = original
    none = ToolPlan.build([WEATHER], "none", None)
    assert with_tools(history[:1], none, aware) == (history[:1], None)
