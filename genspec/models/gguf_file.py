"""What a GGUF file is, read from its own bytes: whether a path names one, and whether it is whole.

A GGUF file begins with the magic bytes ``GGUF``, a version, its tensor and metadata counts, the metadata
(key, type, value), then each tensor's name, shape, type and offset into the data section, which starts at
the next multiple of its alignment. So the header alone says how long a whole file is: a file shorter than
that (a download or copy cut short) is refused here by name, before llama.cpp or transformers read it and
fail on some later array with a message that blames something else. The header is parsed in a memory map,
nothing of the tensor data read.

:class:`TensorRows` reads rows of one tensor (a token embedding's, an output layer's) from that map and
dequantises only those, with the ``gguf`` package's dequantisers: a head drafting for a llama.cpp target needs a
few embedding rows a step, not the whole 262,144-row matrix. (``gguf.GGUFReader`` parses every metadata array
into NumPy objects, seconds for a 262,144-token vocabulary, where this parser skips them.)
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from genspec.errors import InputFileError

#: the bytes every GGUF file begins with
MAGIC = b"GGUF"
#: the extension GGUF files go by (in any case)
SUFFIX = ".gguf"
#: the GGUF versions whose layout is parsed here (1, long superseded, counted in 32-bit integers; a newer
#: one is left to llama.cpp to accept or refuse)
VERSIONS = (2, 3)
#: the data section's alignment when the metadata gives no ``general.alignment``
DEFAULT_ALIGNMENT = 32
#: bytes of each fixed-size metadata value type, by its GGUF type id (8 is a string, 9 an array)
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: the struct codes of the scalar types, by GGUF type id (uint8, int8, ..., bool, uint64, int64, float64)
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def is_gguf(path: str | os.PathLike | None) -> bool:
    """True if ``path`` names a GGUF file: a file that begins with :data:`MAGIC`, whatever its name, or a
    path with the ``.gguf`` extension in any case (``Model.GGUF``) that is not a directory (so a missing
    ``model.gguf`` is reported as a missing GGUF model, not as a missing model directory)."""
    if path is None:
        return False
    path = Path(path)
    if path.is_dir():
        return False
    if path.is_file():
        try:
            with open(path, "rb") as handle:
                if handle.read(len(MAGIC)) == MAGIC:
                    return True
        except OSError:
            pass
    return path.suffix.lower() == SUFFIX


class _Truncated(Exception):
    """The header runs past the end of the file."""


class _NotGGUF(Exception):
    """The file does not begin with :data:`MAGIC`."""


class _Header:
    """A cursor over the header's bytes (``data``, little- or big-endian ``order``)."""

    def __init__(self, data, order: str):
        self.data, self.order, self.at = data, order, 0

    def skip(self, count: int) -> None:
        self.at += count
        if self.at > len(self.data):
            raise _Truncated

    def unpack(self, code: str) -> int:
        size = struct.calcsize(code)
        if self.at + size > len(self.data):
            raise _Truncated
        (value,) = struct.unpack_from(self.order + code, self.data, self.at)
        self.at += size
        return value

    def string(self) -> bytes:
        length = self.unpack("Q")
        start = self.at
        self.skip(length)
        return bytes(self.data[start:self.at])

    def strings(self, count: int) -> None:
        """Skip ``count`` strings (a vocabulary's hundreds of thousands: one length read each, no copies)."""
        length, data, at = struct.Struct(self.order + "Q").unpack_from, self.data, self.at
        try:
            for _ in range(count):  # each takes at least 8 bytes, so a bad count ends at the file's end
                at += 8 + length(data, at)[0]
        except struct.error:  # a length past the end
            raise _Truncated from None
        self.at = at
        if at > len(data):
            raise _Truncated

    def value(self, kind: int):
        """A metadata value of GGUF type ``kind``: a scalar or a string (decoded) is returned, an array
        only skipped (None)."""
        if kind in _SCALAR_CODES:
            return self.unpack(_SCALAR_CODES[kind])
        if kind == _STRING:
            return self.string().decode("utf-8", "replace")
        if kind == _ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item in _VALUE_SIZES:
                self.skip(count * _VALUE_SIZES[item])
            elif item == _STRING:
                self.strings(count)
            else:
                for _ in range(count):  # nested arrays: each takes at least 12 bytes, so this ends
                    self.value(item)
            return None
        raise ValueError(f"unknown metadata value type {kind}")


def _tensor_bytes(kind: int, shape: list[int]) -> int | None:
    """Bytes of a tensor of ggml type ``kind`` and ``shape``; None for a type this gguf package does not know."""
    import gguf  # here: 0.2 s that `import genspec` does not spend for a model directory

    try:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        return None
    elements = 1
    for dimension in shape:
        elements *= dimension
    return elements // block * size


def check_complete(path: str | os.PathLike) -> None:
    """Refuse (:class:`~genspec.errors.InputFileError`) a file that is not a whole GGUF file: one that does
    not begin with :data:`MAGIC`, or ends before its header does, or before the tensor data its header
    describes. A version whose layout is not parsed here (:data:`VERSIONS`), or a header that cannot be
    parsed for another reason, is left to the loader."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise InputFileError(f"cannot load {path}: the file is empty, not a GGUF file")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                extent = _described_size(data)
    except OSError as exc:
        raise InputFileError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except _NotGGUF:
        raise InputFileError(f"cannot load {path}: not a GGUF file (it does not begin with the bytes "
                             f"{MAGIC.decode()})") from None
    except _Truncated:
        raise InputFileError(f"cannot load {path}: truncated, not a complete GGUF file (its {size:,} bytes end "
                             "inside its header)") from None
    if extent is not None and extent > size:
        raise InputFileError(f"cannot load {path}: truncated, not a complete GGUF file ({size:,} bytes; its "
                             f"header describes {extent:,})")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its ``shape`` in ggml's order (the fastest-varying dimension first: a
    ``[rows, width]`` matrix is ``(width, rows)``), its ggml type ``kind`` and ``offset`` into the data section."""

    name: str
    shape: tuple[int, ...]
    kind: int
    offset: int


@dataclass(frozen=True)
class Header:
    """A GGUF file's header: its scalar and string metadata (arrays, such as the vocabulary, are skipped),
    its tensors by name, where the data section starts and where the described data ends (None where a
    tensor's type is unknown to the ``gguf`` package)."""

    metadata: dict[str, object]
    tensors: dict[str, TensorInfo]
    data_start: int
    end: int | None


def _header(data) -> Header | None:
    """The header of the GGUF file in ``data``; None where it is not one parsed here (:data:`VERSIONS`, a
    metadata type not known). Raises :class:`_Truncated` if the header runs past ``data``'s end,
    :class:`_NotGGUF` if ``data`` does not begin as GGUF does."""
    if bytes(data[:len(MAGIC)]) != MAGIC:
        if MAGIC.startswith(bytes(data[:len(MAGIC)])):
            raise _Truncated
        raise _NotGGUF
    if len(data) < 8:
        raise _Truncated
    little, = struct.unpack_from("<I", data, 4)
    big, = struct.unpack_from(">I", data, 4)
    order = "<" if little in VERSIONS else ">" if big in VERSIONS else None
    if order is None:
        return None
    header = _Header(data, order)
    header.skip(8)
    count, entries = header.unpack("Q"), header.unpack("Q")
    metadata: dict[str, object] = {}
    tensors: dict[str, TensorInfo] = {}
    try:
        for _ in range(entries):
            key, kind = header.string().decode("utf-8", "replace"), header.unpack("I")
            value = header.value(kind)
            if value is not None:
                metadata[key] = value
        end: int | None = 0
        for _ in range(count):
            name = header.string().decode("utf-8", "replace")
            shape = tuple(header.unpack("Q") for _ in range(header.unpack("I")))
            kind, offset = header.unpack("I"), header.unpack("Q")
            tensors[name] = TensorInfo(name, shape, kind, offset)
            nbytes = _tensor_bytes(kind, list(shape))
            end = None if nbytes is None or end is None else max(end, offset + nbytes)
    except ValueError:  # an unknown value type: not a layout parsed here
        return None
    alignment = metadata.get("general.alignment") or DEFAULT_ALIGNMENT
    start = -(-header.at // alignment) * alignment
    return Header(metadata, tensors, start if count else header.at, None if end is None else (start + end if count else header.at))


def _described_size(data) -> int | None:
    """The bytes a whole GGUF file with this header holds (the end of its last tensor's data); None where
    the header is not one parsed here. Raises :class:`_Truncated` if the header runs past ``data``'s end,
    :class:`_NotGGUF` if ``data`` does not begin as GGUF does."""
    header = _header(data)
    return None if header is None else header.end


def read_header(path: str | os.PathLike) -> Header:
    """The header of the GGUF file at ``path`` (:class:`Header`); an :class:`~genspec.errors.InputFileError` where
    it is not a whole GGUF file (:func:`check_complete`) or not one parsed here."""
    check_complete(path)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _header(data)
    if header is None:
        raise InputFileError(f"cannot read the header of {path}: a GGUF version or metadata type not parsed here")
    return header


class TensorRows:
    """Rows of one 2-D tensor of a GGUF file, dequantised to float32 when read: ``rows(ids)`` ``[len(ids), width]``.
    The file stays memory-mapped; only the rows asked for are read and dequantised (``gguf.quants``).

        >>> embedding = TensorRows(path, "token_embd.weight")   # doctest: +SKIP
        >>> embedding.rows(torch.tensor([2, 9])).shape           # doctest: +SKIP
        torch.Size([2, 640])
    """

    def __init__(self, path: str | os.PathLike, name: str, header: Header | None = None):
        import gguf  # here: 0.2 s that `import genspec` does not spend for a model directory

        header = read_header(path) if header is None else header
        if name not in header.tensors:
            raise InputFileError(f"{path} holds no tensor {name!r}")
        info = header.tensors[name]
        if len(info.shape) != 2:
            raise InputFileError(f"tensor {name!r} of {path} has {len(info.shape)} dimensions, not 2")
        self.kind = gguf.GGMLQuantizationType(info.kind)
        self.width, self.num_rows = info.shape
        block, size = gguf.GGML_QUANT_SIZES[self.kind]
        row_bytes = self.width // block * size
        self._dequantize = gguf.quants.dequantize
        self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_start + info.offset,
                               shape=(self.num_rows, row_bytes))

    def rows(self, ids) -> torch.Tensor:
        """The rows ``ids`` (any integer array, any shape ``S``) as float32, ``[*S, width]``."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        flat = ids.reshape(-1).numpy()
        values = self._dequantize(np.asarray(self._data[flat]), self.kind).reshape(len(flat), self.width)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(*ids.shape, self.width)
