"""``timeshare bench serve``, ``chaos`` and ``hostile``: the server under load, under
faults and against hostile clients, through HTTP; their options and tables. Part of the
CLI layer; runs in the CLI's process.

    timeshare bench serve [--models ...] [--clients 16] [--requests 2000] [--json PATH]
    timeshare bench chaos [--duration 300] [--fault-every 5] [--workers 2] [--json PATH]
    timeshare bench hostile [--body-mib 63] [--idle 1000] [--json PATH]
"""

from __future__ import annotations

from rich.table import Table

from timeshare.cli.options import SERVE_MODELS_HELP, json_option, models_option, msec

NAMES = ("serve", "chaos", "hostile")


def add_parsers(bench) -> None:
    p = bench.add_parser(
        "serve", help="load test through HTTP: concurrent clients, several models, a budget that forces switching",
        description="Starts `timeshare serve` with the models and a memory budget that holds about half of "
        "them, sends --requests requests from --clients threads (503s are retried after Retry-After), and "
        "checks every response against the model's reference output computed alone: reports lost, "
        "duplicated and mismatched responses, 5xx, throughput and latency percentiles. The same requests go to a "
        "plain-PyTorch server in turns (first --sequential ones one at a time); each server's own cost per "
        "request is broken down by hop (parse, queue, thread hops, the runtime call, encode). "
        "--memory all: every model resident, no switch.")
    models_option(p, SERVE_MODELS_HELP)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--memory", default=None, help="the budget (default: about half of the models' bytes)")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential", type=int, default=200,
                   help="first, this many requests one at a time to each server (0: none)")
    p.add_argument("--rounds", type=int, default=1, help="both passes on both servers this often (medians)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false",
                   help="skip the plain-PyTorch server (same requests, every model resident, one lock)")
    json_option(p)

    from timeshare.bench.chaos import FAULTS

    p = bench.add_parser(
        "chaos", help="faults under load: workers killed or stopped while clients' replies are checked",
        description="Starts `timeshare serve` with worker processes, a training job and a budget that forces "
        "loads; clients send requests for --duration seconds, each reply checked against its own request's "
        "reference, while every --fault-every seconds a worker is killed (computing or loading, training, "
        "idle, or still starting) or stopped and resumed. Reports wrong answers (must be 0), failures by "
        "status and whether a fault explains each, time to heal, and what is left after shutdown.")
    models_option(p, SERVE_MODELS_HELP)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of faults and requests")
    p.add_argument("--fault-every", type=float, default=5.0, help="seconds between faults (jittered +-30%%)")
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS, help="kinds of fault, taken in turn")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--training", default="tiny_cnn:8", help="MODEL:BATCH of the training job ('none': no job)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--memory", default=None, help="the budget (default: about half of the models' bytes)")
    p.add_argument("--seed", type=int, default=0)
    json_option(p)

    p = bench.add_parser(
        "hostile", help="hostile clients: a large JSON body, idle connections, a huge header, a foreign web page",
        description="Starts `timeshare serve` and measures, as a client would: the longest a small request waits "
        "while a large JSON body is parsed (and the same with bodies parsed on the event loop, the baseline), "
        "how many idle connections the header timeout closes, the answer to an oversized header, and whether "
        "cross-site and DNS-rebinding requests to the admin plane are refused.")
    p.add_argument("--model", default="tiny_mlp", help="a zoo model to send the large body to")
    p.add_argument("--body-mib", type=float, default=63.0)
    p.add_argument("--idle", type=int, default=1000, help="idle connections to open")
    p.add_argument("--header-timeout", type=float, default=10.0, help="the server's server.header_timeout_s")
    json_option(p)


def run(args, console, run_bench) -> int:
    if args.bench == "serve":
        from timeshare.bench.serve import ServeBenchConfig
        from timeshare.bench.serve import run as bench_run

        kwargs = {} if args.models is None else {"models": args.models}
        cfg = ServeBenchConfig(clients=args.clients, requests=args.requests, device=args.device, memory=args.memory,
                               workers=args.workers, max_batch=args.max_batch, seed=args.seed,
                               sequential=args.sequential, rounds=args.rounds, baseline=args.baseline, **kwargs)
        return run_bench(bench_run, cfg, lambda r: _print_bench_serve(console, r), args.json)
    if args.bench == "hostile":
        from timeshare.bench.hostile import HostileBenchConfig
        from timeshare.bench.hostile import run as hostile_run

        hcfg = HostileBenchConfig(model=args.model, body_mib=args.body_mib, idle_connections=args.idle,
                                  header_timeout_s=args.header_timeout)
        return run_bench(hostile_run, hcfg, lambda r: _print_bench_hostile(console, r), args.json)
    if args.bench == "chaos":
        from timeshare.bench.chaos import ChaosBenchConfig
        from timeshare.bench.chaos import run as chaos_run

        kwargs = {} if args.models is None else {"models": args.models}
        ccfg = ChaosBenchConfig(clients=args.clients, duration_s=args.duration, fault_every_s=args.fault_every,
                                faults=args.faults, workers=args.workers, device=args.device, memory=args.memory,
                                training=None if args.training.lower() == "none" else args.training,
                                seed=args.seed, **kwargs)
        return run_bench(chaos_run, ccfg, lambda r: _print_bench_chaos(console, r), args.json)
    return 2


def _print_bench_hostile(console, result: dict) -> None:
    ours, base = result["result"]["timeshare"], result["result"]["baseline_parse_on_event_loop"]
    stall, idle = ours["stall"], ours["idle"]
    console.print(f"[bold]bench hostile[/bold]: {stall['body_bytes'] / 1e6:.0f} MB JSON body, "
                  f"{idle['connections']} idle connections")
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for what, value in (
        ("small request, quiet ms", stall["small_request_ms_before"]),
        ("longest small request during the body ms", stall["max_stall_ms"]),
        ("  the same, parsed on the event loop ms", base["stall"]["max_stall_ms"]),
        ("the large request s (status)", f"{stall['big_request_s']} ({stall['status']})"),
        ("idle connections closed", f"{idle['closed']} of {idle['connections']} within {idle['within_s']} s "
                                    f"(last at {idle['last_closed_s']} s)"),
        ("oversized header", ours["large_header"]["status"]),
        ("admin: cross-site / rebinding", f"{ours['admin']['cross_site_status']} / "
                                          f"{ours['admin']['rebinding_status']}"),
    ):
        table.add_row(what, str(value))
    console.print(table)


def _print_bench_chaos(console, result: dict) -> None:
    r, cfg = result["result"], result["config"]
    console.print(f"[bold]bench chaos[/bold]: {r['wall_s']:.0f} s, {cfg['clients']} clients, {cfg['workers']} workers, "
                  f"{r['faults']} faults {r['faults_by_kind']}")
    heal = r["heal_after_last_fault_s"]
    rows = [
        ("requests", r["requests"]), ("answered", r["answered"]), ("wrong answers", r["wrong"]),
        ("failed (by status)", f"{r['failed']} {r['failed_by_status']}"),
        ("failed with no fault under way", r["failed_outside_faults"]),
        ("heal after a fault: p50 / max s", f"{_num(r['heal_s_p50'])} / {_num(r['heal_s_max'])}"),
        ("faults not healed from", r["not_healed"]),
        ("heal after the last fault s", _num(heal)),
        ("slowest request while a worker was stopped s", f"{_num(r['stop_slowest_request_s'])} (call deadline "
                                                          f">= {r['call_deadline_min_s']:g} s)"),
        ("final check wrong / failed", f"{len(r['final_check']['wrong'])} / {len(r['final_check']['failed'])}"),
        ("training restarts", r["training_restarts"]),
        ("server exit code", r["server_exit_code"]),
        ("processes / segments left", f"{r['server_leftover_processes']} / {len(r['shm_segments_left'])}"),
    ]
    table = Table(show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for what, value in rows:
        table.add_row(what, str(value))
    console.print(table)
    for example in r["wrong_examples"] + r["failed_outside_examples"]:
        console.print(f"  {example}")


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _print_bench_serve(console, result: dict) -> None:
    r = result["result"]
    cfg = result["config"]
    console.print(f"[bold]bench serve[/bold]: {r['requests']} requests from {cfg['clients']} clients over "
                  f"{len(cfg['models'])} models, memory {result['server_config']['runtime']['memory']} bytes")
    table = Table()
    for col in ("model", "requests", "answered", "p50 ms", "p99 ms", "loads", "switches"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, m in r["per_model"].items():
        table.add_row(name, str(m["requests"]), str(m["answered"]), msec(m["p50_ms"]), msec(m["p99_ms"]),
                      str(m["loads"]), str(m["switches"]))
    console.print(table)
    console.print(f"throughput {r['throughput_rps']:.1f} req/s, p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
                  f"mean batch {r['mean_batch_rows']:.2f} rows; lost {r['lost']}, duplicated {r['duplicated']}, "
                  f"mismatched {r['mismatched']}, 5xx {r['status_5xx']} (503 retried: {r['status_503_retried']}); "
                  f"server exit {r['server_exit_code']}, leftover processes {r['server_leftover_processes']}")
    passes, comparison = result.get("passes", {}), result.get("comparison", {})
    if not passes:
        return
    table = Table(title="timeshare's server beside a plain-PyTorch one (medians over rounds)")
    for col in ("pass", "server", "clients", "req/s", "p50 ms", "p99 ms", "batch rows", "loads", "mismatched",
                "req/s ratio", "p50 ratio"):
        table.add_column(col, justify="left" if col in ("pass", "server") else "right")
    for name, by_server in passes.items():
        row = comparison.get(name, {})
        for server, results in by_server.items():
            last, med = results[-1], row.get(server, {})
            ratios = ("", "")
            if server == "timeshare" and "throughput_ratio" in row:
                ratios = (f"{row['throughput_ratio']:.2f}", f"{row['p50_ratio']:.2f}" if row["p50_ratio"] else "-")
            clients = 1 if name == "alone" else cfg["clients"]
            table.add_row(name, server, str(clients), f"{med.get('throughput_rps', 0):.1f}", msec(med.get("p50_ms")),
                          msec(med.get("p99_ms")), f"{last['mean_batch_rows']:.2f}", str(last["loads"]),
                          str(last["mismatched"]), *ratios)
    console.print(table)
    hops = Table(title="each server's own time per request, by hop (mean us, last round; NOTE [Request hops])")
    columns = [(name, server) for name, by_server in passes.items() for server in by_server]
    hops.add_column("hop")
    for name, server in columns:
        hops.add_column(f"{server} {name}", justify="right")
    names: list[str] = []
    for name, server in columns:
        names += [h for h in passes[name][server][-1]["hops"].get("us", {}) if h not in names]
    for h in [*names, "total"]:
        cells = []
        for name, server in columns:
            hp = passes[name][server][-1]["hops"]
            value = hp.get("total_us") if h == "total" else hp.get("us", {}).get(h)
            cells.append("-" if value is None else f"{value:.0f}")
        hops.add_row(h, *cells)
    console.print(hops)
