"""CUDA graphs for decode steps: the whole forward of a decode-only batch replayed as one graph.

On a GPU the model's work in a decode step is a few milliseconds of kernels at most for a model
of SmolLM2's size, but the eager forward launches ~400 of them from Python, each with its host
cost (measured on an H200: a batch-1 decode step took 34.6 ms, 3 ms of it on the GPU). vLLM and
SGLang capture decode steps as CUDA graphs; so does this module, behind the same model code.

A graph needs fixed shapes and fixed addresses, so a decode batch of ``n`` sequences runs in the
graph of the next batch size up (``BATCH_SIZES``) and the next *width* up (blocks per sequence,
``widths``), and its inputs are copied into that graph's static buffers, in one host-to-device
copy:

- token ids, positions and KV slots per row; rows past ``n`` are padding: token 0 at position 0,
  writing its keys and values into the pool's spare block (``KVPool.spare_slot``, which the
  allocator never hands out), so that no sequence's cache is touched by them;
- block tables ``[B, W]`` padded with the spare block, and each row's number of keys, from which
  the graph builds its attention masks (keys past a row's length are masked, as the SDPA
  backend's decode groups mask them). A shape whose gathered keys and values would exceed
  ``MAX_GATHER_BYTES`` is not captured; such batches run eagerly.

Attention in the graph is the SDPA backend's decode path (gather the blocks, one masked SDPA call
for the whole batch: :class:`StaticDecodeAttention`); everything else is the model's own layer
closures with plain PyTorch ops. Logits of the real rows are copied out of the graph's memory.

Taken only where it runs what the eager forward runs: a CUDA device, the plain PyTorch ops and the
SDPA backend, every layer a plain ``DecoderLayer`` (Llama, Mistral, Qwen2/3, SmolLM; not Gemma 3's
own layers or experts, whose routing is data-dependent), no tensor-parallel shards (their products
finish across ranks), decode-only batches (prompt chunks run
eagerly), and a pool with a spare block. ``FASTGEN_CUDA_GRAPHS=0`` turns it off (A/B
measurements). On a CPU the same static path runs without capture, which is how the tests check
it against the eager forward.
"""
from __future__ import annotations

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


class DecodeGraphs:
    """Decode-only steps of ``model`` through static buffers, replayed as CUDA graphs on a GPU."""

    def __init__(self, model, *, capture: bool | None = None) -> None:
        self.model = model
        self.device = model.norm.weight.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self._attention = StaticDecodeAttention()
        self._pool: Any = None           # weakref to the pool the graphs write (their addresses)
        self.captures = 0
        self.replays = 0
        self.runs = 0

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
    def build(cls, model) -> "DecodeGraphs | None":
        """The graphs of a prepared ``model`` on CUDA, or None where they do not apply."""
        if os.environ.get(ENV, "1") == "0" or not cls.supported(model) or model.norm.weight.device.type != "cuda":
            return None
        return cls(model)

    def fit(self, batch: RaggedBatch, pool) -> tuple[int, int] | None:
        """The (batch size, width) of the graph that takes ``batch``, or None: a decode-only batch
        of at most ``BATCH_SIZES[-1]`` rows whose graph gathers at most ``MAX_GATHER_BYTES``, over
        the pool the graphs were made for (a graph holds its tensors' addresses; the first pool
        with a spare block that comes is adopted, and another only once that one is gone)."""
        n = batch.num_seqs
        if not (pool.spare_slot is not None and n > 0 and batch.num_decodes == n and n <= BATCH_SIZES[-1]
                and batch.logits_indices.shape[0] == n):
            return None
        shape = self.shape(batch, pool)
        if not self.fits(*shape, pool):
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

    def capture_all(self, pool, max_seqs: int) -> int:
        """Make every graph a decode batch of up to ``max_seqs`` rows can take, for ``pool``, now
        (at start-up, with a progress bar) rather than at each shape's first step: captured while
        serving, each cost 0.1-0.4 s of that step on an H200. Returns how many were made."""
        from tqdm import tqdm

        self._reset(pool)
        sizes = [b for b in BATCH_SIZES if b < max_seqs] + [next(b for b in BATCH_SIZES if b >= min(
            max_seqs, BATCH_SIZES[-1]))]
        widths = _widths(-(-self.model_max_positions() // pool.block_size))
        shapes = [(b, w) for b in sizes for w in widths if self.fits(b, w, pool)]
        for b, w in tqdm(shapes, desc="capturing decode CUDA graphs", unit="graph", leave=False,
                         disable=not self.capture):
            self._graphs[(b, w)] = self._make(b, w, pool)
        return len(shapes)

    def _reset(self, pool) -> None:
        """Drop every graph and adopt ``pool``; the next graphs get a memory pool of their own (the
        caching allocator refuses to capture into a graph pool whose graphs were all freed)."""
        self._graphs.clear()
        self._pool = weakref.ref(pool)
        if self.capture:
            self._mempool = torch.cuda.graph_pool_handle()

    def run(self, batch: RaggedBatch, pool, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """``model.forward(batch, pool)`` for a decode-only batch: logits ``[n, vocab]`` fp32
        (``shape``: :meth:`fit`'s answer, when the caller has it)."""
        self.runs += 1
        n, bs = batch.num_seqs, pool.block_size
        size, width = shape or self.shape(batch, pool)
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
        g.tokens[:n].copy_(batch.token_ids)
        g.positions[:n].copy_(batch.positions)
        g.slots[:n].copy_(batch.slots)
        if n < size:
            g.tokens[n:].zero_()
            g.positions[n:].zero_()
            g.slots[n:].fill_(spare)
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
            residual = model.embed(batch)
            first = model.layers[0].input_layernorm
            x = ops.rms_norm(residual, first.weight, first.eps)
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
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(g, pool)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            g.logits = self._forward(g, pool)
        g.graph = graph
        self.captures += 1
        log.info("captured a CUDA graph for decode batches of %d x %d blocks in %.2f s",
                 size, width, time.perf_counter() - t0)
        return g
