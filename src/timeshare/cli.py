"""The ``timeshare`` command line: the top-level parser, the dispatch to the command modules
(``cli_*``), the common runner of benchmarks and the JSON writer. Runs in the CLI's process;
the CLI layer is the only place that prints to the user.

    timeshare bench pipeline [--models ...] [--batch 8] [--dtype fp32] [--json PATH]
    timeshare bench switch [--models ...] [--train MODEL:BATCH] [--json PATH]
    timeshare bench cycles [--model resnet152] [--cycles 1,2,5,10,30] [--json PATH]
    timeshare bench link [--sizes 64KiB,...,1GiB] [--json PATH]   (these, and lanes: timeshare.cli_switch)
    timeshare bench colocate | scheduler   (see timeshare.cli_sim)
    timeshare sim salus | serving | run
    timeshare serve | demo | models, bench serve | chaos | hostile   (see timeshare.cli_serve)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import shlex
import signal
import sys
import time
from pathlib import Path

from rich.console import Console

from timeshare.errors import TimeshareError

console = Console()
if not console.is_terminal:  # piped or captured: keep tables whole rather than 80 columns wide
    console = Console(width=200)
err = Console(stderr=True)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    global _COMMAND
    _COMMAND = shlex.join(["timeshare", *(sys.argv[1:] if argv is None else argv)])
    _stacks_on_sigusr1()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        code = _dispatch(args)
    except TimeshareError as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    if code is None:
        parser.error("unknown command")
        return 2
    return code


def _parser() -> argparse.ArgumentParser:
    """Every command's parser; each command module adds its own."""
    from timeshare import __version__, cli_bench, cli_ops, cli_serve, cli_switch
    from timeshare.cli_sim import add_bench_parsers, add_sim_parser

    parser = argparse.ArgumentParser(prog="timeshare", description="Fine-grained GPU time-sharing for deep learning.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the runtime does")
    parser.add_argument("--version", action="version", version=f"timeshare {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)
    cli_switch.add_parsers(bench)
    add_bench_parsers(bench)
    cli_bench.add_parsers(bench)
    add_sim_parser(sub)
    cli_serve.add_parsers(sub, bench)
    cli_ops.add_parsers(sub)
    return parser


def _stacks_on_sigusr1() -> None:
    stderr = sys.__stderr__ or sys.stderr  # faulthandler's own fallback; both are None without an fd 2
    if hasattr(signal, "SIGUSR1") and stderr is not None:  # `kill -USR1 <pid>` prints where every thread is
        try:  # (the campaign does, on a time-out)
            faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # no real stderr (embedded, captured): no stacks
            pass


def _dispatch(args) -> int | None:
    """The command's exit code; None for a command no module runs."""
    from timeshare import cli_bench, cli_ops, cli_serve, cli_switch
    from timeshare.cli_sim import run_bench, run_sim

    if args.command == "bench" and args.bench in cli_switch.NAMES:
        return cli_switch.run(args, console, err, _run_bench)
    if args.command == "bench" and args.bench in cli_bench.NAMES:
        return cli_bench.run(args, console, _run_bench)
    if args.command == "bench" and args.bench in ("colocate", "scheduler"):
        return run_bench(args, console, _run_bench)
    if args.command == "sim":
        return run_sim(args, console, _write_json)
    if args.command in cli_ops.NAMES:
        return cli_ops.run(args, console)
    if args.command in ("serve", "demo") \
            or getattr(args, "bench", None) in ("serve", "chaos", "hostile"):
        return cli_serve.run(args, console, _write_json, _run_bench)
    return None


def _run_bench(run, cfg, show, path: Path | None) -> int:
    """Run a benchmark with a progress line (on a terminal; elsewhere, a timestamped line
    per step, so a log shows how far a run got), print its table and write its JSON."""
    if console.is_terminal:
        with console.status("starting") as status:
            result = run(cfg, progress=lambda msg: status.update(msg))
    else:
        t0 = time.monotonic()
        result = run(cfg, progress=lambda msg: print(f"[{time.monotonic() - t0:7.1f} s] {msg}", flush=True))
    show(result)
    _write_json(path, result)
    return 0


_COMMAND = ""  # the command line of this run, written into every result file


def _write_json(path: Path | None, result: dict) -> None:
    if path:
        result = {**result, "command": result.get("command") or _COMMAND}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
