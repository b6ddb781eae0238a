"""``timeshare serve``: the runtime, then uvicorn with the app, plus a metrics-only port.
Runs in the server's process.

Shutdown (Ctrl-C or SIGTERM, handled by uvicorn): stop accepting, let in-flight
requests finish for up to ``server.drain_timeout_s``, then the app's lifespan stops the
service, which closes the runtime: training jobs stop at their next preemption point,
worker processes exit, shared memory is unlinked. No process is left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from timeshare.config import Config, ServerConfig
from timeshare.device import leave_a_core

log = logging.getLogger(__name__)

# Set by ``ServerProcess`` (demo, benches, tests): the process that started this server. When
# it is gone (killed, crashed) the server stops as on SIGTERM, so that no server outlives the
# run that needed it.
PARENT_ENV = "TIMESHARE_PARENT_PID"
PARENT_POLL_S = 1.0


def serve(config: Config, *, log_level: str = "info") -> int:
    """Serve until stopped; the exit status: 0, or 1 when ``server.exit_on_error`` stopped
    the server because a model failed for good (``Service.fatal`` names each)."""
    import uvicorn
    from prometheus_client import start_http_server

    from timeshare.server.app import create_app
    from timeshare.server.service import Service

    leave_a_core()  # NOTE [A core for the front end]
    service = Service(config)
    service.open()  # a bad runtime section (device, memory) fails here, before anything listens
    metrics_server = None
    try:
        s = config.server
        if s.metrics_port is not None:
            metrics_server, _thread = start_http_server(s.metrics_port, addr=s.host, registry=service.metrics.registry)
        server = uvicorn.Server(uvicorn_config(create_app(service), s, log_level=log_level))
        service.on_fatal = lambda: setattr(server, "should_exit", True)  # a drained stop, then status 1
        with _exit_cleanly():
            _stop_with_parent()
            server.run()
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        service.parsers.close()  # idempotent, like the runtime's close
        if service.runtime is not None:
            service.runtime.close()  # idempotent: the lifespan closed it unless start-up failed
    return 0 if service.fatal is None else 1


def uvicorn_config(app, server: ServerConfig, *, log_level: str = "info"):
    """uvicorn's configuration for ``app`` under ``server``: the one place it is made
    (``serve`` and the tests' server), so that every server runs hardened: connection
    deadlines and limits (NOTE [Connection limits]), no X-Forwarded-For (the admin guard
    trusts the peer address), no WebSocket upgrades (no route takes them)."""
    import uvicorn

    from timeshare.server.connections import ConnectionLimits, protocol_class

    return uvicorn.Config(app, host=server.host, port=server.http_port, log_level=log_level, access_log=False,
                          # uvicorn annotates it int, but passes it on as asyncio.wait_for's timeout (a float)
                          timeout_graceful_shutdown=server.drain_timeout_s,  # type: ignore[arg-type]
                          proxy_headers=False, ws="none",
                          http=protocol_class(ConnectionLimits.from_config(server)),
                          # h11 refuses an incomplete request head beyond this (431 in connections.py)
                          h11_max_incomplete_event_size=int(server.max_header_bytes))


def _stop_with_parent() -> None:
    """With ``TIMESHARE_PARENT_PID`` set, a thread that sends this process SIGTERM (the
    graceful stop) once that process is gone."""
    value = os.environ.get(PARENT_ENV)
    if not value or not value.isdigit():
        return
    parent = int(value)

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # alive, someone else's
                continue
            if os.getppid() != parent:  # it died and its pid was taken: we were re-parented
                break
        log.warning("the process that started this server (%d) is gone; stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="timeshare-parent-watch", daemon=True).start()


class _exit_cleanly:
    """uvicorn handles SIGINT and SIGTERM (graceful drain), then raises the signal again
    for the handlers it found. Handlers that only note it make a drained stop exit
    with status 0 rather than die by the signal."""

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, lambda signum, frame: log.info("stopped by signal %d", signum))
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
