"""Scheduling policies: which requests get how many tokens in the next forward pass."""
from .base import Scheduler, StepPlan
from .baselines import PrefillFirstScheduler, StaticScheduler
from .splitfuse import SplitFuseScheduler

POLICIES = {
    "splitfuse": SplitFuseScheduler,
    "prefill-first": PrefillFirstScheduler,
    "static": StaticScheduler,
}

__all__ = ["POLICIES", "PrefillFirstScheduler", "Scheduler", "SplitFuseScheduler", "StaticScheduler",
           "StepPlan", "make_scheduler"]


def make_scheduler(config, allocator, block_size: int, prefix_caching: bool = False) -> Scheduler:
    """The policy named by ``config.policy`` over ``allocator`` (sharing cached prefix blocks
    when ``prefix_caching``)."""
    return POLICIES[config.policy](config, allocator, block_size, prefix_caching)
