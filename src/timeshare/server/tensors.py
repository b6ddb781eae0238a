"""Tensors in the Open Inference Protocol: datatype names, JSON ``data`` and the binary
tensor data extension, to and from torch tensors. Pure functions; run in the server.

Every check here raises :class:`BadRequest` with a message that names the tensor, so
that malformed input becomes a 400, never a 500.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from timeshare.dtypes import DATATYPES, TORCH_DTYPES
from timeshare.errors import BadRequest, TimeshareError

_NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}
KNOWN = set(TORCH_DTYPES) | {"BYTES"}
_INTEGERS = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}


def datatype_of(dtype: torch.dtype) -> str:
    try:
        return DATATYPES[dtype]
    except KeyError:
        raise TimeshareError(f"torch dtype {dtype} has no Open Inference Protocol datatype") from None


_ELEMENT_SIZES = {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}


def element_size(datatype: str) -> int:
    return _ELEMENT_SIZES[datatype]


def from_json(name: str, datatype: str, shape: list[int], data) -> torch.Tensor:
    """The tensor an input's JSON ``data`` describes: a flat list in row-major order or
    nested lists of ``shape``. Strict: strings, nulls, booleans in a number tensor, a
    float in an integer tensor, values out of the datatype's range and ragged lists are
    refused. ``data`` is let go as soon as it was read: a caller that passes its only
    reference frees the Python values (tens of MB for a large body) before the tensor
    is made."""
    count = math.prod(shape)
    if not isinstance(data, list):
        raise BadRequest(f"input {name!r}: 'data' must be a list of {count} values, got {type(data).__name__}")
    try:
        arr = np.asarray(data)
    except ValueError:
        raise BadRequest(f"input {name!r}: 'data' is ragged (nested lists of different lengths)") from None
    kind = arr.dtype.kind if count else None
    has_bool = datatype != "BOOL" and kind in ("i", "u", "f") and _has_bool(data)  # numpy made them numbers
    # Integers beyond int64 (UINT64's upper half) make numpy fall back to float64 or
    # object arrays: such values are checked one by one.
    exact = _flatten(data) if datatype in _INTEGERS and kind not in (None, "i", "u") else None
    del data
    if arr.size != count:
        raise BadRequest(f"input {name!r}: shape {shape} needs {count} values, 'data' has {arr.size}")
    if arr.ndim > 1 and list(arr.shape) != list(shape):
        raise BadRequest(f"input {name!r}: nested 'data' has shape {list(arr.shape)}, not {shape}")
    if datatype == "BOOL":
        if kind not in (None, "b"):
            raise BadRequest(f"input {name!r}: BOOL data must be true/false values")
        out = arr.astype(np.bool_)
    elif has_bool:
        raise BadRequest(f"input {name!r}: {datatype} data must be numbers, not true/false")
    elif datatype in ("FP16", "FP32", "FP64", "BF16"):
        if kind not in (None, "f", "i", "u"):
            raise BadRequest(f"input {name!r}: {datatype} data must be numbers, got {_kind_name(kind)}")
        out = arr.astype(np.float64, copy=False)  # no copies nor temporaries: bodies can be tens of MB
        if count and not np.isfinite(out).all():
            raise BadRequest(f"input {name!r}: data contains NaN or infinity")
        if datatype != "FP64" and count and max(out.max(), -out.min()) > float(torch.finfo(TORCH_DTYPES[datatype]).max):
            raise BadRequest(f"input {name!r}: a value is out of range for {datatype}")
    elif datatype in _INTEGERS:
        info = np.iinfo(_NUMPY[datatype])
        if exact is None:
            lo, hi = (int(arr.min()), int(arr.max())) if count else (0, 0)
        else:
            if not all(type(v) is int for v in exact):
                raise BadRequest(f"input {name!r}: {datatype} data must be integers, got {_kind_name(kind)}")
            lo, hi = min(exact), max(exact)
            arr = np.array(exact, dtype=object)
        if lo < info.min or hi > info.max:
            raise BadRequest(f"input {name!r}: a value is out of range for {datatype} [{info.min}, {info.max}]")
        out = arr.astype(_NUMPY[datatype])
    else:
        raise BadRequest(f"input {name!r}: datatype {datatype} cannot be given as JSON data here")
    dtype = TORCH_DTYPES[datatype]
    if not count:  # numpy refuses empty shapes whose other dimensions multiply past its size limit
        return torch.empty(shape, dtype=dtype)
    out = np.ascontiguousarray(out.reshape(shape))
    if out.dtype.kind == "u" and out.dtype.itemsize > 1:  # torch.from_numpy takes no uint16/32/64 arrays
        return torch.from_numpy(out.view(f"<i{out.dtype.itemsize}")).view(dtype)
    return torch.from_numpy(out).to(dtype)


def _flatten(data) -> list:
    out: list = []
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            out.append(item)
    return out


def _has_bool(data) -> bool:
    if data and not isinstance(data[0], list):
        return any(v is True or v is False for v in data)
    return any(_has_bool(item) for item in data)


def from_binary(name: str, datatype: str, shape: list[int], raw: bytes | memoryview, *,
                finite: bool = True) -> torch.Tensor:
    """A tensor sent with the binary tensor data extension: ``raw`` holds the values in
    row-major order, little-endian. ``finite``: refuse NaN and infinity (inputs)."""
    if datatype not in TORCH_DTYPES:
        raise BadRequest(f"input {name!r}: datatype {datatype} is not supported as binary data here")
    count = math.prod(shape)
    size = count * element_size(datatype)
    if len(raw) != size:
        raise BadRequest(f"input {name!r}: {datatype} of shape {shape} is {size} bytes, binary data has {len(raw)}")
    dtype = TORCH_DTYPES[datatype]
    # One copy of the bytes (the tensor owns them: the body is read-only). numpy checks
    # small tensors for NaN several times faster than a torch op is dispatched.
    t = torch.frombuffer(bytearray(raw), dtype=dtype) if size else torch.empty(0, dtype=dtype)
    t = t.reshape(shape)
    if finite and count and dtype.is_floating_point:
        if not (torch.isfinite(t).all() if dtype == torch.bfloat16 else np.isfinite(t.numpy()).all()):
            raise BadRequest(f"input {name!r}: data contains NaN or infinity")
    return t


def to_json_data(t: torch.Tensor) -> list:
    """A flat row-major list; BF16 goes out as the float32 it widens to exactly."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.reshape(-1).tolist()


def to_binary(t: torch.Tensor) -> bytes:
    return binary_view(t).tobytes()


def binary_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without copying a contiguous tensor on the
    host: the response's body is the one copy (``app.encode_reply``)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).view(np.uint8).data


def _kind_name(kind: str | None) -> str:
    return {"U": "strings", "S": "strings", "O": "mixed or null values", "b": "booleans", "f": "floats",
            "c": "complex numbers"}.get(kind or "", f"values of kind {kind!r}")
