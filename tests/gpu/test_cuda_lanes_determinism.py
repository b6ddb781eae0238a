"""CUDA: two training jobs packed in lanes (``scheduling="pack"``) end with the weights the
same job has alone, bit for bit, under deterministic kernels (NOTE [Deterministic
kernels]); the job alone twice ends the same too, so the comparison tests packing, not
the kernels. Marked ``cuda``; skipped on machines without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import timeshare
from timeshare.bench.lanes import compare_training
from timeshare.device import deterministic_kernels
from timeshare.models.workloads import TrainingWorkload

pytestmark = pytest.mark.cuda


def test_bench_lanes_in_process_packed_training_equals_alone_with_deterministic_kernels(tmp_path):
    """The H200 case of issue 31 (lanes are threads of one process, each on a CUDA stream of
    its own), as ``timeshare bench lanes`` runs it: in a process of its own, because PyTorch
    reads CUBLAS_WORKSPACE_CONFIG at a process's first cuBLAS call, which this test process
    has long made. The bench sets the variable itself: it is taken out of the environment."""
    out = tmp_path / "lanes.json"
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    cmd = [sys.executable, "-m", "timeshare", "bench", "lanes", "--model", "small_resnet", "--counts", "2",
           "--duration", "0.5", "--device", "cuda", "--memory", "1GiB", "--train", "small_resnet:8",
           "--train-iterations", "20", "--json", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tr = json.loads(out.read_text())["training"]
    assert tr["deterministic"] and tr["kernels"] == {"deterministic_algorithms": True, "cudnn_deterministic": True,
                                                     "cudnn_benchmark": False, "cublas_workspace_config": ":4096:8"}
    for mode in ("fifo", "pack"):
        assert tr[mode]["alone_repeatable"], tr[mode]  # the kernels repeat ...
        assert tr[mode]["equals_alone"], tr[mode]  # ... and the jobs trained together match alone
    assert tr["packed_equals_alone"] and tr["time_sliced_equals_alone"]


def test_packed_training_in_workers_equals_alone_with_deterministic_kernels():
    """Each job in a worker process of its own, the workers taking the deterministic
    kernels from this process (``BackendFlags``) before their first kernel."""
    workload = TrainingWorkload.parse("small_resnet:8")
    args = dict(**workload.train_args(), iterations=12, seed=0)
    with deterministic_kernels(), timeshare.Runtime("cuda", "1GiB", scheduling="pack", workers=3) as rt:
        alone = []
        for i in range(2):
            job = rt.train(f"alone{i}", **args)
            assert job.wait(180) and job.error is None, job.error
            alone.append(job.state_dict())
        jobs = [rt.train(f"job{i}", **args) for i in range(2)]
        for job in jobs:
            assert job.wait(180) and job.error is None, job.error
        r = compare_training(alone[0], alone[1], [job.state_dict() for job in jobs])
    assert r["alone_repeatable"] and r["equals_alone"], r
