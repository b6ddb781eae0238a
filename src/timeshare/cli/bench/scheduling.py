"""``timeshare bench colocate`` and ``scheduler``: inference next to training under each
policy, and the scheduler's own decision time; their options and tables. Part of the CLI
layer; runs in the CLI's process.

    timeshare bench colocate [--model tiny_bert] [--train tiny_cnn:32] [--duration 20]
    timeshare bench scheduler [--queued 1000] [--requests 1000000]
"""

from __future__ import annotations

from rich.table import Table

from timeshare.cli.options import json_option

NAMES = ("colocate", "scheduler")


def add_parsers(bench) -> None:
    p = bench.add_parser("colocate", help="inference next to training: FIFO time-slicing vs priority preemption",
                         description="Open-loop inference requests next to a training job on the real runtime, "
                         "under FIFO time-slicing and under priority preemption (SwitchFlow's experiment).")
    p.add_argument("--model", default="tiny_bert", help="zoo model serving requests")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--train", default=None,
                   help="training MODEL:BATCH (default resnet152:64 on CUDA, tiny_cnn:32 on the CPU)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of requests per mode")
    p.add_argument("--rate", type=float, default=None, help="requests per second (default: ~10%% of the device)")
    p.add_argument("--time-slice", type=float, default=0.1, help="FIFO time-slicing: the job's slice in seconds")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: in-process runtime)")
    p.add_argument("--memory", default="auto")
    p.add_argument("--seed", type=int, default=0)
    json_option(p, help=None)

    p = bench.add_parser("scheduler", help="scheduler decision time and simulator replay speed")
    p.add_argument("--queued", type=int, default=1000)
    p.add_argument("--decisions", type=int, default=20_000)
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--costs", nargs="+", default=None)
    p.add_argument("--seed", type=int, default=0)
    json_option(p, help=None)


def run(args, console, run_bench) -> int:
    if args.bench == "colocate":
        from timeshare.bench.colocate import ColocateBenchConfig
        from timeshare.bench.colocate import run as run_colocate

        colocate = ColocateBenchConfig(model=args.model, batch=args.batch, device=args.device, train=args.train,
                                       duration_s=args.duration, rate_per_s=args.rate, time_slice_s=args.time_slice,
                                       workers=args.workers, memory=args.memory, seed=args.seed)
        return run_bench(run_colocate, colocate, lambda r: _print_colocate(console, r), args.json)
    if args.bench == "scheduler":
        from timeshare.bench.scheduler import SchedulerBenchConfig
        from timeshare.bench.scheduler import run as run_scheduler

        scheduler = SchedulerBenchConfig(queued=args.queued, decisions=args.decisions, requests=args.requests,
                                         costs=tuple(args.costs or ()), seed=args.seed)
        return run_bench(run_scheduler, scheduler, lambda r: _print_scheduler(console, r), args.json)
    return 2


def _print_colocate(console, result: dict) -> None:
    cfg, env = result["config"], result["environment"]
    console.print(f"[bold]Inference next to training[/bold] on {env['device']} ({env.get('gpu') or env.get('cpu')}), "
                  f"{cfg['model']} batch {cfg['batch']} ({result['ready_ms']:.1f} ms ready), {cfg['requests']} "
                  f"requests at {cfg['rate_per_s']:.1f}/s; training {cfg['train']} alone "
                  f"{result['training_alone_it_per_s']:.1f} it/s; FIFO slice {cfg['time_slice_s'] * 1e3:.0f} ms")
    table = Table()
    for col in ("mode", "p50 ms", "p95 ms", "p99 ms", "training it/s", "of alone", "preemptions", "exact"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, r in result["modes"].items():
        table.add_row(mode, f"{r['p50_ms']:.1f}", f"{r['p95_ms']:.1f}", f"{r['p99_ms']:.1f}",
                      f"{r['training_it_per_s']:.1f}", f"{r['training_fraction']:.0%}", str(r["training_preemptions"]),
                      "yes" if r["outputs_match_ready"] else "[red]NO[/red]")
    console.print(table)
    if "p95_fifo_over_priority" in result:
        console.print(f"Priority preemption cuts p95 latency {result['p95_fifo_over_priority']:.1f}x against FIFO "
                      "time-slicing. Latency counts from each request's scheduled arrival.")


def _print_scheduler(console, result: dict) -> None:
    table = Table(title=f"scheduler decision with {result['config']['queued']} tasks queued "
                        "(Salus memory model, 16 GiB)")
    for col in ("policy", "median us", "p99 us"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for d in result["decision"]:
        table.add_row(d["policy"], f"{d['median_us']:.1f}", f"{d['p99_us']:.1f}")
    console.print(table)
    r = result["replay"]
    console.print(f"Replayed {r['requests']:,} requests (serving study, LRU) in {r['wall_s']:.1f} s "
                  f"({r['requests_per_s']:,.0f} requests/s, {r['events']:,} events).")

