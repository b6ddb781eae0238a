"""NOTE [A core for the front end]: a server's process on the CPU decodes with every core
but one and prefills with all, unless OMP_NUM_THREADS says otherwise; any other process is
left as it is. Each case runs in a fresh interpreter: the setting is the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys, torch
from timeshare.device import leave_a_core, step_threads
cpu = torch.device("cpu")
before = torch.get_num_threads()
if sys.argv[1] == "serve":
    leave_a_core()
step_threads(cpu, decode=True)
decode = torch.get_num_threads()
step_threads(cpu, decode=False)
prefill = torch.get_num_threads()
step_threads(cpu, decode=True)
print(json.dumps({"before": before, "decode": decode, "prefill": prefill, "again": torch.get_num_threads()}))
"""


def _probe(role: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    out = subprocess.run([sys.executable, "-c", PROBE, role], env=environ, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_server_decodes_with_every_core_but_one_and_prefills_with_all():
    seen = _probe("serve")
    assert seen["decode"] == seen["again"] == max(1, seen["before"] - 1)
    assert seen["prefill"] == seen["before"]


def test_omp_num_threads_overrides_it():
    seen = _probe("serve", OMP_NUM_THREADS="2")
    assert seen["before"] == seen["decode"] == seen["prefill"] == 2


def test_a_process_that_does_not_serve_keeps_its_count():
    seen = _probe("library")
    assert seen["before"] == seen["decode"] == seen["prefill"]
