"""Bodies that cannot hurt (issue 48): a request body the parser refuses (nested too
deeply, not UTF-8, not JSON, not an object; ``parsing.load_json``) is a 400 in the route's own error shape
(OpenAI's under ``/v1``), on every route that reads a JSON body, and the kept-alive
connection answers the next request correctly."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.serving import running_server
from timeshare.llm import hfdir

NESTED = b'{"model": "llama", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
DEEP_OBJECT = b'{"a": ' * 5000 + b"1" + b"}" * 5000
# Under the interpreter's recursion limit, over the parser's depth: refused all the same.
SHALLOWER = b'{"model": "llama", "prompt": "hi", "user": ' + b"[" * 150 + b"]" * 150 + b"}"
HOSTILE = {
    "nested arrays": NESTED,
    "nested 150 deep": SHALLOWER,
    "nested objects": DEEP_OBJECT,
    "not utf-8": b'{"model": "llama", "prompt": "\xff\xfe"}',
    "not json": b"{model: llama",
    "an array": b"[1, 2, 3]",
    "a string": b'"hello"',
}
ROUTES = {
    "/v1/completions": {"model": "llama", "prompt": "hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             "temperature": 0},
    "/v1/embeddings": None,  # no encoder served here: the body is still read first
    "/v2/models/mlp/infer": {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 32], "data": [0.5] * 32}]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = hfdir.write_model_dir(tmp_path_factory.mktemp("bodies") / "llama", "llama", seed=3, hidden=64, layers=2)
    cfg = {
        "runtime": {"device": "cpu", "memory": "64MiB"},
        "server": {"host": "127.0.0.1", "metrics_port": None, "request_timeout_s": 60, "max_request_bytes": "1MiB"},
        "models": [{"name": "mlp", "zoo": "tiny_mlp"}],
        "llms": [{"name": "llama", "path": str(path), "max_sequences": 2, "max_context": 64}],
    }
    with running_server(cfg) as s:
        yield s


def _post(conn: http.client.HTTPConnection, route: str, body: bytes) -> tuple[int, dict]:
    conn.request("POST", route, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    assert response.getheader("connection", "").lower() != "close", "the server closed the connection"
    return response.status, json.loads(data)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_hostile_body_is_a_400_and_the_connection_serves_the_next_request(server, route):
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.connect()
        sock = conn.sock
        for kind, body in HOSTILE.items():
            status, reply = _post(conn, route, body)
            assert status == 400, (kind, status, reply)
            if route.startswith("/v1/"):
                error = reply["error"]
                assert error["type"] == "invalid_request_error" and error["message"], (kind, reply)
            else:
                assert reply["error"], (kind, reply)
        valid = ROUTES[route]
        if valid is not None:
            status, reply = _post(conn, route, json.dumps(valid).encode())
            assert status == 200, reply
            assert reply.get("choices") or reply.get("outputs"), reply
        assert conn.sock is sock, "the connection was reopened"
    finally:
        conn.close()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_size_limit_is_a_413_in_openais_shape(server, declared):
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = b'{"model": "llama", "prompt": "' + b"a" * (2 << 20) + b'"}'
    try:
        if declared:
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        else:
            conn.request("POST", "/v1/completions", body=iter([body[:1 << 20], body[1 << 20:]]),
                         headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = conn.getresponse()
        reply = json.loads(response.read())
        assert response.status == 413
        assert reply["error"]["type"] == "invalid_request_error" and "max_request_bytes" in reply["error"]["message"]
    finally:
        conn.close()
