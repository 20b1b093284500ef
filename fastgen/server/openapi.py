"""The published description of the HTTP API: ``GET /openapi.json`` and ``GET /docs``.

Handlers parse their own bodies (``parse_body`` in app.py), so that a bad field is a 400 naming
it (errors.py) rather than FastAPI's 422. The schema therefore does not come from handler
signatures: each route takes its ``route_doc(path)``, which declares the request body (the very
pydantic model ``parse_body`` validates with), the responses and the error body, by reference
into one set of components built here. The response models below describe what
:class:`~fastgen.server.protocol.ResponseBuilder` and the small handlers write; they document,
they do not serialize (``tests/reliability/test_fuzz.py`` validates real answers against them).

``/docs`` is Swagger UI from files of the ``fastapi-offline`` package, served by this server:
the page needs no internet. The schema and the page hold no data and are open like ``/health``
(as vLLM's are), even with ``--api-key``; the schema then declares the bearer key, and the page's
"Authorize" button sends it.
"""
from __future__ import annotations

from importlib import resources
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, HTMLResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from pydantic.json_schema import models_json_schema

from ..request import FinishReason, Response, SamplingParams
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest,
                       TokenizeRequest)

OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon.png": "image/png"}
DOCS_PATHS = frozenset({OPENAPI_PATH, DOCS_PATH, *(f"{DOCS_PATH}/{name}" for name in _ASSETS)})


# -- response bodies --------------------------------------------------------------------------------

class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Out):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, when one is")
    code: str | None = Field(description="e.g. invalid_json, model_not_found, context_length_exceeded, queue_full")


class ErrorResponse(_Out):
    """Every error of every endpoint (and of a stream, as its last event before ``[DONE]``)."""

    error: ErrorDetail


class PromptTokensDetails(_Out):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


Reason = Literal[tuple(r.value for r in FinishReason)]
ChatReason = Literal[(*(r.value for r in FinishReason), "tool_calls")]


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Reason


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamChoice(CompletionChoice):
    finish_reason: Reason | None = Field(description="set on a choice's last chunk")


class CompletionChunk(_Out):
    """One ``data:`` event of a ``stream: true`` completion. With ``stream_options.include_usage``
    every chunk has ``usage: null`` and a last chunk with no choices carries the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprobEntry]


class CalledFunctionOut(_Out):
    name: str
    arguments: str = Field(description="JSON text")


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: CalledFunctionOut


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatReason


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CalledFunctionDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    """A call's first delta has its ``id``, ``type`` and name; later ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: CalledFunctionDelta


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatReason | None


class ChatCompletionChunk(_Out):
    """One ``data:`` event of a ``stream: true`` chat completion (usage as in CompletionChunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class GenerateResponse(_Out):
    """fastgen's :class:`~fastgen.Response` per prompt, as the Python client rebuilds them."""

    responses: list[Response]


class GenerateTextEvent(_Out):
    text: str


class GenerateFinalEvent(_Out):
    response: Response


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Out):
    prompt: str


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="absent while the engine loads")


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: str = Field(description="ok; else loading, failed or stopped (503)")
    error: str | None = None
    upstreams_up: int | None = Field(None, description="the balancer's: replicas answering")
    upstreams: int | None = None


REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, GenerateRequest,
                                               TokenizeRequest, DetokenizeRequest)
RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    ErrorResponse, CompletionResponse, CompletionChunk, ChatCompletionResponse, ChatCompletionChunk,
    GenerateResponse, GenerateTextEvent, GenerateFinalEvent, TokenizeResponse, DetokenizeResponse, ModelList, Health)


def components() -> dict[str, Any]:
    """Every request and response schema, by model name, with refs into ``#/components/schemas``."""
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS]
                                 + [(m, "serialization") for m in RESPONSE_MODELS],
                                 ref_template="#/components/schemas/{model}")
    schemas = defs["$defs"]
    names = [m.__name__ for m in REQUEST_MODELS + RESPONSE_MODELS]
    assert len(set(names)) == len(names) and all(n in schemas for n in names), "component names must be unique"
    schemas[GenerateRequest.__name__] = _generate_request_schema(schemas[GenerateRequest.__name__])
    return schemas


def _generate_request_schema(base: dict[str, Any]) -> dict[str, Any]:
    """GenerateRequest takes SamplingParams' fields as extra keys; list them, and nothing else."""
    kwargs = TypeAdapter(SamplingParams).json_schema(ref_template="#/components/schemas/{model}")["properties"]
    kwargs["stop"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
                      "default": [], "description": "stop strings"}
    out = dict(base, properties={**base["properties"], **kwargs}, additionalProperties=False)
    out["description"] = (base.get("description", "") + "\n\nThe other keys are fastgen.SamplingParams' fields "
                          "(MII's generate kwargs); an unknown key is a 400 naming it.")
    return out


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _errors(*statuses: int) -> dict[int, dict[str, Any]]:
    words = {400: "a bad request: `param` names the field", 401: "missing or wrong API key (with --api-key)",
             404: "`model` names a model this server does not serve",
             408: "the body did not all arrive within --body-timeout-s", 413: "the body is over 8 MiB",
             429: "the queue is full; retry after `Retry-After`", 500: "the engine failed this request",
             503: "the engine is loading, failed or stopped"}
    return {s: _json(ErrorResponse.__name__, words[s]) for s in statuses}


def _events(*names: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 reads an event stream's schema as each event's): its
    ``data`` is ``[DONE]`` or JSON text, one of ``names`` or an ErrorResponse."""
    payload = {"anyOf": [_ref(n) for n in (*names, ErrorResponse.__name__)]}
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "data": {"anyOf": [
            {"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}


def _generation(summary: str, request: str, response: str, events: tuple[str, ...],
                streamed: str) -> dict[str, Any]:
    ok = _json(response, f"the whole answer (`stream` false); `stream: true`: {streamed}; a choice the engine "
                         "failed, or the server cut, gets an ErrorResponse event; the stream always ends with `[DONE]`")
    ok["content"]["text/event-stream"] = {"schema": _events(*events)}
    return {"summary": summary,
            "openapi_extra": _body(request), "responses": {200: ok, **_errors(400, 401, 404, 408, 413, 429, 500, 503)}}


def _body(request: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}}}


ROUTES: dict[str, dict[str, Any]] = {
    "/v1/completions": _generation("OpenAI completions", CompletionRequest.__name__, CompletionResponse.__name__,
                                   (CompletionChunk.__name__,), "server-sent events of CompletionChunk"),
    "/v1/chat/completions": _generation("OpenAI chat completions", ChatCompletionRequest.__name__,
                                        ChatCompletionResponse.__name__, (ChatCompletionChunk.__name__,),
                                        "server-sent events of ChatCompletionChunk"),
    "/generate": _generation("fastgen's native generate (the Python client's)", GenerateRequest.__name__,
                             GenerateResponse.__name__, (GenerateTextEvent.__name__, GenerateFinalEvent.__name__),
                             "(one prompt) a GenerateTextEvent per piece of text, then a GenerateFinalEvent"),
    "/tokenize": {"summary": "prompt or chat messages to token ids", "openapi_extra": _body(TokenizeRequest.__name__),
                  "responses": {200: _json(TokenizeResponse.__name__, "the token ids"),
                                **_errors(400, 401, 404, 408, 413, 503)}},
    "/detokenize": {"summary": "token ids to text", "openapi_extra": _body(DetokenizeRequest.__name__),
                    "responses": {200: _json(DetokenizeResponse.__name__, "the text"),
                                  **_errors(400, 401, 404, 408, 413, 503)}},
    "/v1/models": {"summary": "the served model",
                   "responses": {200: _json(ModelList.__name__, "one model card"), **_errors(401)}},
    "/health": {"summary": "200 once the engine serves (open, for load balancers)",
                "responses": {200: _json(Health.__name__, "serving"), 503: _json(Health.__name__, "not serving")}},
    "/metrics": {"summary": "Prometheus metrics (open)",
                 "responses": {200: {"description": "Prometheus text format",
                                     "content": {"text/plain": {"schema": {"type": "string"}}}}}},
}


OPERATION_IDS = {"/v1/completions": "create_completion", "/v1/chat/completions": "create_chat_completion",
                 "/generate": "generate", "/tokenize": "tokenize", "/detokenize": "detokenize",
                 "/v1/models": "list_models", "/health": "health", "/metrics": "metrics"}
DESCRIPTIONS = {  # docs/server.md tells the rest
    "/v1/completions": "OpenAI's legacy completions: `max_tokens` defaults to 16; fastgen's extensions are listed "
                       "in the request model (top_k, min_p, min_tokens, ignore_eos, request_timeout_s, ...).",
    "/v1/chat/completions": "OpenAI's chat completions, with tools and structured outputs; `max_tokens` defaults "
                            "to the room the context leaves after the prompt.",
    "/generate": "The pipeline's prompts (text, token ids or a chat; one or a list) and generate kwargs, with "
                 "their meanings and defaults (MII's): `max_new_tokens` is a cap, ended by the context.",
}


def route_doc(path: str) -> dict[str, Any]:
    """FastAPI route keywords that publish ``path``'s body and answers (``response_model=None``:
    handlers return their JSON themselves), under a stable operation id (code generators name
    their methods after it; the balancer's routes get the replicas')."""
    return {"response_model": None, "operation_id": OPERATION_IDS[path],
            "description": DESCRIPTIONS.get(path, ROUTES[path]["summary"]), **ROUTES[path]}


def install_docs(app: FastAPI, open_paths: frozenset[str], keyed: bool) -> None:
    """Serve ``/openapi.json`` (with ``components()``, and the bearer key on every keyed route
    when ``keyed``) and the offline Swagger UI at ``/docs``."""
    assets = resources.files("fastapi_offline").joinpath("static")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description="fastgen's HTTP API: OpenAI completions and chat, the native /generate, "
                                             "tokenize, models, health and metrics. Errors: ErrorResponse.")
            parts = schema.setdefault("components", {})
            parts.setdefault("schemas", {}).update(components())
            if keyed:
                parts["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer",
                                                       "description": "one of the server's --api-key keys"}}
                for path, item in schema["paths"].items():
                    if path not in open_paths:
                        for op in item.values():
                            op["security"] = [{"apiKey": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.get(OPENAPI_PATH, include_in_schema=False)
    async def openapi_json() -> dict[str, Any]:
        return openapi()

    @app.get(DOCS_PATH, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=OPENAPI_PATH, title=f"{app.title} API",
                                   swagger_js_url=f"{DOCS_PATH}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_PATH}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_PATH}/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})  # no call to a validator service

    def asset(name: str, media_type: str):
        async def serve() -> FileResponse:
            return FileResponse(str(assets.joinpath(name)), media_type=media_type)
        return serve

    for name, media_type in _ASSETS.items():
        app.add_api_route(f"{DOCS_PATH}/{name}", asset(name, media_type), methods=["GET"], include_in_schema=False)
