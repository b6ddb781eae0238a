"""The server under scheduling "pack": models answer side by side in their lanes, the
lanes show in /admin/status and /metrics, and pack's limits are refused up front."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from tests.integration.test_server import ZOO, inputs_of, metric, reference
from tests.serving import running_server, tiny_config
from timeshare.config import parse_config
from timeshare.errors import ConfigError
from timeshare.harness.client import Client


def test_packed_models_answer_correctly_and_lanes_are_observable():
    cfg = tiny_config(runtime={"memory": "4MiB", "scheduling": "pack", "lane_memory": "8MiB"})
    with running_server(cfg) as server, Client(server.url) as client, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        inputs = {name: inputs_of(zoo, seed=7) for name, zoo in ZOO.items()}
        for name in ZOO:  # the first call of a shape runs alone and measures its lane
            client.infer(name, inputs[name])
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [(name, pool.submit(client.infer, name, inputs[name])) for name in ZOO for _ in range(2)]
            answers = [(name, f.result(60)) for name, f in futures]
        for name, answer in answers:
            want = reference(ZOO[name], *inputs[name].values())
            for out, t in want.items():
                torch.testing.assert_close(answer.outputs[out], t)  # batches of 2 may reassociate sums
        status = http.get("/admin/status").json()
        assert status["lanes"]["capacity"] == 8 << 20 and status["lanes"]["lanes"] == []
        text = http.get("/metrics").text
        assert metric(text, "timeshare_lane_capacity_bytes") == 8 << 20
        assert metric(text, "timeshare_lanes") == 0 and metric(text, "timeshare_lane_admissions_waiting") == 0


def test_what_pack_cannot_do_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="lane_memory"):
        parse_config(tiny_config(runtime={"scheduling": "pack", "lane_memory": "lots"}))
    # Training jobs with workers run in lanes too: accepted.
    parse_config(tiny_config(runtime={"scheduling": "pack", "workers": 2},
                             training=[{"name": "bg", "model": "tiny_cnn"}]))
