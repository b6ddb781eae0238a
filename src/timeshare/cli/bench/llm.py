"""``timeshare bench llm``: language models woken with pipelined loading, decoding,
prefix caching, a fleet, and side by side with a peer server (``--peer vllm``); its
options and tables. Part of the CLI layer; runs in the CLI's process.
"""

from __future__ import annotations

from rich.table import Table

from timeshare.cli.options import json_option, plot_option
from timeshare.cli.show import shower
from timeshare.options import DEFAULT_MAX_LORAS

NAMES = ("llm",)


def add_parsers(bench) -> None:
    p = bench.add_parser("llm", help="language models: cold vs warm time to first token, decode, prefix caching, "
                         "a fleet", description="Model directories written from code (seeded weights). In each "
                         "mode (in-process, and with worker processes): wake: time to first token with the model "
                         "resident and not (loaded pipelined while its prefill runs), against from_pretrained then "
                         "the prefill, and the floor; decode: tokens per second at each count of sequences against "
                         "transformers' generate of a batch as large, and whether the greedy tokens agree; prefix: "
                         "time to first token of a request whose long system prompt is cached against the same "
                         "request computed whole, and decode at a 0%% hit rate with and without prefix caching. "
                         "fleet: N models in room for two, a Zipf-popular stream of streamed completions through "
                         "the OpenAI API, against a reload-on-switch server.")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "mistral", "gpt2"])
    p.add_argument("--size", default="small", choices=["tiny", "small", "1b", "8b"],
                   help="small: 64M to 113M parameters; 1b: about 0.9B (for a GPU); 8b: Llama-3-8B's shape, 8.0B "
                   "in bf16 (16 GB, drawn on the device; wake and decode only); tiny: a quick check")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--concurrent", default="1,4",
                   help="decode: counts of generations decoded together, comma-separated (a row each), e.g. 1,8,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-baseline", action="store_true",
                   help="wake: skip from_pretrained then the prefill (8b skips it anyway: minutes)")
    p.add_argument("--fleet-models", type=int, default=8)
    p.add_argument("--fleet-requests", type=int, default=100)
    p.add_argument("--fleet-rate", type=float, default=0.5, help="requests per second (Poisson)")
    p.add_argument("--fleet-max-tokens", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--parts", nargs="+", default=None,
                   choices=["wake", "decode", "prefix", "structured", "fleet", "adapters"],
                   help="default: all but adapters (which --adapters alone asks for)")
    p.add_argument("--adapters", default=None, metavar="COUNTS",
                   help="adapters: decode of a batch mixing each count of LoRA adapters against the base, cold "
                   "and warm adapters' first tokens against a merged fine-tune's, e.g. 1,8,64 (default 1,8)")
    p.add_argument("--lora-rank", type=int, default=16, help="adapters: their rank, on every projection")
    p.add_argument("--max-loras", type=int, default=DEFAULT_MAX_LORAS,
                   help=f"adapters: slots on the device (default {DEFAULT_MAX_LORAS}, as timeshare serve's); more "
                   "adapters take turns")
    p.add_argument("--modes", default="in-process,workers",
                   help="the deployment modes wake, decode and prefix run in, comma-separated: in-process, workers")
    p.add_argument("--workers", type=int, default=2, help="the worker processes of the workers mode")
    p.add_argument("--system-tokens", type=int, default=1500, help="prefix: the system prompt's tokens")
    p.add_argument("--turn-tokens", type=int, default=16, help="prefix: each request's own turn after it")
    p.add_argument("--workdir", default=None, help="write (and reuse) the model directories here")
    p.add_argument("--compile", default="auto", choices=["auto", "inductor", "off"],
                   help="the decode step its CUDA graphs capture: compiled (auto: inductor on CUDA) or eager")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", default=None, choices=["vllm"],
                   help="instead of the parts: the same model directory served by timeshare (each of --modes) and "
                   "by this peer, alternated, through their OpenAI APIs (first token, decode tokens/s at 1 and 8 "
                   "requests, start-up, memory, greedy text)")
    p.add_argument("--peer-python", default=None,
                   help="--peer: the Python that has the peer installed (default: $TIMESHARE_VLLM_PYTHON, then "
                   ".venv-vllm/bin/python, which `make vllm-venv` builds)")
    p.add_argument("--peer-runs", type=int, default=3,
                   help="--peer: runs, each starting every server afresh (start-up, first tokens, memory)")
    p.add_argument("--peer-repeats", type=int, default=5,
                   help="--peer: rounds in each run, the servers taking turns (the single request, the concurrent "
                   "ones): each round's rates paired with the peer's next to it")
    json_option(p)
    plot_option(p, "write the three parts as a PNG")


def run(args, console, run_bench) -> int:
    if args.bench == "llm" and args.peer is not None:
        from timeshare.bench import llm_peer

        peer = llm_peer.PeerBenchConfig(peer=args.peer, python=args.peer_python, runs=args.peer_runs,
                                        repeats=args.peer_repeats,
                                        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                                        workers=args.workers, workdir=args.workdir, seed=args.seed)
        return run_bench(llm_peer.run, peer, shower(console, _print_peer, llm_peer.plot, args.plot), args.json)
    if args.bench == "llm":
        from timeshare.bench.llm import LLMBenchConfig, parse_counts
        from timeshare.bench.llm import plot as plot_llm
        from timeshare.bench.llm import run as run_llm

        parts = args.parts or (["adapters"] if args.adapters else None)
        more = {} if parts is None else {"parts": tuple(parts)}
        if args.adapters:
            more["adapters"] = parse_counts(args.adapters)
        llm = LLMBenchConfig(arch=args.arch, size=args.size, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                             new_tokens=args.new_tokens, concurrent=parse_counts(args.concurrent),
                             repeats=args.repeats, baseline=not args.no_baseline,
                             fleet_models=args.fleet_models, fleet_requests=args.fleet_requests,
                             fleet_rate_per_s=args.fleet_rate, fleet_max_tokens=args.fleet_max_tokens,
                             zipf=args.zipf, device=args.device, seed=args.seed, workdir=args.workdir,
                             workers=args.workers, compile=args.compile,
                             modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                             system_tokens=args.system_tokens, turn_tokens=args.turn_tokens,
                             lora_rank=args.lora_rank, max_loras=args.max_loras, **more)
        return run_bench(run_llm, llm, shower(console, _print_llm, plot_llm, args.plot), args.json)
    return 2


def _print_peer(console, r: dict) -> None:
    from timeshare.units import format_bytes as fb

    cfg, summary = r["config"], r["summary"]
    servers = [cfg["peer"], *cfg["modes"]]
    table = Table(title=f"bench llm --peer {cfg['peer']}: {r['model']}, medians of {cfg['runs']} runs of "
                        f"{cfg['repeats']} interleaved rounds (range); ratio to the peer: median of the paired ratios")
    table.add_column("")
    for name in servers:
        table.add_column(name if name == cfg["peer"] else f"timeshare {name}", justify="right")
    shown = (("ready (s)", "ready_s", 1.0, "{:.1f}"), ("first token, short (ms)", "ttft_short_s", 1e3, "{:.1f}"),
             ("first token, its first long prompt (ms)", "ttft_long_first_s", 1e3, "{:.0f}"),
             ("first token, new long prompt (ms)", "ttft_long_new_s", 1e3, "{:.0f}"),
             ("first token, cached prefix (ms)", "ttft_prefix_s", 1e3, "{:.1f}"),
             ("decode tokens/s, 1 request", "decode_1_tokens_per_s", 1.0, "{:.0f}"),
             ("end-to-end tokens/s, 1 request", "e2e_1_tokens_per_s", 1.0, "{:.0f}"),
             ("decode tokens/s, 8 requests", "decode_8_tokens_per_s", 1.0, "{:.0f}"),
             ("decode tokens/s, 8, from request times", "e2e_8_decode_tokens_per_s", 1.0, "{:.0f}"),
             ("total tokens/s, 8 requests", "total_8_tokens_per_s", 1.0, "{:.0f}"))
    for label, metric, scale, fmt in shown:
        cells = []
        for name in servers:
            m = summary[name][metric]
            cell = f"{fmt.format(m['median'] * scale)} ({fmt.format(m['min'] * scale)}-{fmt.format(m['max'] * scale)})"
            if name != cfg["peer"]:
                paired = summary[name]["paired"][metric]
                cell += f" {paired['median']:.2f}x ({paired['min']:.2f}-{paired['max']:.2f})"
            cells.append(cell)
        table.add_row(label, *cells)
    table.add_row("memory", *(fb(int(summary[n]["memory_bytes"]["median"])) for n in servers))
    last = r["runs"][-1]
    table.add_row("greedy = transformers'", *(f"{last[n]['greedy_equal_transformers']}/{last[n]['greedy_compared']}"
                                             for n in servers))
    console.print(table)
    console.print("ratios: above 1.00x is timeshare better (tokens/s ours over theirs; times and memory theirs "
                  "over ours)")


def _print_llm(console, r: dict) -> None:
    from timeshare.units import format_bytes as fb

    cfg = r["config"]
    m = r["models"][0]
    console.print(f"bench llm: {cfg['arch']} ({cfg['size']}, {cfg['dtype']}) on {r['environment']['device']}; "
                  f"{m['parameters']:,} parameters, {fb(m['bytes'])} on disk; "
                  f"prompt {cfg['prompt_tokens']} tokens")
    for mode, x in r.get("modes", {}).items():
        if "wake" in x:
            w = x["wake"]
            base = (f"load-then-generate skipped ({w['baseline_skipped']})" if w["load_then_generate_s"] is None
                    else f"load-then-generate {w['load_then_generate_s'] * 1e3:.1f} ms "
                    f"({w['speedup_vs_load_then_generate']:.1f}x slower)")
            console.print(f"{mode}: wake: {fb(w['bytes'])} at {w['link_GBps']:.2f} GB/s (copy "
                          f"{w['copy_s'] * 1e3:.1f} ms); TTFT warm {w['warm_ttft_s'] * 1e3:.1f} ms, cold "
                          f"{w['cold_ttft_s'] * 1e3:.1f} ms ({w['cold_over_warm_plus_copy']:.2f}x warm + copy, "
                          f"{w['cold_over_floor']:.2f}x the floor), {base}; cold tokens exact "
                          f"{w['cold_tokens_exact']}/{w['cold_runs']}")
        if "graphs" in x:
            g = x["graphs"]
            extra = g.get("registration_reserved_bytes")
            console.print(f"{mode}: decode graphs: {g['captures']} captured ({g['compiled']} of a compiled step) "
                          f"in {g['capture_s']:.1f} s" + ("" if extra is None else
                                                          f"; registration reserved {fb(extra)} beside the arena"))
        if "decode" in x:
            t = Table(title=f"{mode}: decode, {x['decode']['tokens']} tokens per sequence, model resident")
            for col in ("sequences", "timeshare tokens/s", "transformers tokens/s", "ratio", "paired ratio",
                        "tokens exact", "same first tokens (transformers' own)"):
                t.add_column(col, justify="right")
            for row in x["decode"]["rows"]:
                t.add_row(str(row["sequences"]), f"{row['ours_tokens_per_s']:.1f}",
                          f"{row['plain_tokens_per_s']:.1f}", f"{row['ours_over_plain']:.2f}x",
                          f"{row['ours_over_plain_paired']:.2f}x",
                          f"{row['tokens_exact']}/{row['sequences_compared']}",
                          f"{row['agreeing_prefix_mean']:.1f} ({row['plain_self_prefix_mean']:.1f})")
            console.print(t)
        if "prefix" in x:
            p = x["prefix"]
            console.print(f"{mode}: prefix: {p['system_tokens']}-token system prompt, TTFT cached "
                          f"{p['ttft_cached_s'] * 1e3:.1f} ms against {p['ttft_uncached_s'] * 1e3:.1f} ms computed "
                          f"({p['cached_over_uncached']:.3f}x), same tokens {p['tokens_equal']}/"
                          f"{p['requests_compared']}, {p['hits']} pages found; decode at a 0% hit rate "
                          f"{p['miss_decode_cached_tokens_per_s']:.1f} tokens/s against "
                          f"{p['miss_decode_plain_tokens_per_s']:.1f} without prefix caching "
                          f"({p['miss_decode_cached_over_plain']:.3f}x, paired)")
        if "structured" in x:
            s = x["structured"]
            mask = "no mask" if s["mask_us_per_token"] is None else f"{s['mask_us_per_token']:.0f} us per token"
            console.print(f"{mode}: structured: {s['sequences']} answers held to JSON schemas decode "
                          f"{s['constrained_tokens_per_s']:.1f} tokens/s against {s['plain_tokens_per_s']:.1f} "
                          f"unconstrained ({s['constrained_over_plain']:.2f}x, paired); the masks take {mask}")
        if "adapters" in x:
            _print_adapters(console, mode, x["adapters"], r.get("adapters_peft", []))
    for row in r.get("decode_modes", []):
        console.print(f"decode at {row['sequences']}: workers {row['workers_tokens_per_s']:.1f} tokens/s, in-process "
                      f"{row['in_process_tokens_per_s']:.1f} ({row['workers_over_in_process']:.2f}x; "
                      f"{row['workers_over_in_process_normalized']:.2f}x each against its own transformers)")
    if "fleet" in r:
        f = r["fleet"]
        t = Table(title=f"fleet: {f['models']} models in {fb(f['budget_bytes'])}, {f['requests']} requests at "
                        f"{f['rate_per_s']:g}/s")
        for col in ("server", "ok", "TTFT p50 (s)", "TTFT p99 (s)", "e2e p99 (s)", "tokens/s", "loads"):
            t.add_column(col, justify="left" if col == "server" else "right")
        for label, key in (("timeshare", "timeshare"), ("reload on switch", "reload_on_switch")):
            x = f[key]
            t.add_row(label, f"{x['ok']}/{x['ok'] + x['failed']}", f"{x['ttft_p50_s']:.3f}", f"{x['ttft_p99_s']:.3f}",
                      f"{x['e2e_p99_s']:.3f}", f"{x['tokens_per_s']:.1f}", str(x["loads"]))
        console.print(t)
        console.print(f"p99 TTFT {f['p99_ttft_speedup']:.1f}x better, p50 {f['p50_ttft_speedup']:.1f}x; greedy texts "
                      f"agree {f['texts_agree']}/{f['texts_compared']}")


def _print_adapters(console, mode: str, a: dict, peft: list[dict]) -> None:
    from timeshare.units import format_bytes as fb

    plain = {row["adapters"]: row["tokens_per_s"] for row in peft}
    t = Table(title=f"{mode}: LoRA adapters of rank {a['rank']}, {a['rows']} rows, {a['slots']} slots")
    for col in ("adapters mixed", "tokens/s", "base tokens/s", "ratio (paired)", "slot loads", "PEFT tokens/s"):
        t.add_column(col, justify="right")
    for row in a["decode"]:
        t.add_row(str(row["adapters"]), f"{row['adapters_tokens_per_s']:.1f}", f"{row['base_tokens_per_s']:.1f}",
                  f"{row['adapters_over_base']:.2f}x", str(row["slot_loads"]),
                  f"{plain[row['adapters']]:.1f}" if row["adapters"] in plain else "")
    console.print(t)
    f = a["first_token"]
    console.print(f"{mode}: first token: base warm {f['base_warm_s'] * 1e3:.1f} ms, adapter on the device "
                  f"{f['adapter_warm_s'] * 1e3:.1f} ms, adapter in host memory {f['adapter_cold_s'] * 1e3:.1f} ms "
                  f"({fb(f['adapter_bytes'])} at {f['link_GBps']:.2f} GB/s: floor {f['floor_s'] * 1e3:.1f} ms, "
                  f"{f['cold_over_floor']:.2f}x; bound {f['cold_bound_s'] * 1e3:.1f} ms); the merged fine-tune not "
                  f"resident {f['merged_cold_s'] * 1e3:.1f} ms ({f['merged_cold_over_adapter_cold']:.1f}x the cold "
                  "adapter)")
