"""The campaign summary over a real GPU run's files (the H200's, folded in by hand): every
step it has shows, with the numbers of its JSON; and a folder with a corrupt and a failed
step still gets a summary that says so. Reads committed files only; no GPU, no processes."""

import json
import shutil
from pathlib import Path

import pytest

from timeshare.bench import campaign_summary

H200 = Path(__file__).resolve().parents[2] / "bench" / "results" / "nvidia-h200"


def _copy_run(dest: Path, names: list[str] | None = None) -> dict[str, dict]:
    """The run's step files (not its summary) copied into ``dest``; their JSON by name."""
    out = {}
    for path in sorted(H200.glob("*.json")):
        data = json.loads(path.read_text())
        if "campaign" not in data or (names is not None and path.stem not in names):
            continue  # the summary, a call's own record: not a step
        shutil.copyfile(path, dest / path.name)
        out[path.stem] = data
    return out


def _row(text: str, *cells: str) -> str:
    """The one Markdown table row that begins with these cells."""
    start = "| " + " | ".join(cells) + " |"
    rows = [line for line in text.splitlines() if line.startswith(start)]
    assert len(rows) == 1, (start, rows)
    return rows[0]


def test_the_h200_run_shows_every_step_with_its_numbers(tmp_path):
    raw = _copy_run(tmp_path)
    summary = campaign_summary.summarize(tmp_path)
    text = (tmp_path / "SUMMARY.md").read_text()
    assert (tmp_path / "first-inference.png").stat().st_size > 0
    assert "not_summarized" not in summary and "Not summarized" not in text
    for name, r in raw.items():
        rec = r["campaign"]
        assert _row(text, name, str(rec["returncode"]), str(rec.get("seconds", "-")))

    # llm: the wake and the decode, as the bench recorded them
    wake, decode = raw["llm-1b"]["wake"], raw["llm-1b"]["decode"]
    assert "## A language model: wake and decode (bench llm)" in text
    w = summary["llm"][0]["wake"]
    assert w["warm_ttft_ms"] == pytest.approx(wake["warm_ttft_s"] * 1e3)
    assert w["cold_ttft_ms"] == pytest.approx(wake["cold_ttft_s"] * 1e3)
    assert w["cold_over_floor"] == wake["cold_over_floor"]
    line = _row(text, "llm-1b", "llama 1b bf16", f"{wake['bytes'] / 1e9:.2f}")
    for cell in (f"{wake['warm_ttft_s'] * 1e3:.1f} | {wake['cold_ttft_s'] * 1e3:.1f} | {wake['floor_s'] * 1e3:.1f}",
                 f"{wake['cold_over_floor']:.2f}x", f"{wake['load_then_generate_s'] * 1e3:.1f}",
                 f"{wake['speedup_vs_load_then_generate']:.1f}x", f"{wake['cold_tokens_exact']}/{wake['cold_runs']}"):
        assert f"| {cell} |" in line, (cell, line)
    line = _row(text, "llm-1b", "llama 1b bf16", str(decode["tokens"]), "1")
    assert (f"| {decode['ours_tokens_per_s']:.1f} | {decode['plain_tokens_per_s']:.1f} | "
            f"{decode['ours_over_plain']:.2f}x |") in line
    # a run at several counts of sequences: a row each, with how many matched transformers
    for d in raw["llm-8b"]["decode"]["rows"]:
        line = _row(text, "llm-8b", "llama 8b bf16", "32", str(d["sequences"]))
        assert (f"| {d['ours_tokens_per_s']:.1f} | {d['plain_tokens_per_s']:.1f} | {d['ours_over_plain']:.2f}x | "
                f"{d['tokens_exact']}/{d['sequences_compared']} |") in line

    # lanes: every serving row of both files, and each file's training row
    assert "## Many small models, and two training jobs (bench lanes)" in text
    for name in ("lanes", "lanes-train"):
        for r in raw[name]["rows"]:
            line = _row(text, name, str(r["models"]))
            assert (f"| {r['plain_pytorch_req_per_s']:,.0f} | {r['fifo']['req_per_s']:,.0f} | "
                    f"{r['pack']['req_per_s']:,.0f} |") in line and f"| {r['pack_over_fifo']:.2f} |" in line
        t = raw[name]["training"]
        line = _row(text, name, f"2 x {t['workload']} x {t['iterations']}")
        assert f"| {t['fifo']['it_per_s']:.1f} | {t['pack']['it_per_s']:.1f} | {t['pack_over_fifo']:.2f} |" in line
    trained = {t["step"]: t for t in summary["lanes_training"]}
    assert trained["lanes-train"]["pack_it_per_s"] == raw["lanes-train"]["training"]["pack"]["it_per_s"]

    # variants: a switch between two against a full load
    v = raw["variants"]
    assert "## Variants of one model held once" in text
    line = _row(text, "variants", str(v["config"]["variants"]))
    assert f"| {v['switch']['first_inference_s'] * 1e3:.2f} (" in line
    assert f"| {v['full_load']['first_inference_s'] * 1e3:.2f} (" in line
    assert f"{v['switch_speedup_vs_full_load']:.2f}x faster" in line
    assert f"| {v['outputs_exact']}/{v['outputs']} |" in line

    # disk: every model's cold first inference against plain PyTorch's
    assert "## Cold first inference from disk" in text
    for r in raw["disk"]["rows"]:
        line = _row(text, "disk", r["model"])
        assert (f"| {r['baseline_first_inference_s']:.3f} | {r['cold_first_inference_s']:.3f} | "
                f"{r['speedup_vs_baseline']:.2f}x |") in line

    # switch-sas: stop-and-start beside timeshare; and the resident model through a worker
    sas = raw["switch-sas"]["results"][0]
    line = _row(text, "switch-sas", sas["model"], "fp32", f"{sas['ready_ms']:.2f}", f"{sas['timeshare_ms']:.2f}")
    assert (f"| {sas['one_process_ms']:.0f} | {sas['stop_and_start_ms']:.0f} | "
            f"{sas['stop_and_start_vs_timeshare']:.0f}x |") in line
    for r in raw["switch-fp32"]["results"]:
        line = _row(text, "switch-fp32", r["model"], "fp32", f"{r['native_ms']:.2f}")
        assert f"| {r['ready_ms']:.2f} | {r['ready_ms'] - r['native_ms']:.2f} |" in line


def test_a_corrupt_and_a_failed_step_still_make_a_summary(tmp_path):
    raw = _copy_run(tmp_path, ["link", "llm-1b"])
    (tmp_path / "pipeline-fp32.json").write_text('{"benchmark": "pipeline", "results": [')
    failed = {"campaign": {"step": "variants", "command": "python -m timeshare bench variants",
                           "started": "2026-11-26T11:00:00+00:00", "seconds": 4.0, "returncode": 1,
                           "timed_out": False, "limit_s": 60, "log": "variants.log"}}
    (tmp_path / "variants.json").write_text(json.dumps(failed))
    summary = campaign_summary.summarize(tmp_path)
    text = (tmp_path / "SUMMARY.md").read_text()
    assert set(summary["not_summarized"]) == {"pipeline-fp32", "variants"}
    assert "Not summarized: pipeline-fp32 (unreadable JSON" in text
    assert "Not summarized: variants (the step exited 1; KeyError" in text
    assert _row(text, "variants", "1", "4.0")
    # The steps that could be read are summarized as they would be alone.
    assert summary["pipeline"] == [] and summary["variants"] == []
    assert summary["link"]["h2d"] == raw["link"]["fit"]["h2d"]
    assert summary["llm"][0]["decode"]["rows"][0]["ours"] == raw["llm-1b"]["decode"]["ours_tokens_per_s"]
    assert "## A language model: wake and decode" in text and "Pinned host-to-device" in text
    assert "## Cold first inference from disk" not in text and not (tmp_path / "first-inference.png").exists()
