"""Reading a GGUF file: metadata and tensor descriptors.

GGUF layout (little-endian): ``"GGUF"``, version, tensor count, metadata count;
then the metadata key/value pairs; then one descriptor per tensor (name, dims,
ggml type, offset); then, aligned to ``general.alignment`` (default 32), the
tensor data.  The file is memory-mapped and tensors stay on disk until
`GGUFTensor.raw` is asked for their bytes.

This reader exists because `gguf.GGUFReader` builds a NumPy view for every
array element: on Gemma 3's 262,144-token vocabulary that takes ~10 s, this
takes a fraction of a second.  Type constants, block sizes and dequantization
still come from the `gguf` package.

A truncated or corrupt file raises `ValueError` naming the file: every count
and size read from it is checked against the bytes that are actually there
before anything is allocated from it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
MAX_ARRAY_NESTING = 8  # real files nest at most once; deeper means a corrupt header
MAX_DIMS = 8


@dataclass(frozen=True)
class GGUFTensor:
    """Where one tensor lives in the file. `shape` is in NumPy order (GGUF's dims reversed)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    offset: int   # absolute, in bytes
    nbytes: int

    def raw(self, buf) -> np.ndarray:
        """The tensor's bytes as uint8 ``[rows, bytes_per_row]`` (what `gguf.quants.dequantize` takes)."""
        data = np.frombuffer(buf, dtype=np.uint8, count=self.nbytes, offset=self.offset)
        return data.reshape(-1, self.nbytes // max(1, int(np.prod(self.shape[:-1], dtype=np.int64))))


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        if self.pos + length > len(self.buf):
            raise ValueError(f"string of {length} bytes runs past the end of the file")
        value = bytes(self.buf[self.pos:self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return value

    def count(self, n: int, min_bytes_each: int, what: str) -> int:
        """A count read from the file, refused when its items cannot fit in the bytes left."""
        if n * min_bytes_each > len(self.buf) - self.pos:
            raise ValueError(f"{what} count {n:,} does not fit in the {len(self.buf) - self.pos:,} bytes left")
        return n

    def value(self, vtype: int, depth: int = 0):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise ValueError(f"metadata arrays nested more than {MAX_ARRAY_NESTING} deep")
            etype, count = self.scalar("<I"), self.scalar("<Q")
            self.count(count, 1 if etype in _SCALARS else 8, "array element")
            if etype in _SCALARS:  # numeric array: one NumPy read
                dtype = np.dtype(_SCALARS[etype].replace("?", "b1"))
                if self.pos + count * dtype.itemsize > len(self.buf):
                    raise ValueError(f"array of {count} elements runs past the end of the file")
                array = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += count * dtype.itemsize
                return array
            return [self.value(etype, depth + 1) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.scalar(_SCALARS[vtype])


class GGUFFile:
    """One GGUF file: `metadata` (dict), `tensors` (name -> GGUFTensor, file order), `architecture`."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as fh:
            magic = fh.read(4)
            if magic != GGUF_MAGIC:
                raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
            self.buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except (ValueError, struct.error, UnicodeDecodeError, OverflowError, KeyError, TypeError,
                ZeroDivisionError, RecursionError, MemoryError) as exc:
            raise ValueError(f"cannot read GGUF file {path} ({len(self.buf):,} bytes): "
                             f"it is truncated or corrupt ({exc})") from exc
        self.architecture: str = self.metadata.get("general.architecture", "")
        if not self.architecture:
            raise ValueError(f"GGUF file {path} has no general.architecture key")

    def _parse(self) -> None:
        cur = _Cursor(self.buf)
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {self.version} (big-endian files are not supported)")
        n_tensors = cur.count(cur.scalar("<Q"), 24, "tensor")
        n_kv = cur.count(cur.scalar("<Q"), 12, "metadata key")
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ValueError(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} accepted)")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
        alignment = self.metadata.get("general.alignment", 32)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or not 0 < alignment <= 1 << 20:
            raise ValueError(f"general.alignment must be a positive integer; got {alignment!r}")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            elements = 1
            for d in shape:
                elements *= int(d)
            if elements == 0 or int(shape[-1]) % block:
                raise ValueError(f"tensor {name} has shape {shape}, not a whole number of {qtype.name} blocks")
            nbytes = elements // block * type_size
            start = data_start + offset
            if start + nbytes > len(self.buf):
                raise ValueError(f"tensor {name} ends at byte {start + nbytes:,}, past the end of the file")
            self.tensors[name] = GGUFTensor(name, shape, qtype, start, nbytes)

    def get(self, key: str, default=None):
        """Metadata `key` (scalar, str, NumPy array or list of str), else `default`."""
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default=None):
        """`get("<architecture>.<key>")`, e.g. ``arch_get("attention.head_count")``."""
        return self.get(f"{self.architecture}.{key}", default)
