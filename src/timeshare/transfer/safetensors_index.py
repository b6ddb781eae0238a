"""A safetensors file's tensor index, read from its header alone (``SafetensorsIndex``,
one index over a model's shards too), with the ``Fingerprint`` that tells the registered
file from a changed one. Runs wherever weights files are registered or read: the
controller, or the worker that loads.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from timeshare.errors import WeightsError

# safetensors' dtype names (its format specification) and torch's dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"),
                     ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)


# ---------------------------------------------------------------------- safetensors index
@dataclass(frozen=True)
class Fingerprint:
    """What identifies a weights file as the one registered."""

    size: int
    mtime_ns: int
    header: bytes

    @classmethod
    def of(cls, path: Path, header: bytes) -> Fingerprint:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, header)


@dataclass(frozen=True)
class FileTensor:
    """One tensor of a safetensors file: absolute byte range in the file, and which of
    its index's files (``file``: a model sharded over several) holds it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int
    file: int = 0

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsIndex:
    """The tensor index of a safetensors file, or of a model's shards (one index over
    several files, ``read_many``), from their headers alone."""

    paths: tuple[Path, ...]
    tensors: dict[str, FileTensor]
    fingerprints: tuple[Fingerprint, ...]

    @property
    def path(self) -> Path:
        """The first file (the one, unless sharded)."""
        return self.paths[0]

    @classmethod
    def read_many(cls, paths: Iterable[str | os.PathLike]) -> SafetensorsIndex:
        """One index over the shards ``paths``; a tensor name in two of them is an error."""
        parts = [cls.read(p) for p in paths]
        if not parts:
            raise WeightsError("no safetensors files given")
        tensors: dict[str, FileTensor] = {}
        for i, part in enumerate(parts):
            for name, ft in part.tensors.items():
                if name in tensors:
                    raise WeightsError(f"tensor {name!r} is in two shards: {str(parts[tensors[name].file].path)!r} "
                                       f"and {str(part.path)!r}")
                tensors[name] = FileTensor(name, ft.dtype, ft.shape, ft.start, ft.end, i)
        return cls(tuple(p.path for p in parts), tensors, tuple(p.fingerprints[0] for p in parts))

    @classmethod
    def read(cls, path: str | os.PathLike) -> SafetensorsIndex:
        """The header of ``path`` parsed and checked against the file's size; a file
        that is not safetensors, or is cut short, raises ``WeightsError``."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise WeightsError(f"weights file {str(path)!r} is too short for a safetensors header")
                (n,) = struct.unpack("<Q", head)
                size = os.fstat(f.fileno()).st_size
                if n > size - 8 or n > 100 << 20:
                    raise WeightsError(f"weights file {str(path)!r} has a header length of {n} bytes in a "
                                       f"file of {size}: not safetensors, or truncated")
                header = f.read(n)
        except FileNotFoundError:
            raise WeightsError(f"weights file {str(path)!r} does not exist") from None
        except OSError as exc:
            raise WeightsError(f"weights file {str(path)!r} cannot be read: {exc}") from exc
        try:
            meta = json.loads(header)
        except ValueError as exc:
            raise WeightsError(f"weights file {str(path)!r} has a header that is not JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise WeightsError(f"weights file {str(path)!r} has a malformed header")
        base = 8 + n
        tensors: dict[str, FileTensor] = {}
        for name, info in meta.items():
            if name == "__metadata__":
                continue
            try:
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"weights file {str(path)!r}: tensor {name!r} has a malformed or "
                                   f"unsupported entry {info!r}") from None
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or begin < 0 or base + end > size:
                raise WeightsError(f"weights file {str(path)!r}: tensor {name!r} spans bytes {begin}-{end}, "
                                   f"which do not fit its shape {list(shape)} or the file ({size} bytes)")
            tensors[name] = FileTensor(name, dtype, shape, base + begin, base + end)
        return cls((path,), tensors, (Fingerprint.of(path, header),))

    def check(self) -> None:
        """Raise ``WeightsError`` unless every file is still the one indexed."""
        for path, old in zip(self.paths, self.fingerprints):
            where = f"weights file {str(path)!r}"
            try:
                now = Fingerprint.of(path, b"")
            except FileNotFoundError:
                raise WeightsError(f"{where} disappeared after the model was registered") from None
            if now.size != old.size:
                raise WeightsError(f"{where} changed size after the model was registered ({old.size} bytes, now "
                                   f"{now.size}): truncated or rewritten; register the model again")
            if now.mtime_ns != old.mtime_ns:
                raise WeightsError(f"{where} was modified after the model was registered; register the model again")
            with open(path, "rb") as f:
                f.seek(8)
                if f.read(len(old.header)) != old.header:
                    raise WeightsError(f"{where} has a different header than when the model was registered")
