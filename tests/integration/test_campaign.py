"""The GPU campaign's machinery on the CPU: steps under time limits, self-describing JSON,
the summary, and a clear refusal where there is no CUDA device."""

import json
import subprocess
import sys
import tarfile

import pytest
import torch

from timeshare.bench import campaign, campaign_summary, link
from timeshare.bench.campaign import Step


def test_link_bench_on_the_cpu_backend():
    r = link.run(link.LinkBenchConfig(device="cpu", sizes=[64 << 10, 1 << 20, 4 << 20], repeats=3))
    assert r["round_trip_exact"] is True
    assert [row["bytes"] for row in r["results"]] == [64 << 10, 1 << 20, 4 << 20]
    for row in r["results"]:
        assert row["h2d_us"] > 0 and row["h2d_GBps"] == pytest.approx(row["bytes"] / row["h2d_us"] / 1e3)
    fit = r["fit"]["h2d"]
    assert fit["bandwidth_GBps"] > 0 and fit["overhead_us"] >= 0
    # The floor is the larger of the copy time and the ready model.
    assert link.floor_ms(1 << 30, r, 0.001) > link.floor_ms(1 << 20, r, 0.001)
    assert link.floor_ms(1, r, 1e6) == 1e6


def test_link_fit_recovers_a_known_line():
    xs = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    a, bw = link.fit_line(xs, [50e-6 + x / 20e9 for x in xs])
    assert a == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(20e9, rel=1e-6)


def test_a_step_that_overruns_is_killed_and_recorded(tmp_path):
    rec = campaign.run_step(Step("sleepy", ("-c", "print('started', flush=True); import time; time.sleep(60)"), 2,
                                 bench=False), tmp_path)
    assert rec["timed_out"] is True and rec["seconds"] < 30
    assert "started" in (tmp_path / "sleepy.log").read_text()
    data = json.loads((tmp_path / "sleepy.json").read_text())
    assert data["campaign"]["timed_out"] is True and data["environment"]["torch"] == torch.__version__


def test_a_bench_step_writes_self_describing_json_and_the_summary(tmp_path):
    step = Step("link", ("link", "--device", "cpu", "--sizes", "64KiB,1MiB,2MiB", "--repeats", "2"), 120)
    rec = campaign.run_step(step, tmp_path)
    assert rec["returncode"] == 0 and not rec["timed_out"], (tmp_path / "link.log").read_text()
    data = json.loads((tmp_path / "link.json").read_text())
    assert data["campaign"]["command"].startswith("python -m timeshare bench link --device cpu")
    assert {"date", "torch", "device"} <= set(data["environment"])
    failing = campaign.run_step(Step("pipeline-fp32", ("pipeline", "--models", "no_such_model"), 60), tmp_path)
    assert failing["returncode"] != 0  # recorded, and the summary still has the link step
    summary = campaign_summary.summarize(tmp_path)
    assert summary["link"]["h2d"]["bandwidth_GBps"] == data["fit"]["h2d"]["bandwidth_GBps"]
    text = (tmp_path / "SUMMARY.md").read_text()
    assert "Pinned host-to-device" in text and "| link | 0 |" in text


def test_the_campaign_refuses_a_machine_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert campaign.main(["--steps", "link"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    made = subprocess.run(["make", "-s", "gpu-campaign", f"PY={sys.executable}"], cwd=campaign.ROOT,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode != 0 and "needs a CUDA device" in made.stderr


def test_device_slug():
    assert campaign.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def _steps(monkeypatch, *steps):
    monkeypatch.setattr(campaign, "STEPS", {s.name: s for s in steps})
    monkeypatch.setattr(campaign, "GROUPS", {"all": tuple(s.name for s in steps)})


# A step that lists the archive as it stands when the step starts.
_LIST_ARCHIVE = ("-c", "import sys, tarfile; print(sorted(tarfile.open(sys.argv[1]).getnames()))")


def test_a_cpu_dry_run_packs_every_step_and_skips_what_the_budget_cannot_hold(tmp_path, monkeypatch, capsys):
    out, archive = tmp_path / "run", tmp_path / "back" / "campaign.tar.gz"
    _steps(monkeypatch,
           Step("first", ("-c", "print('first ran')"), 60, bench=False, estimate_s=1),
           Step("huge", ("-c", "print('huge ran')"), 60, bench=False, estimate_s=10_000),
           Step("peek", (*_LIST_ARCHIVE, str(archive)), 60, bench=False, estimate_s=1))
    rc = campaign.main(["--allow-cpu", "--out", str(out), "--archive", str(archive), "--budget-s", "300"])
    assert rc == 0, capsys.readouterr()
    # The archive stood packed with the first step before the third began: a call cut
    # short after any step still brings that step back.
    assert "'run/first.json'" in (out / "peek.log").read_text() and "'run/first.log'" in (out / "peek.log").read_text()
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"run/first.json", "run/peek.json", "run/peek.log", "run/campaign.json", "run/SUMMARY.md"} <= names
    assert not (out / "huge.log").exists() and "run/huge.log" not in names
    record = json.loads((out / "campaign.json").read_text())
    assert [s["step"] for s in record["steps"]] == ["first", "huge", "peek"]
    assert "needs about 10000 s (estimate)" in record["steps"][1]["skipped"]
    assert record["commit"] == json.loads((out / "first.json").read_text())["campaign"]["commit"] != ""
    assert not list(archive.parent.glob("*.part"))


def test_a_step_is_limited_to_what_is_left_of_the_budget(tmp_path, monkeypatch):
    _steps(monkeypatch, Step("slow", ("-c", "import time; time.sleep(60)"), 120, bench=False, estimate_s=1))
    records = campaign.run_campaign(["slow"], tmp_path, tmp_path / "a.tar.gz", budget_s=3, results=tmp_path)
    assert records[0]["timed_out"] is True and records[0]["limit_s"] <= 3


def test_recorded_durations_come_from_the_newest_run_of_the_same_command(tmp_path, monkeypatch, capsys):
    step = Step("link", ("link", "--sizes", "1MiB"), 60, estimate_s=7)
    _steps(monkeypatch, step)

    results = tmp_path / "bench" / "results"

    def record(folder, command, started, seconds, **extra):
        (results / folder).mkdir(parents=True, exist_ok=True)
        (results / folder / "link.json").write_text(json.dumps({"campaign": {
            "step": "link", "command": command, "started": started, "seconds": seconds, **extra}}))

    record("gpu-a", "python -m timeshare bench link --sizes 1MiB --json x", "2026-11-01T00:00:00", 11.0)
    record("gpu-b", "python -m timeshare bench link --sizes 1MiB --json y", "2026-11-20T00:00:00", 13.0)
    assert campaign.recorded_seconds(results) == {"link": (13.0, "gpu-b/link.json")}
    record("gpu-b", "python -m timeshare bench link --sizes 1MiB --json y", "2026-11-21T00:00:00", 99.0,
           timed_out=True)  # cut short: says nothing about its length
    assert campaign.recorded_seconds(results) == {"link": (11.0, "gpu-a/link.json")}
    record("gpu-a", "python -m timeshare bench link --sizes 64KiB --json x", "2026-11-22T00:00:00", 5.0)
    assert campaign.recorded_seconds(results) == {}  # another command: the estimate stands
    monkeypatch.setattr(campaign, "ROOT", tmp_path)
    assert campaign.main(["--list"]) == 0
    assert "~7" in capsys.readouterr().out


def test_the_commit_named_by_the_caller_wins_over_a_copied_trees_git(monkeypatch):
    monkeypatch.setenv("TIMESHARE_COMMIT", "abc123def456")
    assert campaign.commit() == "abc123def456"
    monkeypatch.delenv("TIMESHARE_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=campaign.ROOT, capture_output=True, text=True)
    assert campaign.commit() == (head.stdout.strip() if head.returncode == 0 else "unknown")


def test_two_calls_of_a_lease_cover_what_the_open_issues_need_and_each_fits():
    # Issue 36: the GPU test tier, overhead, lanes, switch (ready and one stop-and-start), the
    # 0.9B model at 1/8/32 sequences, the 8B-shaped wake, the fleet and pipeline in bf16.
    needed = {"tests", "overhead", "lanes", "ready", "switch-sas", "llm-1b", "llm-8b", "llm-fleet", "pipeline-bf16"}
    covered = set(campaign.expand("lease1")) | set(campaign.expand("lease2"))
    assert needed <= covered and covered <= set(campaign.STEPS)
    assert "--concurrent" in campaign.STEPS["llm-1b"].args and "1,8,32" in campaign.STEPS["llm-1b"].args
    recorded = campaign.recorded_seconds(campaign.ROOT / "bench" / "results")
    for group in campaign.GROUPS:
        planned = campaign.plan(campaign.expand(group), recorded)
        assert sum(p.expected_s for p in planned) <= campaign.LEASE_CALL_S, group
    assert campaign.expand("lease1,link") == [*campaign.GROUPS["lease1"], "link"]
