"""The ``timeshare sim`` commands and the scheduling benchmarks (``bench colocate``,
``bench scheduler``): argument parsing and printing. Part of the CLI layer.

    timeshare sim salus [--seeds N] [--json PATH] [--plot PNG]
    timeshare sim serving [--models 50] [--requests N] [--costs B1.json [B8.json [SWITCH.json]]]
    timeshare sim run --trace T.csv --policy srtf [--costs ...|--salus-pool CSV]
    timeshare bench colocate [--model tiny_bert] [--train tiny_cnn:32] [--duration 20]
    timeshare bench scheduler [--queued 1000] [--requests 1000000]
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table


def add_sim_parser(sub) -> None:
    sim = sub.add_parser("sim",
                         help="trace-driven simulation of the scheduler").add_subparsers(dest="sim", required=True)
    p = sim.add_parser("salus", help="Salus's Table 1: every policy on 100 jobs from Salus's job pool")
    p.add_argument("--pool", default=None, help="Salus's job pool CSV (default: the copy in timeshare/sim/data)")
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=10, help="traces to run (the table shows the first; ratios over all)")
    p.add_argument("--interarrival", type=float, default=90.0, help="mean seconds between job arrivals (Poisson)")
    p.add_argument("--mix", default="0.85,0.05,0.10", help="shares of 1, 5 and 10-minute jobs")
    p.add_argument("--fair-slice", type=float, default=2.0, help="FAIR's time slice in seconds")
    p.add_argument("--json", type=Path, default=None)
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
        try:
            mix = tuple(float(x) for x in args.mix.split(","))
        except ValueError:
            raise ConfigError(f"--mix must be three comma-separated shares, got {args.mix!r}") from None
        if args.jobs < 1 or args.seeds < 1 or args.interarrival <= 0:
            raise ConfigError("--jobs and --seeds must be at least 1, --interarrival positive")
        with console.status("simulating"):
            result = experiments.salus(pool=args.pool, jobs=args.jobs, seeds=args.seeds, seed=args.seed,
                                       mean_interarrival_s=args.interarrival, length_mix=mix,
                                       fair_quantum_s=args.fair_slice)
        _print_salus(console, result)
        write_json(args.json, result)
        if args.plot:
            experiments.plot_salus(result, args.plot)
            console.print(f"wrote {args.plot}")
        return 0
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
    if args.sim == "run":
        result = _sim_run(args)
        console.print_json(data=result)
        write_json(args.json, result)
        return 0
    return 2


def _sim_run(args) -> dict:
    import numpy as np

    from timeshare.bench.scheduler import load_costs
    from timeshare.errors import ConfigError
    from timeshare.scheduler.core import Scheduler
    from timeshare.sim.cache import ModelCache
    from timeshare.sim.costs import WorkloadCosts
    from timeshare.sim.engine import Simulator
    from timeshare.sim.experiments import find_salus_pool
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
    console.print(f"[bold]Salus Table 1, simulated[/bold]: {cfg['jobs']} jobs from {Path(cfg['pool']).name}, "
                  f"Poisson arrivals every {cfg['mean_interarrival_s']:g} s on average, job mix {cfg['length_mix']} "
                  f"(1/5/10 min), one {cfg['capacity_gb']:g} GB device, seed {cfg['seed']}")
    table = Table()
    for col in ("policy", "makespan", "avg queuing", "avg JCT", "95% JCT", "Salus: makespan", "avg queuing",
                "avg JCT", "95% JCT", "preemptions"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for p, r in result["table"].items():
        s = result["salus_table1"][p]
        table.add_row(p.upper(),
                      *(f"{r[k]:.1f}" for k in ("makespan_min", "avg_queuing_min", "avg_jct_min", "p95_jct_min")),
                      *(f"{s[k]:.1f}" for k in ("makespan_min", "avg_queuing_min", "avg_jct_min", "p95_jct_min")),
                      str(r["preemptions"]))
    console.print(table)
    o = result["over_seeds"]
    console.print(
        f"Minutes. Over {o['srtf_over_fifo_avg_jct']['n']} traces: "
        f"SRTF/FIFO avg JCT {_fmt(o['srtf_over_fifo_avg_jct'])} "
        f"(Salus 0.31); FAIR/FIFO {_fmt(o['fair_over_fifo_avg_jct'])} (Salus 0.57); PACK best makespan in "
        f"{o['pack_best_makespan_share']:.0%} of traces, PACK/FIFO makespan {_fmt(o['pack_over_fifo_makespan'])} "
        "(Salus 0.95). Salus ran 2 P100s; its arrival process is unpublished."
    )


def _fmt(s: dict) -> str:
    return f"{s['mean']:.2f} (range {s['min']:.2f}-{s['max']:.2f})"


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

