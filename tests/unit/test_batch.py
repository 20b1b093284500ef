"""The ragged batch builder and the SDPA backend's metadata (no model)."""
from __future__ import annotations

import torch

from fastgen.batch import SeqInput, build_batch
from fastgen.model.attention import SdpaAttention, decode_group_sizes

CPU = torch.device("cpu")


def test_worked_example_of_the_module_docstring():
    seqs = [SeqInput([90], 9, [7, 2, 5], 1), SeqInput([50], 5, [1, 3], 1), SeqInput([4, 5, 6], 4, [4, 6], 1)]
    b = build_batch(seqs, 4, CPU)
    assert b.positions.tolist() == [5, 9, 4, 5, 6]            # decodes sorted by context length
    assert b.slots.tolist() == [13, 21, 24, 25, 26]
    assert [seqs[i].token_ids for i in b.order] == [[50], [90], [4, 5, 6]]
    assert b.q_starts == (0, 1, 2, 5) and b.start_pos == (5, 9, 4) and b.num_decodes == 2
    assert b.block_tables == ((1, 3), (7, 2, 5), (4, 6))
    assert b.logits_indices.tolist() == [0, 1, 4] and not b.logits_all
    plan = SdpaAttention(torch.float32, CPU).plan(b)
    [g] = plan.decode_groups
    assert g.block_tables.tolist() == [[1, 3, 0], [7, 2, 5]]
    assert (g.mask[:, 0, 0] == 0).sum(-1).tolist() == [6, 10]
    [c] = plan.chunks
    assert (c.q_start, c.num_q, c.start_pos, c.block_table.tolist()) == (2, 3, 4, [4, 6])
    assert (c.mask[0, 0] == 0).sum(-1).tolist() == [5, 6, 7]   # causal over cached keys plus itself


def test_decodes_of_very_different_lengths_are_grouped():
    assert decode_group_sizes([1, 1, 2, 3, 5, 40, 41, 90]) == [3, 2, 2, 1]
    assert decode_group_sizes([1, 3, 7, 15, 31, 63]) == [1, 1, 1, 3]     # at most 4 groups
    seqs = [SeqInput([1], p, list(range(p // 4 + 1)), 1) for p in (3, 200, 5, 190)]
    plan = SdpaAttention(torch.float32, CPU).plan(build_batch(seqs, 4, CPU))
    assert [g.num_seqs for g in plan.decode_groups] == [2, 2]
    assert [g.block_tables.shape[1] for g in plan.decode_groups] == [2, 51]


def test_logits_all_marks_steps_whose_every_row_wants_logits():
    """The model skips the gather of the rows that want logits where that is every row in order
    (decode steps; a prompt whose every row asks for prompt logprobs): ``logits_all`` exactly then."""
    decodes = [SeqInput([90], 9, [7, 2, 5], 1), SeqInput([50], 5, [1, 3], 1)]
    for seqs in (decodes, decodes + [SeqInput([4, 5, 6], 4, [4, 6], 3)], decodes + [SeqInput([4, 5], 4, [4, 6], 1)],
                 [SeqInput([4, 5, 6], 0, [4], 0)], decodes[:1] + [SeqInput([4, 5], 4, [4, 6], 0)]):
        b = build_batch(seqs, 4, CPU)
        assert b.logits_all == (b.logits_indices.tolist() == list(range(b.num_tokens)))
    assert build_batch(decodes, 4, CPU).logits_all
