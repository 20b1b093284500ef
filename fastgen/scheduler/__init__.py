"""Scheduling policies: which requests get how many tokens in the next forward pass."""
from .base import Scheduler, StepPlan
from .splitfuse import SplitFuseScheduler

__all__ = ["Scheduler", "SplitFuseScheduler", "StepPlan", "make_scheduler"]


def make_scheduler(config, allocator, block_size: int) -> Scheduler:
    """The policy named by ``config.policy`` over ``allocator``."""
    policies = {"splitfuse": SplitFuseScheduler}
    return policies[config.policy](config, allocator, block_size)
