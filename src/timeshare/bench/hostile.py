"""``timeshare bench hostile``: how a server holds against hostile clients, measured from
outside: the stall other clients see while a large JSON body is parsed, idle
connections, an oversized header, and requests to the admin plane from a foreign web
page. Runs in the caller's process (a client of the server).

:func:`measure` probes a running server and returns plain JSON-able dicts; :func:`run`
starts servers in child processes and measures them, beside the baseline of parsing on
the event loop (what a plain FastAPI server does).
"""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx


def measure(url: str, *, model: str, body_bytes: int = 63 << 20, idle_connections: int = 50,
            header_timeout_s: float = 10.0, header_bytes: int = 32 << 10, timeout_s: float = 120.0) -> dict:
    """Probe the server at ``url`` (``http://host:port``) as a hostile client would.

    - ``stall``: while a JSON inference request of about ``body_bytes`` (FP32 values, to
      ``model``'s first input; the server may refuse its shape after parsing it) is in
      flight, another client sends small requests (``GET /v2/health/live``) one after
      another; the largest latency among those, in ms, is the stall a small client saw.
    - ``idle``: ``idle_connections`` connections that send nothing; how many the server
      closed within ``header_timeout_s`` (the server's ``server.header_timeout_s``) + 2 s.
    - ``large_header``: the status of a request with a header of ``header_bytes`` (431
      expected).
    - ``admin``: the statuses of ``GET /admin/status`` with ``Origin: http://evil.example``
      (cross-site) and with ``Host: evil.example`` (DNS rebinding); 403 expected, from a
      loopback client without a token.
    """
    url = url.rstrip("/")
    return {
        "url": url,
        "stall": measure_stall(url, model=model, body_bytes=body_bytes, timeout_s=timeout_s),
        "idle": measure_idle(url, connections=idle_connections, header_timeout_s=header_timeout_s),
        "large_header": measure_large_header(url, header_bytes=header_bytes),
        "admin": measure_admin_guard(url),
    }


def json_body(input_name: str, body_bytes: int) -> tuple[bytes, int]:
    """An inference request body of about ``body_bytes``: one FP32 input of shape
    [1, n] given as a JSON list; returns the body and n."""
    value = b"0.123456,"
    n = max(1, body_bytes // len(value))
    head = json.dumps({"name": input_name, "shape": [1, n], "datatype": "FP32"}).encode()[:-1]
    return b'{"inputs":[' + head + b',"data":[' + (value * n)[:-1] + b"]}]}", n


def measure_stall(url: str, *, model: str, body_bytes: int, timeout_s: float = 120.0) -> dict:
    """See :func:`measure` (``stall``)."""
    with httpx.Client(base_url=url, timeout=timeout_s) as http:
        meta = http.get(f"/v2/models/{model}")
        meta.raise_for_status()
        body, n = json_body(meta.json()["inputs"][0]["name"], body_bytes)
        latencies: list[tuple[float, float]] = []  # (start, end) of each small request
        dropped: list[float] = []  # when a kept-alive connection was closed under a small request
        stop = threading.Event()

        def small_client() -> None:
            with httpx.Client(base_url=url, timeout=timeout_s) as small:
                while not stop.is_set():
                    t = time.perf_counter()
                    try:
                        small.get("/v2/health/live").raise_for_status()
                    except httpx.RemoteProtocolError:
                        # The server closed the kept-alive connection as the request went out
                        # (its keep-alive timer, late after a stalled loop): once more on a
                        # new one, as a client does, the time lost counted in its latency.
                        dropped.append(t)
                        small.get("/v2/health/live").raise_for_status()
                    latencies.append((t, time.perf_counter()))

        thread = threading.Thread(target=small_client, name="hostile-small-client", daemon=True)
        thread.start()
        time.sleep(0.2)  # the small client is warm
        t0 = time.perf_counter()
        r = http.post(f"/v2/models/{model}/infer", content=body, headers={"Content-Type": "application/json"})
        t1 = time.perf_counter()
        time.sleep(0.1)
        stop.set()
        thread.join(timeout_s)
    during = [end - start for start, end in latencies if end > t0 and start < t1]
    return {"body_bytes": len(body), "values": n, "status": r.status_code, "big_request_s": round(t1 - t0, 3),
            "small_requests_during": len(during), "small_connections_dropped": len(dropped),
            "max_stall_ms": round(max(during) * 1e3, 2) if during else None,
            "small_request_ms_before": round(_median([e - s for s, e in latencies if e <= t0]) * 1e3, 3)}


def measure_idle(url: str, *, connections: int, header_timeout_s: float) -> dict:
    """See :func:`measure` (``idle``)."""
    host, port = _address(url)
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(connections)]
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    t0 = time.monotonic()
    closed: dict[socket.socket, float] = {}
    deadline = t0 + header_timeout_s + 2.0
    try:
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                conn = key.fileobj
                assert isinstance(conn, socket.socket), "only sockets are registered"
                try:
                    data = conn.recv(65536)
                except ConnectionError:
                    data = b""
                if not data:  # closed by the server (an answer before the close is fine too)
                    closed[conn] = time.monotonic() - t0
                    sel.unregister(conn)
    finally:
        sel.close()
        for s in socks:
            s.close()
    times = sorted(closed.values())
    return {"connections": connections, "closed": len(closed), "within_s": round(header_timeout_s + 2.0, 3),
            "first_closed_s": round(times[0], 3) if times else None,
            "last_closed_s": round(times[-1], 3) if times else None}


def measure_large_header(url: str, *, header_bytes: int) -> dict:
    """See :func:`measure` (``large_header``)."""
    status: int | str
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            status = http.get("/v2/health/live", headers={"X-Padding": "a" * header_bytes}).status_code
    except httpx.HTTPError as exc:  # closed without an answer
        status = f"no answer: {type(exc).__name__}"
    return {"header_bytes": header_bytes, "status": status, "refused_with_431": status == 431}


def measure_admin_guard(url: str) -> dict:
    """See :func:`measure` (``admin``)."""
    with httpx.Client(base_url=url, timeout=30) as http:
        cross_site = http.get("/admin/status", headers={"Origin": "http://evil.example"}).status_code
        rebinding = http.get("/admin/status", headers={"Host": "evil.example"}).status_code
    return {"cross_site_status": cross_site, "rebinding_status": rebinding,
            "refused": cross_site == 403 and rebinding == 403}


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[len(values) // 2]


@dataclass
class HostileBenchConfig:
    model: str = "tiny_mlp"  # a zoo model: its first input names the large request's tensor
    body_mib: float = 63.0
    idle_connections: int = 1000
    header_timeout_s: float = 10.0
    header_bytes: int = 32 << 10


def run(cfg: HostileBenchConfig, progress=None) -> dict:
    """Measure a ``timeshare serve`` (one model on the CPU, in-process) as configured by
    default, then the stall again with every body parsed on the event loop (the baseline)."""
    import resource

    from timeshare.bench.environment import describe
    from timeshare.device import resolve_device
    from timeshare.harness.process import ServerProcess

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this process holds the idle connections
    want = cfg.idle_connections + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    body = int(cfg.body_mib * (1 << 20))
    server: dict[str, Any] = {"runtime": {"device": "cpu", "memory": "64MiB", "workers": 0},
              "server": {"header_timeout_s": cfg.header_timeout_s, "max_connections": cfg.idle_connections + 64,
                         "max_request_bytes": max(64 << 20, body + (1 << 20))},
              "models": [{"name": cfg.model, "zoo": cfg.model}]}
    with ServerProcess(server) as s:
        if progress:
            progress("measuring timeshare serve")
        ours = measure(s.url, model=cfg.model, body_bytes=body, idle_connections=cfg.idle_connections,
                       header_timeout_s=cfg.header_timeout_s, header_bytes=cfg.header_bytes)
    baseline_cfg = {**server, "server": {**server["server"], "parse_in_process_bytes": server["server"]
                                         ["max_request_bytes"]}}
    with ServerProcess(baseline_cfg) as s:
        if progress:
            progress("measuring the baseline: bodies parsed on the event loop")
        measure_stall(s.url, model=cfg.model, body_bytes=1 << 20)  # warm, as the first run was
        baseline = measure_stall(s.url, model=cfg.model, body_bytes=body)
    return {"benchmark": "hostile", "config": asdict(cfg), "server_config": server,
            "environment": describe(resolve_device("cpu")),
            "result": {"timeshare": ours, "baseline_parse_on_event_loop": {"stall": baseline}}}
