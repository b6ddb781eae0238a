"""The admin plane's errors as its clients read them (issue 34, item 5): a validation
error says what is wrong in our words, without pydantic's "Value error, " before them,
and the replica routes of a server without a cluster are 404, saying why. The app in
process, its runtime not started: neither needs one."""

from __future__ import annotations

import asyncio

import httpx

from timeshare.config import parse_config
from timeshare.server.app import create_app
from timeshare.server.service import Service


def _requests(requests: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    app = create_app(Service(parse_config({"models": [{"name": "mlp", "zoo": "tiny_mlp"}]})), start=False)

    async def send() -> list[httpx.Response]:
        # "localhost": the admin plane answers loopback clients that name a local Host
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client:
            return [await client.request(method, path, json=body) for method, path, body in requests]

    return asyncio.run(send())


def test_validation_errors_carry_no_pydantic_prefix():
    zoo, name, extra, index = _requests([
        ("POST", "/admin/training", {"name": "t", "model": "resnet9000"}),
        ("POST", "/admin/training", {"name": "a b", "model": "tiny_mlp"}),
        ("POST", "/admin/training", {"name": "t", "model": "tiny_mlp", "colour": 1}),
        ("POST", "/v2/repository/index", {"ready": "yes"}),
    ])
    assert zoo.status_code == 400
    message = zoo.json()["error"]
    assert message.startswith("invalid request: model: unknown zoo model 'resnet9000'; known: ["), message
    assert name.status_code == 400 and name.json()["error"].startswith("invalid request: name: "), name.text
    for r in (zoo, name, extra, index):
        assert r.status_code == 400 and "Value error" not in r.text, r.text
    assert extra.json()["error"] == "invalid request: colour: Extra inputs are not permitted"
    assert index.json()["error"] == "invalid request: ready: Input should be a valid boolean"


def test_replica_routes_without_a_cluster_are_404_saying_why():
    listed, added, killed, status = _requests([
        ("GET", "/admin/replicas", None), ("POST", "/admin/replicas", None),
        ("POST", "/admin/replicas/r0/kill", None), ("GET", "/v2/health/live", None),
    ])
    for r in (listed, added, killed):
        assert r.status_code == 404, r.text
        assert r.json() == {"error": "this server runs no cluster (its config has no 'cluster' section), so it has "
                                     "no replicas"}
    assert status.status_code == 200
