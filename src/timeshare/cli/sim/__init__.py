"""The ``timeshare sim`` commands: argument parsing and printing. Part of the CLI layer;
runs in the CLI's process.

    timeshare sim salus [--seeds 10] [--devices 1] [--out PATH] [--plot PNG] [--calibrate | --explain]
        (its options, run and tables: timeshare.cli.sim.salus)
    timeshare sim serving [--models 50] [--requests N] [--costs B1.json [B8.json [SWITCH.json]]]
    timeshare sim run --trace T.csv --policy srtf [--costs ...|--salus-pool CSV]
    timeshare sim cluster [--devices 1000] [--models 10000] [--requests 10000000] [--margins 4,8,16,32]
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from timeshare.cli.options import json_option, plot_option
from timeshare.cli.show import shower
from timeshare.cli.sim import salus


def add_parser(sub) -> None:
    sim = sub.add_parser("sim",
                         help="trace-driven simulation of the scheduler").add_subparsers(dest="sim", required=True)
    salus.add_parser(sim)

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
    json_option(p, help=None)
    plot_option(p)

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
    json_option(p, help=None)
    plot_option(p)

    p = sim.add_parser("run", help="replay a trace file under one policy")
    p.add_argument("--trace", type=Path, required=True, help="CSV: time,kind,model,work,priority,slo_s")
    p.add_argument("--policy", default="fifo")
    p.add_argument("--slice", type=float, default=None, help="time slice in seconds")
    p.add_argument("--capacity-gb", type=float, default=None, help="device memory for Salus's lanes")
    p.add_argument("--salus-pool", default=None, help="cost model from Salus's job pool CSV")
    p.add_argument("--costs", nargs="+", default=None, help="cost model from bench JSON (as for sim serving)")
    p.add_argument("--cache-fit", type=int, default=None, help="model cache holding this many models (mean size)")
    p.add_argument("--eviction", default="lru")
    json_option(p, help=None)


def run(args, console, write_json) -> int:
    from timeshare.errors import ConfigError
    from timeshare.sim import experiments

    if args.sim == "salus":
        return salus.run(args, console, write_json)
    if args.sim == "serving":
        from timeshare.bench.scheduler import load_costs

        if args.requests < 1 or args.models < 1 or args.fit < 1:
            raise ConfigError("--requests, --models and --fit must be at least 1")
        with console.status(f"simulating {args.requests:,} requests per mode"):
            result = experiments.serving(costs=load_costs(args.costs or ()), models=args.models,
                                         requests=args.requests, rate_per_s=args.rate, zipf_s=args.zipf,
                                         fit_models=args.fit, slo_factor=args.slo_factor, seed=args.seed,
                                         policy=args.policy, max_batch=args.max_batch)
        shower(console, _print_serving, experiments.plot_serving, args.plot)(result)
        write_json(args.json, result)
        return 0
    if args.sim == "cluster":
        return _sim_cluster(args, console, write_json)
    if args.sim == "run":
        result = _sim_run(args)
        console.print_json(data=result)
        write_json(args.json, result)
        return 0
    return 2


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
    shower(console, _print_cluster, fleet.plot, args.plot)(result)
    write_json(args.json, result)
    return 0


def _print_cluster(console, result: dict) -> None:
    cfg = result["config"]
    table = Table(title=f"sim cluster: {cfg['requests']:,} requests, {cfg['models']:,} models, "
                        f"{cfg['devices']:,} devices")
    for col in ("policy", "loads/request", "p50 ms", "p99 ms", "p99.9 ms", "utilisation", "sim s"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in result["rows"] + result["margin_sweep"]:
        name = r["policy"] + (f" (margin {r['replicate_margin']:g})" if r in result["margin_sweep"] else "")
        table.add_row(name, f"{r['loads_per_request']:.4f}", f"{r['latency_p50_s'] * 1e3:.1f}",
                      f"{r['latency_p99_s'] * 1e3:.1f}", f"{r['latency_p999_s'] * 1e3:.1f}", f"{r['utilisation']:.3f}",
                      f"{r['wall_s']:.1f}")
    console.print(table)
    console.print(f"whole run {result['wall_s']:.1f} s")


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


