"""``timeshare bench cluster``: routing on a local Ray cluster of CPU replicas, and a
replica killed; its options and table. Part of the CLI layer; runs in the CLI's process.
"""

from __future__ import annotations

from rich.table import Table

from timeshare.cli.options import json_option, plot_option
from timeshare.cli.show import shower

NAMES = ("cluster",)


def add_parsers(bench) -> None:
    p = bench.add_parser("cluster", help="routing on a local Ray cluster of CPU replicas, and a replica killed",
                         description="Requests to N models (Zipf popularity) from a few clients, routed over CPU "
                         "replicas on a local Ray cluster by each policy (NOTE [Fleet routing]): loads per request as "
                         "the replicas report them, latency, every output compared with plain PyTorch's; then a "
                         "drill that kills the busiest replica and adds one while requests flow.")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--models", type=int, default=12)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--memory", default="3MiB", help="model memory of each replica")
    p.add_argument("--policies", default="random,ray,timeshare")
    p.add_argument("--no-drill", action="store_true", help="skip the kill-and-add drill")
    p.add_argument("--seed", type=int, default=0)
    json_option(p)
    plot_option(p, "write loads and latency per policy as a PNG")


def run(args, console, run_bench) -> int:
    if args.bench == "cluster":
        from timeshare.bench.cluster import ClusterBenchConfig
        from timeshare.bench.cluster import plot as plot_cluster
        from timeshare.bench.cluster import run as run_cluster

        cluster = ClusterBenchConfig(replicas=args.replicas, models=args.models, requests=args.requests,
                                     clients=args.clients, zipf=args.zipf, memory=args.memory,
                                     policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
                                     drill=not args.no_drill, seed=args.seed)
        return run_bench(run_cluster, cluster, shower(console, _print_cluster, plot_cluster, args.plot), args.json)
    return 2


def _print_cluster(console, r: dict) -> None:
    c = r["config"]
    table = Table(title=f"bench cluster: {c['replicas']} replicas of {c['memory']}, {c['models']} models, "
                        f"{c['requests']} requests (floor {r['floor_loads_per_request']:.3f} loads per request)")
    for col in ("policy", "loads/request", "p50 ms", "p99 ms", "req/s", "lost", "inexact"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    rows = list(r["rows"]) + ([{**r["drill"], "policy": "timeshare, drill"}] if r.get("drill") else [])
    for row in rows:
        table.add_row(row["policy"], f"{row['loads_per_request']:.3f}", f"{row['latency_p50_s'] * 1e3:.1f}",
                      f"{row['latency_p99_s'] * 1e3:.1f}", f"{row['req_per_s']:.0f}", str(row["lost"]),
                      str(row["inexact"]))
    console.print(table)
    d = r.get("drill")
    if d:
        console.print(f"drill: killed {d['killed']}, retried {d['retried']}, added {d['added']} "
                      f"(served {d['added_served']}), lost {d['lost']}")


