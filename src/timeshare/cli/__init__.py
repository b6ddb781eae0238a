"""The ``timeshare`` command line: the top-level parser, the dispatch to the module of each
command (a module per command, a package per group), the common runner of benchmarks and
the JSON writer. Runs in the CLI's process; the CLI layer is the only place that prints to
the user.

    timeshare serve | demo | ps | models   (serve.py, demo.py, ps.py, models.py)
    timeshare bench ...                    (bench/: a module per concept)
    timeshare sim salus | serving | cluster | run   (sim/)
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
        parser.error("unknown command")  # exits with status 2
    return code


def _parser() -> argparse.ArgumentParser:
    """Every command's parser; each command module adds its own."""
    from timeshare import __version__
    from timeshare.cli import bench, demo, models, ps, serve, sim

    parser = argparse.ArgumentParser(prog="timeshare", description="Fine-grained GPU time-sharing for deep learning.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the runtime does")
    parser.add_argument("--version", action="version", version=f"timeshare {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parsers(sub)
    sim.add_parser(sub)
    serve.add_parser(sub)
    demo.add_parser(sub)
    ps.add_parser(sub)
    models.add_parser(sub)
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
    from timeshare.cli import bench, demo, models, ps, serve, sim

    if args.command == "bench":
        return bench.run(args, console, err, _run_bench)
    if args.command == "sim":
        return sim.run(args, console, _write_json)
    commands = {"serve": serve, "demo": demo, "ps": ps, "models": models, "zoo": models}
    command = commands.get(args.command)
    return None if command is None else command.run(args, console)


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
