"""The peer bench waits for a quiet machine before each server's turn (NOTE [Interleaved
servers]): ``settle`` returns once the servers' processes stop using CPU, and gives up at
its deadline when they never do."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from timeshare.bench.llm_peer import cpu_ticks, settle

SPIN = "import time, sys\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass\n" \
    "time.sleep(60)"


def _spinner(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)])


def test_settle_waits_for_a_spinning_process_to_go_quiet():
    proc = _spinner(0.8)
    try:
        time.sleep(0.05)
        before = cpu_ticks([proc.pid])
        waited = asyncio.run(settle(lambda: [proc.pid], timeout_s=10.0))
        assert 0.7 <= waited < 5.0, waited  # quiet only once the spin ended
        assert cpu_ticks([proc.pid]) > before  # it did use the CPU meanwhile
    finally:
        proc.kill()
        proc.wait()


def test_settle_gives_up_at_its_deadline_and_ignores_gone_processes():
    proc = _spinner(30)
    try:
        waited = asyncio.run(settle(lambda: [proc.pid, 2**22 + 7], timeout_s=0.6))
        assert 0.6 <= waited < 1.5, waited
    finally:
        proc.kill()
        proc.wait()
    assert cpu_ticks([2**22 + 7]) == 0
