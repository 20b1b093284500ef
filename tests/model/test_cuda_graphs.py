"""Steps through the static buffers of fastgen/model/cuda_graphs.py (decode steps whole, other
steps in pieces around attention) give what the eager forward gives: on a CPU without capture
(every machine), and replayed as CUDA graphs where a GPU is present."""
from __future__ import annotations

import pytest
import torch

from fastgen.cache import KVPool
from fastgen.model.cuda_graphs import BATCH_SIZES, StepGraphs, _widths, token_buckets
from fastgen.pipeline import Pipeline, pipeline
from fastgen.request import SamplingParams
from tests.tiny_model import make_tiny_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:",
           "Here is a short story about a robot who learns to paint. Once upon a time," * 4,
           "a b c d e f g"]


class Spy(StepGraphs):
    """Runs the static paths and checks that the padding rows write the spare block only; counts
    the steps of each kind and the padded sizes they took."""

    def __init__(self, model, capture):
        super().__init__(model, capture=capture)
        self.checked = 0              # decode steps
        self.pieces_checked = 0       # other steps
        self.sizes: set[int] = set()
        self.buckets: set[int] = set()
        self.padded = 0               # other steps with padding rows

    def run(self, batch, pool, shape=None):
        before = [k.clone() for k in pool.keys]
        got = super().run(batch, pool, shape)
        # every slot that changed is a row's own slot or in the spare block
        real = set(batch.slots.tolist())
        for k0, k1 in zip(before, pool.keys):
            changed = (k0 != k1).reshape(k0.shape[0] * k0.shape[1], -1).any(-1).nonzero().flatten().tolist()
            assert set(changed) <= real | set(range(pool.spare_slot, pool.spare_slot + pool.block_size))
        kind = (shape or self.fit(batch, pool))[0]
        if kind == "decode":
            self.sizes.add(next(b for b in BATCH_SIZES if b >= batch.num_seqs))
            self.checked += 1
        else:
            bucket = next(b for b in token_buckets(self.max_tokens) if b >= batch.num_tokens)
            self.buckets.add(bucket)
            self.padded += bucket > batch.num_tokens
            self.pieces_checked += 1
        return got


def _spare_pool(eng, num_blocks=None, block_size=None):
    """A KV pool shaped for ``eng``'s model with the spare block the static path writes padding to."""
    return KVPool.for_model(eng.model_config, num_kv_heads=eng.model_config.num_kv_heads,
                            num_blocks=num_blocks or eng.config.cache.num_blocks,
                            block_size=block_size or eng.config.cache.block_size, dtype=eng.config.dtype,
                            device=eng.config.device, spare_blocks=1)


def _engines(tmp_path, device, capture):
    # 256 blocks (8k tokens) hold every request here: the spy copies and compares the whole pool at
    # each step, and the tiny model's default pool (1 GB) made that ~70 s of the test
    folder = make_tiny_model(str(tmp_path / "tiny"))
    eager = pipeline(folder, device=device, dtype="float32", kernels="torch", budget_tokens=12, prefix_caching=False,
                     num_blocks=256)
    graphed = pipeline(folder, device=device, dtype="float32", kernels="torch", budget_tokens=12,
                       prefix_caching=False, num_blocks=256)
    eng = graphed.engine
    eng.pool = _spare_pool(eng)
    spy = Spy(eng.model, capture)
    spy.max_tokens = 16                   # over the budget of 12: full steps have padding rows
    eng.model.__dict__["_graphs"] = spy
    return eager, graphed, spy


def _check(eager, graphed, spy):
    want = [list(r.token_ids) for r in eager(PROMPTS, max_new_tokens=20, do_sample=False, ignore_eos=True)]
    got = [list(r.token_ids) for r in graphed(PROMPTS, max_new_tokens=20, do_sample=False, ignore_eos=True)]
    assert got == want
    assert spy.checked > 10 and len(spy.sizes) >= 2     # decode batches of several padded sizes
    assert spy.pieces_checked > 5 and spy.padded > 0    # prompt and mixed steps, some with padding rows
    # sampled requests beside greedy ones, then logits of a decode batch against the eager forward
    eng = graphed.engine
    rid = eng.add_request(PROMPTS[3], SamplingParams(max_new_tokens=8, seed=1))
    for p in PROMPTS[:3]:
        eng.add_request(p, SamplingParams(max_new_tokens=8, do_sample=False))
    while eng.has_unfinished():
        eng.step()
    assert eng.response(rid).generated_length == 8
    assert eng.allocator.num_free_blocks == eng.config.cache.num_blocks


def test_static_decode_path_matches_eager_on_cpu(tmp_path):
    eager, graphed, spy = _engines(tmp_path, "cpu", capture=False)
    _check(eager, graphed, spy)
    assert spy.captures == 0


def test_static_logits_match_the_eager_forward(tmp_path):
    """Decode batches (3 padded to 4), prompt chunks, continuing chunks and mixed steps, prompt
    logprobs' many rows a sequence included: the static paths' logits against model.forward's."""
    folder = make_tiny_model(str(tmp_path / "tiny"))
    pipe = pipeline(folder, device="cpu", dtype="float32", kernels="torch", budget_tokens=24, prefix_caching=False)
    eng = pipe.engine
    eng.pool = _spare_pool(eng)
    graphs = StepGraphs(eng.model, capture=False)
    graphs.max_tokens = 24
    seen = []
    real_forward = type(eng.model).forward

    def spy(model, batch, pool):
        out = real_forward(model, batch, pool)
        shape = graphs.fit(batch, pool)
        if shape is not None:
            seen.append((shape[0], batch.num_decodes < batch.num_seqs and batch.num_decodes > 0, out,
                         graphs.run(batch, pool, shape)))
        return out
    type(eng.model).forward, saved = spy, real_forward
    try:
        pipe(PROMPTS[:3], max_new_tokens=6, do_sample=False, ignore_eos=True)
        pipe(PROMPTS[3:], max_new_tokens=3, do_sample=False, ignore_eos=True, prompt_logprobs=2)
    finally:
        type(eng.model).forward = saved
    kinds = [k for k, _, _, _ in seen]
    assert kinds.count("decode") >= 5 and kinds.count("tokens") >= 4
    assert any(mixed for _, mixed, _, _ in seen)                   # a step with decodes and a chunk
    assert max(got.shape[0] for _, _, _, got in seen) > 4           # many logits rows (prompt logprobs)
    for _, _, want, got in seen:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_token_buckets():
    assert token_buckets(512) == (8, 16, 32, 64, 128, 256, 512)
    assert token_buckets(384) == (8, 16, 32, 64, 128, 256, 384)
    assert token_buckets(5) == (5,)


def test_widths_cover_every_context():
    assert _widths(256) == (4, 16, 64, 256)
    assert _widths(3) == (3,)
    assert _widths(100) == (4, 16, 64, 100)


def test_graphs_not_taken_on_cpu_or_when_turned_off(tmp_path, monkeypatch):
    folder = make_tiny_model(str(tmp_path / "tiny"))
    pipe = pipeline(folder, device="cpu", dtype="float32", kernels="torch")
    assert not pipe.engine.model.uses_cuda_graphs and pipe.engine.pool.spare_slot is None
    # what the static path runs is this model's eager forward; with the native kernels it is not
    assert StepGraphs.supported(pipe.engine.model)
    assert not StepGraphs.supported(pipeline(folder, device="cpu", dtype="float32", kernels="native").engine.model)
    if torch.cuda.is_available():
        off = pipeline(folder, device="cuda", dtype="float32", cuda_graphs=False)
        assert not off.engine.model.uses_cuda_graphs and off.engine.pool.spare_slot is None
        monkeypatch.setenv("FASTGEN_CUDA_GRAPHS", "0")
        gpu = pipeline(folder, device="cuda", dtype="float32")
        assert not gpu.engine.model.uses_cuda_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_match_eager_on_cuda(tmp_path):
    folder = make_tiny_model(str(tmp_path / "t0"))
    eager = pipeline(folder, device="cuda", dtype="float32", budget_tokens=12, prefix_caching=False,
                     cuda_graphs=False)
    graphed = pipeline(folder, device="cuda", dtype="float32", budget_tokens=12, prefix_caching=False)
    assert graphed.engine.model.uses_cuda_graphs and graphed.engine.pool.spare_slot is not None
    spy = Spy(graphed.engine.model, capture=True)
    spy.max_tokens = 16
    graphed.engine.model.__dict__["_graphs"] = spy
    _check(eager, graphed, spy)
    assert spy.captures >= 2 and spy.replays == spy.checked and spy.pieces_checked > 5


def test_capture_all_makes_every_shape_a_step_can_take(tmp_path):
    folder = make_tiny_model(str(tmp_path / "tiny"))
    eng = pipeline(folder, device="cpu", dtype="float32", kernels="torch", max_seqs=20).engine
    pool = _spare_pool(eng, num_blocks=8)
    graphs = StepGraphs(eng.model, capture=False)
    max_blocks = -(-eng.model.ropes[0].cos.shape[0] // pool.block_size)
    # decode batches of 1, 2, 4, 8, 16, 32 rows at every width; steps of 8, 16, 32, 48 tokens
    assert graphs.capture_all(pool, 20, 48) == 6 * len(_widths(max_blocks)) + 4
    assert {b for b, _ in graphs._graphs} == {1, 2, 4, 8, 16, 32}
    assert sorted(graphs._pieces) == [8, 16, 32, 48] and graphs.max_tokens == 48
    assert all(len(p.fns) == eng.model_config.num_layers + 1 for p in graphs._pieces.values())
    # made for this pool: a batch over another pool is not taken (a graph holds its addresses)
    other = _spare_pool(eng, num_blocks=8)
    from fastgen.batch import SeqInput, build_batch
    batch = build_batch([SeqInput([5], 3, [0], 1)], pool.block_size, torch.device("cpu"))
    assert graphs.takes(batch, pool) and not graphs.takes(batch, other)


def test_a_shape_that_would_gather_too_much_is_not_taken(tmp_path, monkeypatch):
    import fastgen.model.cuda_graphs as cg
    from fastgen.batch import SeqInput, build_batch

    folder = make_tiny_model(str(tmp_path / "tiny"))
    eng = pipeline(folder, device="cpu", dtype="float32", kernels="torch").engine
    pool = _spare_pool(eng, num_blocks=64, block_size=16)
    graphs = StepGraphs(eng.model, capture=False)
    per_block = pool.keys[0][0].numel() * 4
    short = build_batch([SeqInput([5], 3, [0], 1)] * 3, 16, torch.device("cpu"))          # 4 rows x 4 blocks
    long = build_batch([SeqInput([5], 300, list(range(19)), 1)] * 3, 16, torch.device("cpu"))  # 4 x 64 blocks
    assert graphs.shape(short, pool) == (4, 4) and graphs.shape(long, pool) == (4, 64)
    monkeypatch.setattr(cg, "MAX_GATHER_BYTES", 2 * 4 * 16 * per_block)
    # the long batch runs in the pieces of 8 tokens instead: attention eager, no gather in a graph
    assert graphs.fit(short, pool) == ("decode", 4, 4) and graphs.fit(long, pool) == ("tokens", 8)
    made = graphs.capture_all(pool, 4, 16)
    assert made == len(graphs._graphs) + 2 and all(b * w <= 4 * 16 for b, w in graphs._graphs)
    assert (4, 16) in graphs._graphs and (4, 64) not in graphs._graphs and (1, 64) in graphs._graphs


def test_a_failed_capture_stops_the_start_with_the_way_out(tmp_path, monkeypatch):
    """A graph that cannot be made (here: its warm-up raises, as a capture error would; graphs are
    made at start-up) raises CaptureFailed naming the option that runs every step eagerly, and
    drops the graphs made so far."""
    from fastgen.model import cuda_graphs as cg

    folder = make_tiny_model(str(tmp_path / "tiny"))
    eng = pipeline(folder, device="cpu", dtype="float32", kernels="torch", budget_tokens=16).engine
    pool = _spare_pool(eng)
    graphs = StepGraphs(eng.model, capture=False)
    graphs.capture_all(pool, 4, 16)
    assert graphs._graphs and graphs._pieces

    def broken(self, fns):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(cg.StepGraphs, "_warm_up", broken)
    graphs.capture = True
    with pytest.raises(cg.CaptureFailed, match="cuda_graphs=False") as e:
        graphs.capture_all(pool, 4, 16)
    assert "decode batches of 1 x" in str(e.value)
    assert not graphs._graphs and not graphs._pieces


@pytest.mark.parametrize("name", ["mistral-window-13", "qwen3-window-bias", "llama-tied-llama3-rope"])
def test_pieces_match_the_eager_forward_across_families(tmp_path, name):
    """The pieces' static path (uncaptured) against the eager forward for the families that take
    it: sliding windows (Mistral; Qwen3's per-layer window), Qwen3's head norms and QKV bias, Llama
    3's RoPE scaling with a tied head. Steps: two prompts from position 0, a continuing chunk beside
    a decode, then decodes beside a new prompt; each on its own pool (same block tables)."""
    from fastgen.batch import SeqInput, build_batch
    from fastgen.model.loader import load_model

    from .test_parity import _tiny_configs, random_checkpoint

    random_checkpoint(_tiny_configs()[name], tmp_path / "ckpt")
    model = load_model(str(tmp_path / "ckpt"), dtype=torch.float32, device=torch.device("cpu"), max_positions=256,
                       kernels="torch")
    assert StepGraphs.supported(model)
    cfg = model.config

    def pool():
        return KVPool.for_model(cfg, num_kv_heads=cfg.num_kv_heads, num_blocks=24, block_size=4,
                                dtype=torch.float32, device=torch.device("cpu"), spare_blocks=1)
    eager_pool, static_pool = pool(), pool()
    graphs = StepGraphs(model, capture=False)
    graphs.max_tokens = 32
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
    a, b, c = list(range(0, 8)), list(range(8, 12)), list(range(12, 14))   # block tables
    steps = [
        [SeqInput(ids(20), 0, a[:5], 1), SeqInput(ids(7), 0, b[:2], 1)],
        [SeqInput(ids(1), 7, b[:2], 1), SeqInput(ids(10), 20, a[:8], 3)],
        [SeqInput(ids(1), 30, a[:8], 1), SeqInput(ids(1), 8, b[:3], 1), SeqInput(ids(5), 0, c, 5)],
    ]
    kinds = []
    for seqs in steps:
        batch = build_batch(seqs, 4, torch.device("cpu"))
        want = model(batch, eager_pool)           # eager: a CPU model builds no graphs of its own
        shape = graphs.fit(batch, static_pool)
        kinds.append(shape[0])
        torch.testing.assert_close(graphs.run(batch, static_pool, shape), want, atol=2e-5, rtol=2e-5)
    assert kinds == ["tokens", "tokens", "tokens"]
