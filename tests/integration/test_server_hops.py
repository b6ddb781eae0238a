"""Where a request's time goes (NOTE [Request hops]), and the plain-PyTorch server that
``bench serve`` measures timeshare's against: its answers must be timeshare's, bit for
bit, or the comparison compares different work."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from time import perf_counter_ns

import pytest
import torch

from tests.serving import running_server, tiny_config
from timeshare.bench.plain_server import create_plain_app, load_models
from timeshare.bench.serve import hop_sums, per_request_us
from timeshare.harness.client import Client
from timeshare.harness.process import free_port
from timeshare.models.zoo import get as zoo_get
from timeshare.server.hops import HOPS, STAMPS

ALL_RESIDENT = tiny_config(runtime={"device": "cpu", "memory": "64MiB"})
ZOO = {"mlp": "tiny_mlp", "cnn": "tiny_cnn", "bert": "tiny_bert"}


def test_each_request_hops_are_ordered_and_within_its_latency():
    with running_server(ALL_RESIDENT) as s, Client(s.url) as client:
        before = hop_sums(s.url)
        for i in range(12):
            name = list(ZOO)[i % 3]
            args = zoo_get(ZOO[name]).example_inputs(1 + i % 2, seed=i)
            inputs = dict(zip(zoo_get(ZOO[name]).input_names, args))
            t0 = perf_counter_ns()
            answer = client.infer(name, inputs, request_id=f"r{i}")
            latency = perf_counter_ns() - t0
            assert answer.status == 200, answer.error
            rec = s.service.hops.recent[-1]  # one request at a time: the last record is this one's
            stamps = [getattr(rec, k) for k in STAMPS]
            assert all(stamps), dict(zip(STAMPS, stamps))  # every hop was stamped
            parts = rec.parts_ns()
            assert len(parts) == len(HOPS)
            assert all(p >= 0 for p in parts), rec.parts()
            assert sum(parts) == rec.total_ns() <= latency
            assert parts[HOPS.index("runtime")] > 0
        after = hop_sums(s.url)
    mean = per_request_us(before, after)
    assert mean["requests"] == 12 and set(mean["us"]) == set(HOPS)
    assert all(v >= 0 for v in mean["us"].values())


@contextmanager
def plain_server(models: list[str]):
    import uvicorn

    device = torch.device("cpu")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_plain_app(load_models(models, device), device), host="127.0.0.1",
                                           port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="plain-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the plain server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("binary", [True, False])
def test_plain_server_answers_what_timeshare_answers_bit_for_bit(binary):
    cfg = tiny_config(runtime={"device": "cpu", "memory": "64MiB"},
                      models=[{"name": z, "zoo": z} for z in ZOO.values()])
    with running_server(cfg) as s, plain_server(list(ZOO.values())) as plain_url, \
            Client(s.url) as ts, Client(plain_url) as plain:
        for name in ZOO.values():
            zoo = zoo_get(name)
            for seed in range(3):
                inputs = dict(zip(zoo.input_names, zoo.example_inputs(1 + seed, seed=100 + seed)))
                if binary:
                    got, want = plain.infer(name, inputs, request_id="x"), ts.infer(name, inputs, request_id="x")
                else:
                    got, want = _infer_json(plain, name, inputs), _infer_json(ts, name, inputs)
                assert got.status == want.status == 200, (got.error, want.error)
                assert got.id == want.id
                assert set(got.outputs) == set(want.outputs) and got.outputs
                for out, t in want.outputs.items():
                    assert got.outputs[out].dtype == t.dtype and torch.equal(got.outputs[out], t), (name, out)


def _infer_json(client: Client, model: str, inputs: dict[str, torch.Tensor]):
    """The request with JSON data (no binary extension) both ways."""
    from timeshare.dtypes import DATATYPES
    from timeshare.harness.client import decode_answer

    body = {"inputs": [{"name": n, "shape": list(t.shape), "datatype": DATATYPES[t.dtype],
                        "data": t.reshape(-1).tolist()} for n, t in inputs.items()]}
    return decode_answer(client.http.post(f"/v2/models/{model}/infer", json=body))
