"""``timeshare bench overhead``: what the runtime costs around a call when nothing
switches, against plain PyTorch driven the same way; its options and tables. Part of the
CLI layer; runs in the CLI's process.
"""

from __future__ import annotations

from rich.table import Table

from timeshare.cli.options import arena_option, json_option

NAMES = ("overhead",)


def add_parsers(bench) -> None:
    p = bench.add_parser("overhead", help="the runtime's own cost per call, against plain PyTorch driven the same way",
                         description="No switch: a tiny model resident. One caller in-process and through worker "
                         "processes; 1, 4 and 16 threads over 8 and 42 models against plain PyTorch behind one "
                         "lock; the round trip of a 4.8 MB and an 8.6 MB input against one copy of its bytes; PACK "
                         "against FIFO with one client per model.")
    p.add_argument("--model", default="tiny_mlp")
    p.add_argument("--device", default="auto")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15, help="single caller: alternating rounds (median)")
    p.add_argument("--calls", type=int, default=200, help="single caller: calls per round and way")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--model-counts", type=int, nargs="+", default=[8, 42])
    p.add_argument("--duration", type=float, default=1.5, help="seconds per threads or pack measurement")
    p.add_argument("--transfer-repeats", type=int, default=20)
    arena_option(p, "1GiB")
    p.add_argument("--parts", nargs="+", default=["single", "threads", "transfer", "pack"],
                   choices=["single", "threads", "transfer", "pack"])
    json_option(p)


def run(args, console, run_bench) -> int:
    if args.bench == "overhead":
        from timeshare.bench.overhead import OverheadBenchConfig
        from timeshare.bench.overhead import run as run_overhead

        overhead = OverheadBenchConfig(device=args.device, model=args.model, workers=args.workers, rounds=args.rounds,
                                       calls=args.calls, threads=tuple(args.threads),
                                       model_counts=tuple(args.model_counts), duration_s=args.duration,
                                       transfer_repeats=args.transfer_repeats, memory=args.memory,
                                       parts=tuple(args.parts))
        return run_bench(run_overhead, overhead, lambda r: _print_overhead(console, r), args.json)
    return 2


def _print_overhead(console, r: dict) -> None:
    def us(x: float) -> str:
        return f"{x:,.1f}"

    s = r.get("single")
    if s is not None:
        table = Table(title=f"bench overhead: one caller, {s['model']} resident (us per call, median of rounds)")
        for col in ("plain PyTorch", "in-process", "workers", "in-process - plain", "workers - in-process", "exact"):
            table.add_column(col, justify="right")
        u = s["us_per_call"]
        table.add_row(us(u["plain_pytorch"]), us(u["in_process"]), us(u["workers"]),
                      us(s["in_process_over_plain_us"]), us(s["workers_over_in_process_us"]), str(s["outputs_exact"]))
        console.print(table)
    for block in r.get("threads") or []:
        table = Table(title=f"bench overhead: threads over {block['models']} resident models")
        for col in ("threads", "req/s", "plain req/s (one lock)", "vs plain", "plain, fair lock", "vs fair",
                    "CPU us/req", "plain CPU us/req", "fair CPU us/req", "CPU vs one thread"):
            table.add_column(col, justify="right")
        for row in block["rows"]:
            ours, base, fair = row["timeshare"], row["plain_pytorch"], row["plain_pytorch_fair"]
            growth = row["cpu_per_request_vs_one_thread"]
            table.add_row(str(row["threads"]), f"{ours['req_per_s']:,.0f}", f"{base['req_per_s']:,.0f}",
                          f"{row['req_per_s_vs_plain']:.2f}x", f"{fair['req_per_s']:,.0f}",
                          f"{row['req_per_s_vs_plain_fair']:.2f}x", us(ours["cpu_us_per_request"]),
                          us(base["cpu_us_per_request"]), us(fair["cpu_us_per_request"]),
                          "-" if growth is None else f"{growth:.2f}x")
        console.print(table)
    t = r.get("transfer")
    if t is not None:
        table = Table(title="bench overhead: large inputs (ms, median)")
        for col in ("head", "input", "memcpy (floor)", "plain PyTorch", "in-process", "workers",
                    "in-process - plain", "workers - in-process", "exact"):
            table.add_column(col, justify="right")
        for row in t["rows"]:
            m = row["ms"]
            table.add_row(row["head"], row["input"], f"{m['memcpy']:.2f}", f"{m['plain_pytorch']:.2f}",
                          f"{m['in_process']:.2f}", f"{m['workers']:.2f}", f"{row['in_process_over_plain_ms']:.2f}",
                          f"{row['workers_over_in_process_ms']:.2f}", str(row["outputs_exact"]))
        console.print(table)
    p = r.get("pack")
    if p is not None:
        table = Table(title=f"bench overhead: one client per model over {p['models']} models")
        for col in ("mode", "req/s", "least client / mean", "most client / mean"):
            table.add_column(col, justify="right")
        for mode in ("fifo", "pack"):
            m = p[mode]
            table.add_row(mode, f"{m['req_per_s']:,.0f}", f"{m['min_share_of_mean']:.2f}",
                          f"{m['max_share_of_mean']:.2f}")
        table.add_row("plain PyTorch (no lock)", f"{p['plain_pytorch_threads']['req_per_s']:,.0f}", "", "")
        console.print(table)
        console.print(f"PACK over FIFO: {p['pack_over_fifo']:.2f}x")
