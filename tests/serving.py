"""Running a real timeshare server (uvicorn on a free loopback port) in a thread of
the test process, for the server tests."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from timeshare.config import parse_config
from timeshare.harness.process import free_port


def tiny_config(**sections) -> dict:
    """Three small zoo models on the CPU, memory for about two of them."""
    cfg = {
        "runtime": {"device": "cpu", "memory": "1MiB"},
        "server": {"host": "127.0.0.1", "metrics_port": None, "request_timeout_s": 60},
        "models": [
            {"name": "mlp", "zoo": "tiny_mlp"},
            {"name": "cnn", "zoo": "tiny_cnn"},
            {"name": "bert", "zoo": "tiny_bert"},
        ],
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


class Running:
    def __init__(self, service, url: str):
        self.service = service
        self.url = url


@contextmanager
def running_server(cfg: dict, *, ready_timeout_s: float = 120.0, expect_ready: bool = True):
    import uvicorn

    from timeshare.server.app import create_app
    from timeshare.server.serve import uvicorn_config
    from timeshare.server.service import Service

    port = free_port()
    cfg = {**cfg, "server": {"drain_timeout_s": 10, **cfg.get("server", {}), "host": "127.0.0.1", "http_port": port}}
    config = parse_config(cfg, "test config")
    service = Service(config)
    service.open()
    server = uvicorn.Server(uvicorn_config(create_app(service), config.server, log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        if expect_ready:
            while not service.ready:
                if service.start_error or time.monotonic() > deadline:
                    raise RuntimeError(f"the test server did not become ready: {service.start_error}")
                time.sleep(0.05)
        yield Running(service, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(60)
        service.parsers.close()
        service.runtime.close()
        assert not thread.is_alive(), "the test server did not stop"


@contextmanager
def openai_client(server, timeout_s: float = 60):
    """The official ``openai`` client of ``server``'s ``/v1``, closed at the end: one left to
    the garbage collector drops its kept-alive sockets unclosed, and the ResourceWarning
    fails whichever later test the collector runs in."""
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=timeout_s) as c:
        yield c
