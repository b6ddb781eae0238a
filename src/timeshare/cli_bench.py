"""``timeshare bench disk``: the memory hierarchy's benchmarks (disk to device), their
options and their tables. The results go to JSON through the CLI's common runner."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

NAMES = ("disk",)


def add_parsers(bench) -> None:
    p = bench.add_parser("disk", help="cold first inference from disk vs safetensors + load_state_dict",
                         description="The first inference of a model whose weights are only on disk (page cache "
                         "dropped for the file): timeshare streams the file group by group while earlier groups "
                         "are copied and computed, against safetensors load_file + load_state_dict + .to(device) "
                         "then the inference, and against the disk's own sequential read bandwidth measured in "
                         "the same run.")
    p.add_argument("--models", nargs="+", default=None, help="zoo models (default: resnet152 inception_v3 bert_base)")
    p.add_argument("--batch", type=int, default=None, help="default: 8 on CUDA, 1 on the CPU")
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=3, help="cold runs per model (median)")
    p.add_argument("--memory", default="auto", help="arena size, e.g. 4GiB")
    p.add_argument("--json", type=Path, default=None, help="write all results to this file")
    p.add_argument("--plot", type=Path, default=None, help="write a bar chart as a PNG")


def run(args, console, run_bench) -> int:
    from timeshare.bench.disk import DEFAULT_MODELS, DiskBenchConfig, plot
    from timeshare.bench.disk import run as run_disk

    cfg = DiskBenchConfig(models=tuple(args.models or DEFAULT_MODELS), batch=args.batch, device=args.device,
                          repeats=args.repeats, memory=args.memory)

    def show(result: dict) -> None:
        _print_disk(console, result)
        if args.plot:
            plot(result, args.plot)
            console.print(f"wrote {args.plot}")

    return run_bench(run_disk, cfg, show, args.json)


def _print_disk(console, result: dict) -> None:
    env = result["environment"]
    t = Table(title=f"bench disk: cold first inference on {env['device']}, batch {result['config']['batch']} "
                    "(seconds; page cache dropped before each cold run)")
    for col in ("model", "MB", "disk seq GB/s", "plain PyTorch", "timeshare cold", "speedup", "disk stage GB/s",
                "of seq", "floor", "ready", "exact"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in result["rows"]:
        t.add_row(r["model"], f"{r['bytes'] / 1e6:.0f}", f"{r['sequential_read_GBps']:.2f}",
                  f"{r['baseline_first_inference_s']:.3f}", f"{r['cold_first_inference_s']:.3f}",
                  f"{r['speedup_vs_baseline']:.2f}x", f"{r['disk_stage_GBps']:.2f}",
                  f"{r['disk_stage_of_sequential']:.0%}", f"{r['floor_s']:.3f}", f"{r['ready_inference_s']:.3f}",
                  "yes" if r["bitwise_equal"] else "NO")
    console.print(t)
