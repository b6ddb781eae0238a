"""The ``timeshare sim`` commands and the scheduling benchmarks (``bench colocate``,
``bench scheduler``): argument parsing and printing. Part of the CLI layer.

    timeshare sim salus [--seeds 10] [--devices 1] [--out PATH] [--plot PNG] [--calibrate | --explain]
    timeshare sim serving [--models 50] [--requests N] [--costs B1.json [B8.json [SWITCH.json]]]
    timeshare sim run --trace T.csv --policy srtf [--costs ...|--salus-pool CSV]
    timeshare sim cluster [--devices 1000] [--models 10000] [--requests 10000000] [--margins 4,8,16,32]
    timeshare bench colocate [--model tiny_bert] [--train tiny_cnn:32] [--duration 20]
    timeshare bench scheduler [--queued 1000] [--requests 1000000]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table


def add_sim_parser(sub) -> None:
    sim = sub.add_parser("sim",
                         help="trace-driven simulation of the scheduler").add_subparsers(dest="sim", required=True)
    p = sim.add_parser("salus", help="Salus's Table 1: every policy on 100 jobs from Salus's job pool",
                       description="FIFO, SRTF, PACK and FAIR on traces of jobs from Salus's job pool, each figure's "
                       "mean and spread over the seeds beside Salus's Table 1, and Table 1's claims checked. The "
                       "arrival process is fitted to Salus's FIFO row (--calibrate; docs/table1.md).")
    p.add_argument("--pool", default=None, help="Salus's job pool CSV (default: the copy in timeshare/sim/data)")
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=10, help="traces to run (seeds --seed, --seed + 1, ...)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices, one scheduler each, jobs dispatched to the least backlog (default 1: Salus's runs)")
    p.add_argument("--interarrival", type=float, default=None,
                   help="mean seconds between job arrivals, Poisson; 0: all at once (default: calibrated)")
    p.add_argument("--mix", default=None, help="shares of 1, 5 and 10-minute jobs, e.g. 0.75,0.125,0.125 "
                   "(default: calibrated)")
    p.add_argument("--order-correlation", type=float, default=None,
                   help="0..1, how strongly longer jobs arrive earlier (default: calibrated)")
    p.add_argument("--fair-slice", type=float, default=2.0, help="FAIR's time slice in seconds")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the arrival process to Salus's FIFO row on --devices devices over the seeds, and print "
                        "the fit instead of the table")
    p.add_argument("--explain", action="store_true",
                   help="run the targeted simulations behind docs/table1.md (policy variants, the FIFO-consistent "
                        "region, random-order queuing) instead of the table; minutes")
    p.add_argument("--json", "--out", dest="json", type=Path, default=None, help="write the result as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the table next to Salus's")

    p = sim.add_parser("serving",
                       help="many models with Zipf popularity: eviction policies vs Ray Serve and stop-and-start")
    p.add_argument("--models", type=int, default=50)
    p.add_argument("--fit", type=int, default=5, help="device memory holds this many models (by mean size)")
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--rate", type=float, default=None, help="requests per second (default: half the device at batch 1)")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--policy", default="edf", help="scheduling order of requests")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--slo-factor", type=float, default=10.0, help="SLO = this x the model's ready latency")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--costs", nargs="+", default=None,
                   help="bench pipeline JSON at batch 1 [, at batch 8 [, bench switch JSON]] "
                        "(default: committed CPU results)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)

    p = sim.add_parser("cluster", help="routing policies on a fleet: random, least-loaded, Ray Serve's, ours",
                       description="Requests to many models (Zipf popularity) routed over a fleet of devices by "
                       "each policy (NOTE [Fleet routing], NOTE [Cluster simulation]): loads per request, latency "
                       "percentiles and device utilisation.")
    p.add_argument("--devices", type=int, default=1000)
    p.add_argument("--models", type=int, default=10_000)
    p.add_argument("--requests", type=int, default=10_000_000)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--memory", default="16GB", help="model memory per device (bytes, or with a unit: 16GB)")
    p.add_argument("--load", type=float, default=0.7, help="offered load, a fraction of the fleet's capacity")
    p.add_argument("--policies", default=",".join(["random", "least-loaded", "ray", "timeshare"]))
    p.add_argument("--margin", type=float, default=4.0, help="timeshare's replicate margin (NOTE [Fleet routing])")
    p.add_argument("--margins", default="", help="also run timeshare at these margins, e.g. 1,2,8,16")
    p.add_argument("--ray-max-models", type=int, default=0,
                   help="Ray's max_num_models_per_replica (default: device memory over the mean model size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)

    p = sim.add_parser("run", help="replay a trace file under one policy")
    p.add_argument("--trace", type=Path, required=True, help="CSV: time,kind,model,work,priority,slo_s")
    p.add_argument("--policy", default="fifo")
    p.add_argument("--slice", type=float, default=None, help="time slice in seconds")
    p.add_argument("--capacity-gb", type=float, default=None, help="device memory for Salus's lanes")
    p.add_argument("--salus-pool", default=None, help="cost model from Salus's job pool CSV")
    p.add_argument("--costs", nargs="+", default=None, help="cost model from bench JSON (as for sim serving)")
    p.add_argument("--cache-fit", type=int, default=None, help="model cache holding this many models (mean size)")
    p.add_argument("--eviction", default="lru")
    p.add_argument("--json", type=Path, default=None)


def add_bench_parsers(bench) -> None:
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
    p.add_argument("--json", type=Path, default=None)

    p = bench.add_parser("scheduler", help="scheduler decision time and simulator replay speed")
    p.add_argument("--queued", type=int, default=1000)
    p.add_argument("--decisions", type=int, default=20_000)
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--costs", nargs="+", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)


def run_sim(args, console, write_json) -> int:
    from timeshare.errors import ConfigError
    from timeshare.sim import experiments

    if args.sim == "salus":
        return _sim_salus(args, console, write_json)
    if args.sim == "serving":
        from timeshare.bench.scheduler import load_costs

        if args.requests < 1 or args.models < 1 or args.fit < 1:
            raise ConfigError("--requests, --models and --fit must be at least 1")
        with console.status(f"simulating {args.requests:,} requests per mode"):
            result = experiments.serving(costs=load_costs(args.costs or ()), models=args.models,
                                         requests=args.requests, rate_per_s=args.rate, zipf_s=args.zipf,
                                         fit_models=args.fit, slo_factor=args.slo_factor, seed=args.seed,
                                         policy=args.policy, max_batch=args.max_batch)
        _print_serving(console, result)
        write_json(args.json, result)
        if args.plot:
            experiments.plot_serving(result, args.plot)
            console.print(f"wrote {args.plot}")
        return 0
    if args.sim == "cluster":
        return _sim_cluster(args, console, write_json)
    if args.sim == "run":
        result = _sim_run(args)
        console.print_json(data=result)
        write_json(args.json, result)
        return 0
    return 2


def _sim_salus(args, console, write_json) -> int:
    from dataclasses import replace

    from timeshare.errors import ConfigError
    from timeshare.sim import table1

    devices = table1.DEFAULT_DEVICES if args.devices is None else args.devices
    if args.jobs < 1 or args.seeds < 1 or devices < 1:
        raise ConfigError(f"--jobs, --seeds and --devices must be at least 1, got {args.jobs}, {args.seeds}, {devices}")
    pool = table1.SalusPool.load(args.pool)
    seeds = list(range(args.seed, args.seed + args.seeds))
    if args.calibrate:
        from timeshare.sim.calibrate import calibrate

        with console.status("calibrating") as status:
            result = calibrate(pool=pool, devices=devices, seeds=seeds, jobs=args.jobs,
                               progress=lambda stage, i, n: status.update(f"calibrating: {stage} grid, {i}/{n}"))
        _print_calibration(console, result)
        write_json(args.json, result)
        return 0
    if args.explain:
        from timeshare.sim.table1_checks import explain

        with console.status("explaining") as status:
            result = explain(pool, devices=devices, seeds=seeds,
                             progress=lambda stage, i, n: status.update(f"{stage}: {i}/{n}"))
        _print_explain(console, result)
        write_json(args.json, result)
        return 0
    given: dict[str, Any] = {k: v for k, v in (("mean_interarrival_s", args.interarrival),
                                               ("order_correlation", args.order_correlation),
                                               ("length_mix", _parse_mix(args.mix))) if v is not None}
    arrivals = None
    if given:
        base = table1.CALIBRATED.get(devices)
        if base is None and len(given) < 3:
            raise ConfigError(f"no calibrated arrival process for {devices} devices to complete the options given; "
                              "give --interarrival, --mix and --order-correlation, or run --calibrate")
        arrivals = replace(base, **given) if base is not None else table1.SalusArrivals(**given)
    with console.status(f"simulating {len(seeds)} traces x {len(table1.SALUS_POLICIES)} policies"):
        result = table1.salus(pool=pool, jobs=args.jobs, seeds=args.seeds, seed=args.seed, devices=devices,
                              arrivals=arrivals, fair_quantum_s=args.fair_slice)
    _print_salus(console, result)
    write_json(args.json, result)
    if args.plot:
        table1.plot_salus(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _sim_cluster(args, console, write_json) -> int:
    from timeshare.errors import ConfigError
    from timeshare.sim import fleet
    from timeshare.units import parse_bytes

    try:
        margins = tuple(float(x) for x in args.margins.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--margins must be comma-separated numbers, got {args.margins!r}") from None
    config = fleet.ClusterSimConfig(devices=args.devices, models=args.models, requests=args.requests, zipf=args.zipf,
                                    memory_bytes=parse_bytes(args.memory, what="--memory"), load=args.load,
                                    policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
                                    ray_max_models=args.ray_max_models, replicate_margin=args.margin,
                                    margins=margins, seed=args.seed)
    with console.status("simulating") as status:
        result = fleet.run(config, progress=status.update)
    table = Table(title=f"sim cluster: {args.requests:,} requests, {args.models:,} models, {args.devices:,} devices")
    for col in ("policy", "loads/request", "p50 ms", "p99 ms", "p99.9 ms", "utilisation", "sim s"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in result["rows"] + result["margin_sweep"]:
        name = r["policy"] + (f" (margin {r['replicate_margin']:g})" if r in result["margin_sweep"] else "")
        table.add_row(name, f"{r['loads_per_request']:.4f}", f"{r['latency_p50_s'] * 1e3:.1f}",
                      f"{r['latency_p99_s'] * 1e3:.1f}", f"{r['latency_p999_s'] * 1e3:.1f}", f"{r['utilisation']:.3f}",
                      f"{r['wall_s']:.1f}")
    console.print(table)
    console.print(f"whole run {result['wall_s']:.1f} s")
    write_json(args.json, result)
    if args.plot:
        fleet.plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _parse_mix(text: str | None) -> tuple[float, float, float] | None:
    from timeshare.errors import ConfigError

    if text is None:
        return None
    try:
        a, b, c = (float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--mix must be three comma-separated shares, got {text!r}") from None
    return (a, b, c)


def _sim_run(args) -> dict:
    import numpy as np

    from timeshare.bench.scheduler import load_costs
    from timeshare.errors import ConfigError
    from timeshare.scheduler.core import Scheduler
    from timeshare.sim.cache import ModelCache
    from timeshare.sim.costs import WorkloadCosts
    from timeshare.sim.engine import Simulator
    from timeshare.sim.table1 import find_salus_pool
    from timeshare.sim.trace import read_trace

    trace = read_trace(args.trace)
    if args.salus_pool:
        costs = WorkloadCosts.from_salus_csv(find_salus_pool(args.salus_pool))
    else:
        costs = load_costs(args.costs or ())
    models = {a.model for a in trace}
    if not models <= set(costs.models):
        costs = costs.variants(len(models)) if all(m.startswith("m") for m in models) else costs
    for m in models:
        costs[m]  # unknown models fail here, naming the known ones
    cache = None
    if args.cache_fit:
        sizes = [costs[m].nbytes for m in models]
        if not all(sizes):
            raise ConfigError("--cache-fit needs model sizes: use a bench JSON cost model")
        cache = ModelCache(capacity=int(args.cache_fit * float(np.mean(sizes))), policy=args.eviction)
    capacity = int(args.capacity_gb * 1e9) if args.capacity_gb else None
    sched = Scheduler(args.policy, capacity=capacity, quantum_s=args.slice)
    report = Simulator(sched, costs, cache=cache).run(trace).report()
    return {"trace": str(args.trace), "costs": costs.source, "report": report}


def run_bench(args, console, run_bench_fn) -> int:
    if args.bench == "colocate":
        from timeshare.bench.colocate import ColocateBenchConfig
        from timeshare.bench.colocate import run as run_colocate

        colocate = ColocateBenchConfig(model=args.model, batch=args.batch, device=args.device, train=args.train,
                                       duration_s=args.duration, rate_per_s=args.rate, time_slice_s=args.time_slice,
                                       workers=args.workers, memory=args.memory, seed=args.seed)
        return run_bench_fn(run_colocate, colocate, lambda r: _print_colocate(console, r), args.json)
    if args.bench == "scheduler":
        from timeshare.bench.scheduler import SchedulerBenchConfig
        from timeshare.bench.scheduler import run as run_scheduler

        scheduler = SchedulerBenchConfig(queued=args.queued, decisions=args.decisions, requests=args.requests,
                                         costs=tuple(args.costs or ()), seed=args.seed)
        return run_bench_fn(run_scheduler, scheduler, lambda r: _print_scheduler(console, r), args.json)
    return 2


def _print_salus(console, result: dict) -> None:
    cfg = result["config"]
    arr = cfg["arrivals"]
    seeds = cfg["seeds"]
    mix = "uniform over the pool" if arr["length_mix"] is None else "/".join(f"{x:.3g}" for x in arr["length_mix"])
    console.print(
        f"[bold]Salus Table 1, simulated[/bold]: {cfg['jobs']} jobs from {Path(cfg['pool']).name} on "
        f"{cfg['devices']} x {cfg['capacity_gb_per_device'] or 'unlimited'} GB device(s); arrivals "
        f"{'calibrated to FIFO' if arr['calibrated'] else 'as given'}: Poisson every {arr['mean_interarrival_s']:g} s, "
        f"1/5/10-min mix {mix}, length-order correlation {arr['order_correlation']:g}; seeds {seeds[0]}-{seeds[-1]}")
    table = Table()
    for col in ("policy", "makespan", "avg queuing", "avg JCT", "95% JCT", "Salus: makespan", "avg queuing",
                "avg JCT", "95% JCT", "preemptions"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    keys = ("makespan_min", "avg_queuing_min", "avg_jct_min", "p95_jct_min")
    for p, stats in result["spread"].items():
        s = result["salus_table1"][p]
        table.add_row(p.upper(), *(f"{stats[k]['mean']:.1f} ±{stats[k]['std']:.1f}" for k in keys),
                      *(f"{s[k]:.1f}" for k in keys), f"{stats['preemptions']['mean']:.0f}")
    console.print(table)
    c = result.get("criteria")
    if c:
        def mark(ok: bool) -> str:
            return "[green]holds[/green]" if ok else "[red]does not hold[/red]"

        f, s3, pk, fa = (c["fifo_within_10pct"], c["srtf_avg_jct_at_most_a_third_of_fifo"], c["pack_best_makespan"],
                         c["fair_between_srtf_and_fifo"])
        console.print(f"Minutes, mean ±std over {c['seeds']} traces. FIFO within 10% of Salus: makespan "
                      f"{f['makespan_error']:+.1%}, avg queuing {f['avg_queuing_error']:+.1%}: {mark(f['holds'])}")
        console.print(f"SRTF avg JCT / FIFO's {s3['ratio']:.2f} (Salus {s3['salus']:.2f}; at most 1/3 in "
                      f"{s3['share_of_seeds']:.0%} of traces): {mark(s3['holds'])}")
        console.print(f"PACK makespan / best other {pk['pack_over_best_other']:.3f} (Salus {pk['salus']:.3f}), best in "
                      f"{pk['share_of_seeds']:.0%} of traces: {mark(pk['holds'])}")
        console.print(f"FAIR avg JCT at {fa['position']:.2f} of the way from SRTF to FIFO (Salus {fa['salus']:.2f}; "
                      f"between in {fa['share_of_seeds']:.0%} of traces): {mark(fa['holds'])}")
        run = c["fifo_mean_run_min"]
        console.print(f"FIFO avg JCT - avg queuing (a job's mean run): {run['ours']:.1f} min "
                      f"(Salus {run['salus']:.1f})")


def _print_explain(console, result: dict) -> None:
    console.print(f"[bold]Targeted simulations[/bold] on {result['devices']} device(s), seeds "
                  f"{result['seeds'][0]}-{result['seeds'][-1]}, {result['wall_s']:.0f} s")
    table = Table()
    for col in ("run", "makespan", "avg queuing", "avg JCT", "95% JCT", "preemptions"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name, r in result["variants"].items():
        table.add_row(name, *(f"{r[k]:.1f}" for k in ("makespan_min", "avg_queuing_min", "avg_jct_min",
                                                       "p95_jct_min")), f"{r['preemptions']:.0f}")
    console.print(table)
    g = result["fifo_consistent_region"]
    console.print(f"{g['fifo_consistent_points']} of {g['grid_points']} grid points have all four FIFO figures within "
                  f"{g['tolerance']:.0%} of Salus's.")
    if g["fifo_consistent_points"]:
        s, f = g["srtf_over_fifo"], g["fair_position"]
        console.print(f"There: SRTF/FIFO avg JCT {s['min']:.2f}-{s['max']:.2f} (<= 1/3 at {s['share_holding']:.0%}); "
                      f"FAIR's position from SRTF to FIFO {f['min']:.2f}-{f['max']:.2f} (between at "
                      f"{f['share_holding']:.0%}); PACK best makespan at {g['pack_best_share']:.0%}")
    for r in result.get("random_order_queuing", []):
        console.print(f"random order, mean inter-arrival {r['mean_interarrival_s']:g} s: FIFO queuing/makespan "
                      f"{r['mean']:.3f} (sd {r['std']:.3f}, max {r['max']:.3f}) over {r['traces']} traces, "
                      f"{r['share_reaching_salus']:.1%} reach Salus's {r['salus']:.3f}")


def _print_calibration(console, result: dict) -> None:
    b = result["best"]
    console.print(f"[bold]Arrival process fitted to Salus's FIFO row[/bold] on {result['devices']} device(s), "
                  f"seeds {result['seeds'][0]}-{result['seeds'][-1]}, {result['wall_s']:.0f} s")
    console.print(f"objective: {result['objective']}")
    table = Table()
    for col in ("stage", "not_short", "order corr.", "interarrival s", "makespan", "avg queuing", "avg JCT",
                "95% JCT", "worst error"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    search = result["search"]
    fine = search.get("fine", [])
    stages = [("coarse", search["coarse"])] + ([(f"fine {len(fine)}", fine[-1])] if fine else [])
    for stage, found in stages:
        for r in found["best"][:5]:
            table.add_row(f"{stage} ({found['points']} points)", f"{r['not_short']:g}", f"{r['order_correlation']:g}",
                          f"{r['mean_interarrival_s']:g}",
                          *(f"{r['fifo'][k]:.1f} ({r['errors'][k]:+.1%})" for k in
                            ("makespan_min", "avg_queuing_min", "avg_jct_min", "p95_jct_min")),
                          f"{r['score'][0]:.1%}")
    console.print(table)
    if fine:
        console.print(f"{len(fine)} fine grid(s), each centred on the best point so far, until the best was the centre")
    t = result["targets"]
    console.print(f"Salus FIFO: makespan {t['makespan_min']}, avg queuing {t['avg_queuing_min']}, avg JCT "
                  f"{t['avg_jct_min']}, 95% JCT {t['p95_jct_min']} min")
    console.print(f"best: not_short {b['not_short']:g} (mix {'/'.join(f'{x:.3g}' for x in b['length_mix'])}), "
                  f"order_correlation {b['order_correlation']:g}, mean inter-arrival {b['mean_interarrival_s']:g} s")
    h = b["held_out"]
    if h:
        console.print("held-out seeds " + f"{h['seeds'][0]}-{h['seeds'][-1]}: " + ", ".join(
            f"{k.removesuffix('_min')} {h['fifo'][k]:.1f} ({h['errors'][k]:+.1%})" for k in h["fifo"]))
    ratio = result["random_order_max_queuing_over_makespan"]
    if ratio is not None:
        console.print(f"avg queuing / makespan: Salus {result['salus_queuing_over_makespan']:.3f}; at most "
                      f"{ratio:.3f} over the grid's random-order points")


def _print_serving(console, result: dict) -> None:
    cfg = result["config"]
    console.print(f"[bold]Many-model serving, simulated[/bold]: {cfg['models']} models (Zipf {cfg['zipf_s']:g}), "
                  f"{cfg['requests']:,} requests at {cfg['rate_per_s']:.2f}/s, memory for {cfg['fit_models']} models "
                  f"({cfg['capacity_bytes'] / 1e9:.2f} GB; LRU-by-count holds {cfg['lru_count_models']}), "
                  f"order {cfg['policy']}, batches up to {cfg['max_batch']}; costs: {cfg['costs']}")
    table = Table()
    for col in ("mode", "p50 ms", "p95 ms", "p99 ms", "SLO met", "loads", "evictions", "utilization", "sim s"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for mode, r in result["results"].items():
        i = r["inference"]
        slo = i["slo_attainment"]
        table.add_row(mode, f"{i['p50_ms']:.1f}", f"{i['p95_ms']:.1f}", f"{i['p99_ms']:.1f}",
                      "-" if slo is None else f"{slo:.1%}", f"{r['loads']:,}", f"{r['evictions']:,}",
                      f"{r['utilization']:.2f}", f"{r['wall_s']:.1f}")
    console.print(table)


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

