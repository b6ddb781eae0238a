"""The load test, short version (``timeshare bench serve`` is the long one): concurrent
clients over several models whose memory budget holds about half of them. No response
may be lost, duplicated or mismatched, and none may be a 5xx."""

from __future__ import annotations

import json

from tests.serving import running_server
from timeshare import cli
from timeshare.bench.serve import ServeBenchConfig, drive, references, server_config


def test_many_clients_over_models_that_must_take_turns():
    cfg = ServeBenchConfig(clients=12, requests=480, distinct_inputs=6, seed=3)
    server_cfg = server_config(cfg)
    server_cfg["server"].update(host="127.0.0.1", metrics_port=None)
    cases = references(cfg)
    with running_server(server_cfg) as s:
        r = drive(s.url, cfg, cases)
        evictions = s.service.runtime.stats()["evictions"]
    assert r["requests"] == 480 and r["answered"] == 480
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["transport_errors"] == 0
    assert r["mismatched"] == 0, r["mismatch_examples"]
    assert r["status_5xx"] == 0
    assert r["loads"] > 4 and evictions > 4  # the budget made models take turns
    assert r["mean_batch_rows"] > 1.0  # concurrent requests for one model were batched
    assert all(m["answered"] == m["requests"] for m in r["per_model"].values())


def test_bench_serve_command_writes_its_json(tmp_path):
    out = tmp_path / "serve.json"
    code = cli.main(["bench", "serve", "--models", "tiny_mlp", "tiny_bert", "--requests", "60", "--clients", "4",
                     "--sequential", "20", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    r = result["result"]
    assert r["answered"] == 60 and r["lost"] == 0 and r["mismatched"] == 0 and r["status_5xx"] == 0
    assert r["server_exit_code"] == 0 and r["server_leftover_processes"] == 0
    assert r["throughput_rps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0
    assert result["environment"]["torch"]
    # The plain-PyTorch server had the same requests, and every hop was counted on both.
    for name, requests in (("alone", 20), ("load", 60)):
        for server in ("timeshare", "plain"):
            p = result["passes"][name][server][-1]
            assert p["answered"] == requests and p["mismatched"] == 0, (name, server)
            assert p["hops"]["requests"] == requests and p["hops"]["total_us"] > 0
        assert result["comparison"][name]["throughput_ratio"] > 0
