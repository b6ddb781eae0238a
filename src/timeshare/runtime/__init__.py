"""The controller's core: the public ``Runtime`` (``facade``), and behind it
registration, the model table and residency, the dispatcher, training jobs' handles, the
host tier and shared tensors. Where models run is ``timeshare.executor``'s."""

from timeshare.runtime.calls import Call
from timeshare.runtime.facade import Runtime
from timeshare.runtime.observe import RuntimeSnapshot

__all__ = ["Call", "Runtime", "RuntimeSnapshot"]
