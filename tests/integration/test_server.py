"""The HTTP server end to end: a real uvicorn server on loopback, real HTTP clients
(our own and Triton's), outputs checked against the models run alone."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.serving import running_server, tiny_config
from timeshare.harness.client import Client
from timeshare.models.weights import read_weights
from timeshare.models.zoo import get as zoo_get
from timeshare.models.zoo import weights_path
from timeshare.server.endpoint import flatten_outputs
from timeshare.server.tensors import to_json_data

ZOO = {"mlp": "tiny_mlp", "cnn": "tiny_cnn", "bert": "tiny_bert"}


def reference(zoo: str, *inputs) -> dict[str, torch.Tensor]:
    """The model's outputs computed alone, from the same seeded weights."""
    module = zoo_get(zoo).build()
    module.load_state_dict(read_weights(str(weights_path(zoo))), strict=False)
    with torch.no_grad():
        return dict(flatten_outputs(module.eval()(*inputs)))


def inputs_of(zoo: str, batch: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    z = zoo_get(zoo)
    return dict(zip(z.input_names, z.example_inputs(batch, seed=seed)))


def json_request(inputs: dict[str, torch.Tensor], **extra) -> dict:
    from timeshare.dtypes import DATATYPES

    return {"inputs": [{"name": n, "shape": list(t.shape), "datatype": DATATYPES[t.dtype], "data": to_json_data(t)}
                       for n, t in inputs.items()], **extra}


def metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def server():
    # 600,000 bytes hold tiny_bert (563,200) with one of the two others, never all three.
    cfg = tiny_config(runtime={"memory": 600_000}, training=[{"name": "bg", "model": "tiny_cnn", "batch": 4}])
    with running_server(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_health_metadata_and_json_inference_match_the_model_alone(http):
    assert http.get("/v2/health/live").json() == {"live": True}
    assert http.get("/v2/health/ready").status_code == 200
    meta = http.get("/v2").json()
    assert meta["name"] == "timeshare" and "binary_tensor_data" in meta["extensions"]
    bert = http.get("/v2/models/bert").json()
    assert [i["name"] for i in bert["inputs"]] == ["input_ids", "attention_mask"]
    assert bert["inputs"][0] == {"name": "input_ids", "datatype": "INT64", "shape": [-1, 16]}
    assert {o["name"] for o in bert["outputs"]} == {"last_hidden_state", "pooler_output"}
    assert http.get("/v2/models/bert/ready").json() == {"name": "bert", "ready": True}
    for name, zoo in ZOO.items():
        inputs = inputs_of(zoo, batch=2, seed=5)
        r = http.post(f"/v2/models/{name}/infer", json=json_request(inputs, id="abc"))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "abc" and body["model_name"] == name
        ref = reference(zoo, *inputs.values())
        got = {o["name"]: torch.tensor(o["data"]).reshape(o["shape"]) for o in body["outputs"]}
        assert set(got) == set(ref)
        for k in ref:  # JSON carries float32 values exactly
            assert torch.equal(got[k], ref[k]), k


def test_binary_extension_and_requested_outputs(http, server):
    inputs = inputs_of("tiny_bert", batch=3, seed=2)
    with Client(server.url) as client:
        answer = client.infer("bert", inputs, request_id="b1")
    assert answer.status == 200 and answer.id == "b1"
    ref = reference("tiny_bert", *inputs.values())
    assert all(torch.equal(answer.outputs[k], ref[k]) for k in ref)
    r = http.post("/v2/models/bert/infer", json=json_request(inputs, outputs=[{"name": "pooler_output"}]))
    assert [o["name"] for o in r.json()["outputs"]] == ["pooler_output"]
    r = http.post("/v2/models/bert/infer", json=json_request(inputs, outputs=[{"name": "logits"}]))
    assert r.status_code == 400 and "no output 'logits'" in r.json()["error"]


def test_triton_client_works_unchanged(server):
    """A standard Open Inference Protocol client that this project did not write."""
    import numpy as np
    import tritonclient.http as tc

    url = server.url.removeprefix("http://")
    client = tc.InferenceServerClient(url=url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("cnn")
        assert client.get_model_metadata("cnn")["inputs"][0]["shape"] == [-1, 3, 16, 16]
        index = client.get_model_repository_index()
        assert {m["name"] for m in index} == set(ZOO) and all(m["state"] == "READY" for m in index)
        x = inputs_of("tiny_cnn", batch=2, seed=9)["x"]
        for binary in (True, False):
            inp = tc.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x.numpy(), binary_data=binary)
            out = tc.InferRequestedOutput("output", binary_data=binary)
            result = client.infer("cnn", [inp], outputs=[out], request_id="t1")
            assert result.get_response()["id"] == "t1"
            np.testing.assert_array_equal(result.as_numpy("output"), reference("tiny_cnn", x)["output"].numpy())
    finally:
        client.close()


@pytest.mark.parametrize("body, status, words", [
    ({"inputs": [{"name": "x", "shape": [1, 32], "datatype": "INT64", "data": [1] * 32}]}, 400, "must be FP32"),
    ({"inputs": [{"name": "x", "shape": [1, 31], "datatype": "FP32", "data": [1.0] * 31}]}, 400, "must have shape"),
    ({"inputs": [{"name": "y", "shape": [1, 32], "datatype": "FP32", "data": [1.0] * 32}]}, 400, "no input 'y'"),
    ({"inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32", "data": [1.0] * 32}], "extra": 1}, 400, "extra"),
    ({"inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32"}]}, 400, "no 'data'"),
    ({"inputs": [{"name": "x", "shape": [9, 32], "datatype": "FP32", "data": [1.0] * 288}]}, 400, "1 to 8 rows"),
    ({"inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32", "data": [True] * 32}]}, 400, "numbers"),
])
def test_malformed_requests_get_4xx_with_a_message(http, body, status, words):
    r = http.post("/v2/models/mlp/infer", json=body)
    assert r.status_code == status and words in r.json()["error"], r.text


def test_bad_input_never_hurts_the_server(http):
    nan = '{"inputs": [{"name": "x", "shape": [1, 32], "datatype": "FP32", "data": [NaN' + ", 1.0" * 31 + "]}]}"
    r = http.post("/v2/models/mlp/infer", content=nan, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "NaN" in r.json()["error"]
    assert http.post("/v2/models/mlp/infer", content=b"{not json").status_code == 400
    assert http.post("/v2/models/nope/infer", json={"inputs": []}).status_code == 404
    assert http.get("/v2/models/mlp/versions/2").status_code == 404
    ids = inputs_of("tiny_bert")
    ids["input_ids"][0, 0] = 5000  # outside the vocabulary: refused before the model sees it
    r = http.post("/v2/models/bert/infer", json=json_request(ids))
    assert r.status_code == 400 and "[0, 999]" in r.json()["error"]
    r = http.post("/v2/models/mlp/infer", content=b"x" * (65 << 20))
    assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]
    ok = http.post("/v2/models/bert/infer", json=json_request(inputs_of("tiny_bert")))
    assert ok.status_code == 200


def _hold_device(server, model: str = "mlp"):
    """Keep the runtime busy (a turn of one of the server's models holds the device) so
    that requests queue."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with server.service.runtime.turn(model):  # the test needs the device taken
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert held.wait(10)
    return release, t


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server):
    inputs = [inputs_of("tiny_mlp", seed=100 + i) for i in range(4)]
    release, t = _hold_device(server)
    with Client(server.url) as client, concurrent.futures.ThreadPoolExecutor(5) as pool:
        first = pool.submit(client.infer, "mlp", inputs[0], request_id="0")
        time.sleep(0.3)  # the first is taken; the others queue behind it
        rest = [pool.submit(client.infer, "mlp", x, request_id=str(i)) for i, x in enumerate(inputs[1:], 1)]
        time.sleep(0.5)
        assert server.service.queue_depths()["mlp"] == 3
        release.set()
        answers = [first.result(30)] + [f.result(30) for f in rest]
    t.join(10)
    assert [a.id for a in answers] == ["0", "1", "2", "3"]
    assert [a.parameters["timeshare_batch_rows"] for a in answers] == [1, 3, 3, 3]
    for a, x in zip(answers, inputs):
        torch.testing.assert_close(a.outputs["output"], reference("tiny_mlp", x["x"])["output"])


def test_the_slo_deadline_counts_from_the_oldest_arrival_in_the_batch(server, monkeypatch):
    runtime = server.service.runtime
    calls, call = [], runtime.call

    def spy(name, args=(), kwargs=None, *, strategy=None, arrived_at=None):
        calls.append((name, arrived_at, time.monotonic()))
        return call(name, args, kwargs, strategy=strategy, arrived_at=arrived_at)

    monkeypatch.setattr(runtime, "call", spy)
    release, t = _hold_device(server)
    with Client(server.url) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        sent = time.monotonic()
        first = pool.submit(client.infer, "mlp", inputs_of("tiny_mlp", seed=1))
        time.sleep(0.6)  # the first waits for the device held above
        second = pool.submit(client.infer, "mlp", inputs_of("tiny_mlp", seed=2))
        time.sleep(0.3)
        release.set()
        assert first.result(30).status == 200 and second.result(30).status == 200
    t.join(10)
    # The first went straight to the runtime and waited in its dispatcher.
    name, arrived, called = calls[0]
    assert name == "mlp" and sent <= arrived <= called
    # The second waited in the server's queue behind the first: that wait counts.
    name, arrived, called = calls[1]
    assert sent + 0.6 <= arrived and called - arrived >= 0.25


def test_full_queue_gets_503_with_retry_after(server):
    ep = server.service.endpoints["cnn"]
    limit = ep.cfg.max_queue
    object.__setattr__(ep.cfg, "max_queue", 1)
    release, t = _hold_device(server)
    try:
        with Client(server.url) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
            x = inputs_of("tiny_cnn")
            running = pool.submit(client.infer, "cnn", x)
            time.sleep(0.3)
            queued = pool.submit(client.infer, "cnn", x)
            time.sleep(0.3)
            refused = client.infer("cnn", x)
            assert refused.status == 503 and int(refused.retry_after) >= 1 and "max_queue" in refused.error
            release.set()
            assert running.result(30).status == 200 and queued.result(30).status == 200
    finally:
        release.set()
        t.join(10)
        object.__setattr__(ep.cfg, "max_queue", limit)


def test_metrics_follow_prometheus_conventions(http, server):
    http.post("/v2/models/cnn/infer", json=json_request(inputs_of("tiny_cnn")))
    http.post("/v2/models/mlp/infer", json=json_request(inputs_of("tiny_mlp")))
    text = http.get("/metrics").text
    for name in ("timeshare_request_duration_seconds_bucket", "timeshare_queue_duration_seconds_bucket",
                 "timeshare_load_duration_seconds_bucket", "timeshare_switch_duration_seconds_bucket",
                 "timeshare_queue_depth", "timeshare_resident_models", "timeshare_model_resident_bytes",
                 "timeshare_arena_used_bytes", "timeshare_arena_capacity_bytes", "timeshare_host_pinned_bytes",
                 "timeshare_switches_total", "timeshare_evictions_total", "timeshare_preemptions_total",
                 "timeshare_requests_total", "timeshare_device_busy_seconds_total"):
        assert f"\n{name}" in text, name
    assert metric(text, "timeshare_requests_total", model="cnn", code="200") >= 1
    assert metric(text, "timeshare_switches_total") >= 1
    snap = server.service.runtime.snapshot()
    assert metric(text, "timeshare_arena_capacity_bytes") == snap.capacity_bytes > 590_000
    assert metric(text, "timeshare_arena_used_bytes") == snap.used_bytes > 0
    assert metric(text, "timeshare_device_busy_seconds_total", task="training") > 0


def _wait_status(http, job: str, status: str) -> dict:
    deadline = time.monotonic() + 30
    while (state := http.get(f"/admin/training/{job}").json())["status"] != status:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    return state


def test_training_jobs_through_the_admin_plane(http):
    jobs = http.get("/admin/training").json()
    assert [j["name"] for j in jobs] == ["bg"] and jobs[0]["status"] in ("running", "queued")
    # Under "priority" training jobs run one after another, so the endless one pauses first.
    assert http.post("/admin/training/bg/pause").status_code == 200
    before = _wait_status(http, "bg", "paused")["iterations"]
    r = http.post("/admin/training", json={"name": "t2", "model": "tiny_mlp", "batch": 2, "iterations": 5})
    assert r.status_code == 201, r.text
    assert http.post("/admin/training", json={"name": "bg", "model": "tiny_cnn"}).status_code == 409
    bad = http.post("/admin/training", json={"name": "t3", "model": "resnet9000"})
    assert bad.status_code == 400 and "resnet9000" in bad.json()["error"]
    done = _wait_status(http, "t2", "finished")
    assert done["iterations"] == 5 and done["loss"] is not None
    assert http.get("/admin/training/bg").json()["iterations"] == before  # paused means paused
    assert http.post("/admin/training/bg/resume").status_code == 200
    deadline = time.monotonic() + 30
    while http.get("/admin/training/bg").json()["iterations"] == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert http.post("/admin/training/bg/explode").status_code == 400
    assert http.get("/admin/training/nope").status_code == 404


def test_unload_frees_memory_and_load_brings_the_model_back(http, server):
    status = http.get("/admin/status").json()
    assert "bert" in status["resident"] or http.post("/v2/repository/models/bert/load").status_code == 200
    host_before = http.get("/admin/status").json()["host_bytes"]
    assert http.post("/v2/repository/models/bert/unload").status_code == 200
    status = http.get("/admin/status").json()
    assert "bert" not in status["resident"] and status["host_bytes"] < host_before
    assert http.get("/v2/models/bert/ready").status_code == 400
    r = http.post("/v2/models/bert/infer", json=json_request(inputs_of("tiny_bert")))
    assert r.status_code == 503 and "not loaded" in r.json()["error"]  # the server's state: retry after a load
    assert r.headers["retry-after"] == "1"
    index = {m["name"]: m for m in http.post("/v2/repository/index").json()}
    assert index["bert"]["state"] == "UNAVAILABLE"
    assert [m["name"] for m in http.post("/v2/repository/index", json={"ready": True}).json()] == ["mlp", "cnn"]
    assert http.post("/v2/repository/models/bert/load").status_code == 200
    assert "bert" in http.get("/admin/status").json()["resident"]
    x = inputs_of("tiny_bert", seed=4)
    r = http.post("/v2/models/bert/infer", json=json_request(x))
    assert r.status_code == 200
    got = {o["name"]: torch.tensor(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
    assert torch.equal(got["pooler_output"], reference("tiny_bert", *x.values())["pooler_output"])
    assert http.post("/v2/repository/models/nope/load").status_code == 404


def test_pinned_models_stay_resident(http, server):
    assert http.post("/admin/models/mlp/pin").json() == {"name": "mlp", "pinned": True}
    for _ in range(3):  # the other models take turns in a budget that cannot hold all three
        for name in ("bert", "cnn"):
            assert http.post(f"/v2/models/{name}/infer", json=json_request(inputs_of(ZOO[name]))).status_code == 200
            assert "mlp" in http.get("/admin/status").json()["resident"]
    assert http.post("/admin/models/mlp/unpin").status_code == 200


def test_models_that_cannot_load_are_unavailable_with_the_reason(tmp_path):
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    wrong = tmp_path / "wrong.safetensors"
    save_file({"fc1.weight": torch.zeros(3, 3)}, str(wrong))
    # Optional: the server is ready without them (issue 34; test_server_readiness.py has the others).
    cfg = tiny_config(runtime={"memory": "64KiB"}, models=[
        {"name": "mlp", "zoo": "tiny_mlp"},
        {"name": "big", "zoo": "tiny_bert", "optional": True},  # 557 KB: larger than the whole budget
        {"name": "corrupt", "zoo": "tiny_mlp", "weights": str(corrupt), "optional": True},
        {"name": "wrong", "zoo": "tiny_mlp", "weights": str(wrong), "optional": True},
    ])
    with running_server(cfg) as s, httpx.Client(base_url=s.url) as http:
        index = {m["name"]: m for m in http.post("/v2/repository/index").json()}
        assert index["mlp"]["state"] == "READY"
        assert index["big"]["state"] == "UNAVAILABLE" and "ModelTooLargeError" in index["big"]["reason"]
        assert index["corrupt"]["state"] == "UNAVAILABLE" and "corrupt" in index["corrupt"]["reason"]
        assert index["wrong"]["state"] == "UNAVAILABLE" and "WeightsError" in index["wrong"]["reason"]
        r = http.post("/v2/models/big/infer", json=json_request(inputs_of("tiny_bert")))
        assert r.status_code == 503 and "arena holds only" in r.json()["error"]
        assert "retry-after" not in r.headers  # failed for good: coming back does not help
        assert http.post("/v2/repository/models/big/load").status_code == 409
        assert http.post("/v2/models/mlp/infer", json=json_request(inputs_of("tiny_mlp"))).status_code == 200
        assert s.service.runtime.models() == ["mlp"]  # nothing half-registered stays behind


def test_admin_token(monkeypatch):
    cfg = tiny_config(models=[{"name": "mlp", "zoo": "tiny_mlp"}], admin={"token": "s3cret"})
    with running_server(cfg) as s, httpx.Client(base_url=s.url) as http:
        assert http.post("/v2/repository/index").status_code == 401
        assert http.post("/v2/repository/index", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.post("/v2/repository/index", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert http.get("/v2/health/ready").status_code == 200  # the data plane needs no token
    cfg = tiny_config(models=[{"name": "mlp", "zoo": "tiny_mlp"}], admin={"enabled": False})
    with running_server(cfg) as s, httpx.Client(base_url=s.url) as http:
        r = http.post("/v2/repository/index")
        assert r.status_code == 403 and "disabled" in r.json()["error"]


def test_admin_plane_refuses_other_hosts_without_a_token():
    from timeshare.server.admin import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("127.5.0.1")
    assert not is_loopback("10.0.0.7") and not is_loopback("testclient") and not is_loopback("")


def test_a_web_page_cannot_drive_the_loopback_admin_plane(http, server):
    """DNS rebinding (a foreign Host) and cross-site requests (a foreign Origin) are refused
    even though they come from the loopback address."""
    port = server.url.rsplit(":", 1)[1]
    assert http.get("/admin/status").status_code == 200
    r = http.post("/v2/repository/models/mlp/unload", headers={"Host": f"evil.example:{port}"})
    assert r.status_code == 403 and "Host" in r.json()["error"]
    r = http.post("/v2/repository/models/mlp/unload", headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-site" in r.json()["error"]
    assert http.post("/admin/training", headers={"Origin": "null"}, json={}).status_code == 403
    assert "mlp" in [m["name"] for m in http.post("/v2/repository/index", json={"ready": True}).json()]
    for origin in (f"http://localhost:{port}", f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
        assert http.get("/admin/status", headers={"Origin": origin}).status_code == 200
    assert http.get("/admin/status", headers={"Host": f"[::1]:{port}"}).status_code == 200
    assert http.get("/v2/health/ready", headers={"Host": "evil.example"}).status_code == 200  # the data plane is open


def test_the_api_description_is_off_by_default(http):
    """server.openapi: false (test_server_hostile.py turns it on)."""
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert http.get(path).status_code == 404, path


def test_one_bad_request_does_not_fail_its_batch_mates():
    from tests.models import picky_linear

    cfg = tiny_config(models=[{"name": "picky", "build": "tests.models:picky_linear",
                               "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]}])
    xs = [torch.full((1, 4), float(i)) for i in (1, 7, 2, 3)]  # the second one makes the model raise
    with running_server(cfg) as s, Client(s.url) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        release, t = _hold_device(s, "picky")
        first = pool.submit(client.infer, "picky", {"x": xs[0]})
        time.sleep(0.3)
        rest = [pool.submit(client.infer, "picky", {"x": x}) for x in xs[1:]]
        time.sleep(0.5)
        release.set()
        answers = [first.result(30)] + [f.result(30) for f in rest]
        t.join(10)
    assert [a.status for a in answers] == [200, 400, 200, 200]
    assert "a row starts with 7" in answers[1].error
    with torch.no_grad():
        for a, x in zip(answers, xs):
            if a.status == 200:
                torch.testing.assert_close(a.outputs["output"], picky_linear().fc(x))


def test_a_pin_that_cannot_be_kept_is_undone_and_unload_unpins():
    cfg = tiny_config(runtime={"memory": 600_000})
    cfg["models"][0]["pinned"] = True  # mlp
    cfg["models"][1]["pinned"] = True  # cnn: with both pinned, bert (563,200 bytes) cannot fit
    with running_server(cfg) as s, httpx.Client(base_url=s.url) as http:
        assert http.get("/v2/health/ready").status_code == 200
        r = http.post("/admin/models/bert/pin")
        assert r.status_code == 503 and "pinned" in r.json()["error"] and r.headers["retry-after"] == "1"
        assert http.get("/v2/health/ready").status_code == 200  # bert was not left pinned
        assert http.post("/v2/repository/models/cnn/unload").status_code == 200
        assert http.get("/v2/health/ready").status_code == 200  # an unloaded model is no longer pinned
        assert http.post("/v2/models/bert/infer", json=json_request(inputs_of("tiny_bert"))).status_code == 200
        assert http.post("/admin/models/cnn/unpin").status_code == 200  # in any state
