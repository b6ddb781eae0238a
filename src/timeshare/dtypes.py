"""The one table of tensor types timeshare names: the Open Inference Protocol's
datatypes (``FP32``, ``INT64``...) and their torch dtypes, and the names a user may give
for converting a model's floating weights (``fp32``, ``bfloat16``...)."""

from __future__ import annotations

import torch

from timeshare.errors import ConfigError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "UINT16": torch.uint16, "UINT32": torch.uint32,
    "UINT64": torch.uint64, "INT8": torch.int8, "INT16": torch.int16, "INT32": torch.int32,
    "INT64": torch.int64, "FP16": torch.float16, "FP32": torch.float32, "FP64": torch.float64,
    "BF16": torch.bfloat16,
}
DATATYPES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}
DATATYPE_NAMES: tuple[str, ...] = tuple(TORCH_DTYPES)

# A model's weights convert to a floating type, named as in the protocol (any case) or as torch does.
FLOAT_NAMES: dict[str, torch.dtype] = {
    **{name.lower(): dtype for name, dtype in TORCH_DTYPES.items() if dtype.is_floating_point},
    **{str(dtype).removeprefix("torch."): dtype for dtype in TORCH_DTYPES.values() if dtype.is_floating_point},
}


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """A floating dtype from its name ("fp32", "bf16", "float16"...); None stays None."""
    if value is None or isinstance(value, torch.dtype):
        return value
    try:
        return FLOAT_NAMES[str(value).lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {value!r}; known: {sorted(FLOAT_NAMES)}") from None
