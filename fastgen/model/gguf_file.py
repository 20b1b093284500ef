"""The tensors and scalar metadata of a GGUF file, indexed without parsing its vocabulary.

``gguf.GGUFReader`` builds a numpy view of every metadata value, which for a 262k-token
vocabulary (Gemma 3) takes about 20 s on this CPU before the first tensor is read; the
tensors need only the header's layout, and a family's config only the scalar keys
(:class:`GgufHeader`). The tokenizer (and, for the families whose GGUF config transformers
maps, the config) comes from transformers (fastgen.model.loader). GGUF layout (version 2 and 3, little-endian):
magic ``GGUF``, u32 version, u64 tensor count, u64 metadata count, the metadata
(key string, u32 value type, value), then per tensor (name string, u32 number of dims,
u64 dims (innermost first), u32 ggml type, u64 offset), then the data, aligned to
``general.alignment`` (32 by default). A string is a u64 length and its bytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_ARRAY_READ = 1024   # longer arrays (vocabularies, merges) are skipped: only their length is kept
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray      # F32/F16: the values [rows, cols]; other types: bytes [rows, row_bytes]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return v

    def string(self) -> str:
        n = self.u64()
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        """A scalar, a string, or a tuple for an array of scalars up to MAX_ARRAY_READ long;
        other arrays are skipped and come back as :class:`ArrayLength`."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype not in _SCALAR_SIZES or count > MAX_ARRAY_READ:
                self.skip_elements(etype, count)
                return ArrayLength(count)
            return tuple(self.value(etype) for _ in range(count))
        (v,) = struct.unpack_from(_SCALAR_FORMATS[vtype], self.buf, self.pos)
        self.pos += _SCALAR_SIZES[vtype]
        return v

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            n = self.u64()   # read before ``pos`` is (``pos += self.u64()`` would drop the 8 bytes)
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            self.skip_elements(etype, count)
        else:
            self.pos += _SCALAR_SIZES[vtype]

    def skip_elements(self, etype: int, count: int) -> None:
        if etype in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[etype] * count
        else:
            for _ in range(count):
                self.skip_value(etype)


@dataclass(frozen=True)
class ArrayLength:
    """A metadata array that was not read (a vocabulary, its merges): its length."""

    length: int


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's metadata (``meta``: key -> value, see :meth:`_Cursor.value`) and tensors."""

    meta: dict[str, Any]
    tensors: list[GgufTensor] = field(repr=False)

    @property
    def arch(self) -> str:
        return self.meta.get("general.architecture", "")

    def tensor(self, name: str) -> GgufTensor | None:
        return next((t for t in self.tensors if t.name == name), None)

    def has(self, name: str) -> bool:
        return self.tensor(name) is not None

    def key(self, name: str, default: Any = ...) -> Any:
        """``meta[name]``, ``{arch}`` replaced by the file's architecture; without ``default``,
        a missing key is a ``KeyError`` that names it (the file lacks what the config needs)."""
        full = name.replace("{arch}", self.arch)
        if full in self.meta:
            return self.meta[full]
        if default is ...:
            raise KeyError(f"the GGUF file has no metadata key {full!r}")
        return default


def read_tensors(path: str | Path) -> list[GgufTensor]:
    """Every tensor of the GGUF file at ``path``, memory-mapped; ``ValueError`` if it is not one."""
    return read_header(path).tensors


def read_header(path: str | Path) -> GgufHeader:
    """The metadata and the (memory-mapped) tensors of the GGUF file at ``path``; ``ValueError``
    if it is not one."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2, 3)")
    num_tensors, num_kv = cur.u64(), cur.u64()
    meta = {}
    for _ in range(num_kv):
        key, vtype = cur.string(), cur.u32()
        meta[key] = cur.value(vtype)
    alignment = meta.get("general.alignment", 32)
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.u64() for _ in range(cur.u32())]
        infos.append((name, GGMLQuantizationType(cur.u32()), dims, cur.u64()))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, qtype, dims, offset in infos:
        shape = tuple(reversed(dims))                      # [rows, cols], outermost first
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(dims)) * type_size // block
        raw = mm[start + offset:start + offset + n_bytes]
        if qtype in _PLAIN:
            data = raw.view(_PLAIN[qtype]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors.append(GgufTensor(name, qtype, data))
    return GgufHeader(meta, tensors)


def rows(header: GgufHeader, name: str) -> int | None:
    """Rows of tensor ``name`` (of one expert, for a 3-D ``[experts, rows, cols]`` one); None if absent."""
    t = header.tensor(name)
    return None if t is None else t.data.shape[-2]


def base_config(header: GgufHeader) -> dict[str, Any]:
    """The transformers config fields that every llama.cpp LLM file states, under the keys of
    gguf-py's ``Keys`` (``{arch}`` the file's architecture); a family's GGUF config adds its own.
    ``KeyError`` names a required key the file lacks."""
    from gguf import Keys

    heads = header.key(Keys.Attention.HEAD_COUNT)
    embd = header.tensor("token_embd.weight")
    if embd is None:
        raise KeyError("the GGUF file has no tensor 'token_embd.weight'")
    return dict(
        vocab_size=embd.data.shape[0], hidden_size=header.key(Keys.LLM.EMBEDDING_LENGTH),
        num_hidden_layers=header.key(Keys.LLM.BLOCK_COUNT), num_attention_heads=heads,
        num_key_value_heads=header.key(Keys.Attention.HEAD_COUNT_KV, heads),
        max_position_embeddings=header.key(Keys.LLM.CONTEXT_LENGTH),
        bos_token_id=header.key(Keys.Tokenizer.BOS_ID, None), eos_token_id=header.key(Keys.Tokenizer.EOS_ID, None),
        pad_token_id=header.key(Keys.Tokenizer.PAD_ID, None),
        # llama.cpp writes the output projection only where it is not the embedding
        tie_word_embeddings=not header.has("output.weight"))


def default_rope(header: GgufHeader, rotary_fraction: float = 1.0) -> dict[str, Any]:
    """transformers' ``rope_parameters`` of a file with plain RoPE; ``ValueError`` for a RoPE
    scaling type (``{arch}.rope.scaling.type``) that the family's GGUF config does not map."""
    from gguf import Keys

    scaling = header.key(Keys.Rope.SCALING_TYPE, "none")
    if scaling != "none":
        raise ValueError(f"GGUF RoPE scaling {scaling!r} is not mapped for {header.arch!r} files")
    params = {"rope_type": "default", "rope_theta": float(header.key(Keys.Rope.FREQ_BASE, 10000.0))}
    return params if rotary_fraction == 1.0 else {**params, "partial_rotary_factor": rotary_fraction}
