"""The ragged batch: the tokens of many sequences laid end to end for one forward pass.

Worked example (block_size = 4). Three sequences are scheduled this step:

    seq A: decoding; 9 tokens computed, its newest token (position 9) is fed now
    seq B: decoding; 5 tokens computed, position 5 is fed now
    seq C: a prompt chunk of 3 tokens starting at position 4 (tokens 0..3 are cached)

Single-token sequences come first, shortest context first, so the flat arrays are:

    token_ids    = [b5, a9, c4, c5, c6]
    positions    = [ 5,  9,  4,  5,  6]
    block tables   A: [7, 2, 5]   B: [1, 3]   C: [4, 6]
    slots        = [3*4+1, 5*4+1, 6*4+0, 6*4+1, 6*4+2] = [13, 21, 24, 25, 26]
    decode group : q_start 0, 2 sequences, block_tables = [[1, 3, 0], [7, 2, 5]] (0 = padding),
                   context lengths [6, 10] (keys beyond are masked)
    chunks       : [Chunk(q_start=2, num_q=3, start_pos=4, block_table=[4, 6])]
    logits_indices = [0, 1, 4]   (the last token of each sequence that samples)

Decodes are attended in groups of similar context length (see ``_decode_groups``), so that
one long sequence does not make every short one gather and mask its length. A chunk that
starts at position 0 attends only to itself (causal), so its keys are taken
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
class DecodeGroup:
    """Adjacent single-token sequences of similar context length, attended in one call."""

    q_start: int
    num_seqs: int
    block_tables: torch.Tensor       # [num_seqs, max_blocks] int64 (padded with block 0)
    mask: torch.Tensor               # [num_seqs, 1, 1, max_blocks * block_size] additive (0 / -inf)


@dataclass(frozen=True)
class RaggedBatch:
    token_ids: torch.Tensor           # [T] int64
    positions: torch.Tensor           # [T] int64
    slots: torch.Tensor               # [T] int64, flat KV slot of each token
    decode_groups: tuple[DecodeGroup, ...]   # the single-token sequences, first in the flat batch
    chunks: tuple[Chunk, ...]
    logits_indices: torch.Tensor      # [num_logits] int64 rows of the flat batch to unembed
    order: tuple[int, ...]            # order[i] = index into the caller's seq list of flat seq i

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_decodes(self) -> int:
        return sum(g.num_seqs for g in self.decode_groups)


def _decode_groups(num_blocks: list[int]) -> list[int]:
    """Group sizes for decodes sorted by block count: a group closes when the next sequence
    needs more than twice the blocks of the group's first (so padding at most doubles the
    gathered keys), and at most 4 groups are made."""
    sizes: list[int] = []
    first = 0
    for i, n in enumerate(num_blocks):
        if sizes and (n <= 2 * num_blocks[first] or len(sizes) == 4):
            sizes[-1] += 1
        else:
            sizes.append(1)
            first = i
    return sizes


def build_batch(seqs: list[SeqInput], block_size: int, device: torch.device,
                dtype: torch.dtype) -> RaggedBatch:
    """Lay ``seqs`` out as a :class:`RaggedBatch`; single-token sequences first.

    Masks are additive, in the model's ``dtype``, built once here for every layer (a
    boolean mask would be converted by attention in each layer).

    ``logits_indices`` lists, in the order of the flat sequences, the rows whose logits are
    wanted (for each sequence its last ``num_logits`` tokens).
    """
    # decodes first, shortest context first (for grouping); then chunks in the caller's order
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i].token_ids) != 1,
                                                    seqs[i].start_pos if len(seqs[i].token_ids) == 1 else 0))
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
    groups = []
    start = 0
    for size in _decode_groups([len(b) for b in decode_tables]):
        tables, lens = decode_tables[start:start + size], decode_lens[start:start + size]
        width = max(len(b) for b in tables)
        key_pos = torch.arange(width * block_size, device=device)
        mask = additive(key_pos[None, :] < t(lens)[:, None]).view(size, 1, 1, -1)
        groups.append(DecodeGroup(start, size, t([b + [0] * (width - len(b)) for b in tables]), mask))
        start += size
    chunks = []
    for q_start, n, start, blocks in chunk_specs:
        mask = None
        if start > 0:
            key_pos = torch.arange(len(blocks) * block_size, device=device)
            mask = additive(key_pos[None, :] <= pos_t[q_start:q_start + n, None]).view(1, 1, n, -1)
        chunks.append(Chunk(q_start, n, start, t(blocks), mask))
    return RaggedBatch(
        token_ids=t(token_ids), positions=pos_t, slots=t(slots), decode_groups=tuple(groups), chunks=tuple(chunks),
        logits_indices=t(logits_rows), order=tuple(order))
