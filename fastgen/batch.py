"""The ragged batch: the tokens of many sequences laid end to end for one forward pass.

Worked example (block_size = 4). Three sequences are scheduled this step:

    seq A: decoding; 9 tokens computed, its newest token (position 9) is fed now
    seq B: decoding; 5 tokens computed, position 5 is fed now
    seq C: a prompt chunk of 3 tokens starting at position 4 (tokens 0..3 are cached)

Single-token sequences come first, so the flat arrays are:

    token_ids    = [a9, b5, c4, c5, c6]
    positions    = [ 9,  5,  4,  5,  6]
    block tables   A: [7, 2, 5]   B: [1, 3]   C: [4, 6]
    slots        = [5*4+1, 3*4+1, 6*4+0, 6*4+1, 6*4+2] = [21, 13, 24, 25, 26]
    decode group : num_decodes = 2, decode_block_tables = [[7, 2, 5], [1, 3, 0]] (0 = padding),
                   decode_context_lens = [10, 6] (keys beyond are masked)
    chunks       : [Chunk(q_start=2, num_q=3, start_pos=4, block_table=[4, 6])]
    logits_indices = [0, 1, 4]   (the last token of each sequence that samples)

A chunk that starts at position 0 attends only to itself (causal), so its keys are taken
from the fresh projections instead of the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ScheduledChunk:
    """Scheduler -> engine: compute ``num_tokens`` more tokens of ``request_id``."""

    request_id: str
    num_tokens: int


@dataclass(frozen=True)
class SeqInput:
    """Engine -> batch builder: one sequence's slice of the step."""

    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    num_logits: int       # how many of this slice's last tokens need logits (0 = none)


@dataclass(frozen=True)
class Chunk:
    """A multi-token slice of the flat batch, attended one sequence at a time."""

    q_start: int
    num_q: int
    start_pos: int
    block_table: torch.Tensor        # [num_blocks] int64, device
    mask: torch.Tensor | None        # [1, 1, num_q, num_blocks * block_size] additive (0 / -inf); None when start_pos == 0


@dataclass(frozen=True)
class RaggedBatch:
    token_ids: torch.Tensor           # [T] int64
    positions: torch.Tensor           # [T] int64
    slots: torch.Tensor               # [T] int64, flat KV slot of each token
    num_decodes: int                  # the first num_decodes tokens are single-token sequences
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None          # [num_decodes, 1, 1, max_blocks * block_size] additive (0 / -inf)
    chunks: tuple[Chunk, ...]
    logits_indices: torch.Tensor      # [num_logits] int64 rows of the flat batch to unembed
    order: tuple[int, ...]            # order[i] = index into the caller's seq list of flat seq i

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def build_batch(seqs: list[SeqInput], block_size: int, device: torch.device,
                dtype: torch.dtype) -> RaggedBatch:
    """Lay ``seqs`` out as a :class:`RaggedBatch`; single-token sequences first.

    Masks are additive, in the model's ``dtype``, built once here for every layer (a
    boolean mask would be converted by attention in each layer).

    ``logits_indices`` lists, in the order of the flat sequences, the rows whose logits are
    wanted (for each sequence its last ``num_logits`` tokens).
    """
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    chunk_specs: list[tuple[int, int, int, list[int]]] = []
    for i in order:
        s = seqs[i]
        n = len(s.token_ids)
        q_start = len(token_ids)
        token_ids.extend(s.token_ids)
        pos = range(s.start_pos, s.start_pos + n)
        positions.extend(pos)
        blocks = s.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        logits_rows.extend(range(q_start + n - s.num_logits, q_start + n))
        if n == 1:
            decode_tables.append(blocks[: s.start_pos // block_size + 1])
            decode_lens.append(s.start_pos + 1)
        else:
            chunk_specs.append((q_start, n, s.start_pos, blocks[: (s.start_pos + n - 1) // block_size + 1]))

    def t(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    def additive(visible: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=dtype, device=device)
        return torch.where(visible, zero, torch.tensor(float("-inf"), dtype=dtype, device=device))

    pos_t = t(positions)
    decode_bt = decode_mask = None
    if decode_tables:
        width = max(len(b) for b in decode_tables)
        decode_bt = t([b + [0] * (width - len(b)) for b in decode_tables])
        key_pos = torch.arange(width * block_size, device=device)
        decode_mask = additive(key_pos[None, :] < t(decode_lens)[:, None]).view(len(decode_lens), 1, 1, -1)
    chunks = []
    for q_start, n, start, blocks in chunk_specs:
        mask = None
        if start > 0:
            key_pos = torch.arange(len(blocks) * block_size, device=device)
            mask = additive(key_pos[None, :] <= pos_t[q_start:q_start + n, None]).view(1, 1, n, -1)
        chunks.append(Chunk(q_start, n, start, t(blocks), mask))
    return RaggedBatch(
        token_ids=t(token_ids), positions=pos_t, slots=t(slots), num_decodes=len(decode_tables),
        decode_block_tables=decode_bt, decode_mask=decode_mask, chunks=tuple(chunks),
        logits_indices=t(logits_rows), order=tuple(order))
