"""fastgen: high-throughput LLM serving with Dynamic SplitFuse (DeepSpeed-FastGen)."""
from .errors import FastgenError, InvalidRequestError, ModelLoadError, PromptTooLongError
from .pipeline import Pipeline, pipeline
from .request import FinishReason, Response, SamplingParams

__all__ = ["FastgenError", "FinishReason", "InvalidRequestError", "ModelLoadError", "Pipeline",
           "PromptTooLongError", "Response", "SamplingParams", "pipeline"]
__version__ = "0.1.0"
