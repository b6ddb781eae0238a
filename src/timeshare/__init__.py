"""timeshare: fine-grained time-sharing of one GPU among deep-learning tasks.

Public API (stable): :class:`Runtime` and the errors in :mod:`timeshare.errors`.
Importing timeshare never initializes CUDA.
"""

from timeshare.errors import (
    ConfigError,
    DeviceError,
    DuplicateModelError,
    MemoryBudgetError,
    ModelError,
    ModelTooLargeError,
    PipelineError,
    TimeshareError,
    UnknownModelError,
    WeightsError,
)
from timeshare.runtime import Runtime

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DeviceError",
    "DuplicateModelError",
    "MemoryBudgetError",
    "ModelError",
    "ModelTooLargeError",
    "PipelineError",
    "Runtime",
    "TimeshareError",
    "UnknownModelError",
    "WeightsError",
    "__version__",
]
