"""The HTTP server (``timeshare serve``): Open Inference Protocol data plane, admin
plane and Prometheus metrics over one :class:`~timeshare.Runtime`. Runs in the
server's process; the runtime's worker processes, if any, are its children."""

from timeshare.server.serve import serve

__all__ = ["serve"]
