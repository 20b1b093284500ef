"""The tensors of a GGUF file, indexed without parsing its metadata values.

``gguf.GGUFReader`` builds a numpy view of every metadata value, which for a 262k-token
vocabulary (Gemma 3) takes about 20 s on this CPU before the first tensor is read; the
tensors need only the header's layout. The metadata itself (config, tokenizer) comes from
transformers (fastgen.model.loader). GGUF layout (version 2 and 3, little-endian):
magic ``GGUF``, u32 version, u64 tensor count, u64 metadata count, the metadata
(key string, u32 value type, value), then per tensor (name string, u32 number of dims,
u64 dims (innermost first), u32 ggml type, u64 offset), then the data, aligned to
``general.alignment`` (32 by default). A string is a u64 length and its bytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
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

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            n = self.u64()   # read before ``pos`` is (``pos += self.u64()`` would drop the 8 bytes)
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _SCALAR_SIZES:
                self.pos += _SCALAR_SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            self.pos += _SCALAR_SIZES[vtype]


def read_tensors(path: str | Path) -> list[GgufTensor]:
    """Every tensor of the GGUF file at ``path``, memory-mapped; ``ValueError`` if it is not one."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(mm[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.u32()
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2, 3)")
    num_tensors, num_kv = cur.u64(), cur.u64()
    alignment = 32
    for _ in range(num_kv):
        key, vtype = cur.string(), cur.u32()
        if key == "general.alignment" and vtype == 4:
            alignment = cur.u32()
        else:
            cur.skip_value(vtype)
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
    return tensors
