"""The serving commands of the CLI: argument parsing and printing only. Runs in the CLI's
process.

    timeshare serve [MODEL ...] [--config timeshare.yaml] [--host H] [--port N] [--metrics-port N|none] [--check]
    timeshare demo [--duration 40] [--out demo-output]
    timeshare bench serve [--models ...] [--clients 16] [--requests 2000] [--json PATH]
    timeshare bench chaos [--duration 300] [--fault-every 5] [--workers 2] [--json PATH]
    timeshare bench hostile [--body-mib 63] [--idle 1000] [--json PATH]
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from timeshare.cli_options import SERVE_MODELS_HELP, json_option, models_option
from timeshare.errors import ConfigError


def add_parsers(sub, bench) -> None:
    p = sub.add_parser(
        "serve", help="serve models over HTTP (Open Inference Protocol v2) from a YAML config",
        description="Start the runtime and an HTTP server: the Open Inference Protocol (KServe v2) data plane "
        "on --port, Triton's model repository extension and timeshare's admin plane (loopback only unless a "
        "token is set), Prometheus /metrics on both --port and --metrics-port. Ctrl-C or SIGTERM drains "
        "in-flight requests, then stops every worker process. Without --config: the embedded default.")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="a Hugging Face model directory, a repository id in the local Hugging Face cache "
                   "(org/model; nothing is downloaded) or, with --build and --input, a safetensors file: served "
                   "beside the config's models (without --config, alone)")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="the name each MODEL is served as, in order (default: its directory's name or its id)")
    p.add_argument("--build", default=None, metavar="MODULE:FUNCTION", help="the builder of a weights file MODEL")
    p.add_argument("--input", action="append", default=None, metavar="NAME:DATATYPE:SHAPE",
                   help="an input of a weights file MODEL, e.g. x:FP32:-1,3,32,32 (-1: any size)")
    p.add_argument("--config", type=Path, default=None,
                   help="timeshare.yaml (default: the embedded default, or nothing when MODELs are given)")
    p.add_argument("--host", default=None,
                   help="override server.host (default 127.0.0.1, this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=None, help="override server.http_port")
    p.add_argument("--metrics-port", default=None, help="override server.metrics_port ('none': no metrics port)")
    p.add_argument("--device", default=None, help="override runtime.device")
    p.add_argument("--memory", default=None, help="override runtime.memory, e.g. 4GiB")
    p.add_argument("--workers", type=int, default=None, help="override runtime.workers")
    p.add_argument("--api-key", default=None, help="override server.api_key: /v1 and /v2 (but health) then need "
                   "'Authorization: Bearer KEY' (default: $TIMESHARE_API_KEY, else open)")
    p.add_argument("--check", action="store_true",
                   help="validate the config and print it, then check every model (builder imported, module built, "
                   "weights headers matched against it) and exit: 1 if a model that is not optional fails, each named")
    p.add_argument("--exit-on-error", action="store_true",
                   help="exit with status 1 once start-up ends if a model that is not optional failed for good "
                   "(server.exit_on_error)")
    p.add_argument("--print-default-config", action="store_true", help="print the embedded default config and exit")

    p = sub.add_parser(
        "demo", help="the server on the embedded default, a mixed workload through HTTP, a summary and a plot",
        description="Starts `timeshare serve` on the embedded default (the zoo models and a training job, on "
        "whatever device is present), replays a mixed open-loop workload through HTTP whose popular model "
        "changes every phase, then stops the server with SIGTERM. Prints per-model p50/p99 latency, the "
        "switches and their latency and the device's utilization; writes demo.png (latency over time, "
        "switches marked) and demo.json.")
    p.add_argument("--config", type=Path, default=None, help="a config of zoo models (default: the embedded one)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of workload")
    p.add_argument("--load", type=float, default=0.6, help="offered load as a share of the device's measured pace")
    p.add_argument("--phase", type=float, default=10.0, help="seconds per popularity phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("demo-output"), help="where demo.png and demo.json go")

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


def run(args, console, write_json, run_bench) -> int:
    if args.command == "serve":
        return _serve(args, console)
    if args.command == "demo":
        return _demo(args, console)
    if args.command == "bench" and args.bench == "serve":
        from timeshare.bench.serve import ServeBenchConfig
        from timeshare.bench.serve import run as bench_run

        kwargs = {} if args.models is None else {"models": args.models}
        cfg = ServeBenchConfig(clients=args.clients, requests=args.requests, device=args.device, memory=args.memory,
                               workers=args.workers, max_batch=args.max_batch, seed=args.seed,
                               sequential=args.sequential, rounds=args.rounds, baseline=args.baseline, **kwargs)
        return run_bench(bench_run, cfg, lambda r: _print_bench_serve(console, r), args.json)
    if args.command == "bench" and args.bench == "hostile":
        from timeshare.bench.hostile import HostileBenchConfig
        from timeshare.bench.hostile import run as hostile_run

        hcfg = HostileBenchConfig(model=args.model, body_mib=args.body_mib, idle_connections=args.idle,
                                  header_timeout_s=args.header_timeout)
        return run_bench(hostile_run, hcfg, lambda r: _print_bench_hostile(console, r), args.json)
    if args.command == "bench" and args.bench == "chaos":
        from timeshare.bench.chaos import ChaosBenchConfig
        from timeshare.bench.chaos import run as chaos_run

        kwargs = {} if args.models is None else {"models": args.models}
        ccfg = ChaosBenchConfig(clients=args.clients, duration_s=args.duration, fault_every_s=args.fault_every,
                                faults=args.faults, workers=args.workers, device=args.device, memory=args.memory,
                                training=None if args.training.lower() == "none" else args.training,
                                seed=args.seed, **kwargs)
        return run_bench(chaos_run, ccfg, lambda r: _print_bench_chaos(console, r), args.json)
    return 2


def load_with_overrides(args):
    from timeshare.config import DEFAULT_CONFIG, load_config, parse_config

    given = getattr(args, "models", None) or []
    source = args.config or (None if given else DEFAULT_CONFIG)
    doc = {} if source is None else load_config(source).model_dump()
    doc.setdefault("server", {}), doc.setdefault("runtime", {})
    _add_models(doc, given, args)
    server, runtime = doc["server"], doc["runtime"]
    for key, value in (("host", args.host), ("http_port", args.port), ("api_key", args.api_key)):
        if value is not None:
            server[key] = value
    if args.metrics_port is not None:
        server["metrics_port"] = None if args.metrics_port.lower() == "none" else _int(args.metrics_port)
    for key, value in (("device", args.device), ("memory", args.memory), ("workers", args.workers)):
        if value is not None:
            runtime[key] = value
    return parse_config(doc, f"{source or 'the command line'} with command-line overrides")


def _add_models(doc: dict, given: list[str], args) -> None:
    """The MODEL arguments as ``llms`` or ``models`` entries of the config document."""
    from timeshare.config.sources import section, tensor_spec
    from timeshare.config.workloads import ModelConfig

    names = args.served_model_name or []
    if len(names) > len(given):
        raise ConfigError(f"--served-model-name given {len(names)} times for {len(given)} MODEL arguments")
    inputs = [tensor_spec(t) for t in args.input or []]
    for i, arg in enumerate(given):
        entry = section(arg, name=names[i] if i < len(names) else None, build=args.build, inputs=inputs)
        key = "models" if isinstance(entry, ModelConfig) else "llms"
        doc.setdefault(key, []).append(entry.model_dump(exclude_defaults=True))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--metrics-port must be a port number or 'none', got {text!r}") from None


def _serve(args, console) -> int:
    import yaml

    from timeshare.config import DEFAULT_CONFIG

    if args.print_default_config:
        console.print(DEFAULT_CONFIG.read_text(), markup=False, highlight=False, end="")
        return 0
    config = load_with_overrides(args)
    if args.exit_on_error:
        config = config.model_copy(update={"server": config.server.model_copy(update={"exit_on_error": True})})
    if args.check:
        shown = config.model_dump()
        for section, key in (("server", "api_key"), ("admin", "token")):  # a secret is not printed
            if shown[section].get(key) is not None:
                shown[section][key] = "(set, not shown)"
        console.print(yaml.safe_dump(shown, sort_keys=False), markup=False, highlight=False, end="")
        return _check(config)
    import logging

    logging.getLogger("timeshare").setLevel(logging.INFO)
    from timeshare.server import serve

    s = config.server
    c = config.cluster
    where = config.runtime.device if c is None else (
        f"a cluster of {c.replicas} {config.runtime.device} replicas on Ray "
        f"({'a local one' if c.address is None else c.address})")
    llms = f", {len(config.llms)} language models ({', '.join(m.name for m in config.llms)}; " \
        f"http://{s.host}:{s.http_port}/v1)" if config.llms else ""
    console.print(f"timeshare serve: {len(config.models)} models, {len(config.training)} training jobs{llms} on "
                  f"{where}; http://{s.host}:{s.http_port}/v2"
                  + (f", metrics on :{s.metrics_port}" if s.metrics_port is not None else ""), markup=False)
    return serve(config)


def _check(config) -> int:
    """``--check``'s models (``server/check.py``): one line each on stderr, stdout keeping
    the validated config; status 1 when a model that is not optional failed."""
    from rich.console import Console

    from timeshare.server.check import check_config

    report = check_config(config)
    err = Console(stderr=True, soft_wrap=True, markup=False, highlight=False)
    for c in report.checks:
        verdict = "ok" if c.ok else "FAILED (optional)" if c.optional else "FAILED"
        err.print(f"{verdict}: {c.kind} {c.name!r}: {c.detail if c.ok else c.problem}")
    if report.failed:
        err.print(f"{len(report.failed)} of {len(report.checks)} models cannot serve: "
                  + ", ".join(repr(c.name) for c in report.failed))
        return 1
    return 0


def _demo(args, console) -> int:
    from timeshare.config import DEFAULT_CONFIG
    from timeshare.demo import DemoConfig, run

    cfg = DemoConfig(config=args.config or DEFAULT_CONFIG, duration_s=args.duration, load=args.load,
                     phase_s=args.phase, seed=args.seed, out=args.out)
    console.print("[bold]timeshare demo[/bold]: the server on the embedded default config (three zoo models, a "
                  "memory budget that holds two of them, and a training job) with a small language model beside "
                  "them, a workload through HTTP whose popular model changes every phase, and streamed chats "
                  "through the OpenAI-compatible API.")
    with console.status("starting") as status:
        result = run(cfg, progress=status.update)
    _print_demo(console, result["summary"])
    console.print(f"wrote {cfg.out / 'demo.png'} and {cfg.out / 'demo.json'} (server log: {cfg.out / 'server.log'})")
    s = result["summary"]
    return 0 if s["errors"] == 0 and s["server_exit_code"] == 0 and not s["server_leftover_processes"] else 1


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _print_demo(console, s: dict) -> None:
    table = Table(title=f"{s['answered']}/{s['requests']} requests in {s['duration_s']:.0f} s on {s['device']} "
                        f"(offered {s['offered_rate_per_s']:.1f}/s)")
    for col in ("model", "requests", "p50 ms", "p99 ms", "ready ms", "loads", "switches", "switch p50 ms"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, m in s["per_model"].items():
        table.add_row(name, str(m["requests"]), _ms(m["p50_ms"]), _ms(m["p99_ms"]), _ms(s["ready_ms"].get(name)),
                      str(m["loads"]), str(m["switches"]), _ms(m["switch_p50_ms"]))
    console.print(table)
    util = s["device_utilization"]
    console.print(
        f"switches: {s['switches']} ({s['switches_from_training']} from the training job), latency of a switched "
        f"call p50 {_ms(s['switch_p50_ms'])} ms, p99 {_ms(s['switch_p99_ms'])} ms; loads {s['loads']}, evictions "
        f"{s['evictions']:.0f}, training preemptions {s['preemptions']:.0f}, training iterations "
        f"{s['training_iterations']:.0f}")
    if util is not None:
        console.print(f"device busy {s['device_busy_s']:.1f} s of {s['duration_s']:.0f}: utilization {100 * util:.0f}% "
                      f"(inference {100 * s['inference_utilization']:.0f}%, the training job the rest)")
    chat = s.get("chat")
    if chat is not None:
        console.print(f"language model {chat['model']!r} (OpenAI API, streamed chats beside the others): "
                      f"{chat['answered']}/{chat['requests']} answered, time to first token p50 "
                      f"{_ms(chat['ttft_p50_ms'])} ms, p99 {_ms(chat['ttft_p99_ms'])} ms, {chat['tokens']} tokens; "
                      f"greedy texts equal to transformers' generate: {chat['answered'] - chat['mismatched']}"
                      f"/{chat['answered']}")
    console.print(f"server: ready in {s['startup_s']:.1f} s; stopped by SIGTERM "
                  f"with exit code {s['server_exit_code']}, "
                  f"{s['server_leftover_processes']} processes left; errors: {s['errors']}")
    for line in s.get("server_leftovers", []):
        console.print(f"  left running: {line}", markup=False)
    console.print("ready ms: one request on a resident model with nothing else waiting. A switched call is one whose "
                  "device turn followed another model or the training job: its latency includes the switch (and the "
                  "pipelined load when the model was not resident).")


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
        table.add_row(name, str(m["requests"]), str(m["answered"]), _ms(m["p50_ms"]), _ms(m["p99_ms"]),
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
            table.add_row(name, server, str(clients), f"{med.get('throughput_rps', 0):.1f}", _ms(med.get("p50_ms")),
                          _ms(med.get("p99_ms")), f"{last['mean_batch_rows']:.2f}", str(last["loads"]),
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
