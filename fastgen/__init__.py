"""fastgen: high-throughput LLM serving with Dynamic SplitFuse (DeepSpeed-FastGen)."""
from .client import client
from .errors import FastgenError, InvalidRequestError, ModelLoadError, PromptTooLongError
from .pipeline import Pipeline, pipeline
from .request import FinishReason, Response, SamplingParams
from .server.launch import serve

__all__ = ["FastgenError", "FinishReason", "InvalidRequestError", "ModelLoadError", "Pipeline",
           "PromptTooLongError", "Response", "SamplingParams", "client", "pipeline", "serve"]
__version__ = "0.1.0"
