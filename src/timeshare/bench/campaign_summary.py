"""The GPU campaign's summary: the headline numbers of every step's JSON in a results folder,
as ``summary.json``, ``SUMMARY.md`` and a plot of first inferences. Pure reading of files
written by ``timeshare.bench.campaign`` (or copied from a raw run); it runs on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path


def summarize(out: Path) -> dict:
    """Gather the headline numbers of every step present in ``out``; write summary.json and SUMMARY.md."""
    def load(name):
        p = out / f"{name}.json"
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    summary: dict = {"steps": {}, "pipeline": [], "switch": [], "cycles": []}
    link = load("link")
    steps = []
    for path in sorted(out.glob("*.json")):
        r = load(path.stem)
        if isinstance(r, dict) and "campaign" in r:
            steps.append((r["campaign"].get("started", ""), path.stem, r))
    for _, name, r in sorted(steps):
        summary["steps"][name] = r["campaign"]
        summary.setdefault("environment", r.get("environment"))
    if link and "fit" in link:
        summary["link"] = {"h2d": link["fit"]["h2d"], "d2h": link["fit"]["d2h"], "peak": link["peak"]}
    for dtype in ("fp32", "bf16"):
        p = load(f"pipeline-{dtype}")
        for r in (p or {}).get("results", []):
            opt = r["strategies"].get("optimal", {})
            row = {"model": r["model"], "dtype": dtype, "MB": r["needed_bytes"] / 1e6, "ready_ms": r["ready_ms"],
                   "native_ms": r.get("native_ms"), "floor_ms": r["floor_ms"],
                   **{f"{s}_ms": v["ms"] for s, v in r["strategies"].items()},
                   "optimal_vs_floor": opt.get("vs_floor"), "exact": r["outputs_match_ready"]}
            if link and "fit" in link:
                from timeshare.bench.link import floor_ms

                row["link_floor_ms"] = floor_ms(r["needed_bytes"], link, r["ready_ms"])
                if opt:
                    row["optimal_vs_link_floor"] = opt["ms"] / row["link_floor_ms"]
            summary["pipeline"].append(row)
        s = load(f"switch-{dtype}")
        for r in (s or {}).get("results", []):
            summary["switch"].append({
                "model": r["model"], "dtype": dtype, "ready_ms": r["ready_ms"], "timeshare_ms": r["timeshare_ms"],
                "overhead_ms": r["overhead_ms"], "components_ms": r["components_ms"],
                **{k: r[k] for k in ("two_processes_ms", "one_process_ms", "stop_and_start_ms",
                                     "stop_and_start_vs_timeshare") if k in r},
                "exact": r["outputs_match_ready"], "ready_breakdown_ms": r.get("ready_breakdown_ms"),
            })
    o = load("overhead")
    if o is not None:
        summary["overhead"] = _overhead_summary(o)
    lanes = load("lanes")
    if lanes is not None:
        summary["lanes"] = [{"models": r["models"], "fifo_req_per_s": r["fifo"]["req_per_s"],
                             "pack_req_per_s": r["pack"]["req_per_s"], "plain_req_per_s": r["plain_pytorch_req_per_s"],
                             "fifo_vs_plain": r["fifo"]["req_per_s"] / r["plain_pytorch_req_per_s"],
                             "pack_over_fifo": r["pack_over_fifo"]} for r in lanes.get("rows", [])]
    ready = load("ready")
    if ready is not None:
        summary["ready"] = [{"model": r["model"], "native_ms": r["native_ms"], "ready_ms": r["ready_ms"],
                             "ready_vs_native": r["ready_ms"] / r["native_ms"], "exact": r["outputs_match_ready"]}
                            for r in ready.get("results", [])]
    c = load("cycles")
    for r in (c or {}).get("results", []):
        summary["cycles"].append({"cycle_s": r["cycle_s"], "fraction_of_ready": r["fraction_of_ready"],
                                  "switches": r["switches"]})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "SUMMARY.md").write_text(_markdown(summary))
    if summary["pipeline"]:
        plot_first_inference(summary, out / "first-inference.png")
    return summary


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
    f = lambda v, d=2: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    env = s.get("environment") or {}
    lines = ["# GPU campaign summary", "",
             f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, CUDA {env.get('cuda', '?')}, "
             f"torch {env.get('torch', '?')}. Generated from the JSON files beside this one "
             "(`python -m timeshare.bench.campaign --summary-only`).", "", "| step | exit | seconds | command |",
             "|---|---|---|---|"]
    for name, rec in s["steps"].items():
        rc = "timed out" if rec["timed_out"] else str(rec["returncode"])
        lines.append(f"| {name} | {rc} | {rec['seconds']} | `{rec['command']}` |")
    if "link" in s:
        h, d = s["link"]["h2d"], s["link"]["d2h"]
        lines += ["", f"Pinned host-to-device {h['bandwidth_GBps']:.1f} GB/s + {h['overhead_us']:.1f} us per copy; "
                  f"device-to-host {d['bandwidth_GBps']:.1f} GB/s + {d['overhead_us']:.1f} us; both at once "
                  f"{s['link']['peak']['both_GBps']:.1f} GB/s (peak)."]
    if s["pipeline"]:
        lines += ["", "## First inference, model not resident (ms, median)", "",
                  "| model | dtype | MB | native | ready | floor | whole | per_layer | fixed | optimal "
                  "| optimal/floor | exact |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in s["pipeline"]:
            fl = r.get("link_floor_ms", r["floor_ms"])
            ratio = r.get("optimal_vs_link_floor", r["optimal_vs_floor"])
            lines.append(f"| {r['model']} | {r['dtype']} | {r['MB']:.0f} | {f(r['native_ms'])} | {f(r['ready_ms'])} | "
                         f"{f(fl)} | {f(r.get('whole_ms'))} | {f(r.get('per_layer_ms'))} | {f(r.get('fixed_ms'))} | "
                         f"{f(r.get('optimal_ms'))} | {f(ratio, 3)} | {'yes' if r['exact'] else 'NO'} |")
    if s["switch"]:
        lines += ["", "## First inference after a switch from training (ms, median)", "",
                  "| model | dtype | ready | timeshare | overhead | stop | start | load | clean | two processes | "
                  "one process | stop-and-start | stop-and-start / timeshare | exact |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in s["switch"]:
            c = r["components_ms"]
            lines.append(
                f"| {r['model']} | {r['dtype']} | {f(r['ready_ms'])} | {f(r['timeshare_ms'])} | "
                f"{f(r['overhead_ms'])} | "
                f"{f(c.get('stop'))} | {f(c.get('start'))} | {f(c.get('load'))} | {f(c.get('clean'))} | "
                f"{f(r.get('two_processes_ms'), 0)} | {f(r.get('one_process_ms'), 0)} | "
                f"{f(r.get('stop_and_start_ms'), 0)} | {f(r.get('stop_and_start_vs_timeshare'), 0)}x | "
                f"{'yes' if r['exact'] else 'NO'} |")
    o = s.get("overhead")
    if o:
        u = o.get("single_us") or {}
        lines += ["", "## The runtime's own cost, nothing switched (bench overhead)", "",
                  f"One caller, tiny model: plain PyTorch {f(u.get('plain_pytorch'), 1)} us, in-process "
                  f"{f(u.get('in_process'), 1)} us, through workers {f(u.get('workers'), 1)} us; PACK over FIFO "
                  f"{f(o.get('pack_over_fifo'))}x.", "", "| models | threads | req/s | vs plain (one lock) | "
                  "CPU per request vs one thread |", "|---|---|---|---|---|"]
        for r in o["threads"]:
            lines.append(f"| {r['models']} | {r['threads']} | {r['req_per_s']:,.0f} | {f(r['vs_plain'])}x | "
                         f"{f(r['cpu_vs_one_thread'])}x |")
        if o["transfer"]:
            lines += ["", "| head | input | copy (floor) ms | plain ms | in-process ms | workers ms |",
                      "|---|---|---|---|---|---|"]
            for r in o["transfer"]:
                lines.append(f"| {r['head']} | {r['input']} | {f(r['memcpy'])} | {f(r['plain_pytorch'])} | "
                             f"{f(r['in_process'])} | {f(r['workers'])} |")
    if s.get("lanes"):
        lines += ["", "## Many small models (bench lanes)", "", "| models | plain req/s | FIFO req/s | FIFO/plain | "
                  "PACK/FIFO |", "|---|---|---|---|---|"]
        for r in s["lanes"]:
            lines.append(f"| {r['models']} | {r['plain_req_per_s']:,.0f} | {r['fifo_req_per_s']:,.0f} | "
                         f"{f(r['fifo_vs_plain'])} | {f(r['pack_over_fifo'])} |")
    if s.get("ready"):
        lines += ["", "## A resident model through a worker (ms, median)", "", "| model | plain PyTorch | ready | "
                  "ready/plain | exact |", "|---|---|---|---|---|"]
        for r in s["ready"]:
            lines.append(f"| {r['model']} | {f(r['native_ms'])} | {f(r['ready_ms'])} | {f(r['ready_vs_native'])} | "
                         f"{'yes' if r['exact'] else 'NO'} |")
    if s["cycles"]:
        lines += ["", "## Inference throughput time-sharing with training", "", "| cycle s | of ready | switches |",
                  "|---|---|---|"]
        for r in s["cycles"]:
            lines.append(f"| {r['cycle_s']:g} | {r['fraction_of_ready'] * 100:.1f}% | {r['switches']} |")
    return "\n".join(lines) + "\n"
