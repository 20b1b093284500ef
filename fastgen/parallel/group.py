"""The ranks of one tensor-parallel replica and what they say to each other.

Two process groups over ``torch.distributed``:

- *control* (gloo, no practical timeout): rank 0 broadcasts each step's work to the others,
  which wait for it between steps however long the server is idle;
- *compute* (gloo on CPU, nccl on CUDA; ``FASTGEN_TP_TIMEOUT_S``, default 300 s): the
  all-reduces and the logits gather inside the forward pass.

A rank that dies closes its sockets; the others' next collective then fails at once
(gloo: "Connection closed by peer"), which :class:`RankFailedError` turns into one message
naming the replica's end. A rank that hangs is caught by the compute timeout.

Ranks are started by fastgen (:func:`start`: rank 0 runs ``python -m fastgen.parallel.worker``
for each other rank, on 127.0.0.1) or by ``torchrun`` (each rank runs ``fastgen serve``;
:func:`from_env` joins through the ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` variables).
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref

import torch
import torch.distributed as dist

from ..batch import RaggedBatch
from ..errors import RankFailedError
from .shm import ShmComm
from .shm import supported as shm_supported

log = logging.getLogger(__name__)

OP_STOP, OP_FORWARD, OP_MEMORY, OP_FORWARD_GLOO = 0, 1, 2, 3
HEADER = 6             # op, payload length, pool key, pool blocks, pool block size, pools released


def _timeout_s() -> float:
    return float(os.environ.get("FASTGEN_TP_TIMEOUT_S", "300"))


def torchrun_env() -> bool:
    """True when this process was started by torchrun (or any launcher that sets the env)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


class TPGroup:
    """This process's view of the replica: its rank, the two groups, and, on rank 0, the
    worker processes it started."""

    def __init__(self, rank: int, size: int, device: torch.device,
                 workers: list[subprocess.Popen] | None = None, shm: str | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.workers = workers or []
        # ranks on this machine (fastgen started them): collectives through shared memory (shm.py)
        self.shm = ShmComm(shm, rank, size, _timeout_s(), create=False) if shm and device.type == "cpu" else None
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
        self.compute = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo",
                                      timeout=datetime.timedelta(seconds=_timeout_s()))
        self._pool_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_key = 1
        self._released = []
        self.closed = False
        if self.workers:
            threading.Thread(target=self._watch, name="fastgen-tp-watch", daemon=True).start()

    # -- failures ----------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Rank 0: name a worker that exits (the collective that notices fails on its own)."""
        import time

        while not self.closed:
            for r, p in enumerate(self.workers, start=1):
                if p.poll() is not None and not self.closed:
                    log.error("tensor-parallel rank %d (pid %d) exited with code %s; this replica ends",
                              r, p.pid, p.returncode)
                    self.dead = (r, p.returncode)
                    return
            time.sleep(0.2)

    dead: tuple[int, int] | None = None

    def failed(self, e: BaseException) -> RankFailedError:
        import time

        deadline = time.monotonic() + 2.0   # a dead rank's exit code arrives just after its sockets close
        while self.dead is None and self.workers and time.monotonic() < deadline:
            self.dead = next(((r, p.returncode) for r, p in enumerate(self.workers, start=1)
                              if p.poll() is not None), None)
            time.sleep(0.05)
        who = (f"rank {self.dead[0]} exited with code {self.dead[1]}" if self.dead is not None
               else "a rank stopped answering")
        return RankFailedError(f"tensor parallelism failed ({who}): {e}; the replica must be restarted")

    # -- collectives inside the forward ------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(x):
            try:
                return self.shm.all_reduce(x)
            except RuntimeError as e:
                raise self.failed(e) from e
        try:
            dist.all_reduce(x, group=self.compute)
        except RuntimeError as e:
            raise self.failed(e) from e
        return x

    def gather_vocab(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rank 0: ``[rows, sum(sizes)]`` from each rank's ``[rows, sizes[rank]]``; the other ranks
        get their own part back (they discard it)."""
        width = max(sizes)
        if x.shape[1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            try:
                parts = self.shm.gather(x)
            except RuntimeError as e:
                raise self.failed(e) from e
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
            try:
                dist.gather(x, parts, dst=0, group=self.compute)
            except RuntimeError as e:
                raise self.failed(e) from e
        if self.rank != 0:
            return x
        return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)

    # -- rank 0 -> the others: objects once, batches every step -----------------------------------

    def broadcast_object(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_status(self, error: str | None) -> list[str | None]:
        """Every rank's load result (None = ok), on every rank."""
        out: list = [None] * self.size
        dist.all_gather_object(out, error, group=self.control)
        return out

    def _pool_key(self, pool) -> int:
        key = self._pool_keys.get(pool)
        if key is None:
            key = self._pool_keys[pool] = self._next_key
            self._next_key += 1
            weakref.finalize(pool, self._released.append, key)   # the other ranks free theirs
        return key

    _released: list[int]

    def send_batch(self, batch: RaggedBatch, pool) -> None:
        """Rank 0, before its own forward: the batch and which of its KV pools it runs on."""
        key = self._pool_key(pool)
        released, self._released[:] = list(self._released), []
        payload = torch.cat([encode_batch(batch), torch.tensor(released, dtype=torch.long)])
        header = torch.tensor([OP_FORWARD, payload.numel(), key, pool.num_blocks, pool.block_size,
                               len(released)], dtype=torch.long)
        if self.shm is not None:
            if self.shm.send(torch.cat([header, payload])):
                return
            header[0] = OP_FORWARD_GLOO   # too large for the shared control buffer: say so, send by gloo
            self.shm.send(header)
        try:
            dist.broadcast(header, 0, group=self.control)
            dist.broadcast(payload, 0, group=self.control)
        except RuntimeError as e:
            raise self.failed(e) from e

    def receive(self) -> tuple[int, RaggedBatch | None, tuple[int, int, int], list[int]]:
        """The other ranks: ``(op, batch, (pool key, blocks, block size), pools released)`` of
        rank 0's next step."""
        if self.shm is not None:
            msg = self.shm.receive()
            header, payload = msg[:HEADER], msg[HEADER:]
        else:
            header = torch.empty(HEADER, dtype=torch.long)
            dist.broadcast(header, 0, group=self.control)
        op, n, key, blocks, block_size, num_released = header.tolist()
        if op in (OP_STOP, OP_MEMORY):
            return op, None, (0, 0, 0), []
        if self.shm is None or op == OP_FORWARD_GLOO:
            payload = torch.empty(n, dtype=torch.long)
            dist.broadcast(payload, 0, group=self.control)
            op = OP_FORWARD
        released = payload[n - num_released:].tolist()
        return op, decode_batch(payload[:n - num_released], self.device), (key, blocks, block_size), released

    def ask_memory(self, mine: dict) -> list[dict]:
        """Rank 0: every rank's memory figures (rank 0's are ``mine``)."""
        try:
            self._say(torch.tensor([OP_MEMORY, 0, 0, 0, 0, 0], dtype=torch.long))
            out: list = [None] * self.size
            dist.all_gather_object(out, mine, group=self.control)
        except RuntimeError as e:
            raise self.failed(e) from e
        return out

    def answer_memory(self, mine: dict) -> None:
        dist.all_gather_object([None] * self.size, mine, group=self.control)

    def _say(self, header: torch.Tensor) -> None:
        """Rank 0: a header-only message (stop, memory)."""
        if self.shm is not None:
            self.shm.send(header)
        else:
            dist.broadcast(header, 0, group=self.control)

    def stop(self) -> None:
        """Rank 0: tell the others to exit, and wait for the processes it started."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.dead is None:
                self._say(torch.zeros(HEADER, dtype=torch.long))
        except RuntimeError:
            pass
        for p in self.workers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        try:
            dist.destroy_process_group()
        except Exception:  # already gone with a dead peer
            pass
        if self.shm is not None:
            self.shm.unlink()


# -- the batch on the wire: one int64 tensor ---------------------------------------------------------

def encode_batch(b: RaggedBatch) -> torch.Tensor:
    s = b.num_seqs
    head = [b.num_tokens, int(b.logits_indices.shape[0]), s, b.num_decodes, b.block_size]
    host = [*b.q_starts, *b.start_pos, *b.order, *(len(t) for t in b.block_tables),
            *(blk for t in b.block_tables for blk in t)]
    return torch.cat([torch.tensor(head, dtype=torch.long), b.token_ids.cpu(), b.positions.cpu(), b.slots.cpu(),
                      b.logits_indices.cpu(), torch.tensor(host, dtype=torch.long)])


def decode_batch(flat: torch.Tensor, device: torch.device) -> RaggedBatch:
    t, num_logits, s, num_decodes, block_size = flat[:5].tolist()
    dev = flat[5:5 + 3 * t + num_logits].to(device)
    host = flat[5 + 3 * t + num_logits:].tolist()
    q_starts, start_pos, order = host[:s + 1], host[s + 1:2 * s + 1], host[2 * s + 1:3 * s + 1]
    lens, blocks = host[3 * s + 1:4 * s + 1], host[4 * s + 1:]
    tables, i = [], 0
    for n in lens:
        tables.append(tuple(blocks[i:i + n]))
        i += n
    return RaggedBatch(token_ids=dev[:t], positions=dev[t:2 * t], slots=dev[2 * t:3 * t],
                       logits_indices=dev[3 * t:], order=tuple(order), q_starts=tuple(q_starts),
                       start_pos=tuple(start_pos), block_tables=tuple(tables), num_decodes=num_decodes,
                       block_size=block_size)


# -- starting and joining ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, size: int, device: torch.device, init_method: str | None = None) -> None:
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=_timeout_s()))


def start(size: int, device: torch.device) -> TPGroup:
    """Rank 0 of a replica on this machine: start ranks 1..size-1 and join them."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process; one tensor-parallel "
                           "replica per process")
    port = _free_port()
    shm = None
    if device.type == "cpu" and shm_supported() and os.environ.get("FASTGEN_TP_SHM", "1") != "0":
        shm = f"fastgen-tp-{os.getpid()}-{port}"
        ShmComm(shm, 0, size, _timeout_s(), create=True)   # the file; each rank maps it
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size),
               LOCAL_WORLD_SIZE=str(size), TQDM_DISABLE="1", FASTGEN_TP_DEVICE=device.type,
               FASTGEN_TP_SHM_NAME=shm or "")
    workers = []
    for r in range(1, size):
        workers.append(subprocess.Popen([sys.executable, "-m", "fastgen.parallel.worker"],
                                        env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
    try:
        _init(0, size, device, f"tcp://127.0.0.1:{port}")
    except Exception:
        for p in workers:
            p.kill()
        if shm:
            os.unlink(f"/dev/shm/{shm}")
        raise
    group = TPGroup(0, size, device, workers, shm)
    atexit.register(group.stop)   # the other ranks exit with this process, whatever ends it
    return group


def from_env(device: torch.device) -> TPGroup:
    """Join the replica whose ranks a launcher (torchrun) started, from its variables."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    _init(rank, size, device)
    return TPGroup(rank, size, device, shm=os.environ.get("FASTGEN_TP_SHM_NAME") or None)


def threads_per_rank(num_threads: int, ranks_here: int) -> int:
    """Cores of one rank: the cores this process may use split among the ranks on this host."""
    return max(1, num_threads // max(1, ranks_here))
