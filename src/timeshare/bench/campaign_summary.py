"""The GPU campaign's summary: the headline numbers of every step's JSON in a results folder,
as ``summary.json``, ``SUMMARY.md`` and a plot of first inferences. Pure reading of files
written by ``timeshare.bench.campaign`` (or copied from a raw run); it runs on any machine.

A file's kind is its name up to the first '-' (``pipeline-fp32``, ``switch-sas``,
``lanes-train``, ``llm-1b``): the campaign names its steps so, and a raw run folded in by
hand keeps to it. The steps table lists every file with a ``campaign`` block; the sections
read every file of their kind, so two runs of one bench both show, each row naming its file.
A file that cannot be read, or lacks what its kind's reader needs, is listed as not
summarized and leaves the rest of the summary as it would be without it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from timeshare.bench import campaign_tables as tables
from timeshare.bench.campaign_tables import count, fmt, times, yes_no

DTYPES = ["fp32", "bf16", "fp16"]
# What a reader may raise on a file of another shape than it expects (an older bench, a
# step cut short): the file is reported as not summarized, with the error's text.
_SHAPE_ERRORS = (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError, IndexError)


def summarize(out: Path) -> dict:
    """Gather the headline numbers of every step present in ``out``; write summary.json and SUMMARY.md."""
    results, unreadable = _read_folder(out)
    summary: dict = {"steps": {}, "pipeline": [], "switch": [], "cycles": [], "ready": [], "lanes": [],
                     "lanes_training": [], "llm": [], "variants": [], "disk": []}
    steps = sorted((str(r["campaign"].get("started") or ""), name, r) for name, r in results.items()
                   if isinstance(r.get("campaign"), dict))
    for _, name, r in steps:
        summary["steps"][name] = r["campaign"]
        if not summary.get("environment") and isinstance(r.get("environment"), dict):
            summary["environment"] = r["environment"]
    # The link first: the pipeline's floors use its fit, where it could be read.
    for name, r in sorted(results.items(), key=lambda item: (item[0] != "link", item[0])):
        reader = _READERS.get(name.split("-")[0])
        if reader is None:
            continue
        try:
            parts = reader(name, r, results["link"] if "link" in summary else None)
        except _SHAPE_ERRORS as exc:
            rc = (r.get("campaign") or {}).get("returncode")
            unreadable[name] = (f"the step exited {rc}; " if rc else "") + f"{type(exc).__name__}: {exc}"
            continue
        for key, value in parts.items():
            if isinstance(value, list):
                summary[key].extend(value)
            else:
                summary[key] = value
    for key in ("pipeline", "switch", "ready"):
        summary[key].sort(key=lambda row: _dtype_rank(row.get("dtype")))
    if unreadable:
        summary["not_summarized"] = dict(sorted(unreadable.items()))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "SUMMARY.md").write_text(_markdown(summary))
    if summary["pipeline"]:
        plot_first_inference(summary, out / "first-inference.png")
    return summary


def _read_folder(out: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """Every step's JSON in ``out`` by name (not the summary's own), and why any could not be read."""
    results: dict[str, dict] = {}
    unreadable: dict[str, str] = {}
    for path in sorted(out.glob("*.json")):
        if path.name == "summary.json":
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            unreadable[path.stem] = f"unreadable JSON: {exc}"
            continue
        if isinstance(data, dict):
            results[path.stem] = data
        else:
            unreadable[path.stem] = f"not a JSON object but {type(data).__name__}"
    return results, unreadable


def _dtype_rank(dtype: str | None) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def _dtype(name: str, r: dict) -> str:
    return (r.get("config") or {}).get("dtype") or name.split("-", 1)[-1]


def _link(name: str, r: dict, link: dict | None) -> dict:
    if "fit" not in r:
        return {}
    # The two numbers per direction that the summary and the pipeline's floors read, read here.
    fit = {d: {"overhead_us": float(r["fit"][d]["overhead_us"]), "bandwidth_GBps": float(r["fit"][d]["bandwidth_GBps"])}
           for d in ("h2d", "d2h")}
    peak = r.get("peak")
    return {"link": {**fit, "peak": peak if isinstance(peak, dict) else {}}}


def _pipeline(name: str, p: dict, link: dict | None) -> dict:
    rows = []
    dtype = _dtype(name, p)
    for r in p.get("results") or []:
        opt = r["strategies"].get("optimal", {})
        row = {"model": r["model"], "dtype": dtype, "MB": r["needed_bytes"] / 1e6, "ready_ms": r["ready_ms"],
               "native_ms": r.get("native_ms"), "floor_ms": r["floor_ms"],
               **{f"{s}_ms": v["ms"] for s, v in r["strategies"].items()},
               "optimal_vs_floor": opt.get("vs_floor"), "optimal_groups": opt.get("groups"),
               "exact": r["outputs_match_ready"]}
        if link:
            from timeshare.bench.link import floor_ms

            row["link_floor_ms"] = floor_ms(r["needed_bytes"], link, r["ready_ms"])
            if opt:
                row["optimal_vs_link_floor"] = opt["ms"] / row["link_floor_ms"]
        rows.append(row)
    return {"pipeline": rows}


def _switch(name: str, s: dict, link: dict | None) -> dict:
    dtype = _dtype(name, s)
    rows = [{"step": name, "model": r["model"], "dtype": dtype, "ready_ms": r["ready_ms"],
             "timeshare_ms": r["timeshare_ms"], "overhead_ms": r["overhead_ms"], "components_ms": r["components_ms"],
             **{k: r[k] for k in ("two_processes_ms", "one_process_ms", "stop_and_start_ms",
                                  "stop_and_start_vs_timeshare") if k in r},
             "exact": r["outputs_match_ready"], "ready_breakdown_ms": r.get("ready_breakdown_ms")}
            for r in s.get("results") or []]
    return {"switch": rows, "ready": tables.ready_rows(name, s)}


def _cycles(name: str, c: dict, link: dict | None) -> dict:
    return {"cycles": [{"cycle_s": float(r["cycle_s"]), "fraction_of_ready": float(r["fraction_of_ready"]),
                        "switches": r["switches"]} for r in c.get("results") or []]}


_READERS: dict[str, Callable[[str, dict, dict | None], dict]] = {
    "link": _link,
    "pipeline": _pipeline,
    "switch": _switch,
    "ready": lambda name, r, link: {"ready": tables.ready_rows(name, r)},
    "cycles": _cycles,
    "overhead": lambda name, r, link: {"overhead": _overhead_summary(r)},
    "lanes": lambda name, r, link: {"lanes": tables.lanes_rows(name, r),
                                    "lanes_training": tables.lanes_training_rows(name, r)},
    "llm": lambda name, r, link: {"llm": tables.llm_rows(name, r)},
    "variants": lambda name, r, link: {"variants": tables.variants_rows(name, r)},
    "disk": lambda name, r, link: {"disk": tables.disk_rows(name, r)},
}


def _overhead_summary(o: dict) -> dict:
    """The headline figures of ``bench overhead``."""
    single = o.get("single") or {}
    return {
        "single_us": single.get("us_per_call"),
        "threads": [{"models": b["models"], "threads": r["threads"], "req_per_s": r["timeshare"]["req_per_s"],
                     "vs_plain": r["req_per_s_vs_plain"], "cpu_vs_one_thread": r["cpu_per_request_vs_one_thread"]}
                    for b in o.get("threads") or [] for r in b["rows"]],
        "transfer": [{"head": r["head"], "input": r["input"], **r["ms"]}
                     for r in (o.get("transfer") or {}).get("rows", [])],
        "pack_over_fifo": (o.get("pack") or {}).get("pack_over_fifo"),
    }


# PipeSwitch's artifact on a V100 (PCIe 3.0 x16), batch 8, fp32, mean ms (../shared/REFERENCES.md).
PIPESWITCH_V100 = {
    "resnet152": {"ready": 37.06, "pipeswitch": 43.45},
    "inception_v3": {"ready": 40.54, "pipeswitch": 40.59},
    "bert_base": {"ready": 39.33, "pipeswitch": 53.85},
}


def plot_first_inference(summary: dict, path: Path) -> None:
    """Bars per model: the floor, plain PyTorch, ready and every strategy on this device,
    beside PipeSwitch's V100 figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["pipeline"]
    dtypes = sorted({r["dtype"] for r in rows}, key=["fp32", "bf16", "fp16"].index)
    series = [("floor", "link_floor_ms", "#999999"), ("native", "native_ms", "#4c72b0"),
              ("ready", "ready_ms", "#55a868"), ("optimal", "optimal_ms", "#c44e52"),
              ("whole", "whole_ms", "#dd8452"), ("per_layer", "per_layer_ms", "#8172b3")]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.2), squeeze=False)
    env = summary.get("environment") or {}
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        models = [r for r in rows if r["dtype"] == dtype]
        width = 0.8 / (len(series) + (2 if dtype == "fp32" else 0))
        for i, r in enumerate(models):
            k = 0
            for label, key, color in series:
                v = r.get(key) if key != "link_floor_ms" else r.get(key, r.get("floor_ms"))
                if v is not None:
                    ax.bar(i + k * width, v, width, color=color, label=label if i == 0 else None)
                k += 1
            ref = PIPESWITCH_V100.get(r["model"]) if dtype == "fp32" else None
            if ref:
                ax.bar(i + k * width, ref["ready"], width, color="#cccccc", hatch="//",
                       label="V100 ready (PipeSwitch paper)" if i == 0 else None)
                ax.bar(i + (k + 1) * width, ref["pipeswitch"], width, color="#937860", hatch="//",
                       label="V100 PipeSwitch" if i == 0 else None)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], [r["model"] for r in models])
        ax.set_ylabel("first inference, ms (median)")
        ax.set_title(f"{env.get('gpu', 'GPU')}, batch 8, {dtype}")
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(s: dict) -> str:
    env = s.get("environment") or {}
    commits = sorted({str(rec["commit"]) for rec in s["steps"].values() if rec.get("commit")})
    lines = ["# GPU campaign summary", "",
             f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, CUDA {env.get('cuda', '?')}, "
             f"torch {env.get('torch', '?')}" + (f", commit {', '.join(commits)}" if commits else "") +
             ". Generated from the JSON files beside this one (`python -m timeshare.bench.campaign --summary-only`).",
             "", "| step | exit | seconds | command |", "|---|---|---|---|"]
    for name, rec in s["steps"].items():
        rc = "timed out" if rec.get("timed_out") else str(rec.get("returncode", "?"))
        lines.append(f"| {name} | {rc} | {rec.get('seconds', '-')} | `{rec.get('command', '?')}` |")
    for name, why in (s.get("not_summarized") or {}).items():
        lines.append(f"\nNot summarized: {name} ({why}).")
    if "link" in s:
        h, d = s["link"]["h2d"], s["link"]["d2h"]
        lines += ["", f"Pinned host-to-device {fmt(h['bandwidth_GBps'], 1)} GB/s + {fmt(h['overhead_us'], 1)} us "
                  f"per copy; device-to-host {fmt(d['bandwidth_GBps'], 1)} GB/s + {fmt(d['overhead_us'], 1)} us; "
                  f"both at once {fmt(s['link']['peak'].get('both_GBps'), 1)} GB/s (peak)."]
    if s["pipeline"]:
        lines += _pipeline_table(s["pipeline"])
    if s["switch"]:
        lines += _switch_table(s["switch"])
    if s.get("ready"):
        lines += tables.ready_table(s["ready"])
    if s.get("overhead"):
        lines += _overhead_table(s["overhead"])
    if s.get("lanes") or s.get("lanes_training"):
        lines += tables.lanes_table(s.get("lanes", []), s.get("lanes_training", []))
    if s.get("llm"):
        lines += tables.llm_table(s["llm"])
    if s.get("variants"):
        lines += tables.variants_table(s["variants"])
    if s.get("disk"):
        lines += tables.disk_table(s["disk"])
    if s["cycles"]:
        lines += ["", "## Inference throughput time-sharing with training", "", "| cycle s | of ready | switches |",
                  "|---|---|---|"]
        for r in s["cycles"]:
            lines.append(f"| {r['cycle_s']:g} | {r['fraction_of_ready'] * 100:.1f}% | {r['switches']} |")
    return "\n".join(lines) + "\n"


def _pipeline_table(rows: list[dict]) -> list[str]:
    lines = ["", "## First inference, model not resident (ms, median)", "",
             "| model | dtype | MB | native | ready | floor | whole | per_layer | fixed | optimal (groups) "
             "| optimal/floor | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fl = r.get("link_floor_ms", r["floor_ms"])
        ratio = r.get("optimal_vs_link_floor", r["optimal_vs_floor"])
        groups = f" ({r['optimal_groups']})" if r.get("optimal_groups") else ""
        lines.append(f"| {r['model']} | {r['dtype']} | {fmt(r['MB'], 0)} | {fmt(r['native_ms'])} | "
                     f"{fmt(r['ready_ms'])} | {fmt(fl)} | {fmt(r.get('whole_ms'))} | {fmt(r.get('per_layer_ms'))} | "
                     f"{fmt(r.get('fixed_ms'))} | {fmt(r.get('optimal_ms'))}{groups} | {fmt(ratio, 3)} | "
                     f"{yes_no(r['exact'])} |")
    return lines


def _switch_table(rows: list[dict]) -> list[str]:
    lines = ["", "## First inference after a switch from training (ms, median)", "",
             "| step | model | dtype | ready | timeshare | overhead | stop | start | load | clean | two processes | "
             "one process | stop-and-start | stop-and-start / timeshare | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["components_ms"] if isinstance(r["components_ms"], dict) else {}
        lines.append(
            f"| {r.get('step', '-')} | {r['model']} | {r['dtype']} | {fmt(r['ready_ms'])} | {fmt(r['timeshare_ms'])} | "
            f"{fmt(r['overhead_ms'])} | "
            f"{fmt(c.get('stop'))} | {fmt(c.get('start'))} | {fmt(c.get('load'))} | {fmt(c.get('clean'))} | "
            f"{fmt(r.get('two_processes_ms'), 0)} | {fmt(r.get('one_process_ms'), 0)} | "
            f"{fmt(r.get('stop_and_start_ms'), 0)} | {times(r.get('stop_and_start_vs_timeshare'), 0)} | "
            f"{yes_no(r['exact'])} |")
    return lines


def _overhead_table(o: dict) -> list[str]:
    u = o.get("single_us") or {}
    lines = ["", "## The runtime's own cost, nothing switched (bench overhead)", "",
             f"One caller, tiny model: plain PyTorch {fmt(u.get('plain_pytorch'), 1)} us, in-process "
             f"{fmt(u.get('in_process'), 1)} us, through workers {fmt(u.get('workers'), 1)} us; PACK over FIFO "
             f"{times(o.get('pack_over_fifo'))}.", "", "| models | threads | req/s | vs plain (one lock) | "
             "CPU per request vs one thread |", "|---|---|---|---|---|"]
    for r in o["threads"]:
        lines.append(f"| {r['models']} | {r['threads']} | {count(r['req_per_s'])} | {times(r['vs_plain'])} | "
                     f"{times(r['cpu_vs_one_thread'])} |")
    if o["transfer"]:
        lines += ["", "| head | input | copy (floor) ms | plain ms | in-process ms | workers ms |",
                  "|---|---|---|---|---|---|"]
        for r in o["transfer"]:
            lines.append(f"| {r['head']} | {r['input']} | {fmt(r.get('memcpy'))} | {fmt(r.get('plain_pytorch'))} | "
                         f"{fmt(r.get('in_process'))} | {fmt(r.get('workers'))} |")
    return lines
