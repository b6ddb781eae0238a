"""The runtime: the public ``Runtime`` and the engine behind it."""

from timeshare.runtime.engine import Runtime

__all__ = ["Runtime"]
