"""The server against hostile clients: large JSON bodies parsed off the event loop (by
a parser process that may die), idle and trickling connections, oversized headers, a
flood of connections, the API description, and bounded training submissions. A real
uvicorn server on loopback, run as ``timeshare serve`` runs it (``uvicorn_config``)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.serving import running_server, tiny_config
from timeshare.bench.hostile import measure_admin_guard, measure_idle, measure_large_header
from timeshare.errors import BadRequest, WorkerTimeoutError
from timeshare.server.parser_pool import ParserPool
from timeshare.server.parsing import parse_infer

HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 1.0, 2.0
WIDE = {"name": "wide", "build": "tests.models:row_sum",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}]}
PARSER_BUSY = "every request parser is busy"


@pytest.fixture(scope="module")
def server():
    cfg = tiny_config(
        models=[{"name": "mlp", "zoo": "tiny_mlp"}, WIDE],
        server={"header_timeout_s": HEADER_TIMEOUT_S, "body_timeout_s": BODY_TIMEOUT_S, "max_connections": 60,
                "parse_processes": 1, "parse_queue": 1},
        admin={"max_training_batch": 16, "max_training_jobs": 2, "max_finished_jobs": 2})
    with running_server(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def wide_body(n: int) -> tuple[bytes, torch.Tensor]:
    """A JSON inference request for ``wide`` with one row of n FP32 values (6 bytes
    of JSON each), and that row as the server should read it."""
    texts = [f"{i / 1000:.3f}" for i in range(1000)]
    reps = n // 1000
    x = torch.tensor([float(t) for t in texts], dtype=torch.float32).repeat(reps)[None]
    data = ",".join(texts * reps).encode()
    body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,%d],"data":[%s]}]}' % (x.shape[1], data)
    return body, x


def post_json(url: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/wide/infer", content=body, headers={"Content-Type": "application/json"},
                      timeout=120)


def started_parser(server) -> int:
    """The parser process's id, once it has parsed a large body (it starts when first needed)."""
    body, _ = wide_body(200_000)  # 1.2 MB: over parse_in_process_bytes
    assert post_json(server.url, body).status_code == 200
    [pid] = server.service.parsers.pids()
    return pid


def wait_for(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def raw_connection(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


# ---------------------------------------------------------------------- parsing off the loop
def test_a_large_json_body_is_parsed_while_other_clients_are_served(server, http):
    body, x = wide_body(3_400_000)  # 20 MB of JSON: about half a second of parsing here
    assert len(body) > 19e6
    parsers = server.service.parsers
    parsed = parsers.stats()["parsed"]
    small = {"inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32", "data": [0.5] * 32}]}
    answered_while_parsing = 0
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(post_json, server.url, body)
        while not big.done():
            parsing = parsers.stats()["busy"]
            assert http.post("/v2/models/mlp/infer", json=small).status_code == 200
            if parsing and parsers.stats()["busy"]:  # sent and answered while the body was being parsed
                answered_while_parsing += 1
        r = big.result()
    assert r.status_code == 200, r.text
    assert parsers.stats()["parsed"] == parsed + 1  # in the parser process, not on the event loop
    out = {o["name"]: torch.tensor(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
    torch.testing.assert_close(out["output_0"], x.sum(dim=1, keepdim=True), rtol=1e-5, atol=0)
    assert torch.equal(out["output_1"], x[:, :4]) and torch.equal(out["output_2"], x[:, -4:])
    assert answered_while_parsing >= 5, answered_while_parsing


def test_a_dead_parser_fails_only_its_request_and_is_replaced(server, http):
    parsers = server.service.parsers
    pid = started_parser(server)
    body, _ = wide_body(1_000_000)  # 6 MB
    replaced = parsers.stats()["replaced"]
    os.kill(pid, signal.SIGSTOP)  # it takes the next body and never answers
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post_json, server.url, body)
            wait_for(lambda: parsers.stats()["busy"] == 1, what="the first body to reach the parser")
            second = pool.submit(post_json, server.url, body)
            wait_for(lambda: parsers.stats()["waiting"] == 1, what="the second body to wait for it")
            third = post_json(server.url, body)  # one parsing, one waiting (parse_queue: 1): full
            assert third.status_code == 503 and PARSER_BUSY in third.json()["error"], third.text
            assert third.headers["retry-after"] == "1"
            assert http.post("/v2/models/mlp/infer", json={"inputs": [  # small bodies do not wait for it
                {"name": "x", "shape": [1, 32], "datatype": "FP32", "data": [0.5] * 32}]}).status_code == 200
            os.kill(pid, signal.SIGKILL)
            failed, served = first.result(60), second.result(60)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert failed.status_code == 503 and "request parser process died" in failed.json()["error"], failed.text
    assert served.status_code == 200, served.text  # parsed by the replacement
    assert parsers.stats()["replaced"] == replaced + 1 and parsers.pids() != [pid]


def test_a_full_parser_pool_refuses_a_declared_large_body_before_reading_it(server):
    """The 503 comes from Content-Length alone: the client has sent only the headers."""
    parsers = server.service.parsers
    pid = started_parser(server)
    body, _ = wide_body(1_000_000)
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post_json, server.url, body) for _ in range(2)]
            wait_for(lambda: parsers.stats()["busy"] == 1 and parsers.stats()["waiting"] == 1, what="a full pool")
            with raw_connection(server) as sock:
                sock.sendall(b"POST /v2/models/wide/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
                answer = read_until_closed(sock, 10)
            os.kill(pid, signal.SIGKILL)
            assert sorted(f.result(60).status_code for f in held) == [200, 503]  # the parsed one died
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert answer.startswith(b"HTTP/1.1 503") and PARSER_BUSY.encode() in answer, answer[:300]


def test_a_parser_past_its_deadline_is_killed_and_replaced():
    async def scenario():
        pool = ParserPool(in_process_bytes=0, processes=1, queue=0, timeout_s=1.0)
        try:
            body = b'{"inputs":[{"name":"x","datatype":"INT64","shape":[2],"data":[1,2]}]}'
            req, tensors = await pool.parse(body, None)  # started and warm
            assert torch.equal(tensors["x"], torch.tensor([1, 2])) and req.inputs[0].data is None
            [pid] = pool.pids()
            os.kill(pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(WorkerTimeoutError, match="did not finish within 1.0 s"):
                await pool.parse(body, None)
            assert time.monotonic() - t0 < 10  # the deadline, not whenever
            _, tensors = await pool.parse(body, None)  # the replacement
            assert torch.equal(tensors["x"], torch.tensor([1, 2]))
            assert pool.stats()["replaced"] == 1 and pool.pids() != [pid]
        finally:
            pool.close()

    asyncio.run(scenario())


BODIES = [  # parsed in a parser process, each answers as parse_infer does on the event loop
    b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,3],"data":[1,2.5,-3]}],"id":"a","outputs":[{"name":"y"}]}',
    b'{"inputs":[{"name":"x","datatype":"BF16","shape":[2],"data":[1.00390625,3e38]},'
    b'{"name":"b","datatype":"BOOL","shape":[1],"data":[true]},{"name":"u","datatype":"UINT64","shape":[1],'
    b'"data":[18446744073709551615]},{"name":"h","datatype":"FP16","shape":[0],"data":[]}]}',
    b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,NaN]}]}',
    b'{"inputs":[{"name":"x","datatype":"INT8","shape":[2],"data":[1,2.5]}]}',
    b'{"inputs":[{"name":"x","datatype":"FP32","shape":[3],"data":[1,2]}]}',
    b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":"ab"}]}',
    b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,2],"colour":1}]}',
    b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2]}]}', b'{"inputs": [', b"[1]",
    b'\xef\xbb\xbf{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]}]}', b'\xff\xfe{',
]


def test_the_parser_process_answers_as_the_event_loop_does():
    async def scenario():
        pool = ParserPool(in_process_bytes=0, processes=1, queue=0, timeout_s=60)
        try:
            for body in BODIES:
                try:
                    expected = parse_infer(body, None)
                except BadRequest as exc:
                    with pytest.raises(BadRequest) as got:
                        await pool.parse(body, None)
                    assert str(got.value) == str(exc), body
                    continue
                req, tensors = await pool.parse(body, None)
                assert req == expected[0] and list(tensors) == list(expected[1]), body
                for name, t in tensors.items():
                    assert t.dtype == expected[1][name].dtype and torch.equal(t, expected[1][name]), (body, name)
            header = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}]}'
            _, tensors = await pool.parse(header + torch.tensor([1.0, 2.0]).numpy().tobytes(), str(len(header)))
            assert torch.equal(tensors["x"], torch.tensor([1.0, 2.0]))
            assert pool.stats()["parsed"] == 1 + sum(1 for b in BODIES if _parses(b))
        finally:
            pool.close()

    asyncio.run(scenario())


def _parses(body: bytes) -> bool:
    try:
        parse_infer(body, None)
    except BadRequest:
        return False
    return True


# ---------------------------------------------------------------------- connections
def test_idle_connections_are_closed_by_the_header_deadline(server):
    r = measure_idle(server.url, connections=50, header_timeout_s=HEADER_TIMEOUT_S)
    assert r["closed"] == 50, r
    assert r["first_closed_s"] >= HEADER_TIMEOUT_S / 2, r  # not at once: by the deadline


def trickle(sock, piece, pieces: int) -> tuple[int, bytes]:
    """Send ``piece(i)`` every 0.2 s until the server answers or closes; how many were
    sent, and the answer."""
    sent, answer = 0, b""
    sock.settimeout(0.2)
    for sent in range(pieces):
        try:
            sock.sendall(piece(sent))
            answer = sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if answer:
            break
    return sent, answer + read_until_closed(sock, 5)


def test_a_client_trickling_its_headers_is_cut_off(server):
    with raw_connection(server) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        # 8 s of trickling, each line in time for uvicorn's keep-alive
        sent, answer = trickle(sock, lambda i: b"X-Slow: %d\r\n" % i, 40)
    assert answer.startswith(b"HTTP/1.1 408") and b"server.header_timeout_s" in answer, answer
    assert sent < 20, sent  # well before the trickle ended


def test_a_client_trickling_its_body_is_cut_off(server):
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        sent, answer = trickle(sock, lambda i: b" ", 60)
    assert answer.startswith(b"HTTP/1.1 408") and b"server.body_timeout_s" in answer, answer
    assert sent < 30, sent
    assert server.service.ready  # the request that lost its body was let go


def test_a_request_head_over_the_limit_gets_431(server, http):
    assert measure_large_header(server.url, header_bytes=32 << 10)["status"] == 431
    r = http.get("/v2/health/live", headers={"X-Padding": "a" * (32 << 10)})
    assert r.status_code == 431 and "server.max_header_bytes" in r.json()["error"]
    assert http.get("/v2/health/live", headers={"X-Padding": "a" * (12 << 10)}).status_code == 200
    with raw_connection(server) as sock:  # an incomplete head that outgrows the limit: h11's own refusal
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * (20 << 10))
        answer = read_until_closed(sock, 10)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]


def test_connections_over_the_limit_are_refused_at_once(server):
    holders = [raw_connection(server) for _ in range(60)]  # the limit; closed by the header deadline
    try:
        with raw_connection(server) as sock:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = read_until_closed(sock, 10)
    finally:
        for h in holders:
            h.close()
    assert answer.startswith(b"HTTP/1.1 503") and b"server.max_connections" in answer, answer[:300]
    assert b"retry-after: 1" in answer.lower()
    deadline = time.monotonic() + 10  # the refused ones linger up to a second
    while (status := httpx.get(f"{server.url}/v2/health/live").status_code) != 200:
        assert time.monotonic() < deadline, status
        time.sleep(0.1)


def test_a_web_page_cannot_reach_the_admin_plane_through_the_hardened_server(server):
    assert measure_admin_guard(server.url) == {"cross_site_status": 403, "rebinding_status": 403, "refused": True}


# ---------------------------------------------------------------------- API description
def test_the_api_description_is_served_only_when_configured(http):
    from timeshare.config import parse_config
    from timeshare.server.app import create_app
    from timeshare.server.service import Service

    for path in ("/openapi.json", "/docs", "/redoc"):
        assert http.get(path).status_code == 404, path  # the default

    async def described() -> list[httpx.Response]:
        app = create_app(Service(parse_config({"server": {"openapi": True}, "models": [WIDE]})), start=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return [await client.get(path) for path in ("/docs", "/redoc", "/openapi.json")]

    docs, redoc, openapi = asyncio.run(described())
    assert docs.status_code == redoc.status_code == openapi.status_code == 200
    schema = openapi.json()
    body = schema["paths"]["/v2/models/{model}/infer"]["post"]["requestBody"]["content"]["application/json"]
    assert "inputs" in str(body["schema"])
    assert "iterations" in str(schema["paths"]["/admin/training"]["post"]["requestBody"])


# ---------------------------------------------------------------------- training submissions
def _status(http, job: str, *wanted: str) -> dict:
    deadline = time.monotonic() + 30
    while (state := http.get(f"/admin/training/{job}").json())["status"] not in wanted:
        assert time.monotonic() < deadline, state
        time.sleep(0.02)
    return state


def test_training_submissions_are_bounded(server, http):
    def submit(**job):
        return http.post("/admin/training", json={"model": "tiny_mlp", "batch": 2, **job})

    r = submit(name="big-batch", batch=17, iterations=1)
    assert r.status_code == 400 and "admin.max_training_batch" in r.json()["error"]
    r = submit(name="too-long", iterations=1_000_001)
    assert r.status_code == 400 and "admin.max_training_iterations" in r.json()["error"]
    r = submit(name="endless")
    assert r.status_code == 400 and "give 'iterations'" in r.json()["error"]
    r = submit(name="too-big", model="tiny_bert", iterations=1)  # 139,456 parameters x 12 bytes > 1 MiB
    assert r.status_code == 400 and "device memory budget" in r.json()["error"], r.text
    assert http.get("/admin/training").json() == []
    # admin.max_training_jobs: 2 running at once (paused ones run)
    for name in ("j1", "j2"):
        assert submit(name=name, iterations=1_000_000).status_code == 201
        assert http.post(f"/admin/training/{name}/pause").status_code == 200
    r = submit(name="j3", iterations=1)
    assert r.status_code == 409 and "admin.max_training_jobs" in r.json()["error"], r.text
    assert http.post("/admin/training/j1/cancel").status_code == 200
    _status(http, "j1", "cancelled")
    # admin.max_finished_jobs: 2 kept when a job is submitted, the oldest forgotten first
    for name in ("j3", "j4", "j5", "j6"):
        assert submit(name=name, iterations=1).status_code == 201
        _status(http, name, "finished")
    names = [j["name"] for j in http.get("/admin/training").json()]
    assert names == ["j2", "j4", "j5", "j6"], names  # j1 (cancelled), then j3 (finished) went
    assert http.get("/admin/training/j1").status_code == 404 and http.get("/admin/training/j3").status_code == 404
    assert not {"j1", "j3"} & set(server.service.runtime.jobs())  # the runtime forgot them too (and their state)
    assert http.post("/admin/training/j2/cancel").status_code == 200
    _status(http, "j2", "cancelled")


def test_admin_bodies_are_read_only_after_the_guard(server, http):
    """A foreign page's large POST is refused before its body is parsed; a large admin
    body from the operator gets 413 rather than a parse on the event loop."""
    body = b'{"name":"x","model":"tiny_mlp","pad":"' + b"a" * (2 << 20) + b'"}'
    r = http.post("/admin/training", content=body, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    r = http.post("/admin/training", content=body)
    assert r.status_code == 413 and "server.parse_in_process_bytes" in r.json()["error"]

