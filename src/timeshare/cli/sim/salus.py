"""``timeshare sim salus``: Salus's Table 1 simulated (every policy on jobs from Salus's job
pool, each figure's spread over seeds beside Salus's), the arrival process fitted to its
FIFO row (``--calibrate``) and the targeted simulations behind docs/table1.md
(``--explain``): the options, the run and the tables. Part of the CLI layer; runs in the
CLI's process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from timeshare.cli.options import plot_option
from timeshare.cli.show import shower


def add_parser(sim) -> None:
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
    plot_option(p, "write a PNG of the table next to Salus's")


def run(args, console, write_json) -> int:
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
    shower(console, _print_salus, table1.plot_salus, args.plot)(result)
    write_json(args.json, result)
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
