"""The GPU campaign's machinery on the CPU: steps under time limits, self-describing JSON,
the summary, and a clear refusal where there is no CUDA device."""

import json
import subprocess
import sys

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
