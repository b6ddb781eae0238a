"""NOTE [A core for the front end]: a server's process on the CPU decodes with every core
but one and prefills with all; its workers decode wide steps with every core too; unless
OMP_NUM_THREADS says otherwise; any other process is left as it is. Each case runs in a
fresh interpreter: the setting is the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys, torch
from timeshare.device import WIDE_DECODE_ROWS, leave_a_core, leaves_a_core, step_threads
cpu = torch.device("cpu")
before = torch.get_num_threads()
if sys.argv[1] != "library":
    leave_a_core(one_team=sys.argv[1] == "worker")
seen = {"before": before, "leaves": leaves_a_core()}
for name, decode, rows in (("decode", True, 1), ("prefill", False, 1), ("again", True, 3),
                           ("wide", True, WIDE_DECODE_ROWS), ("narrow", True, WIDE_DECODE_ROWS - 1)):
    step_threads(cpu, decode, rows)
    seen[name] = torch.get_num_threads()
print(json.dumps(seen))
"""


def _probe(role: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env
    out = subprocess.run([sys.executable, "-c", PROBE, role], env=environ, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_server_decodes_with_every_core_but_one_and_prefills_with_all():
    seen = _probe("serve")
    fewer = max(1, seen["before"] - 1)
    assert seen["leaves"] and seen["decode"] == seen["again"] == seen["narrow"] == seen["wide"] == fewer
    assert seen["prefill"] == seen["before"]


def test_a_servers_worker_decodes_wide_steps_with_every_core():
    seen = _probe("worker")
    fewer = max(1, seen["before"] - 1)
    assert seen["decode"] == seen["again"] == seen["narrow"] == fewer
    assert seen["wide"] == seen["prefill"] == seen["before"]


def test_omp_num_threads_overrides_it():
    for role in ("serve", "worker"):
        seen = _probe(role, OMP_NUM_THREADS="2")
        assert not seen["leaves"]
        assert seen["before"] == seen["decode"] == seen["prefill"] == seen["wide"] == 2


def test_a_process_that_does_not_serve_keeps_its_count():
    seen = _probe("library")
    assert not seen["leaves"]
    assert seen["before"] == seen["decode"] == seen["prefill"] == seen["wide"]
