"""The decode weights moved onto 2 MiB pages (fastgen/model/huge_pages.py): quantized rows and the
plain weights of the native GEMV, the same bytes, one buffer, shared rows still shared, the same
logits bit for bit."""
from __future__ import annotations

import pytest
import torch

from fastgen import kernels
from fastgen.model import huge_pages
from fastgen.model.llama import ModelConfig
from fastgen.model.loader import load_hf_config, load_model
from fastgen.model.quant import QuantEmbedding

from .ragged import ragged_logits
from .test_parity import TINY, _tiny_configs, random_checkpoint


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not kernels.load():
        pytest.fail("fastgen's native kernels did not build on this host")


def _load(tmp_path, monkeypatch, on: bool, quantization: str = "int4"):
    """SmolLM2's shape in miniature: a tied head (its rows are the embedding's), int4 rows."""
    path = tmp_path / "ckpt"
    if not path.exists():
        random_checkpoint(_tiny_configs()["llama-tied-llama3-rope"], path)
    monkeypatch.setenv(huge_pages.ENV, "1" if on else "0")
    model = load_model(str(path), dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=256,
                       kernels="native", quantization=quantization)
    return model, ModelConfig.from_hf(load_hf_config(str(path)))


def _rows(model) -> list:
    return [getattr(obj, attr) for obj, attr in huge_pages._quant_holders(model)]


def _logits(model, cfg):
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist() for n in (3, 9, 17, 30)]
    decodes = ragged_logits(model, cfg, sequences, block_size=4, seed=3, max_chunk=1)
    chunks = ragged_logits(model, cfg, sequences, block_size=4, seed=3, max_chunk=12)
    return decodes + chunks


def test_quantized_rows_move_into_one_buffer_and_compute_the_same(tmp_path, monkeypatch):
    if huge_pages.thp_mode() not in ("always", "madvise"):
        pytest.skip(f"this kernel gives no transparent huge pages (setting: {huge_pages.thp_mode()})")
    before, cfg = _load(tmp_path, monkeypatch, on=False)
    after, _ = _load(tmp_path, monkeypatch, on=True)
    old, new = _rows(before), _rows(after)
    # the head, the layers, the quantized embedding and the model's reference to its rows
    assert len(new) == len(old) and any(isinstance(m, QuantEmbedding) for m in after.modules())
    ptrs = set()
    for o, n in zip(old, new):
        for a, b in ((o.qweight, n.qweight), (o.scales, n.scales), (o.mins, n.mins)):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
            assert b.data_ptr() % huge_pages.ALIGN == 0
            ptrs.add((b.data_ptr(), b.numel() * b.element_size()))
    # one buffer: the moved tensors lie back to back, nothing between them but alignment
    ordered = sorted(ptrs)
    span = ordered[-1][0] + ordered[-1][1] - ordered[0][0]
    assert span <= sum(-(-size // huge_pages.ALIGN) * huge_pages.ALIGN for _, size in ordered)
    # the tied head still reads the embedding's rows, not a copy of them
    assert after.head.format.quant.qweight.data_ptr() == after.embed_tokens.rows.qweight.data_ptr()
    assert after._embed_quant.qweight.data_ptr() == after.embed_tokens.rows.qweight.data_ptr()
    for g, w in zip(_logits(after, cfg), _logits(before, cfg)):
        assert torch.equal(g, w)


def test_nothing_moves_where_turned_off_or_without_huge_pages(tmp_path, monkeypatch):
    model, _ = _load(tmp_path, monkeypatch, on=False)
    ptrs = [r.qweight.data_ptr() for r in _rows(model)]
    assert huge_pages.move_to_huge_pages(model) == 0          # FASTGEN_HUGE_PAGES=0
    monkeypatch.setenv(huge_pages.ENV, "1")
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert huge_pages.move_to_huge_pages(model) == 0
    assert [r.qweight.data_ptr() for r in _rows(model)] == ptrs


def test_dense_gemv_weights_move_too_and_a_tied_embedding_follows(tmp_path, monkeypatch):
    """``quantization=none``: every GemvDenseWeight's weight lands in one buffer in model order (where
    the kernel gives huge pages; elsewhere they stay put), the tied embedding's parameter is the
    head's rows (one copy, not two), the logits unchanged."""
    moves = huge_pages.thp_mode() in ("always", "madvise")
    before, cfg = _load(tmp_path, monkeypatch, on=False, quantization="none")
    after, _ = _load(tmp_path, monkeypatch, on=True, quantization="none")
    old = [getattr(o, a) for o, a in huge_pages._dense_holders(before)]
    new = [getattr(o, a) for o, a in huge_pages._dense_holders(after)]
    # the layers' four products each and the tied head
    assert len(new) == len(old) == 4 * TINY["num_hidden_layers"] + 1
    for a, b in zip(old, new):
        assert torch.equal(a, b)
    # with huge pages: in the order the layers call them, back to back, each on a cache line (as
    # loaded, with FASTGEN_HUGE_PAGES=0, they are not)
    def one_buffer(ts):
        starts = [t.data_ptr() for t in ts]
        end = starts[-1] + ts[-1].numel() * ts[-1].element_size()
        span = sum(-(-(t.numel() * t.element_size()) // huge_pages.ALIGN) * huge_pages.ALIGN for t in ts)
        return starts == sorted(starts) and end - starts[0] <= span and all(p % huge_pages.ALIGN == 0 for p in starts)

    assert one_buffer(new) == moves and not one_buffer(old)
    assert after.embed_tokens.weight.data_ptr() == after.head.format.weight.data_ptr()
    for g, w in zip(_logits(after, cfg), _logits(before, cfg)):
        assert torch.equal(g, w)
