"""The runtime: the public ``Runtime`` (``facade``), and behind it registration,
residency, the executors, the dispatcher and training jobs."""

from timeshare.runtime.calls import Call
from timeshare.runtime.facade import Runtime
from timeshare.runtime.observe import RuntimeSnapshot

__all__ = ["Call", "Runtime", "RuntimeSnapshot"]
