"""The data plane's API key (issue 34, item 4; NOTE [The data plane's key]): with
``server.api_key`` (or $TIMESHARE_API_KEY) every ``/v2`` metadata and inference route and
every ``/v1`` route answers 401 without "Authorization: Bearer <key>", in its path's error
shape, and serves with it; the health routes, /metrics and the admin plane's own rules stay
as they were. A real server for the requests that run models, the app in process (no
runtime started) for the walk over every route and for the environment variable."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch

from tests.serving import running_server, tiny_config
from timeshare.llm import hfdir
from timeshare.models.weights import read_weights
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.server.endpoint import flatten_outputs

openai = pytest.importorskip("openai")

KEY = "ts-test-0123456789abcdef"
BEARER = {"Authorization": f"Bearer {KEY}"}
WRONG = [{}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"},
         {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer  {KEY}"}]

X = [[0.01 * i for i in range(32)]]
INFER = {"inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32", "data": X[0]}]}
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
# (method, path, JSON body) of every kind of data-plane route
ROUTES = [
    ("GET", "/v2", None), ("GET", "/v2/models/mlp", None), ("GET", "/v2/models/mlp/versions/1", None),
    ("GET", "/v2/models/mlp/ready", None), ("POST", "/v2/models/mlp/infer", INFER),
    ("POST", "/v2/models/mlp/versions/1/infer", INFER), ("GET", "/v1/models", None), ("GET", "/v1/models/llama", None),
    ("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", {**CHAT, "prompt": "a", "messages": None}),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llama = hfdir.write_model_dir(tmp_path_factory.mktemp("auth") / "llama", "llama", seed=5)
    cfg = tiny_config(runtime={"memory": "4MiB"}, server={"api_key": KEY}, models=[{"name": "mlp", "zoo": "tiny_mlp"}],
                      llms=[{"name": "llama", "path": str(llama), "max_sequences": 2}])
    with running_server(cfg) as s:
        yield s


def _reference_mlp() -> list[float]:
    module = zoo_get("tiny_mlp").build()
    module.load_state_dict(read_weights(str(weights_path("tiny_mlp"))), strict=False)
    with torch.no_grad():
        out = dict(flatten_outputs(module.eval()(torch.tensor(X))))
    return out["output"].flatten().tolist()


def _send(url: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def test_every_data_plane_route_refuses_a_request_without_the_key(server):
    for method, path, body in ROUTES:
        for headers in WRONG:
            r = _send(server.url, method, path, body, headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer", path
            error = r.json()["error"]
            if path.startswith("/v1"):  # OpenAI's shape: what its clients read
                assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key", error
                assert "Authorization: Bearer" in error["message"] and error["param"] is None
            else:
                assert isinstance(error, str) and "Authorization: Bearer" in error, error
    # a header that is not even ASCII is refused like any wrong one, not a 500
    r = httpx.get(server.url + "/v2/models/mlp", headers=[(b"Authorization", b"Bearer \xe9\xe9")], timeout=30)
    assert r.status_code == 401, r.text


def test_refused_requests_queue_nothing_and_count_in_no_model_metric(server):
    def answered() -> str:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return "\n".join(line for line in text.splitlines() if line.startswith("timeshare_requests_total"))

    before = answered()
    for _ in range(3):
        assert _send(server.url, "POST", "/v2/models/mlp/infer", INFER, {}).status_code == 401
    assert answered() == before


def test_the_key_lets_requests_through_with_the_models_answers(server):
    for method, path, body in ROUTES:
        r = _send(server.url, method, path, body, BEARER)
        assert r.status_code == 200, (path, r.text)
    r = _send(server.url, "POST", "/v2/models/mlp/infer", INFER, BEARER)
    assert r.json()["outputs"][0]["data"] == pytest.approx(_reference_mlp(), rel=1e-5, abs=1e-6)
    assert _send(server.url, "GET", "/v2/models/mlp", None, BEARER).json()["name"] == "mlp"
    assert [m["id"] for m in _send(server.url, "GET", "/v1/models", None, BEARER).json()["data"]] == ["llama"]


def test_the_openai_client_passes_its_api_key(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        chat = client.chat.completions.create(model="llama", messages=CHAT["messages"], max_tokens=3, temperature=0)
        assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError) as err:
            client.models.list()
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_health_metrics_and_the_admin_plane_keep_their_own_rules(server):
    assert httpx.get(server.url + "/v2/health/live", timeout=30).json() == {"live": True}
    ready = httpx.get(server.url + "/v2/health/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["ready"] is True
    metrics = httpx.get(server.url + "/metrics", timeout=30)
    assert metrics.status_code == 200 and "timeshare_" in metrics.text
    # the admin plane: no admin token is set, so a loopback client needs no key at all
    status = httpx.get(server.url + "/admin/status", timeout=30)
    assert status.status_code == 200 and status.json()["ready"] is True
    index = httpx.post(server.url + "/v2/repository/index", timeout=30)
    assert index.status_code == 200 and [m["name"] for m in index.json()] == ["mlp"]


# ---------------------------------------------------------------------- the app in process
def _app(monkeypatch, env: str | None = None, **server):
    from timeshare.config import parse_config
    from timeshare.server.app import create_app
    from timeshare.server.service import Service

    if env is None:
        monkeypatch.delenv("TIMESHARE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("TIMESHARE_API_KEY", env)
    return create_app(Service(parse_config({"server": server, "models": [{"name": "mlp", "zoo": "tiny_mlp"}]})),
                      start=False)


def _statuses(app, requests: list[tuple[str, str, dict]]) -> list[int]:
    async def send() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return [(await client.request(method, path, headers=headers)).status_code
                    for method, path, headers in requests]

    return asyncio.run(send())


def test_no_route_under_v1_or_v2_is_left_open_but_health_and_the_repository(monkeypatch):
    """Walks the app's routes, so that a route added later without the key's check fails here."""
    app = _app(monkeypatch, api_key=KEY)
    checked = []
    for route in app.routes:
        path = getattr(route, "path", "")
        # The health checks are open; Triton's repository and vLLM's adapter loading are the
        # admin plane's, behind its own guard (test_server.py, test_lora_server.py).
        if not re.match(r"/v[12](/|$)", path) or path.startswith(("/v2/health/", "/v2/repository/")) or \
                path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                checked.append((method, re.sub(r"\{[^}]*\}", "1", path)))
    assert {("POST", "/v2/models/1/infer"), ("GET", "/v2/models/1"), ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models")} <= set(checked)
    without = _statuses(app, [(m, p, {}) for m, p in checked])
    assert without == [401] * len(checked), list(zip(checked, without))
    opened = _statuses(app, [(m, p, BEARER) for m, p in checked])
    assert 401 not in opened, list(zip(checked, opened))


def test_the_key_may_come_from_the_environment_and_the_file_wins(monkeypatch):
    assert _statuses(_app(monkeypatch), [("GET", "/v2", {})]) == [200]  # no key anywhere: open
    from_env = _app(monkeypatch, env="from-the-env")
    assert _statuses(from_env, [("GET", "/v2", {}), ("GET", "/v2", {"Authorization": "Bearer from-the-env"}),
                                ("GET", "/v2/health/live", {})]) == [401, 200, 200]
    both = _app(monkeypatch, env="from-the-env", api_key="from-the-file")
    assert _statuses(both, [("GET", "/v2", {"Authorization": "Bearer from-the-env"}),
                            ("GET", "/v2", {"Authorization": "Bearer from-the-file"})]) == [401, 200]
    # another variable, or none
    monkeypatch.setenv("MY_KEY", "mine")
    named = _app(monkeypatch, env="from-the-env", api_key_env="MY_KEY")
    assert _statuses(named, [("GET", "/v2", {"Authorization": "Bearer mine"})]) == [200]
    assert _statuses(_app(monkeypatch, env="from-the-env", api_key_env=None), [("GET", "/v2", {})]) == [200]
