"""The ``timeshare bench`` group: each module here holds the benchmarks of one concept, their
options, their checks of the arguments and their tables; this one adds their parsers and
hands a command to the module that has it. Part of the CLI layer; runs in the CLI's
process. The results go to JSON through the CLI's common runner.

    timeshare bench pipeline | switch | cycles | lanes | link   (switching.py)
    timeshare bench disk | tiers | variants                     (memory.py)
    timeshare bench llm [--peer vllm]                           (llm.py)
    timeshare bench overhead                                    (overhead.py)
    timeshare bench cluster                                     (cluster.py)
    timeshare bench serve | chaos | hostile                     (serving.py)
    timeshare bench colocate | scheduler                        (scheduling.py)
"""

from __future__ import annotations

from timeshare.cli.bench import cluster, llm, memory, overhead, scheduling, serving, switching

# In the order ``timeshare bench --help`` lists them.
GROUPS = (switching, scheduling, overhead, memory, llm, cluster, serving)


def add_parsers(sub):
    """The ``bench`` command and each benchmark's parser under it; the subparsers."""
    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)
    for group in GROUPS:
        group.add_parsers(bench)
    return bench


def run(args, console, err, run_bench) -> int:
    """Run ``timeshare bench <args.bench>``; ``err`` is the console that refusals go to."""
    if args.bench in switching.NAMES:
        return switching.run(args, console, err, run_bench)
    for group in GROUPS:
        if args.bench in group.NAMES:
            return group.run(args, console, run_bench)
    return 2
