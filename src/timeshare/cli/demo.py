"""``timeshare demo``: the server on the embedded default config, a mixed workload
through HTTP, a summary and a plot. Runs in the CLI's process.

    timeshare demo [--duration 40] [--out demo-output]
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from timeshare.cli.options import msec


def add_parser(sub) -> None:
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


def run(args, console) -> int:
    from timeshare.config import DEFAULT_CONFIG
    from timeshare.demo import DemoConfig
    from timeshare.demo import run as run_demo

    cfg = DemoConfig(config=args.config or DEFAULT_CONFIG, duration_s=args.duration, load=args.load,
                     phase_s=args.phase, seed=args.seed, out=args.out)
    console.print("[bold]timeshare demo[/bold]: the server on the embedded default config (three zoo models, a "
                  "memory budget that holds two of them, and a training job) with a small language model beside "
                  "them, a workload through HTTP whose popular model changes every phase, and streamed chats "
                  "through the OpenAI-compatible API.")
    with console.status("starting") as status:
        result = run_demo(cfg, progress=status.update)
    _print_demo(console, result["summary"])
    console.print(f"wrote {cfg.out / 'demo.png'} and {cfg.out / 'demo.json'} (server log: {cfg.out / 'server.log'})")
    s = result["summary"]
    return 0 if s["errors"] == 0 and s["server_exit_code"] == 0 and not s["server_leftover_processes"] else 1


def _print_demo(console, s: dict) -> None:
    table = Table(title=f"{s['answered']}/{s['requests']} requests in {s['duration_s']:.0f} s on {s['device']} "
                        f"(offered {s['offered_rate_per_s']:.1f}/s)")
    for col in ("model", "requests", "p50 ms", "p99 ms", "ready ms", "loads", "switches", "switch p50 ms"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, m in s["per_model"].items():
        table.add_row(name, str(m["requests"]), msec(m["p50_ms"]), msec(m["p99_ms"]), msec(s["ready_ms"].get(name)),
                      str(m["loads"]), str(m["switches"]), msec(m["switch_p50_ms"]))
    console.print(table)
    util = s["device_utilization"]
    console.print(
        f"switches: {s['switches']} ({s['switches_from_training']} from the training job), latency of a switched "
        f"call p50 {msec(s['switch_p50_ms'])} ms, p99 {msec(s['switch_p99_ms'])} ms; loads {s['loads']}, evictions "
        f"{s['evictions']:.0f}, training preemptions {s['preemptions']:.0f}, training iterations "
        f"{s['training_iterations']:.0f}")
    if util is not None:
        console.print(f"device busy {s['device_busy_s']:.1f} s of {s['duration_s']:.0f}: utilization {100 * util:.0f}% "
                      f"(inference {100 * s['inference_utilization']:.0f}%, the training job the rest)")
    chat = s.get("chat")
    if chat is not None:
        console.print(f"language model {chat['model']!r} (OpenAI API, streamed chats beside the others): "
                      f"{chat['answered']}/{chat['requests']} answered, time to first token p50 "
                      f"{msec(chat['ttft_p50_ms'])} ms, p99 {msec(chat['ttft_p99_ms'])} ms, {chat['tokens']} tokens; "
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


