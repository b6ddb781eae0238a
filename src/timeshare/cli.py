"""The ``timeshare`` command line. The only place that prints to the user.

    timeshare bench pipeline [--models ...] [--batch 8] [--dtype fp32] [--json PATH]
    timeshare zoo [--generate]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from timeshare.errors import TimeshareError

console = Console()
if not console.is_terminal:  # piped or captured: keep tables whole rather than 80 columns wide
    console = Console(width=200)
err = Console(stderr=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="timeshare", description="Fine-grained GPU time-sharing for deep learning.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the runtime does")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("pipeline", help="first-inference latency per grouping strategy (PipeSwitch Fig. 7)")
    p.add_argument("--models", nargs="+", default=None, help="zoo models (default: resnet152 inception_v3 bert_base)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=10, help="timed rounds (each times ready and every strategy)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--memory", default="auto", help="arena size, e.g. 4GiB")
    p.add_argument("--json", type=Path, default=None, help="write all results to this file")

    z = sub.add_parser("zoo", help="list the model zoo")
    z.add_argument("--generate", action="store_true", help="generate and cache every model's weights")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        if args.command == "bench" and args.bench == "pipeline":
            return _bench_pipeline(args)
        if args.command == "zoo":
            return _zoo(args)
    except TimeshareError as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    parser.error("unknown command")
    return 2


def _bench_pipeline(args) -> int:
    from timeshare.bench.pipeline import DEFAULT_MODELS, PipelineBenchConfig, run
    from timeshare.models.zoo import get

    if args.batch < 1 or args.repeats < 1 or args.warmup < 0:
        err.print("[red]error:[/red] --batch and --repeats must be at least 1, --warmup at least 0")
        return 2
    models = args.models or list(DEFAULT_MODELS)
    for m in models:
        get(m)  # unknown names fail before any work
    cfg = PipelineBenchConfig(models=models, batch=args.batch, dtype=args.dtype, device=args.device,
                              repeats=args.repeats, warmup=args.warmup, memory=args.memory)
    with console.status("starting") as status:
        result = run(cfg, progress=lambda msg: status.update(msg))
    _print_pipeline(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0


def _print_pipeline(result: dict) -> None:
    env = result["environment"]
    link = result["link"]
    where = env.get("gpu") or env.get("cpu") or env["device"]
    console.print(
        f"[bold]First-inference latency[/bold] on {env['device']} ({where}), torch {env['torch']}, "
        f"batch {result['config']['batch']}, {result['config']['dtype']}; "
        f"host->device {link['bandwidth_GBps']:.1f} GB/s, per-group overhead "
        f"copy {link['alpha_us']:.0f} us / compute {link['beta_us']:.0f} us, wake-up {link['latency_us']:.0f} us"
    )
    strategies = result["config"]["strategies"]
    table = Table(show_lines=False)
    for col in ["model", "MB", "layers", "ready ms", "floor ms", *[f"{s} ms" for s in strategies], "optimal/floor",
                "optimal vs best", "exact"]:
        table.add_column(col, justify="right" if col != "model" else "left")
    for r in result["results"]:
        cells = [
            r["model"], f"{r['needed_bytes'] / 1e6:.1f}", str(r["layers"]), f"{r['ready_ms']:.2f}", f"{r['floor_ms']:.2f}",
        ]
        cells += [f"{r['strategies'][s]['ms']:.2f} ({r['strategies'][s]['groups']}g)" for s in strategies]
        cells[3] += f" ±{r['ready']['iqr_ms'] / 2:.2f}"
        opt = r["strategies"].get("optimal")
        cells.append(f"{opt['vs_floor']:.3f}x" if opt else "-")
        v = r.get("verdict") or {}
        if v:
            ok = "within noise" if v["optimal_within_noise_of_best"] else "[red]slower[/red]"
            cells.append(f"{v['optimal_minus_best_ms']:+.2f} ms (noise {v['noise_ms']:.2f}): {ok}")
        else:
            cells.append("-")
        cells.append("yes" if r["outputs_match_ready"] else "[red]NO[/red]")
        table.add_row(*cells)
    console.print(table)
    console.print(
        "Medians over rounds; (Ng) = groups. ready: the model already resident (± half the interquartile "
        "range). floor: max(bytes / measured bandwidth, ready compute), no loader can beat it. whole: copy "
        "everything, then run. per_layer: one group per layer. fixed: ~2 MiB groups. optimal: the grouping "
        "that minimises the profiled cost model. optimal vs best: its median minus the best strategy's, "
        "against the larger interquartile range. exact: every first-inference output is bitwise equal to "
        "the ready model's."
    )


def _zoo(args) -> int:
    from timeshare.models.zoo import ZOO, weights_path

    table = Table()
    for col in ["name", "parameters", "builder", "description"]:
        table.add_column(col)
    for m in ZOO.values():
        table.add_row(m.name, f"{m.parameters:,}", m.builder, m.description)
        if args.generate:
            weights_path(m.name)
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
