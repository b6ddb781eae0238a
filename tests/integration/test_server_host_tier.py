"""The server with a host budget (NOTE [Host tier]): models beyond host memory answer
exactly, and the host tier shows in /admin/status and /metrics."""

from __future__ import annotations

import httpx
import torch

from tests.integration.test_server import ZOO, inputs_of, metric, reference
from tests.serving import running_server, tiny_config
from timeshare.harness.client import Client


def test_models_beyond_the_host_budget_answer_exactly_and_the_tier_is_observable():
    # tiny_bert alone is 0.56 MB, the other two 0.04 MB: 0.57 MB never holds all three.
    cfg = tiny_config(runtime={"memory": "1MiB", "host_memory": 570_000})
    with running_server(cfg) as server, Client(server.url) as client, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(2):
            for name, zoo in ZOO.items():
                inputs = inputs_of(zoo, seed=3)
                answer = client.infer(name, inputs)
                for out, t in reference(zoo, *inputs.values()).items():
                    assert torch.equal(answer.outputs[out], t), (name, out)
        tier = http.get("/admin/status").json()["host_tier"]
        assert tier["budget"] == 570_000 and tier["used"] <= 570_000 and tier["drops"] >= 2
        text = http.get("/metrics").text
        assert metric(text, "timeshare_host_budget_bytes") == 570_000
        assert metric(text, "timeshare_host_drops_total") == tier["drops"] >= 2
        assert metric(text, "timeshare_disk_read_bytes_total") >= 561_000
