"""The non-persistent deployment (MII's ``pipeline``): an engine inside this process.

    pipe = fastgen.pipeline()                      # the embedded SmolLM2
    [r] = pipe(["Tell me about Paris."], max_new_tokens=32, do_sample=False)
    for delta in pipe.stream("Once upon a time", max_new_tokens=32):
        print(delta, end="")
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterator

from .engine import Engine, StepOutput
from .errors import InvalidRequestError
from .request import Response, SamplingParams

Prompt = str | list[int] | list[dict]


def apply_chat_template(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The model's chat template applied to OpenAI-style ``messages`` (and ``tools``, for templates
    that take them), ready for generation."""
    if tokenizer.chat_template is None:
        raise InvalidRequestError("this model has no chat template", param="messages")
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts",
                                  param="messages")
    extra = {} if tools is None else {"tools": tools}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)


class Pipeline:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        # Each call and each open stream collects its own requests' outputs here, so that
        # whoever runs a step never loses another consumer's deltas (interleaved streams).
        self._outbox: dict[str, deque[StepOutput]] = {}

    def _step(self) -> None:
        for out in self.engine.step():
            box = self._outbox.get(out.request_id)
            if box is not None:
                box.append(out)

    def _submit(self, prompt: Prompt, params: SamplingParams, cache_salt: str | None = None) -> str:
        rid = self.engine.add_request(self._prompt(prompt), params, cache_salt=cache_salt)
        self._outbox[rid] = deque()
        return rid

    def _forget(self, rid: str) -> Response:
        del self._outbox[rid]
        return self.engine.response(rid)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return apply_chat_template(self.tokenizer, messages)

    def _prompt(self, prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.apply_chat_template(prompt)
        return prompt

    def __call__(self, prompts: Prompt | list[Prompt], *, cache_salt: str | None = None,
                 **generate_kwargs: Any) -> list[Response]:
        """Generate for every prompt; responses come back in input order.

        A prompt is a string, a list of token ids, or a chat (a list of messages). All
        prompts are validated before any is queued, so one bad prompt queues nothing.
        ``cache_salt``: only requests with the same salt share cached prefix blocks.
        """
        params = SamplingParams.from_kwargs(generate_kwargs)
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise InvalidRequestError("prompts must be a non-empty list", param="prompts")
        ids: list[str] = []
        try:
            for p in prompts:
                ids.append(self._submit(p, params, cache_salt))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
                self._forget(rid)
            raise
        pending = set(ids)
        while pending:
            self._step()
            for rid in list(pending):
                box = self._outbox[rid]
                while box:
                    if box.popleft().finish_reason is not None:
                        pending.discard(rid)
        return [self._forget(rid) for rid in ids]

    def stream(self, prompt: Prompt, *, cache_salt: str | None = None, **generate_kwargs: Any) -> Iterator[str]:
        """Yield text deltas (whole UTF-8 characters) as they are generated.

        Other requests already queued in this pipeline's engine advance alongside.
        Closing the generator early aborts the request.
        """
        params = SamplingParams.from_kwargs(generate_kwargs)
        rid = self._submit(prompt, params, cache_salt)
        box = self._outbox[rid]
        done = False
        try:
            while not done:
                if not box:
                    self._step()
                while box and not done:
                    out = box.popleft()
                    if out.text_delta:
                        yield out.text_delta
                    done = out.finish_reason is not None
        finally:
            if not done:
                self.engine.abort(rid)
            self._forget(rid)


def pipeline(model: str | None = None, *, dtype: str = "auto", **engine_options: Any) -> Pipeline:
    """Load ``model`` (HF folder or .gguf; None = the embedded SmolLM2-135M-Instruct)."""
    return Pipeline(Engine.from_pretrained(model, dtype=dtype, **engine_options))
