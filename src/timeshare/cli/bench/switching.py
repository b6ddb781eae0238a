"""``timeshare bench pipeline``, ``switch``, ``cycles``, ``lanes`` and ``link``: the
benchmarks of sharing the device between tasks (PipeSwitch's Figures 5 to 7 and 9, Salus's
lanes against time-slicing, the copy ceilings every load is judged by), their options,
their checks of the arguments and their tables. Part of the CLI layer; runs in the CLI's
process. The results go to JSON through the CLI's common runner.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from timeshare.cli.options import (
    arena_option,
    background_train_option,
    copy_delay_option,
    device_batch_option,
    device_options,
    json_option,
    models_option,
    plot_option,
)
from timeshare.errors import TimeshareError

NAMES = ("pipeline", "switch", "cycles", "lanes", "link")


def add_parsers(bench) -> None:
    p = bench.add_parser("pipeline", help="first-inference latency per grouping strategy (PipeSwitch Fig. 7)")
    models_option(p)
    p.add_argument("--batch", type=int, default=8)
    device_options(p)
    p.add_argument("--repeats", type=int, default=10, help="timed rounds (each times ready and every strategy)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    arena_option(p)
    json_option(p)

    p = bench.add_parser("switch", help="first inference after a switch from training (PipeSwitch Figs. 5 and 9)",
                         description="The latency of the first inference after switching from a training task "
                         "to an inference task: the ready model, timeshare, and the baselines a system without "
                         "it pays (two processes without a standby, one process, stop-and-start).")
    models_option(p)
    device_batch_option(p)
    device_options(p)
    p.add_argument("--repeats", type=int, default=10, help="timed rounds of ready and timeshare")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--baseline-repeats", type=int, default=3, help="runs of each baseline")
    p.add_argument("--baselines", nargs="*", default=None,
                   help="which baselines (default: two_processes one_process stop_and_start)")
    background_train_option(p)
    arena_option(p)
    copy_delay_option(p)
    json_option(p)

    p = bench.add_parser("cycles", help="inference throughput time-sharing with training (PipeSwitch Fig. 6)",
                         description="An inference task and a training task take turns on the device every "
                         "scheduling cycle; reports the inference throughput during its turns as a fraction of "
                         "the ready model's.")
    p.add_argument("--model", default="resnet152", help="zoo model serving inference")
    device_batch_option(p)
    device_options(p)
    p.add_argument("--cycles", default="1,2,5,10,30", help="scheduling cycles in seconds, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="at least this many turns per cycle length")
    p.add_argument("--min-inference-s", type=float, default=20.0,
                   help="more turns for short cycles until each length has this much inference time")
    p.add_argument("--keep-resident", action="store_true",
                   help="keep the model resident across training turns (default: evicted, as in PipeSwitch)")
    background_train_option(p)
    arena_option(p)
    copy_delay_option(p)
    json_option(p)

    p = bench.add_parser("lanes", help="small models side by side in Salus's lanes vs time-slicing (PACK)",
                         description="N small inference models, each with a closed-loop client, under "
                         "scheduling 'pack' (memory lanes, calls of different lanes at the same time) and 'fifo' "
                         "(one at a time) on the same runtime: aggregate throughput, added latency per request over "
                         "each model alone, outputs bitwise equal to the model alone; plain PyTorch threads and the "
                         "hardware bound beside them.")
    p.add_argument("--model", default="small_resnet", help="zoo model of which N copies are served")
    p.add_argument("--counts", default="4,8,16,42", help="numbers of models, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of requests per mode and count")
    arena_option(p, "1GiB")
    p.add_argument("--lane-memory", default="auto", help="bytes for lanes of ephemeral memory")
    p.add_argument("--workers", type=int, default=0,
                   help="worker processes (0: lanes are threads of this process, sharing its interpreter lock)")
    p.add_argument("--train", default="small_resnet:8",
                   help="two training jobs MODEL:BATCH packed vs FIFO (in workers with --workers); 'none' to skip")
    p.add_argument("--train-iterations", type=int, default=20)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True,
                   help="train with deterministic kernels (torch.use_deterministic_algorithms, cuDNN deterministic, "
                   "CUBLAS_WORKSPACE_CONFIG=:4096:8) in every process that trains, so that packed against alone "
                   "tests packing; on by default on every device")
    json_option(p)
    plot_option(p, "write the PACK timeline as a PNG")

    p = bench.add_parser("link", help="the ceilings: pinned host<->device and device copy bandwidth by size",
                         description="Pinned host-to-device and device-to-host bandwidth from 64 KiB to 1 GiB, both "
                         "at once, and a device-to-device copy, timed with device events; the fixed per-copy "
                         "overhead and the bandwidth from a straight-line fit. The floor every load is judged by.")
    p.add_argument("--device", default="auto")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes, e.g. 64KiB,1MiB,1GiB (default 64KiB..1GiB, x4)")
    p.add_argument("--repeats", type=int, default=20, help="timed copies per size (median)")
    json_option(p)


def run(args, console, err, run_bench) -> int:
    """Run ``timeshare bench <args.bench>``; ``err`` is the console that refusals go to."""
    if args.bench == "pipeline":
        return _bench_pipeline(args, console, err, run_bench)
    if args.bench == "switch":
        return _bench_switch(args, console, err, run_bench)
    if args.bench == "cycles":
        return _bench_cycles(args, console, err, run_bench)
    if args.bench == "link":
        return _bench_link(args, console, err, run_bench)
    return _bench_lanes(args, console, err, run_bench)


def _bench_pipeline(args, console, err, run_bench) -> int:
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
    return run_bench(run, cfg, lambda r: _print_pipeline(console, r), args.json)


def _print_pipeline(console, result: dict) -> None:
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
    for col in ["model", "MB", "layers", "native ms", "ready ms", "floor ms",
                *[f"{s} ms" for s in strategies], "optimal+direct ms", "optimal/floor",
                "optimal vs best", "exact"]:
        table.add_column(col, justify="right" if col != "model" else "left")
    for r in result["results"]:
        cells = [
            r["model"], f"{r['needed_bytes'] / 1e6:.1f}", str(r["layers"]),
            f"{r['native_ms']:.2f}", f"{r['ready_ms']:.2f}",
            f"{r['floor_ms']:.2f}",
        ]
        cells += [f"{r['strategies'][s]['ms']:.2f} ({r['strategies'][s]['groups']}g)" for s in strategies]
        direct = r["strategies"].get("optimal+direct")  # NOTE [Direct host access]
        cells.append(f"{direct['ms']:.2f} ({direct['direct_layers']} on host)" if direct else "-")
        cells[4] += f" ±{r['ready']['iqr_ms'] / 2:.2f}"
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
        "Medians over rounds; (Ng) = groups. native: the same module in plain PyTorch, weights resident, "
        "inference mode, inputs from and outputs to the host. "
        "ready: the model already resident (± half the interquartile "
        "range). floor: max(fixed per-load overhead + bytes / measured bandwidth, ready compute), "
        "no loader can beat it. whole: copy "
        "everything, then run. per_layer: one group per layer. fixed: ~2 MiB groups. optimal: the grouping "
        "that minimises the profiled cost model. optimal vs best: its median minus the best strategy's, "
        "against the larger interquartile range. exact: every first-inference output is bitwise equal to "
        "the ready model's."
    )


def _bench_switch(args, console, err, run_bench) -> int:
    from timeshare.bench.pipeline import DEFAULT_MODELS
    from timeshare.bench.switch import BASELINES, SwitchBenchConfig, run
    from timeshare.models.zoo import get

    if (args.batch is not None and args.batch < 1) or args.repeats < 1 or args.warmup < 0 or args.baseline_repeats < 1 \
            or args.copy_delay_ms < 0:
        err.print("[red]error:[/red] --batch, --repeats and --baseline-repeats must be at least 1, --warmup and "
                  "--copy-delay-ms at least 0")
        return 2
    models = args.models or list(DEFAULT_MODELS)
    for m in models:
        get(m)
    cfg = SwitchBenchConfig(models=models, batch=args.batch, dtype=args.dtype, device=args.device,
                            repeats=args.repeats, warmup=args.warmup, baseline_repeats=args.baseline_repeats,
                            baselines=BASELINES if args.baselines is None else args.baselines, train=args.train,
                            memory=args.memory, copy_delay_s=args.copy_delay_ms / 1e3)
    return run_bench(run, cfg, lambda r: _print_switch(console, r), args.json)


def _print_switch(console, result: dict) -> None:
    env, cfg, bg = result["environment"], result["config"], result["background_training"]
    where = env.get("gpu") or env.get("cpu") or env["device"]
    console.print(
        f"[bold]First inference after a switch from training[/bold] on {env['device']} ({where}), torch "
        f"{env['torch']}, batch {cfg['batch']}, {cfg['dtype']}; background training {bg['workload']} "
        f"({bg['mean_iteration_ms']:.1f} ms per iteration)"
    )
    table = Table()
    cols = ["model", "native ms", "ready ms", "timeshare ms", "vs ready", "stop", "start", "load", "clean",
            *[f"{b} ms" for b in cfg["baselines"]], "stop-and-start / timeshare", "exact"]
    for col in cols:
        table.add_column(col, justify="left" if col == "model" else "right")
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in result["results"]:
        c = r["components_ms"]
        row = [r["model"], f"{r['native_ms']:.1f}", f"{r['ready_ms']:.1f}", f"{r['timeshare_ms']:.1f}",
               f"{r['timeshare_vs_ready']:.2f}x",
               fmt(c["stop"]), fmt(c["start"]), fmt(c["load"]), fmt(c["clean"])]
        row += [f"{r[b + '_ms']:.0f}" for b in cfg["baselines"]]
        ratio = r.get("stop_and_start_vs_timeshare")
        row.append(f"{ratio:.1f}x" if ratio else "-")
        row.append("yes" if r["outputs_match_ready"] else "[red]NO[/red]")
        table.add_row(*row)
    console.print(table)
    console.print(
        "Medians. native: the same module in plain PyTorch in this process, weights resident, no "
        "runtime. ready: the model resident, nothing running. timeshare: request to output while the "
        "training job runs in a worker and the model is not resident; stop (the job reaching its next "
        "iteration boundary), start (a standby taking the request), load (all weights copied) and clean "
        "(the stopped worker's clean-up, in parallel) are its components in ms. two_processes: a worker "
        "started for the request (no standby). one_process: train, free, allocate and copy unpipelined in "
        "one process. stop_and_start: kill, new process, import, build, read weights, run. exact: every "
        "output bitwise equal to the ready model's."
    )


def _bench_cycles(args, console, err, run_bench) -> int:
    from timeshare.bench.cycles import CyclesBenchConfig, run
    from timeshare.models.zoo import get

    get(args.model)
    try:
        cycles = [float(c) for c in args.cycles.split(",") if c.strip()]
    except ValueError:
        err.print(f"[red]error:[/red] --cycles must be comma-separated seconds, got {args.cycles!r}")
        return 2
    if not cycles or min(cycles) <= 0 or args.rounds < 1 or (args.batch is not None and args.batch < 1) \
            or args.copy_delay_ms < 0:
        err.print("[red]error:[/red] --cycles must be positive seconds; --rounds and --batch at least 1; "
                  "--copy-delay-ms at least 0")
        return 2
    cfg = CyclesBenchConfig(model=args.model, batch=args.batch, dtype=args.dtype, device=args.device, cycles=cycles,
                            rounds=args.rounds, min_inference_s=args.min_inference_s, evict=not args.keep_resident,
                            train=args.train, memory=args.memory,
                            copy_delay_s=args.copy_delay_ms / 1e3)
    return run_bench(run, cfg, lambda r: _print_cycles(console, r), args.json)


def _print_cycles(console, result: dict) -> None:
    env, cfg = result["environment"], result["config"]
    where = env.get("gpu") or env.get("cpu") or env["device"]
    console.print(
        f"[bold]Inference throughput time-sharing with training[/bold] on {env['device']} ({where}), "
        f"{cfg['model']} batch {cfg['batch']} {cfg['dtype']}, training {cfg['train']}; "
        f"model {'evicted' if cfg['evict'] else 'kept resident'} each training turn"
    )
    table = Table()
    for col in ["cycle s", "requests", "inference time s", "req/s", "ready req/s", "of ready", "switches"]:
        table.add_column(col, justify="right")
    for r in result["results"]:
        table.add_row(f"{r['cycle_s']:g}", str(r["requests"]), f"{r['inference_s']:.2f}", f"{r['rps']:.2f}",
                      f"{r['ready_rps']:.2f}", f"{r['fraction_of_ready'] * 100:.1f}%", str(r["switches"]))
    console.print(table)
    console.print(
        "Each cycle the training job runs for the cycle length, then inference requests run back to back "
        "for the cycle length (the first pays the switch), then the ready model (resident, job paused) for as "
        "long. req/s counts requests over the turns' time, from the first request to the last output."
    )


def _bench_lanes(args, console, err, run_bench) -> int:
    from timeshare.bench.lanes import LanesBenchConfig, plot, run

    try:
        counts = tuple(int(c) for c in args.counts.split(",") if c.strip())
    except ValueError:
        err.print(f"[red]error:[/red] --counts must be comma-separated integers, got {args.counts!r}")
        return 2
    cfg = LanesBenchConfig(model=args.model, counts=counts, batch=args.batch, device=args.device,
                           duration_s=args.duration, memory=args.memory, lane_memory=args.lane_memory,
                           workers=args.workers, train=None if args.train == "none" else args.train,
                           train_iterations=args.train_iterations, deterministic=args.deterministic)

    def show(result: dict) -> None:
        _print_lanes(console, result)
        if args.plot:
            plot(result, args.plot)
            console.print(f"wrote {args.plot}")

    return run_bench(run, cfg, show, args.json)


def _print_lanes(console, result: dict) -> None:
    t = Table(title=f"bench lanes: {result['config']['model']} x N, batch {result['config']['batch']} on "
                    f"{result['environment']['device']} ({result['environment']['cores']} cores); alone "
                    f"{result['alone_ms']:.2f} ms")
    for col in ("models", "fifo req/s", "pack req/s", "pack / fifo", "added ms fifo", "added ms pack",
                "plain PyTorch req/s", "bound req/s", "exact"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        bound = r["bound_req_per_s"]
        t.add_row(str(r["models"]), f"{r['fifo']['req_per_s']:.0f}", f"{r['pack']['req_per_s']:.0f}",
                  f"{r['pack_over_fifo']:.2f}x", f"{r['fifo']['added_latency_ms']:.2f}",
                  f"{r['pack']['added_latency_ms']:.2f}", f"{r['plain_pytorch_req_per_s']:.0f}",
                  "-" if bound is None else f"{bound:.0f}",
                  "yes" if r["fifo"]["outputs_exact"] and r["pack"]["outputs_exact"] else "NO")
    console.print(t)
    tr = result.get("training")
    if tr:
        console.print(f"two {tr['workload']} jobs x {tr['iterations']} iterations: "
                      f"FIFO {tr['fifo']['makespan_s']:.2f} s "
                      f"({tr['fifo']['it_per_s']:.1f} it/s), PACK {tr['pack']['makespan_s']:.2f} s "
                      f"({tr['pack']['it_per_s']:.1f} it/s), {tr['pack_over_fifo']:.2f}x")
        console.print(f"weights ({tr['comparison']}): alone twice equal: {_yes(tr['alone_repeatable'])}; "
                      f"packed = alone: {_yes(tr['packed_equals_alone'])}; time-sliced = alone: "
                      f"{_yes(tr['time_sliced_equals_alone'])}")
        for mode, label in (("pack", "PACK"), ("fifo", "FIFO")):
            r = tr[mode]
            console.print(f"  {label}: {r['verdict']} (largest difference: alone twice "
                          f"{_diff(r['alone_max_abs_diff'])}, together vs alone {_diff(r['max_abs_diff'])})")


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _diff(value: float | None) -> str:
    return "shapes differ" if value is None else f"{value:.3g}"


def _bench_link(args, console, err, run_bench) -> int:
    from timeshare.bench.link import DEFAULT_SIZES, LinkBenchConfig, run
    from timeshare.units import parse_bytes

    try:
        sizes = [parse_bytes(s) for s in args.sizes.split(",")] if args.sizes else list(DEFAULT_SIZES)
    except (ValueError, TimeshareError) as exc:
        err.print(f"[red]error:[/red] --sizes: {exc}")
        return 2
    if args.repeats < 1 or min(sizes) < 1:
        err.print("[red]error:[/red] --repeats and every size must be at least 1")
        return 2
    return run_bench(run, LinkBenchConfig(device=args.device, sizes=sizes, repeats=args.repeats),
                     lambda r: _print_link(console, r), args.json)


def _print_link(console, result: dict) -> None:
    env = result["environment"]
    where = env.get("gpu") or env.get("cpu") or env["device"]
    console.print(f"[bold]Copy ceilings[/bold] on {env['device']} ({where}), timed with {result['config']['timer']}")
    table = Table()
    for col in ["bytes", "h2d GB/s", "d2h GB/s", "both GB/s", "d2d GB/s (r+w)", "h2d us"]:
        table.add_column(col, justify="right")
    for r in result["results"]:
        table.add_row(f"{r['bytes']:,}", f"{r['h2d_GBps']:.1f}", f"{r['d2h_GBps']:.1f}", f"{r['both_GBps']:.1f}",
                      f"{r['d2d_GBps']:.0f}", f"{r['h2d_us']:.1f}")
    console.print(table)
    for k, v in result["fit"].items():
        console.print(f"{k}: {v['bandwidth_GBps']:.2f} GB/s + {v['overhead_us']:.1f} us per copy "
                      "(fit over sizes >= 1 MiB)")
    console.print(f"round trip exact: {result['round_trip_exact']}")
