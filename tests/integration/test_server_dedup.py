"""The server with dedup (NOTE [Shared tensors]): two endpoints of one model share its
tensors, answer exactly, and the sharing shows in /admin/status and /metrics."""

from __future__ import annotations

import httpx
import torch

from tests.integration.test_server import inputs_of, metric, reference
from tests.serving import running_server, tiny_config
from timeshare.harness.client import Client


def test_two_endpoints_of_one_model_share_its_tensors_and_answer_exactly():
    # No warm-up: the first requests are the first loads, so the second endpoint's load
    # finds the set resident.
    cfg = tiny_config(runtime={"memory": "1MiB", "dedup": True}, server={"warmup": False},
                      models=[{"name": "bert", "zoo": "tiny_bert"}, {"name": "bert_copy", "zoo": "tiny_bert"},
                              {"name": "mlp", "zoo": "tiny_mlp"}])
    with running_server(cfg) as server, Client(server.url) as client, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        inputs = inputs_of("tiny_bert", seed=3)
        want = reference("tiny_bert", *inputs.values())
        for name in ("bert", "bert_copy", "mlp", "bert", "bert_copy"):
            zoo_inputs = inputs if name != "mlp" else inputs_of("tiny_mlp", seed=3)
            answer = client.infer(name, zoo_inputs)
            expected = want if name != "mlp" else reference("tiny_mlp", *zoo_inputs.values())
            for out, t in expected.items():
                assert torch.equal(answer.outputs[out], t), (name, out)
        shared = http.get("/admin/status").json()["shared"]
        assert shared["sets"] == 1 and shared["saved_bytes"] >= 500_000  # tiny_bert is 0.56 MB
        text = http.get("/metrics").text
        assert metric(text, "timeshare_shared_sets") == 1
        assert metric(text, "timeshare_dedup_saved_bytes") == shared["saved_bytes"]
        # Whichever endpoint loads while the other's set is resident copies a few bytes only.
        moved = {name: metric(text, "timeshare_load_bytes_total", model=name) for name in ("bert", "bert_copy")}
        assert 0 < min(moved.values()) < shared["shared_bytes"] / 10, moved
