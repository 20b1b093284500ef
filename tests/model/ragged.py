"""Drive a fastgen model through random ragged schedules and collect per-position logits."""
from __future__ import annotations

import random

import torch

from fastgen.batch import SeqInput, build_batch
from fastgen.cache import BlockAllocator, KVPool


def ragged_logits(model, cfg, sequences: list[list[int]], *, block_size: int, seed: int,
                  max_chunk: int = 8, paths: dict[str, int] | None = None,
                  kv_dtype: str = "auto") -> list[torch.Tensor]:
    """Feed every sequence through ``model`` in random chunks, many sequences per forward.

    Each step, every unfinished sequence gets a random chunk (1 token = the decode path,
    several = a prompt chunk, starting at 0 or continuing). Returns, per sequence, the
    logits of every position ``[len(seq), vocab]``. ``paths`` (if given) counts the attention
    paths the batches took: decodes, chunks from position 0, continuing chunks. ``kv_dtype``: the
    pool's (KVPool).
    """
    rng = random.Random(seed)
    num_blocks = sum(-(-len(s) // block_size) for s in sequences) + 2
    pool = KVPool(num_layers=cfg.num_layers, num_blocks=num_blocks, block_size=block_size,
                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  dtype=model.dtype, device=torch.device("cpu"), kv_dtype=kv_dtype)
    alloc = BlockAllocator(num_blocks)
    # hand out blocks in a scrambled order so that block tables are not contiguous
    alloc.allocate(1)
    tables = [alloc.allocate(-(-len(s) // block_size)) for s in sequences]
    for t in tables:
        rng.shuffle(t)
    done = [0] * len(sequences)
    out: list[list[torch.Tensor]] = [[] for _ in sequences]
    while any(d < len(s) for d, s in zip(done, sequences)):
        active = [i for i, s in enumerate(sequences) if done[i] < len(s)]
        rng.shuffle(active)
        seqs, ids = [], []
        for i in active[: rng.randint(1, len(active))]:
            n = min(rng.randint(1, max_chunk), len(sequences[i]) - done[i])
            seqs.append(SeqInput(sequences[i][done[i]:done[i] + n], done[i], tables[i], n))
            ids.append(i)
        batch = build_batch(seqs, block_size, torch.device("cpu"))
        if paths is not None:
            paths["decode"] = paths.get("decode", 0) + (batch.num_decodes > 0)
            for s in range(batch.num_decodes, batch.num_seqs):
                key = "fresh" if batch.start_pos[s] == 0 else "continuing"
                paths[key] = paths.get(key, 0) + 1
        logits = model(batch, pool)
        row = 0
        for k in batch.order:
            n = seqs[k].num_logits
            out[ids[k]].append(logits[row:row + n])
            row += n
        for i, s in zip(ids, seqs):
            done[i] += len(s.token_ids)
    return [torch.cat(chunks) for chunks in out]
