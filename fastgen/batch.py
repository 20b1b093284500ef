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
    q_starts     = [0, 1, 2, 5]        start_pos = [5, 9, 4]      num_decodes = 2
    block_tables = [(1, 3), (7, 2, 5), (4, 6)]   (the blocks holding each sequence's keys)
    logits_indices = [0, 1, 4]   (the last token of each sequence that samples)

This is all an attention backend gets; each derives its own metadata from it
(``fastgen.model.attention``): the SDPA backend groups decodes of similar context length
and builds masks, the paged backend hands the tables to its kernel as they are.
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
class RaggedBatch:
    """What every attention backend needs; backends derive their own metadata from it
    (``fastgen.model.attention``). Device tensors come from one host-to-device copy."""

    token_ids: torch.Tensor           # [T] int64
    positions: torch.Tensor           # [T] int64
    slots: torch.Tensor               # [T] int64, flat KV slot of each token
    logits_indices: torch.Tensor      # [num_logits] int64 rows of the flat batch to unembed, ascending
    order: tuple[int, ...]            # order[i] = index into the caller's seq list of flat seq i
    q_starts: tuple[int, ...]         # [S + 1] flat row where sequence s starts (host)
    start_pos: tuple[int, ...]        # [S] position of sequence s's first token this step (host)
    block_tables: tuple[tuple[int, ...], ...]  # [S] blocks covering each sequence's keys (host)
    num_decodes: int                  # the first num_decodes sequences have one token each
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def logits_all(self) -> bool:
        """Whether every row wants logits (decode steps): its distinct, ascending indices are then
        all the rows, in order."""
        return self.logits_indices.shape[0] == self.token_ids.shape[0]

    def logits_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` ([T, ...]) that want logits: ``x`` itself where that is every row (no
        gather: a cold indexing op, ~70 us of a batch-1 step on the Zen 3 host)."""
        return x if self.logits_all else x[self.logits_indices]

    @property
    def num_seqs(self) -> int:
        return len(self.start_pos)


def build_batch(seqs: list[SeqInput], block_size: int, device: torch.device) -> RaggedBatch:
    """Lay ``seqs`` out as a :class:`RaggedBatch`: single-token sequences first, shortest
    context first (so a backend can group them); then chunks in the caller's order.

    ``logits_indices`` lists, in the order of the flat sequences, the rows whose logits are
    wanted (for each sequence its last ``num_logits`` tokens).
    """
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i].token_ids) != 1,
                                                    seqs[i].start_pos if len(seqs[i].token_ids) == 1 else 0))
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    q_starts = [0]
    tables: list[tuple[int, ...]] = []
    num_decodes = 0
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
        q_starts.append(q_start + n)
        tables.append(tuple(blocks[: (s.start_pos + n - 1) // block_size + 1]))
        num_decodes += n == 1
    t = len(token_ids)
    flat = torch.tensor(token_ids + positions + slots + logits_rows, dtype=torch.long).to(device)
    return RaggedBatch(
        token_ids=flat[:t], positions=flat[t:2 * t], slots=flat[2 * t:3 * t], logits_indices=flat[3 * t:],
        order=tuple(order), q_starts=tuple(q_starts), start_pos=tuple(seqs[i].start_pos for i in order),
        block_tables=tuple(tables), num_decodes=num_decodes, block_size=block_size)
