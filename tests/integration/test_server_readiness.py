"""Issue 34, item 2: honest readiness and failure. A server with broken models is not
ready and says which and why; a model that failed for good is answered 503 without
Retry-After and with the cause; a transient failure keeps Retry-After and is loaded
again; ``optional`` models do not hold readiness; ``--exit-on-error`` exits naming the
model; ``timeshare serve --check`` exits 1 naming each broken model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from safetensors.torch import save_file

from tests import failing_models
from tests.serving import running_server, tiny_config
from timeshare.llm import hfdir
from timeshare.models.zoo import get as zoo_get
from timeshare.server.check import check_llm

ROOT = Path(__file__).resolve().parents[2]
LINEAR_INPUTS = [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
X = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}

def _mlp_request() -> dict:
    (x,) = zoo_get("tiny_mlp").example_inputs(1)
    return {"inputs": [{"name": zoo_get("tiny_mlp").input_names[0], "shape": list(x.shape), "datatype": "FP32",
                        "data": x.flatten().tolist()}]}


MLP = _mlp_request()


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, str]:
    """A garbled weights file, one whose shapes do not match ``failing_models.linear``, and
    a language model directory whose first shard is garbled."""
    root = tmp_path_factory.mktemp("broken")
    corrupt = root / "corrupt.safetensors"
    corrupt.write_bytes(b"\x0e\x00\x00\x00\x00\x00\x00\x00{not a header}")
    wrong = root / "wrong.safetensors"
    save_file({"weight": torch.ones(3, 4), "bias": torch.zeros(3)}, str(wrong))
    good_llm = hfdir.write_model_dir(root / "llm", "llama", seed=1, hidden=32, layers=1)
    bad_llm = root / "bad_llm"
    shutil.copytree(good_llm, bad_llm)
    shard = hfdir.shard_files(bad_llm)[0]
    shard.write_bytes(b"\xff" * 8 + shard.read_bytes()[8:])  # a header length larger than the file
    return {"corrupt": str(corrupt), "wrong": str(wrong), "llm": str(good_llm), "bad_llm": str(bad_llm),
            "bad_shard": str(shard)}


def broken_models(broken: dict[str, str], *, optional: bool = False) -> list[dict]:
    return [
        {"name": "mlp", "zoo": "tiny_mlp"},
        {"name": "corrupt", "zoo": "tiny_mlp", "weights": broken["corrupt"], "optional": optional},
        {"name": "gone", "build": "no_such_module_for_readiness:make", "inputs": LINEAR_INPUTS, "optional": optional},
        {"name": "wrong", "build": "tests.failing_models:linear", "weights": broken["wrong"], "inputs": LINEAR_INPUTS,
         "optional": optional},
    ]


def started(service, deadline_s: float = 120.0) -> None:
    """Until start-up has ended (every model loaded or failed)."""
    deadline = time.monotonic() + deadline_s
    while (service.readiness().reason or "").startswith("starting"):
        assert time.monotonic() < deadline, "start-up did not end"
        time.sleep(0.05)


def test_readiness_names_each_broken_model_and_permanent_failures_have_no_retry_after(broken):
    cfg = tiny_config(models=broken_models(broken),
                      llms=[{"name": "chat", "path": broken["llm"]}, {"name": "badchat", "path": broken["bad_llm"]}])
    with running_server(cfg, expect_ready=False) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        started(s.service)
        r = http.get("/v2/health/ready")
        assert r.status_code == 400
        body = r.json()
        assert body["ready"] is False and body["reason"].startswith("models cannot serve: corrupt (permanent: ")
        models = body["models"]
        assert sorted(models) == ["badchat", "corrupt", "gone", "wrong"]  # mlp and chat serve
        assert models["corrupt"].startswith(f"permanent: WeightsError: weights file {broken['corrupt']!r} ")
        assert models["gone"].startswith("permanent: ConfigError: cannot import 'no_such_module_for_readiness'")
        assert models["wrong"] == "permanent: WeightsError: tensor 'weight' has shape [3, 4] in the weights but " \
                                  "[2, 4] in the module"
        assert models["badchat"].startswith("permanent: WeightsError: ") and broken["bad_shard"] in models["badchat"]
        status = http.get("/admin/status").json()
        assert status["ready"] is False and status["not_ready_reason"] == body["reason"]

        r = http.post("/v2/models/corrupt/infer", json=MLP)  # failed for good: no Retry-After, the cause
        assert r.status_code == 503 and "retry-after" not in r.headers
        assert r.json()["error"].startswith("model 'corrupt' failed to load and cannot serve until the cause is fixed")
        assert f"WeightsError: weights file {broken['corrupt']!r}" in r.json()["error"]
        r = http.post("/v1/completions", json={"model": "badchat", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "retry-after" not in r.headers
        assert broken["bad_shard"] in r.json()["error"]["message"]
        assert http.post("/v2/models/mlp/infer", json=MLP).status_code == 200
        r = http.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert http.get("/v2/models/corrupt/ready").json() == {"name": "corrupt", "ready": False}
        assert http.get("/v2/models/mlp/ready").status_code == 200

        # Unloading a broken model is the operator's choice: readiness no longer waits for it.
        assert http.post("/v2/repository/models/wrong/unload").status_code == 200
        assert "wrong" not in http.get("/v2/health/ready").json()["models"]
        r = http.post("/v2/models/wrong/infer", json=X)  # unloaded, not failed: Retry-After as before
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "is not loaded" in r.json()["error"]


def test_optional_models_do_not_hold_readiness(broken):
    cfg = tiny_config(models=broken_models(broken, optional=True),
                      llms=[{"name": "badchat", "path": broken["bad_llm"], "optional": True}])
    with running_server(cfg) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        assert http.get("/v2/health/ready").json() == {"ready": True}
        r = http.post("/v2/models/gone/infer", json=X)  # still answered as failed for good
        assert r.status_code == 503 and "retry-after" not in r.headers and "cannot import" in r.json()["error"]
        index = {m["name"]: m for m in http.post("/v2/repository/index").json()}
        assert index["corrupt"]["state"] == "UNAVAILABLE" and "WeightsError" in index["corrupt"]["reason"]


def test_a_transient_failure_keeps_retry_after_and_is_loaded_again():
    failing_models.Flaky.failing = True  # its warm-up runs out of memory until this is cleared
    cfg = tiny_config(models=[{"name": "mlp", "zoo": "tiny_mlp"},
                              {"name": "flaky", "build": "tests.failing_models:flaky", "inputs": LINEAR_INPUTS}])
    try:
        with running_server(cfg, expect_ready=False) as s, httpx.Client(base_url=s.url, timeout=60) as http:
            started(s.service)
            r = http.get("/v2/health/ready")
            assert r.status_code == 400
            assert r.json()["models"]["flaky"].startswith("transient: MemoryError: out of memory (on purpose")
            r = http.post("/v2/models/flaky/infer", json=X)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            failing_models.Flaky.failing = False  # the next load after the back-off succeeds
            deadline = time.monotonic() + 60
            while http.get("/v2/health/ready").status_code != 200:
                assert time.monotonic() < deadline, http.get("/v2/health/ready").json()
                time.sleep(0.1)
            r = http.post("/v2/models/flaky/infer", json=X)
            assert r.status_code == 200
            want = failing_models.linear()(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
            assert torch.allclose(torch.tensor(r.json()["outputs"][0]["data"]), want.flatten())
    finally:
        failing_models.Flaky.failing = False


def test_a_pinned_model_that_cannot_load_says_why(broken):
    cfg = tiny_config(models=[{"name": "mlp", "zoo": "tiny_mlp"},
                              {"name": "pinned", "zoo": "tiny_mlp", "weights": broken["corrupt"], "pinned": True}])
    with running_server(cfg, expect_ready=False) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        started(s.service)
        body = http.get("/v2/health/ready").json()
        assert list(body["models"]) == ["pinned"] and body["models"]["pinned"].startswith("permanent: WeightsError")


def run_cli(*args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # tests.failing_models for the builders
    return subprocess.run([sys.executable, "-m", "timeshare", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout_s)


def test_check_exits_1_naming_each_broken_model(broken, tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text(yaml.safe_dump({"runtime": {"device": "cpu", "memory": "1MiB"},
                                      "models": broken_models(broken),
                                      "llms": [{"name": "chat", "path": broken["llm"]},
                                               {"name": "badchat", "path": broken["bad_llm"]}]}))
    done = run_cli("serve", "--config", str(config), "--check")
    assert done.returncode == 1, done.stderr
    assert yaml.safe_load(done.stdout)["models"][0]["name"] == "mlp"  # the validated config, as before
    lines = done.stderr.splitlines()
    assert lines[0].startswith("ok: model 'mlp': ")
    assert lines[1].startswith(f"FAILED: model 'corrupt': WeightsError: weights file {broken['corrupt']!r} has a "
                               "header that is not JSON")
    assert lines[2].startswith("FAILED: model 'gone': ConfigError: cannot import 'no_such_module_for_readiness'")
    assert lines[3] == "FAILED: model 'wrong': WeightsError: tensor 'weight' has shape [3, 4] in the weights but " \
                       "[2, 4] in the module"
    assert lines[4].startswith("ok: language model 'chat': ")
    assert lines[5].startswith("FAILED: language model 'badchat': WeightsError: weights file "
                               f"{broken['bad_shard']!r} has a header length")
    assert lines[6] == "4 of 6 models cannot serve: 'corrupt', 'gone', 'wrong', 'badchat'"

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"models": broken_models(broken, optional=True)[:2]}))
    done = run_cli("serve", "--config", str(good), "--check")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[1].startswith("FAILED (optional): model 'corrupt': WeightsError")


def test_check_reads_a_language_model_directory(broken):
    ok = check_llm(parse_llm("chat", broken["llm"]))
    assert ok.ok and ok.detail.endswith(f"shard(s) in {broken['llm']}"), ok
    bad = check_llm(parse_llm("bad", broken["bad_llm"]))
    assert bad.problem is not None and broken["bad_shard"] in bad.problem


def parse_llm(name: str, path: str):
    from timeshare.config import LLMConfig

    return LLMConfig(name=name, path=path)


def test_exit_on_error_exits_naming_the_model(broken, tmp_path):
    config = tmp_path / "exit.yaml"
    config.write_text(yaml.safe_dump({
        "runtime": {"device": "cpu", "memory": "1MiB"},
        "server": {"host": "127.0.0.1", "http_port": 0, "metrics_port": None},
        "models": broken_models(broken)[:2] + [{**broken_models(broken)[2], "optional": True}]}))
    done = run_cli("serve", "--config", str(config), "--exit-on-error", timeout_s=120)
    assert done.returncode == 1, done.stderr
    failed = [line for line in done.stderr.splitlines() if "exiting (server.exit_on_error)" in line]
    assert len(failed) == 1 and f"corrupt: WeightsError: weights file {broken['corrupt']!r}" in failed[0]
    assert "gone" not in failed[0]  # optional
