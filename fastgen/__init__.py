"""fastgen: high-throughput LLM serving with Dynamic SplitFuse (DeepSpeed-FastGen).

The names below load on first use (PEP 562), so that processes that only route HTTP (the
``--replicas`` balancer, the CLI before it starts an engine) never import torch."""
from __future__ import annotations

import importlib
import sys
import types

_NAMES = {
    "client": "client", "FastgenError": "errors", "InvalidRequestError": "errors", "ModelLoadError": "errors",
    "PromptTooLongError": "errors", "ServerError": "errors", "Pipeline": "pipeline", "pipeline": "pipeline", "FinishReason": "request",
    "Response": "request", "SamplingParams": "request", "serve": "server.launch",
}

__all__ = sorted(_NAMES)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'fastgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_NAMES])


class _Package(types.ModuleType):
    """``fastgen.pipeline`` and ``fastgen.client`` are functions named like their modules: importing
    the module ``fastgen.pipeline`` makes Python bind it on the package, which would hide the
    function. The package keeps the function (the module stays in ``sys.modules``)."""

    def __setattr__(self, name: str, value) -> None:
        if name in ("pipeline", "client") and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
