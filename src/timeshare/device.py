"""Resolving the compute device, once. Runs in every process.

``resolve_device`` is the only place that asks whether CUDA exists; everything else
receives a ``torch.device``. Importing this module never initializes CUDA.
"""

from __future__ import annotations

import torch

from timeshare.errors import ConfigError, DeviceError

_KNOWN = ("auto", "cpu", "cuda")


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """Turn "auto" | "cpu" | "cuda" | "cuda:N" into a concrete ``torch.device``.

    "auto" picks the first CUDA device when one is usable, else the CPU. Asking for
    CUDA on a machine without it is a :class:`DeviceError`, never a silent fallback.
    """
    if isinstance(spec, torch.device):
        text = str(spec)
    elif isinstance(spec, str):
        text = spec.strip().lower()
    else:
        raise ConfigError(f"device must be one of {_KNOWN} or 'cuda:N', got {spec!r}")
    if text == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text.startswith("cuda"):
        try:
            dev = torch.device(text)
        except RuntimeError as exc:
            raise ConfigError(f"device {spec!r} is not a valid CUDA device name") from exc
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r} was requested but CUDA is not available on this machine")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise DeviceError(
                f"device {spec!r} was requested but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        return torch.device("cuda", index)
    raise ConfigError(f"device must be one of {_KNOWN} or 'cuda:N', got {spec!r}")


def synchronize(device: torch.device) -> None:
    """Wait until all work queued on ``device`` has finished (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
