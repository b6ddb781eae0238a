"""``make demo``: the pipeline benchmark on the device present, explained.

Runs in the caller's process. Prints what is measured, runs
``timeshare bench pipeline`` on the three zoo models, and says how to read it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from timeshare import cli

INTRO = """\
timeshare demo: switching a model onto the device without waiting for all of it.

A model that is not resident must bring its weights from host memory before it can run.
timeshare copies them in groups of layers while the groups that already arrived compute,
with a grouping chosen by an exact optimiser over per-layer costs profiled on this device.
Below, for ResNet-152, Inception-v3 and BERT-base (built from code, seeded weights), the
latency of the first inference on a model that is not resident, per loading strategy, beside
the ready model (already resident) and the floor no loader can beat. Every pipelined output is
checked bitwise against the ready model's.
"""

OUTRO_CPU = """\
On a CPU the "device" is shared memory and the copy is a memcpy by a thread that shares the cores
and memory bandwidth with the compute, so it cannot hide fully and the strategies differ by less than
the noise of a shared machine; what this run shows is that the mechanism is exact and cheap. On a GPU
the copy runs on its own engine over PCIe and the grouping decides how much of it hides behind
compute: run `make bench-pipeline` there; results are kept in bench/results/.
"""


def main() -> int:
    print(INTRO)
    cuda = torch.cuda.is_available()
    out = Path(".cache") / "demo-pipeline.json"
    argv = ["bench", "pipeline", "--json", str(out)]
    if not cuda:  # batch 1 keeps the CPU run near a minute and the copy a visible share
        argv += ["--batch", "1", "--repeats", "10"]
    code = cli.main(argv)
    if code == 0 and not cuda:
        print(OUTRO_CPU)
    return code


if __name__ == "__main__":
    sys.exit(main())
