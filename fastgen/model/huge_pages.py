"""The weights a decode step streams moved onto 2 MiB pages (Linux transparent huge pages), once,
after load: quantized rows, and the plain weights the native GEMV reads (``quantization=none``).

A decode step streams every weight once: SmolLM2's 96 MB as 121 products of 70 KB to 30 MB. On
4 KiB pages that is ~24,000 pages a step, each a TLB miss, and the hardware prefetchers stop at
every page boundary. On the 2-core Zen 4 host (a VM: each miss walks two page tables) the 121
one-row products of a decode step took 0.81x the time with the same bytes on 2 MiB pages (one
process, old and new alternating, 30 rounds: 3.82 -> 3.09 ms); faster kernels had not moved that
time, because it was the memory's, not the arithmetic's. The plain bf16 weights (12-06, after the
GEMV's sixteen-row blocks): the 120 layer products from memory 0.83x the time in one buffer in
model order on 4 KiB pages and 0.77x on 2 MiB pages (28-29 of 30 rounds); whole batch-1 decodes
(one process holding both copies, alternating) 0.92x in bf16 (14 of 16) and 0.95x in fp32 (11 of 12).

The allocator does not give small tensors huge pages (PyTorch's ``THP_MEM_ALLOC_ENABLE`` only
advises allocations of 2 MiB and more, and most weights are smaller), so the weights are copied
into one anonymous mapping aligned to 2 MiB and advised ``MADV_HUGEPAGE``, in the order the layers
call them; each format then holds views of it. The bytes and their values are the same; only where
they live changes. ``FASTGEN_HUGE_PAGES=0`` keeps the weights where they were loaded (A/B
measurements). Where the kernel has no transparent huge pages (``never``), or off Linux, nothing
moves.
"""
from __future__ import annotations

import logging
import mmap
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from .layers import GemvDenseWeight
from .quant import QuantEmbedding, QuantRows, QuantWeight

log = logging.getLogger(__name__)

ENV = "FASTGEN_HUGE_PAGES"      # "1" (default) | "0"
HUGE_PAGE = 2 << 20
ALIGN = 64                      # each tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page setting (``always``, ``madvise``, ``never``), None
    where it cannot be read (not Linux)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_page_buffer(num_bytes: int) -> torch.Tensor | None:
    """A uint8 tensor of ``num_bytes`` on anonymous memory aligned to 2 MiB and advised
    ``MADV_HUGEPAGE``; None where that cannot be had (off Linux, no THP, no madvise)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    if thp_mode() not in ("always", "madvise"):
        return None
    area = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        area.close()
        return None
    # the tensor keeps the mapping alive (torch.frombuffer holds a reference to its buffer)
    whole = torch.frombuffer(area, dtype=torch.uint8)
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start:start + num_bytes]


def _formats(model: torch.nn.Module):
    """``(module, its weight format)`` for every module, a tensor-parallel format unwrapped to the
    rank's inner one (fastgen/parallel/layers.py); the format None where the module has none."""
    for m in model.modules():
        fmt = getattr(m, "format", None)
        yield m, getattr(fmt, "inner", fmt)


def _quant_holders(model: torch.nn.Module) -> list[tuple[object, str]]:
    """``(object, attribute)`` of every QuantRows the model's hot paths read: the formats of its
    linear layers (the output head included; a tensor-parallel format's inner one), a quantized
    embedding, and the model's own reference to a tied embedding's rows."""
    holders: list[tuple[object, str]] = []
    for m, fmt in _formats(model):
        if type(fmt) is QuantWeight:
            holders.append((fmt, "quant"))
        if isinstance(m, QuantEmbedding):
            holders.append((m, "rows"))
    if isinstance(getattr(model, "_embed_quant", None), QuantRows):
        holders.append((model, "_embed_quant"))
    return holders


def _dense_holders(model: torch.nn.Module) -> list[tuple[object, str]]:
    """``(format, attribute)`` of every plain weight and bias the native GEMV streams for decode
    rows (``GemvDenseWeight``: ``quantization=none`` on CPU; a tensor-parallel format's inner one)."""
    holders: list[tuple[object, str]] = []
    for _, fmt in _formats(model):
        if type(fmt) is GemvDenseWeight:
            holders += [(fmt, "weight")] + ([(fmt, "bias")] if fmt.bias is not None else [])
    return holders


def move_to_huge_pages(model: torch.nn.Module) -> int:
    """Copy the tensors a decode step streams (quantized rows, and the plain weights of the native
    GEMV) into one huge-page buffer, in the model's order, and point their holders at it.
    Returns the bytes moved (0 when nothing moved: turned off, not CPU, nothing to move, or no
    huge pages to be had). Tensors shared by several holders (a tied head and embedding) stay
    shared: a parameter on the same memory (a tied embedding's) follows."""
    if os.environ.get(ENV, "1") == "0":
        return 0
    quant = [(obj, attr) for obj, attr in _quant_holders(model) if getattr(obj, attr).qweight.device.type == "cpu"]
    dense = [(obj, attr) for obj, attr in _dense_holders(model) if getattr(obj, attr).device.type == "cpu"]
    tensors: dict[int, torch.Tensor] = {}
    for obj, attr in quant:
        rows = getattr(obj, attr)
        for t in (rows.qweight, rows.scales, rows.mins):
            if t is not None and t.is_contiguous():
                tensors.setdefault(t.data_ptr(), t)
    for obj, attr in dense:
        t = getattr(obj, attr)
        if t.is_contiguous() and t.numel() > 0:
            tensors.setdefault(t.data_ptr(), t)
    if not tensors:
        return 0
    sizes = {ptr: (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN for ptr, t in tensors.items()}
    buf = huge_page_buffer(sum(sizes.values()))
    if buf is None:
        log.info("weights stay on the allocator's pages (no transparent huge pages here)")
        return 0
    moved: dict[int, torch.Tensor] = {}
    offset = 0
    for ptr, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        view = buf[offset:offset + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        moved[ptr] = view
        offset += sizes[ptr]

    def new(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.data_ptr() not in moved:
            return t
        view = moved[t.data_ptr()]
        return view if view.shape == t.shape and view.dtype == t.dtype else t

    for obj, attr in quant:
        rows = getattr(obj, attr)
        object.__setattr__(obj, attr, replace(rows, qweight=new(rows.qweight), scales=new(rows.scales),
                                              mins=new(rows.mins)))
    for obj, attr in dense:
        setattr(obj, attr, new(getattr(obj, attr)))
    for p in model.parameters():   # a tied embedding's weight: the head's rows, not a copy of them
        if p.numel() > 0 and p.data_ptr() in moved and moved[p.data_ptr()].shape == p.shape:
            p.data = moved[p.data_ptr()]
    log.info("decode weights on 2 MiB pages: %.1f MB", offset / 1e6)
    return offset
