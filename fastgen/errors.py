"""Typed errors raised at the edges of fastgen.

Every error a user can cause is a subclass of :class:`FastgenError`; the server maps
:class:`InvalidRequestError` to HTTP 400 with an OpenAI-style body naming ``param``.
"""
from __future__ import annotations


class FastgenError(Exception):
    """Base class of every error fastgen raises on purpose."""


class InvalidRequestError(FastgenError, ValueError):
    """A request argument is out of range, of the wrong type, or unsupported.

    ``param`` names the offending argument so that callers (and the HTTP layer) can
    point at it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens it asks to generate) does not fit the context or KV pool."""


class ModelLoadError(FastgenError):
    """A model path is missing, corrupt, or names an architecture fastgen does not support."""


class EngineDeadError(FastgenError):
    """The engine failed in a way that affects every request (e.g. the forward pass raised)."""


class RankFailedError(EngineDeadError):
    """A tensor-parallel rank died or stopped answering: the replica cannot go on and ends."""


class ServerError(FastgenError):
    """A fastgen (or OpenAI-compatible) server refused, failed, or never answered a request: the one
    error class of fastgen's HTTP clients (:class:`fastgen.client.Client`, the load generator's
    ``HTTPTarget``, :func:`fastgen.server.health.wait_healthy`). A 400/404 from the native client is
    an :class:`InvalidRequestError` instead, as the same call to the pipeline would raise.

    ``status``: the HTTP status (429: busy, retry; 503: not serving), ``None`` when no answer came.
    ``code`` and ``param``: those of the OpenAI-style error body, when it had them.
    """

    def __init__(self, message: str, status: int | None, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
