"""The GPU campaign: every measurement the project reports about a CUDA device, in steps
of a few minutes each, ordered by value, so that a short lease on a GPU runs as many of
them as fit and brings every finished one back.

    python -m timeshare.bench.campaign [--steps tests,link,...] [--budget-s 480]
                                       [--out bench/results/<device>] [--archive PATH]
    python -m timeshare.bench.campaign --list
    make gpu-campaign [STEP=tests,link] [BUDGET_S=480] [ARCHIVE=$OUT/campaign.tar.gz]
    make gpu-campaign-list
    make gpu-campaign STEP=lease1 BUDGET_S=450, then STEP=lease2: a 15-minute lease in two calls

Each step is one command (the GPU test tier, or one ``timeshare bench`` run) started as
a child process with its own time limit. A step that fails or runs out of time is
recorded as such and never stops or hides the others. Every step leaves, in the output
folder (``bench/results/<device>/`` by default):

- ``<step>.json``: the bench's own JSON (which describes the machine: device, driver,
  CUDA, torch, date) with a ``campaign`` block added: the exact command, the commit, its
  exit code, start time and seconds;
- ``<step>.log``: everything the command printed.

NOTE [A campaign inside a lease]: a GPU is lent for minutes in all and gives back a few
files per call. With a budget, steps run in the order of ``STEPS`` (most valuable first);
a step whose last recorded duration (the newest ``campaign`` block of that step under
``bench/results/``, else its estimate) exceeds what is left is skipped, and a step that
runs is limited to what is left. After every step, run or skipped, ``summary.json`` and
``SUMMARY.md`` are rewritten and every file the campaign wrote is packed into one
archive, replaced atomically: a call cut short still brings back each finished step.
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
import tarfile
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
    estimate_s: int = 0  # seconds expected where no run of the step is recorded (0: limit_s)
    what: str = ""

    @property
    def expected_s(self) -> int:
        return self.estimate_s or self.limit_s


LLM_DIR = "/tmp/timeshare-llm-models"

# In order of value: what the open issues need measured first (issue 36).
STEPS: dict[str, Step] = {
    s.name: s
    for s in [
        # What the runtime costs around a forward when nothing switches (issue 32).
        Step("overhead", ("overhead", "--workers", "2", "--duration", "0.5"), 300, estimate_s=60,
             what="one caller, threads over 8 and 42 models, large inputs through workers, PACK vs FIFO"),
        Step("ready", ("switch", "--batch", "8", "--dtype", "fp32", "--train", "resnet152:64", "--memory", "4GiB",
                       "--baselines", "--repeats", "10"), 240, estimate_s=45,
             what="zoo models resident through a worker against plain PyTorch, and switched from training"),
        Step("lanes", ("lanes", "--counts", "8,42", "--duration", "2", "--train-iterations", "10"), 300,
             estimate_s=40, what="Salus's lanes: many small models, PACK vs FIFO vs plain PyTorch, training"),
        # Language models (issues 18, 35, 45): a 0.9B bf16 model's cold time to first token
        # against bytes / bandwidth + warm, decode at 1, 8 and 32 sequences and a cached
        # 1,500-token system prompt, in-process and with workers (the one engine in both).
        # Estimates and limits count the decode step's compilation at registration (NOTE
        # [Compiled decode steps]) in each mode, not yet timed on a GPU.
        Step("llm-1b", ("llm", "--size", "1b", "--dtype", "bf16", "--parts", "wake", "decode", "prefix",
                        "--concurrent", "1,8,32", "--workdir", LLM_DIR), 540, estimate_s=280,
             what="0.9B model in both modes: cold wake against the floor, decode at 1/8/32 sequences, a cached "
                  "system prompt"),
        # Issue 35: paged caches and decode graphs on the device, the language-model GPU tests.
        Step("tests-llm", ("-m", "pytest", "tests/gpu/test_cuda_llm_graphs.py", "tests/gpu/test_cuda_llm.py",
                           "tests/gpu/test_cuda_regions.py", "tests/gpu/test_cuda_no_waits.py", "-m",
                           "cuda", "-p", "no:cacheprovider", "-q", "--timeout", "200", "-rfE"), 360, bench=False,
             estimate_s=100, what="decode graphs (of compiled steps) on paged caches: tokens of transformers, "
             "replays, invalidation, no waits on the device"),
        # Issue 49: LoRA adapters under captured graphs (PEFT is the tests' and the bench's
        # reference: its wheel travels with the campaign, the device image has none).
        Step("tests-lora", ("-m", "pytest", "tests/gpu/test_cuda_lora.py", "-m", "cuda", "-p", "no:cacheprovider",
                            "-q", "--timeout", "200", "-rfE"), 300, bench=False, estimate_s=90,
             what="adapters from captured graphs give PEFT's tokens, mixed and taking turns in slots"),
        Step("llm-adapters", ("llm", "--size", "1b", "--dtype", "bf16", "--adapters", "1,8,64", "--concurrent", "8",
                              "--repeats", "3", "--workdir", LLM_DIR), 540, estimate_s=300,
             what="0.9B model: decode mixing 1/8/64 adapters against the base and PEFT, cold adapters' first "
                  "tokens against a merged fine-tune"),
        Step("tests", ("-m", "pytest", "tests/gpu", "-m", "cuda", "-p", "no:cacheprovider", "-q",
                       "--timeout", "150", "-rfE"), 360, bench=False, estimate_s=150,
             what="the GPU test tier"),
        # The GPU tests added or changed since the first H200 run: the tensor channel, lane
        # pools, deterministic lanes, the locked host tier, dedup and the kill mid-load.
        Step("tests-new", ("-m", "pytest", "tests/gpu/test_cuda_channel.py", "tests/gpu/test_cuda_lane_pools.py",
                           "tests/gpu/test_cuda_lanes_determinism.py", "tests/gpu/test_cuda_tiered_pinning.py",
                           "tests/gpu/test_cuda_dedup.py", "tests/gpu/test_cuda.py::"
                           "test_killing_a_cuda_worker_mid_load_leaves_device_memory_as_it_was", "-m", "cuda",
                           "-p", "no:cacheprovider", "-q", "--timeout", "120", "-rfE"), 240, bench=False,
             estimate_s=50, what="the GPU tests new since the first H200 run"),
        Step("pipeline-bf16", ("pipeline", "--batch", "8", "--dtype", "bf16", "--repeats", "10", "--warmup", "2"),
             180, estimate_s=30, what="pipelined first inference by grouping strategy, bf16"),
        Step("switch-sas", ("switch", "--models", "resnet152", "--batch", "8", "--dtype", "fp32", "--train",
                            "resnet152:64", "--memory", "4GiB", "--baselines", "stop_and_start",
                            "--baseline-repeats", "1", "--repeats", "5"), 180, estimate_s=50,
             what="one stop-and-start against a switch"),
        # In-process only: 16 GB of host store a second time for the workers' mode would not
        # add what the 0.9B model's run in both modes shows.
        Step("llm-8b", ("llm", "--size", "8b", "--dtype", "bf16", "--parts", "wake", "decode", "--concurrent", "1,8",
                        "--repeats", "2", "--modes", "in-process", "--workdir", LLM_DIR), 480, estimate_s=170,
             what="an 8B-shaped model's cold wake against the floor, decode at 1/8 sequences"),
        Step("llm-fleet", ("llm", "--size", "small", "--dtype", "bf16", "--parts", "fleet", "--fleet-rate", "8",
                           "--fleet-requests", "120", "--workdir", LLM_DIR), 240, estimate_s=60,
             what="a fleet of small models in room for two behind the OpenAI API"),
        Step("link", ("link",), 120, estimate_s=15, what="host-device copy bandwidth and per-copy cost"),
        Step("pipeline-fp32", ("pipeline", "--batch", "8", "--dtype", "fp32", "--repeats", "10", "--warmup", "2"),
             180, estimate_s=30, what="pipelined first inference by grouping strategy, fp32"),
        Step("switch-fp32", ("switch", "--batch", "8", "--dtype", "fp32", "--train", "resnet152:64", "--memory",
                             "4GiB", "--baseline-repeats", "2"), 480, estimate_s=300,
             what="a switch with every baseline"),
        Step("switch-bf16", ("switch", "--batch", "8", "--dtype", "bf16", "--train", "resnet152:64", "--memory",
                             "4GiB", "--baseline-repeats", "2"), 480, estimate_s=300, what="the same in bf16"),
        Step("variants", ("variants", "--batch", "8", "--repeats", "10", "--memory", "4GiB"), 240, estimate_s=75,
             what="fine-tuned variants sharing their base's weights"),
        Step("disk", ("disk", "--repeats", "3", "--memory", "4GiB"), 240, estimate_s=45, what="cold loads from disk"),
        Step("cycles", ("cycles", "--model", "resnet152", "--batch", "8", "--train", "resnet152:64",
                        "--memory", "4GiB", "--cycles", "1,2,5,10,30", "--rounds", "1", "--min-inference-s", "5"),
             420, estimate_s=300, what="inference throughput time-sharing with training"),
    ]
}


# Two calls of a 15-minute lease (a machine's start takes one or two minutes of it): each
# group's expected seconds stay within LEASE_CALL_S, and together they hold what the open
# issues need measured. ``--steps lease1`` names a group.
LEASE_CALL_S = 450
GROUPS: dict[str, tuple[str, ...]] = {
    "lease1": ("overhead", "ready", "switch-sas", "llm-1b"),
    "llm": ("tests-llm", "llm-1b"),  # the one engine's GPU tests and its 0.9B run in both modes
    "lora": ("tests-lora", "llm-adapters"),  # issue 49's adapters on the device
    "lease2": ("tests", "llm-8b", "llm-fleet", "pipeline-bf16", "lanes"),
}


def expand(steps: str) -> list[str]:
    """Step names from a comma-separated list of steps and groups."""
    names: list[str] = []
    for n in (n.strip() for n in steps.split(",")):
        names += GROUPS.get(n, (n,)) if n else ()
    return names


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
    record = {"step": step.name, "command": shown, "commit": commit(), "started": started,
              "seconds": round(seconds, 1), "returncode": rc, "timed_out": timed_out, "limit_s": limit,
              "log": log_path.name}
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


def commit() -> str:
    """The commit the campaign runs at: ``TIMESHARE_COMMIT`` where set (a copied tree may
    carry no .git, or a stale one: the H200's copy answered its session's first commit),
    else git's."""
    if os.environ.get("TIMESHARE_COMMIT"):
        return os.environ["TIMESHARE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        head = None
    if head is not None and head.returncode == 0 and head.stdout.strip():
        return head.stdout.strip()
    return "unknown"


def recorded_seconds(results: Path) -> dict[str, tuple[float, str]]:
    """The newest recorded duration of every step under ``results`` (one folder per device)
    that ran the step's current command: step name -> (seconds, the file it was read from)."""
    newest: dict[str, tuple[str, float, str]] = {}
    for path in sorted(results.glob("*/*.json")):
        try:
            rec = json.loads(path.read_text()).get("campaign")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        if not isinstance(rec, dict) or rec.get("timed_out") or "seconds" not in rec:
            continue  # a step cut short says nothing about how long it takes
        name, started = str(rec.get("step", path.stem)), str(rec.get("started", ""))
        step = STEPS.get(name)
        if step is None or " ".join(shlex.quote(a) for a in step.args) not in str(rec.get("command", "")):
            continue  # another command under that name: its time says nothing about this one
        if name not in newest or started > newest[name][0]:
            newest[name] = (started, float(rec["seconds"]), str(path.relative_to(results)))
    return {name: (secs, where) for name, (_, secs, where) in newest.items()}


@dataclass(frozen=True)
class Planned:
    """A step's expected duration and where that figure came from."""
    step: Step
    expected_s: float
    source: str  # a results file, or "estimate"


def plan(names: list[str], recorded: dict[str, tuple[float, str]]) -> list[Planned]:
    out = []
    for name in names:
        step = STEPS[name]
        secs, where = recorded.get(name, (float(step.expected_s), "estimate"))
        out.append(Planned(step, secs, where))
    return out


def pack(out: Path, archive: Path, since: float) -> int:
    """Every file in ``out`` written since ``since`` (the campaign's start), as one .tar.gz
    at ``archive``, replaced atomically; returns how many files it holds."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.stat().st_mtime >= since
                   and p.resolve() != archive.resolve() and not p.name.endswith(".tar.gz.part"))
    part = archive.with_name(archive.name + ".part")
    with tarfile.open(part, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(Path(out.name) / p.relative_to(out)))
    os.replace(part, archive)
    return len(files)


def list_steps(results: Path) -> str:
    recorded = recorded_seconds(results)
    lines = [f"{'step':<14} {'last s':>7} {'limit s':>7}  from / what"]
    for p in plan(list(STEPS), recorded):
        shown = f"{p.expected_s:7.0f}" if p.source != "estimate" else f"{'~' + str(int(p.expected_s)):>7}"
        lines.append(f"{p.step.name:<14} {shown} {p.step.limit_s:7d}  {p.source}: {p.step.what}")
    lines.append("(~: no run recorded, an estimate; steps run in this order, the most valuable first)")
    for group, members in GROUPS.items():
        total = sum(p.expected_s for p in plan(list(members), recorded))
        lines.append(f"--steps {group}: {', '.join(members)} (about {total:.0f} s)")
    return "\n".join(lines)


def run_campaign(names: list[str], out: Path, archive: Path, budget_s: float | None = None,
                 max_step_s: int | None = None, results: Path | None = None) -> list[dict]:
    """Run ``names`` in order within ``budget_s`` (NOTE [A campaign inside a lease]); return
    one record per step, run or skipped."""
    t0, since = time.monotonic(), time.time() - 1
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for p in plan(names, recorded_seconds(results or ROOT / "bench" / "results")):
        left = None if budget_s is None else budget_s - (time.monotonic() - t0)
        if left is not None and p.expected_s > left:
            rec = {"step": p.step.name, "skipped": f"needs about {p.expected_s:.0f} s ({p.source}), "
                   f"{max(left, 0):.0f} s left"}
            print(f"[campaign] {p.step.name}: skipped, {rec['skipped']}", flush=True)
        else:
            cap = [c for c in (max_step_s, None if left is None else int(left)) if c is not None]
            limit = min([p.step.limit_s, *cap])
            print(f"[campaign] {p.step.name}: up to {limit} s (expected {p.expected_s:.0f} s)", flush=True)
            rec = run_step(p.step, out, max_s=limit)
            status = "timed out" if rec["timed_out"] else f"exit {rec['returncode']}"
            print(f"[campaign] {p.step.name}: {status} in {rec['seconds']} s (log {out / rec['log']})", flush=True)
        records.append(rec)
        (out / "campaign.json").write_text(json.dumps({"commit": commit(), "budget_s": budget_s,
                                                       "steps": records}, indent=2) + "\n")
        summarize(out)
        n = pack(out, archive, since)
        print(f"[campaign] packed {n} files into {archive}", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m timeshare.bench.campaign", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated, from: {', '.join(STEPS)}; or a group: {', '.join(GROUPS)}")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<device>)")
    parser.add_argument("--archive", type=Path, default=None,
                        help="the archive packed after every step (default <out>/campaign.tar.gz)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole campaign: steps that will not fit are skipped")
    parser.add_argument("--list", action="store_true", help="print the steps, in order, with their last seconds")
    parser.add_argument("--summary-only", action="store_true", help="rewrite the summary from the JSON present")
    parser.add_argument("--max-step-s", type=int, default=None, help="cap every step's time limit (seconds)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU backend (to check the campaign itself)")
    args = parser.parse_args(argv)
    if args.list:
        print(list_steps(ROOT / "bench" / "results"))
        return 0
    if not (ROOT / "tests" / "gpu").is_dir():
        print(f"the GPU campaign runs from the repository's root (no tests/gpu under {ROOT})", file=sys.stderr)
        return 2
    names = expand(args.steps)
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; known: {list(STEPS)} and the groups {list(GROUPS)}")
    import torch

    has_cuda = torch.cuda.is_available()
    # Without CUDA: only a summary of a named folder, or a check of the campaign itself (--allow-cpu --out).
    if not has_cuda and (args.out is None or not (args.summary_only or args.allow_cpu)):
        print("the GPU campaign needs a CUDA device, and torch sees none on this machine "
              f"(torch {torch.__version__}, torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    out = args.out or ROOT / "bench" / "results" / device_slug(torch.cuda.get_device_name(0))
    if args.summary_only:
        summarize(out)
        print((out / "SUMMARY.md").read_text())
        return 0
    records = run_campaign(names, out, args.archive or out / "campaign.tar.gz", args.budget_s, args.max_step_s)
    print((out / "SUMMARY.md").read_text())
    failed = [r["step"] for r in records if r.get("timed_out") or r.get("returncode", 0) != 0]
    if failed:
        print(f"[campaign] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
