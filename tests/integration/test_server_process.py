"""``timeshare serve`` as an operator runs it: a child process, stopped by SIGTERM or
Ctrl-C while a request is in flight. The request must finish, the server must exit 0
and leave no process behind."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from timeshare.harness.client import Client
from timeshare.harness.process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch):
    """The server (and its workers) import ``tests.models``."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def config(workers: int) -> dict:
    cfg = {
        "runtime": {"device": "cpu", "memory": "1MiB", "workers": workers},
        "models": [{"name": "sleepy", "build": "tests.models:sleepy_linear",
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]},
                   {"name": "mlp", "zoo": "tiny_mlp"}],
    }
    if workers != 1:
        cfg["training"] = [{"name": "bg", "model": "tiny_cnn", "batch": 4}]
    return cfg


@pytest.mark.parametrize("workers, sig", [(2, signal.SIGTERM), (0, signal.SIGINT)])
def test_stop_drains_in_flight_requests_and_leaves_nothing(workers, sig):
    from tests.models import sleepy_linear

    server = ServerProcess(config(workers), ready_timeout_s=180)
    try:
        server.start()
        pid = server.proc.pid
        assert server.start().proc.pid == pid  # started once, whatever calls start again (a with block)
        if workers:
            assert len(server.children) >= workers  # the worker processes (and the resource tracker)
        x = torch.zeros(1, 4)
        x[0, 0] = 11.0  # sleeps one second in the model
        with Client(server.url) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(client.infer, "sleepy", {"x": x}, request_id="in-flight")
            time.sleep(0.4)
            server.proc.send_signal(sig)
            answer = slow.result(60)
        assert answer.status == 200 and answer.id == "in-flight", answer.error
        with torch.no_grad():
            torch.testing.assert_close(answer.outputs["output"], sleepy_linear().fc(x), rtol=0, atol=0)
        assert server.proc.wait(60) == 0, server.log_tail()
        assert server.leftovers(grace_s=10) == [], server.log_tail()
    finally:
        server.close()


def test_a_server_whose_starter_dies_stops_by_itself():
    import json
    import subprocess
    import sys

    starter = (
        "import json, os, sys\n"
        "from timeshare.harness.process import ServerProcess\n"
        "server = ServerProcess(json.loads(sys.argv[1]), ready_timeout_s=120).start()\n"
        "print(server.pid, flush=True)\n"
        "os._exit(0)  # dies without stopping it\n"
    )
    cfg = {"runtime": {"device": "cpu", "memory": "1MiB"}, "models": [{"name": "mlp", "zoo": "tiny_mlp"}]}
    out = subprocess.run([sys.executable, "-c", starter, json.dumps(cfg)], capture_output=True, text=True,
                         timeout=180, check=True)
    pid = int(out.stdout.split()[0])

    def alive() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"

    deadline = time.monotonic() + 60
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), f"the orphaned server {pid} is still running"
