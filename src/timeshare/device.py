"""Resolving the compute device, once. Runs in every process.

``resolve_device`` is the only place that asks whether CUDA exists; everything else
receives a ``torch.device``. Importing this module never initializes CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# The objects whose ``fp32_precision`` (PyTorch's newer TF32 API) selects the kernels'
# float32 arithmetic, parents before children: setting a parent can reset its children.
_PRECISION_PATHS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn",
                    "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _backend(path: str):
    obj = torch.backends
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class BackendFlags:
    """The numerics switches of PyTorch's backends that change a kernel's result bits:
    TF32 for matmul and cuDNN (``fp32_precision`` per backend where PyTorch has it, else
    the legacy ``allow_tf32`` flags and the float32 matmul precision), cuDNN's
    deterministic and benchmark modes, reduced-precision reductions and deterministic
    algorithms. A worker process starts with PyTorch's defaults; the runtime captures
    the creating process's flags and every worker applies them before its first kernel,
    so a worker computes the same bits as the process that created the runtime. Reading
    and setting them never initializes CUDA."""

    cudnn_benchmark: bool
    cudnn_deterministic: bool
    matmul_allow_fp16_reduced: bool
    matmul_allow_bf16_reduced: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    precisions: tuple[tuple[str, str], ...] = ()  # (backend path, fp32_precision), newer PyTorch
    legacy: tuple[bool, bool, str] | None = None  # (cudnn allow_tf32, matmul allow_tf32, matmul precision)

    @classmethod
    def capture(cls) -> "BackendFlags":
        m = torch.backends.cuda.matmul
        precisions: tuple[tuple[str, str], ...] = ()
        legacy = None
        if hasattr(torch.backends.cudnn, "fp32_precision"):
            precisions = tuple((p, str(_backend(p).fp32_precision)) for p in _PRECISION_PATHS
                               if hasattr(_backend(p), "fp32_precision"))
        else:
            legacy = (bool(torch.backends.cudnn.allow_tf32), bool(m.allow_tf32), torch.get_float32_matmul_precision())
        return cls(
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            matmul_allow_fp16_reduced=bool(m.allow_fp16_reduced_precision_reduction),
            matmul_allow_bf16_reduced=bool(m.allow_bf16_reduced_precision_reduction),
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            precisions=precisions,
            legacy=legacy,
        )

    def apply(self) -> None:
        for path, value in self.precisions:
            _backend(path).fp32_precision = value
        if self.legacy is not None:
            cudnn_tf32, matmul_tf32, precision = self.legacy
            torch.set_float32_matmul_precision(precision)  # first: it also sets matmul TF32
            torch.backends.cudnn.allow_tf32 = cudnn_tf32
            torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        m = torch.backends.cuda.matmul
        m.allow_fp16_reduced_precision_reduction = self.matmul_allow_fp16_reduced
        m.allow_bf16_reduced_precision_reduction = self.matmul_allow_bf16_reduced
        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.deterministic_warn_only)
