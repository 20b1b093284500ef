"""One tensor-parallel replica: rank 0 inside the engine, the other ranks in their own loop.

Rank 0 is the ordinary engine: it schedules, builds each step's ragged batch, samples, and
owns every request. Its model is :class:`TensorParallelModel`, which hands the batch to the
other ranks before running its own shard; the other ranks (:func:`serve_rank`) run the same
forward on theirs, meeting rank 0 in the same collectives, and never decide anything, so
they cannot diverge from it. Each rank holds its shard of the weights and a KV pool of its
own KV heads, with the same blocks as rank 0's (the block tables travel with the batch).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import nn

from ..batch import RaggedBatch
from ..cache import KVPool
from ..config import EngineConfig
from ..errors import ModelLoadError, RankFailedError
from ..model.layers import weight_bytes
from . import group as groups
from .group import OP_MEMORY, OP_STOP, TPGroup
from .shard import Shard, shard_plan

log = logging.getLogger(__name__)


class TensorParallelModel(nn.Module):
    """Rank 0's model: ``forward(batch, pool)`` sends the batch, then runs rank 0's shard (whose
    head gathers the full logits). Other attributes are the shard model's."""

    def __init__(self, local: nn.Module, group: TPGroup, shards: list[Shard]) -> None:
        super().__init__()
        self.local = local
        self.group = group
        self.shards = shards

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["local"], name)

    def forward(self, batch: RaggedBatch, pool: KVPool) -> torch.Tensor:
        if self.group.closed:
            raise RankFailedError("this tensor-parallel replica was closed")
        self.group.send_batch(batch, pool)
        try:
            return self.local(batch, pool)
        except RankFailedError:
            raise
        except Exception as e:  # the other ranks wait in a collective rank 0 will not reach
            raise RankFailedError(f"rank 0's forward failed mid-step, leaving the ranks out of step: {e}") from e

    # the head's shards gather their logits after the product, so the engine takes the argmax of
    # them; set here so that the shard model's own ``fuses_greedy`` / ``forward_greedy`` are never
    # reached past the batch sent to the other ranks
    fuses_greedy = False

    def forward_greedy(self, batch: RaggedBatch, pool: KVPool) -> tuple[torch.Tensor, None]:
        """:meth:`forward`, and no greedy choice from the head (see ``fuses_greedy``)."""
        return self.forward(batch, pool), None

    def close(self) -> None:
        self.group.stop()

    def rank_memory(self, pools: list[KVPool]) -> list[dict]:
        """Per rank: ``weight_bytes`` (what its model holds) and ``kv_bytes`` (its KV pools; rank 0's
        are ``pools``)."""
        return self.group.ask_memory({"weight_bytes": weight_bytes(self.local),
                                      "kv_bytes": sum(p.num_bytes for p in pools)})


def _load(path: str, config: EngineConfig, group: TPGroup, hf_config=None) -> tuple[nn.Module, list[Shard]]:
    from ..model.loader import load_hf_config, load_model
    from ..model.spec import ModelConfig

    hf_config = hf_config or load_hf_config(path)
    shards = shard_plan(ModelConfig.from_hf(hf_config), group.size)
    net = load_model(path, dtype=config.dtype, device=group.device, max_positions=config.max_model_len,
                     hf_config=hf_config, kernels=config.kernels, quantization=config.quantization,
                     int8_activations=config.int8_activations, parallel=(group, shards))
    return net, shards


def start_replica(path: str, config: EngineConfig, hf_config) -> tuple[TensorParallelModel, EngineConfig]:
    """Rank 0: start (or, under torchrun, join) the other ranks, load every shard, and return
    rank 0's model with the config every rank runs (threads are per rank)."""
    from ..model.spec import ModelConfig

    size = config.tensor_parallel_size
    shard_plan(ModelConfig.from_hf(hf_config), size)  # reject a config that cannot be split before any process
    if groups.torchrun_env():
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ModelLoadError(f"tensor_parallel_size={size} but the launcher started WORLD_SIZE={world} ranks")
        group = groups.from_env(config.device)
        here = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    else:
        group = groups.start(size, config.device)
        here = size
    try:
        config = dataclasses.replace(config, device=group.device,
                                     num_threads=groups.threads_per_rank(config.num_threads, here))
        torch.set_num_threads(config.num_threads)
        group.broadcast_object((path, config))
        error = None
        try:
            net, shards = _load(path, config, group, hf_config)
        except Exception as e:
            error, net = f"{type(e).__name__}: {e}", None
        statuses = group.gather_status(error)
        if group.shm is not None:
            group.shm.unlink()   # every rank has it mapped: nothing is left in /dev/shm, however we end
        failed = [(r, s) for r, s in enumerate(statuses) if s]
        if failed:
            raise ModelLoadError("tensor-parallel load failed: " + "; ".join(f"rank {r}: {s}" for r, s in failed))
    except BaseException:
        group.stop()
        raise
    return TensorParallelModel(net, group, shards), config


def serve_rank(device: torch.device) -> int:
    """Ranks 1..N-1: join, load this rank's shard, and run rank 0's steps until it stops.
    Returns the exit code (0: rank 0 said stop; 1: it went away or a step failed here).

    SIGINT and SIGTERM are ignored: rank 0 decides when the replica ends (it may drain its
    requests first, which needs every rank), and these ranks exit when it does."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    group = groups.from_env(device)
    path, config = group.broadcast_object()
    torch.set_num_threads(config.num_threads)
    config = dataclasses.replace(config, device=group.device)
    error = None
    try:
        if config.kernels == "native":
            from ..kernels import load

            if not load():
                raise RuntimeError("fastgen's native kernels do not build on this rank's host")
        net, _ = _load(path, config, group)
    except Exception as e:
        log.exception("rank %d: loading its shard failed", group.rank)
        error, net = f"{type(e).__name__}: {e}", None
    if any(group.gather_status(error)):
        return 1
    local = net.config
    pools: dict[int, KVPool] = {}   # rank 0's pools by key, each mirrored over this rank's KV heads
    while True:
        try:
            op, batch, (key, num_blocks, block_size), released = group.receive()
        except (RuntimeError, RankFailedError) as e:
            log.error("rank %d: rank 0 went away (%s); exiting", group.rank, e)
            return 1
        if op == OP_STOP:
            return 0
        if op == OP_MEMORY:
            group.answer_memory({"weight_bytes": weight_bytes(net),
                                 "kv_bytes": sum(p.num_bytes for p in pools.values())})
            continue
        for k in released:
            pools.pop(k, None)
        pool = pools.get(key)
        if pool is None:  # rank 0 ran on a pool this rank has not seen: its engine's, a calibration's
            pool = pools[key] = KVPool.for_model(local, num_kv_heads=local.num_kv_heads, num_blocks=num_blocks,
                                                 block_size=block_size, dtype=config.dtype, device=group.device,
                                                 kv_dtype=config.kv_cache_dtype)
        try:
            net(batch, pool)
        except Exception as e:  # exit, so rank 0's next collective fails at once instead of waiting
            log.exception("rank %d: a step failed (%s); exiting", group.rank, e)
            return 1
