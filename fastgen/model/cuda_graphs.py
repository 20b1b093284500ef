"""CUDA graphs for the engine's steps: decode steps replayed whole, steps with prompt work in
pieces around an eager attention call.

On a GPU the model's work in a step is a few milliseconds of kernels at most for a model of
SmolLM2's size, but the eager forward launches ~400 of them from Python, each with its host cost
(measured on an H200: a batch-1 decode step took 34.6 ms, 3 ms of it on the GPU; a 512-token
prompt step ~25 ms, most of it host work too). vLLM and SGLang capture steps as CUDA graphs; so
does this module, behind the same model code.

A graph needs fixed shapes and fixed addresses, so a step's inputs are copied into the static
buffers of a graph made for the next size up, and the rows past the step's own are padding: token 0
at position 0, writing its keys and values into the pool's spare block (``KVPool.spare_slot``,
which the allocator never hands out), so that no sequence's cache is touched by them.

**Decode-only steps** of ``n`` sequences run whole in the graph of the next batch size up
(``BATCH_SIZES``) and the next *width* up (blocks per sequence, ``widths``). Block tables
``[B, W]`` are padded with the spare block, and each row's number of keys, from which the graph
builds its attention masks, comes in the same host-to-device copy. Attention in the graph is the
SDPA backend's decode path with fixed shapes (:class:`StaticDecodeAttention`). A shape whose
gathered keys and values would exceed ``MAX_GATHER_BYTES`` is not captured.

**Any other step** (prompt chunks, mixed steps, decode batches no decode graph takes) of ``T``
tokens runs in the *pieces* of the next token bucket up (:func:`token_buckets`, up to the token
budget), as vLLM's piecewise graphs do: per layer, a graph of everything before attention (the
previous layer's output product, residual adds and norms, its MLP; this layer's QKV product and
RoPE, and its KV write) and, between two graphs, the attention backend called eagerly on the
step's real rows, whose shapes and metadata differ in every step. A model of ``L`` layers replays
``L + 1`` graphs a step; the output head runs eagerly on the rows whose logits are wanted.

Taken only where it runs what the eager forward runs: a CUDA device, the plain PyTorch ops and the
SDPA backend, every layer a plain ``DecoderLayer`` (Llama, Mistral, Qwen2/3, SmolLM; not Gemma 3's
own layers or experts, whose routing is data-dependent), no tensor-parallel shards (their products
finish across ranks), and a pool with a spare block. ``FASTGEN_CUDA_GRAPHS=0`` or the engine option
``cuda_graphs=False`` turns it off. On a CPU the same static paths run without capture, which is
how the tests check them against the eager forward.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..batch import RaggedBatch

log = logging.getLogger(__name__)

ENV = "FASTGEN_CUDA_GRAPHS"
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# a graph's gathered keys and values (B x W blocks, both) at most this large; a batch whose graph
# would gather more runs eagerly (SmolLM2 at 64 x 8,192 keys: 403 MB; a Llama 3 8B, 8 KV heads of
# 128, gathers 2.1 GB for 64 x 8,192 keys)
MAX_GATHER_BYTES = 1 << 30


def _widths(max_blocks: int) -> tuple[int, ...]:
    """Blocks per sequence a graph gathers: powers of four from 4, and ``max_blocks`` last (a
    batch's widest sequence picks the next one up: at most 4x the keys it needs are gathered)."""
    out, w = [], 4
    while w < max_blocks:
        out.append(w)
        w *= 4
    return tuple(out) + (max_blocks,)


@functools.lru_cache(maxsize=16)
def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token counts the pieces' graphs are made for: powers of two from 8, and ``max_tokens`` last
    (a step of ``T`` tokens takes the next one up: at most 2x the rows it needs, and every step of
    a full budget exactly its own)."""
    out, t = [], 8
    while t < max_tokens:
        out.append(t)
        t *= 2
    return tuple(out) + (max_tokens,)


def _fill_rows(tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, batch: RaggedBatch,
               spare_slot: int) -> None:
    """A graph's static token ids, positions and KV slots: ``batch``'s rows (device copies), then
    padding rows (token 0 at position 0, writing the spare slot)."""
    n = batch.num_tokens
    tokens[:n].copy_(batch.token_ids)
    positions[:n].copy_(batch.positions)
    slots[:n].copy_(batch.slots)
    if n < tokens.shape[0]:
        tokens[n:].zero_()
        positions[n:].zero_()
        slots[n:].fill_(spare_slot)


@dataclass(frozen=True)
class StaticPlan:
    block_tables: torch.Tensor                    # [B, W] int64
    mask: torch.Tensor                            # [B, 1, 1, W * bs] additive
    window_masks: dict[int, torch.Tensor]         # sliding window -> its mask, same shape


class StaticDecodeAttention:
    """One decode per row of ``q``: the rows' blocks gathered to a fixed width, one masked SDPA
    call (the SDPA backend's decode group, with shapes that do not depend on the batch)."""

    name = "sdpa-static"

    def __call__(self, layer, q, k, v, plan: StaticPlan, pool, scale, window=0):
        kc, vc = pool.gather(layer, plan.block_tables)                    # [B, W * bs, KVH, D]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kc.transpose(1, 2), vc.transpose(1, 2),
            attn_mask=plan.window_masks[window] if window else plan.mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
        return o.squeeze(2)                                               # [B, H, D]


class CaptureFailed(RuntimeError):
    """A graph could not be made. Graphs are made at engine start-up (the budget's calibration and
    :meth:`StepGraphs.capture_all`), so this stops the start with the way out in its message, as
    vLLM's capture errors do: a failed CUDA capture leaves the caching allocator mid-capture, which
    no public PyTorch call ends, so running on eagerly in the same process is not offered."""


class _Graph:
    """The static buffers of one (batch size, width), and its captured graph (None on a CPU)."""

    def __init__(self, batch: int, width: int, block_size: int, device: torch.device) -> None:
        self.batch, self.width = batch, width
        # one int64 buffer: tokens [B], positions [B], slots [B], key counts [B], tables [B * W]
        self.ints = torch.zeros(4 * batch + batch * width, dtype=torch.long, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None
        b = batch
        self.tokens, self.positions, self.slots = self.ints[:b], self.ints[b:2 * b], self.ints[2 * b:3 * b]
        self.lengths = self.ints[3 * b:4 * b]
        self.tables = self.ints[4 * b:].view(b, width)
        self.rows = torch.arange(b, device=device)
        self.key_pos = torch.arange(width * block_size, device=device)

    def plan(self, dtype: torch.dtype, windows: tuple[int, ...]) -> StaticPlan:
        visible = self.key_pos[None, :] < self.lengths[:, None]
        zero = torch.zeros((), dtype=dtype, device=visible.device)
        ninf = torch.full((), float("-inf"), dtype=dtype, device=visible.device)
        mask = torch.where(visible, zero, ninf).view(self.batch, 1, 1, -1)
        wm = {w: torch.where(visible & (self.key_pos[None, :] >= self.lengths[:, None] - w), zero, ninf)
              .view(self.batch, 1, 1, -1) for w in windows}
        return StaticPlan(self.tables, mask, wm)


class _Pieces:
    """The static buffers of steps of up to ``tokens`` tokens, and their pieces: functions on a CPU,
    captured graphs on a GPU (see the module doc)."""

    def __init__(self, tokens: int, model, device: torch.device) -> None:
        cfg, dtype = model.config, model.dtype
        self.tokens = tokens
        self.ints = torch.zeros(3 * tokens, dtype=torch.long, device=device)
        self.token_ids, self.positions, self.slots = self.ints[:tokens], self.ints[tokens:2 * tokens], \
            self.ints[2 * tokens:]
        self.residual = torch.zeros(tokens, cfg.hidden_size, dtype=dtype, device=device)
        # one layer's q, k, v (written by the piece before its attention) and attention output (read
        # by the piece after it); every layer uses the same buffers
        self.q = torch.zeros(tokens, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(tokens, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.attn = torch.zeros_like(self.q)
        self.x = torch.zeros(tokens, cfg.hidden_size, dtype=dtype, device=device)   # the final norm's output
        self.fns: list = []
        self.graphs: list = []

    def replay(self, i: int) -> None:
        if self.graphs:
            self.graphs[i].replay()
        else:
            self.fns[i]()


class StepGraphs:
    """Steps of ``model`` through static buffers, replayed as CUDA graphs on a GPU: decode-only
    steps whole, any other step in pieces (see the module doc)."""

    def __init__(self, model, *, capture: bool | None = None) -> None:
        self.model = model
        self.device = model.norm.weight.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pieces: dict[int, _Pieces] = {}
        # the largest step (tokens) that runs in pieces; capture_all sets it to the token budget
        self.max_tokens = 8192
        self._mempool: Any = None         # the graphs' memory pool, made at the first capture after _reset
        self._attention = StaticDecodeAttention()
        self._pool: Any = None           # weakref to the pool the graphs write (their addresses)
        self.captures = 0
        self.replays = 0
        self.runs = 0
        self.piece_runs = 0               # steps run in pieces (replayed on a GPU)
        self._side: Any = None            # the warm-up stream, one for every capture (each new stream keeps
                                          # a cuBLAS workspace of its own)

    @staticmethod
    def supported(model) -> bool:
        """Whether ``model``'s eager forward is what the static path runs (the module's list)."""
        from ..kernels.ops import TorchOps
        from .attention import SdpaAttention
        from .llama import MLP, Attention, DecoderLayer, LlamaForCausalLM

        if (not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward
                or type(model.ops) is not TorchOps):
            return False
        if type(model.attention) is not SdpaAttention:
            return False
        # a tensor-parallel rank's products finish across ranks (all-reduce, gather: fastgen.parallel)
        from ..parallel.layers import VocabParallelEmbedding, _Finishing
        from .layers import Linear
        if isinstance(model.embed_tokens, VocabParallelEmbedding) or any(
                isinstance(getattr(m, "format", None), _Finishing) for m in model.modules() if isinstance(m, Linear)):
            return False
        return all(type(layer) is DecoderLayer and type(getattr(layer, "self_attn", None)) is Attention
                   and type(getattr(layer, "mlp", None)) is MLP for layer in model.layers)

    @classmethod
    def build(cls, model) -> "StepGraphs | None":
        """The graphs of a prepared ``model`` on CUDA, or None where they do not apply."""
        if os.environ.get(ENV, "1") == "0" or not cls.supported(model) or model.norm.weight.device.type != "cuda":
            return None
        return cls(model)

    def fit(self, batch: RaggedBatch, pool) -> tuple | None:
        """How ``batch`` runs: ``("decode", batch size, width)`` for a decode-only batch of at most
        ``BATCH_SIZES[-1]`` rows whose graph gathers at most ``MAX_GATHER_BYTES``; else ``("tokens",
        bucket)`` for a step of at most ``max_tokens`` tokens; else None (eagerly). Only over the
        pool the graphs were made for (a graph holds its tensors' addresses; the first pool with a
        spare block that comes is adopted, and another only once that one is gone)."""
        n, t = batch.num_seqs, batch.num_tokens
        if pool.spare_slot is None or n == 0:
            return None
        shape: tuple | None = None
        if batch.num_decodes == n and n <= BATCH_SIZES[-1] and batch.logits_indices.shape[0] == n:
            size, width = self.shape(batch, pool)
            if self.fits(size, width, pool):
                shape = ("decode", size, width)
        if shape is None and t <= self.max_tokens:
            shape = ("tokens", next(b for b in token_buckets(self.max_tokens) if b >= t))
        if shape is None:
            return None
        held = self._pool() if self._pool is not None else None
        if held is None:
            self._reset(pool)
        elif held is not pool:
            return None
        return shape

    def takes(self, batch: RaggedBatch, pool) -> bool:
        return self.fit(batch, pool) is not None

    def shape(self, batch: RaggedBatch, pool) -> tuple[int, int]:
        """(batch size, width in blocks) of the graph that takes ``batch``."""
        n, bs = batch.num_seqs, pool.block_size
        need = max(len(t) for t in batch.block_tables)
        max_blocks = -(-self.model_max_positions() // bs)
        return (next(b for b in BATCH_SIZES if b >= n),
                next(w for w in _widths(max(max_blocks, need)) if w >= need))

    @staticmethod
    def fits(size: int, width: int, pool) -> bool:
        """Whether a graph of this shape gathers at most ``MAX_GATHER_BYTES`` of keys and values."""
        k = pool.keys[0]
        per_block = k[0].numel() * k.element_size()
        return 2 * size * width * per_block <= MAX_GATHER_BYTES

    def capture_all(self, pool, max_seqs: int, max_tokens: int | None = None) -> int:
        """Make every graph a decode batch of up to ``max_seqs`` rows and a step of up to
        ``max_tokens`` tokens (the token budget) can take, for ``pool``, now (at start-up, with a
        progress bar) rather than at each shape's first step: captured while serving, each cost
        0.1-0.4 s of that step on an H200. Returns how many shapes were made."""
        from tqdm import tqdm

        self._reset(pool)
        if max_tokens is not None:
            self.max_tokens = max_tokens
        sizes = [b for b in BATCH_SIZES if b < max_seqs] + [next(b for b in BATCH_SIZES if b >= min(
            max_seqs, BATCH_SIZES[-1]))]
        widths = _widths(-(-self.model_max_positions() // pool.block_size))
        shapes = [("decode", b, w) for b in sizes for w in widths if self.fits(b, w, pool)]
        shapes += [("tokens", t) for t in token_buckets(self.max_tokens)]
        for shape in tqdm(shapes, desc="capturing CUDA graphs", unit="shape", leave=False, disable=not self.capture):
            if shape[0] == "decode":
                self._graphs[shape[1:]] = self._make(shape[1], shape[2], pool)
            else:
                self._pieces[shape[1]] = self._make_pieces(shape[1], pool)
        return len(shapes)

    def _reset(self, pool) -> None:
        """Drop every graph and adopt ``pool``; the next graphs get a memory pool of their own (the
        caching allocator refuses to capture into a graph pool whose graphs were all freed)."""
        self._graphs.clear()
        self._pieces.clear()
        self._pool = weakref.ref(pool)
        self._mempool = None

    def run(self, batch: RaggedBatch, pool, shape: tuple | None = None) -> torch.Tensor:
        """``model.forward(batch, pool)``: logits ``[len(batch.logits_indices), vocab]`` fp32 (``shape``:
        :meth:`fit`'s answer, when the caller has it)."""
        shape = shape or self.fit(batch, pool)
        if shape is None:
            raise ValueError("this step fits no CUDA graph (StepGraphs.fit)")
        if shape[0] == "tokens":
            return self._run_pieces(batch, pool, shape[1])
        return self._run_decode(batch, pool, shape[1], shape[2])

    def _run_decode(self, batch: RaggedBatch, pool, size: int, width: int) -> torch.Tensor:
        self.runs += 1
        n, bs = batch.num_seqs, pool.block_size
        g = self._graphs.get((size, width))
        if g is None:
            g = self._graphs[(size, width)] = self._make(size, width, pool)
        # the rows' token ids, positions and slots are on the device already (build_batch): copied
        # there; padding, key counts and block tables from one host buffer, in one copy
        spare = pool.spare_slot
        pad = spare // bs
        host = [p + 1 for p in batch.start_pos] + [1] * (size - n)
        for t in batch.block_tables:
            host.extend(t)
            host.extend([pad] * (width - len(t)))
        host.extend([pad] * (width * (size - n)))
        host = torch.tensor(host, dtype=torch.long)
        g.ints[3 * size:].copy_(host)
        _fill_rows(g.tokens, g.positions, g.slots, batch, spare)
        if g.graph is not None:
            g.graph.replay()
            self.replays += 1
            return g.logits[:n].clone()
        return self._forward(g, pool)[:n]

    def model_max_positions(self) -> int:
        return self.model.ropes[0].cos.shape[0]

    def _forward(self, g: _Graph, pool) -> torch.Tensor:
        """The model's forward over ``g``'s buffers, with a fresh ops object (TorchOps caches the
        step's RoPE tables by the positions tensor: a graph must compute them, not find them)."""
        from ..kernels.ops import TorchOps
        from .llama import Step

        model = self.model
        batch = RaggedBatch(token_ids=g.tokens, positions=g.positions, slots=g.slots, logits_indices=g.rows,
                            order=tuple(range(g.batch)), q_starts=tuple(range(g.batch + 1)),
                            start_pos=(0,) * g.batch, block_tables=((0,),) * g.batch, num_decodes=g.batch,
                            block_size=pool.block_size)
        ops = TorchOps()
        step = Step(batch, pool, g.plan(model.dtype, model.attention.windows), ops, self._attention,
                    tuple(model.ropes))
        with torch.inference_mode():
            residual, x = model.embed_normed(batch, ops)
            for run in model._layer_runs():
                x = run(x, residual, step)
            return model.head(x).float()

    def _make(self, size: int, width: int, pool) -> _Graph:
        g = _Graph(size, width, pool.block_size, self.device)
        # until the first real fill, every row is padding: the warm-up runs write the spare block only
        g.slots.fill_(pool.spare_slot)
        g.tables.fill_(pool.spare_slot // pool.block_size)
        g.lengths.fill_(1)
        if not self.capture:
            return g
        t0 = time.perf_counter()
        with self._capturing(f"decode batches of {size} x {width} blocks"):
            self._warm_up([lambda: self._forward(g, pool)])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                g.logits = self._forward(g, pool)
        g.graph = graph
        self.captures += 1
        log.info("captured a CUDA graph for decode batches of %d x %d blocks in %.2f s",
                 size, width, time.perf_counter() - t0)
        return g

    def _warm_up(self, fns: list) -> None:
        """Run ``fns`` twice on a side stream before their capture (as PyTorch's docs ask)."""
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                for fn in fns:
                    fn()
        torch.cuda.current_stream(self.device).wait_stream(side)

    @contextlib.contextmanager
    def _capturing(self, what: str):
        """Warm-up and capture on this model's device (``torch.cuda.graph`` captures on the current
        device's stream), with the thread's current stream restored whatever happens (a capture that
        fails can leave its own stream current). A failure raises :class:`CaptureFailed`."""
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(torch.cuda.current_stream(self.device)):
                if self._mempool is None:
                    self._mempool = torch.cuda.graph_pool_handle()
                yield
        except Exception as e:
            self._graphs.clear()
            self._pieces.clear()
            raise CaptureFailed(f"CUDA graph capture failed for {what}: {type(e).__name__}: {e}. Start the engine "
                                f"with cuda_graphs=False (fastgen serve --no-cuda-graphs, or FASTGEN_CUDA_GRAPHS=0) "
                                f"to run every step eagerly") from e

    def _run_pieces(self, batch: RaggedBatch, pool, tokens: int) -> torch.Tensor:
        """A step in the pieces of ``tokens`` tokens: per layer a replay, then the attention
        backend on the step's real rows (its plan built once, as the eager forward builds it)."""
        self.piece_runs += 1
        p = self._pieces.get(tokens)
        if p is None:
            p = self._pieces[tokens] = self._make_pieces(tokens, pool)
        n, model = batch.num_tokens, self.model
        _fill_rows(p.token_ids, p.positions, p.slots, batch, pool.spare_slot)
        step = model.step(batch, pool)                          # the eager forward's: the same plan
        q, k, v, out = p.q[:n], p.k[:n], p.v[:n], p.attn[:n]
        for i, attend in enumerate(self._attends()):
            p.replay(i)
            out.copy_(attend(q, k, v, step))
        p.replay(len(model.layers))
        return model.head(p.x[:n][batch.logits_indices]).float()

    def _attends(self) -> list:
        """Each layer's attention call (``DecoderLayer.bind_parts``), made once."""
        attends = getattr(self, "_attend_fns", None)
        if attends is None:
            attends = self._attend_fns = [parts[1] for parts in self._layer_parts()]
        return attends

    def _layer_parts(self) -> list[tuple]:
        return [layer.bind_parts(norm) for layer, norm in zip(self.model.layers, self.model.next_norms())]

    def _piece_fns(self, p: _Pieces, pool) -> list:
        """The ``L + 1`` pieces over ``p``'s buffers. Each call takes a fresh ops object and step
        (TorchOps caches a step's RoPE tables by its positions tensor: a graph must compute them,
        not find them)."""
        from ..kernels.ops import TorchOps
        from .llama import Step

        model, parts = self.model, self._layer_parts()
        t = p.tokens
        batch = RaggedBatch(token_ids=p.token_ids, positions=p.positions, slots=p.slots,
                            logits_indices=torch.zeros(0, dtype=torch.long, device=self.device),
                            order=(0,), q_starts=(0, t), start_pos=(0,), block_tables=((0,),), num_decodes=0,
                            block_size=pool.block_size)
        ropes = tuple(model.ropes)

        def step() -> Step:
            return Step(batch, pool, None, TorchOps(), None, ropes)

        def project(i: int, x: torch.Tensor, s: Step) -> None:
            q, k, v = parts[i][0](x, s)
            p.q.copy_(q)
            p.k.copy_(k)
            p.v.copy_(v)

        def first() -> None:
            s = step()
            with torch.inference_mode():
                residual, x = model.embed_normed(batch, s.ops)
                p.residual.copy_(residual)
                project(0, x, s)

        def middle(i: int):
            def run() -> None:
                s = step()
                with torch.inference_mode():
                    x = parts[i - 1][2](p.attn, p.residual, s)
                    if i < len(parts):
                        project(i, x, s)
                    else:
                        p.x.copy_(x)
            return run
        return [first] + [middle(i) for i in range(1, len(parts) + 1)]

    def _make_pieces(self, tokens: int, pool) -> _Pieces:
        p = _Pieces(tokens, self.model, self.device)
        p.slots.fill_(pool.spare_slot)        # every row is padding until the first real fill
        fns = self._piece_fns(p, pool)
        if not self.capture:
            p.fns = fns
            return p
        t0 = time.perf_counter()
        with self._capturing(f"steps of {tokens} tokens"):
            self._warm_up(fns)
            for fn in fns:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._mempool):
                    fn()
                p.graphs.append(graph)
        self.captures += len(fns)
        log.info("captured %d CUDA graph pieces for steps of %d tokens in %.2f s", len(fns), tokens,
                 time.perf_counter() - t0)
        return p
