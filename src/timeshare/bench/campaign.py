"""The GPU campaign: every measurement the project reports about a CUDA device, in steps
of a few minutes each, so that a short lease on a GPU runs them one after another.

    python -m timeshare.bench.campaign [--steps tests,link,...] [--out bench/results/<device>]
    make gpu-campaign [STEP=tests,link]

Each step is one command (the GPU test tier, or one ``timeshare bench`` run) started as
a child process with its own time limit. A step that fails or runs out of time is
recorded as such and never stops or hides the others. Every step leaves, in the output
folder (``bench/results/<device>/`` by default):

- ``<step>.json``: the bench's own JSON (which describes the machine: device, driver,
  CUDA, torch, date) with a ``campaign`` block added: the exact command, its exit
  code, start time and seconds;
- ``<step>.log``: everything the command printed.

``summary.json`` and ``SUMMARY.md`` are rewritten after every step from the JSON files
present, so a partial campaign still has a summary.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from timeshare.bench.campaign_summary import summarize

# The campaign is a tool of the repository (it runs the GPU test tier and writes into
# bench/results): it runs from the checkout's root, as `make gpu-campaign` does.
ROOT = Path.cwd()


@dataclass(frozen=True)
class Step:
    name: str
    args: tuple[str, ...]
    limit_s: int
    bench: bool = True  # a ``timeshare bench`` command writing --json (else: the test tier)


STEPS: dict[str, Step] = {
    s.name: s
    for s in [
        Step("tests", ("-m", "pytest", "tests/gpu", "-m", "cuda", "-p", "no:cacheprovider", "-q",
                       "--timeout", "240"), 480, bench=False),
        Step("link", ("link",), 240),
        # What the runtime costs around a forward when nothing switches (issue 32): one
        # caller, threads over 8 and 42 models, large inputs through workers, PACK vs FIFO;
        # then Salus's lanes on the zoo's small model, and a zoo model resident through a
        # worker against plain PyTorch (bench switch's "ready", no baselines).
        Step("overhead", ("overhead", "--workers", "2", "--duration", "1.0"), 300),
        Step("lanes", ("lanes", "--counts", "8,42", "--duration", "3", "--train-iterations", "10"), 420),
        Step("ready", ("switch", "--batch", "8", "--dtype", "fp32", "--train", "resnet152:64", "--memory", "4GiB",
                       "--baselines", "--repeats", "20"), 360),
        Step("pipeline-fp32", ("pipeline", "--batch", "8", "--dtype", "fp32", "--repeats", "20", "--warmup", "3"), 420),
        Step("pipeline-bf16", ("pipeline", "--batch", "8", "--dtype", "bf16", "--repeats", "20", "--warmup", "3"), 420),
        Step("switch-fp32", ("switch", "--batch", "8", "--dtype", "fp32", "--train", "resnet152:64", "--memory", "4GiB",
                                "--baseline-repeats", "2"), 480),
        Step("switch-bf16", ("switch", "--batch", "8", "--dtype", "bf16", "--train", "resnet152:64", "--memory", "4GiB",
                                "--baseline-repeats", "2"), 480),
        Step("cycles", ("cycles", "--model", "resnet152", "--batch", "8", "--train", "resnet152:64",
                        "--memory", "4GiB", "--cycles", "1,2,5,10,30", "--rounds", "1", "--min-inference-s", "5"), 420),
        # The memory hierarchy (issue 17): cold loads from disk, and variants held once.
        Step("disk", ("disk", "--repeats", "5", "--memory", "4GiB"), 420),
        Step("variants", ("variants", "--batch", "8", "--repeats", "20", "--memory", "4GiB"), 420),
        # Language models (issue 18): a 0.9B bf16 model's cold time to first token against
        # bytes / bandwidth + warm, its decode against transformers; then a fleet.
        Step("llm-1b", ("llm", "--size", "1b", "--dtype", "bf16", "--parts", "wake", "decode",
                        "--workdir", "/tmp/timeshare-llm-models"), 600),
        Step("llm-fleet", ("llm", "--size", "small", "--dtype", "bf16", "--parts", "fleet", "--fleet-rate", "4",
                           "--fleet-requests", "200", "--workdir", "/tmp/timeshare-llm-models"), 600),
    ]
}


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3': the results folder of a device."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def run_step(step: Step, out: Path, python: str = sys.executable, max_s: int | None = None) -> dict:
    """Run one step as a child process under its time limit; return its record."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{step.name}.json"
    log_path = out / f"{step.name}.log"
    if step.bench:
        cmd = [python, "-m", "timeshare", "bench", *step.args, "--json", _rel(json_path)]
    else:
        cmd = [python, *step.args]
    shown = " ".join(shlex.quote(c) for c in ["python", *cmd[1:]])
    started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TIMESHARE_CACHE", str(ROOT / ".cache"))  # the test tier's cache: weights made once
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    limit = min(step.limit_s, max_s) if max_s else step.limit_s
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {shown}\n")
        log.flush()
        # A session of its own, so the limit kills the step's workers and baselines too.
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            try:  # first, where is everyone: the bench prints every thread's stack on SIGUSR1
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(2)
            except ProcessLookupError:
                pass
            _kill_group(proc)
            rc, timed_out = proc.wait(30), True
    seconds = time.monotonic() - t0
    record = {"step": step.name, "command": shown, "started": started, "seconds": round(seconds, 1),
              "returncode": rc, "timed_out": timed_out, "limit_s": limit, "log": log_path.name}
    if step.bench and json_path.exists():
        try:
            result = json.loads(json_path.read_text())
        except json.JSONDecodeError as exc:
            record["error"] = f"unreadable JSON: {exc}"
        else:
            result["campaign"] = record
            json_path.write_text(json.dumps(result, indent=2) + "\n")
    elif not step.bench:
        json_path.write_text(json.dumps({"benchmark": "tests", "environment": environment(), "campaign": record,
                                         "tail": _tail(log_path)}, indent=2) + "\n")
    return record


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 40) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def environment() -> dict:
    import torch

    from timeshare.bench.environment import describe

    return describe(torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m timeshare.bench.campaign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from: {', '.join(STEPS)}")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<device>)")
    parser.add_argument("--summary-only", action="store_true", help="rewrite the summary from the JSON present")
    parser.add_argument("--max-step-s", type=int, default=None, help="cap every step's time limit (seconds)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU backend (to check the campaign itself)")
    args = parser.parse_args(argv)
    if not (ROOT / "tests" / "gpu").is_dir():
        print(f"the GPU campaign runs from the repository's root (no tests/gpu under {ROOT})", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.steps.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; known: {list(STEPS)}")
    import torch

    has_cuda = torch.cuda.is_available()
    # Without CUDA: only a summary of a named folder, or a check of the campaign itself (--allow-cpu --out).
    if not has_cuda and (args.out is None or not (args.summary_only or args.allow_cpu)):
        print("the GPU campaign needs a CUDA device, and torch sees none on this machine "
              f"(torch {torch.__version__}, torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    out = args.out or ROOT / "bench" / "results" / device_slug(torch.cuda.get_device_name(0))
    if not args.summary_only:
        failed = []
        for name in names:
            step = STEPS[name]
            print(f"[campaign] {name}: up to {min(step.limit_s, args.max_step_s or step.limit_s)} s", flush=True)
            rec = run_step(step, out, max_s=args.max_step_s)
            status = "timed out" if rec["timed_out"] else f"exit {rec['returncode']}"
            print(f"[campaign] {name}: {status} in {rec['seconds']} s (log {out / rec['log']})", flush=True)
            if rec["timed_out"] or rec["returncode"] != 0:
                failed.append(name)
            summarize(out)
        print((out / "SUMMARY.md").read_text())
        if failed:
            print(f"[campaign] failed: {', '.join(failed)}", file=sys.stderr)
            return 1
        return 0
    summarize(out)
    print((out / "SUMMARY.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
