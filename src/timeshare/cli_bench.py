"""``timeshare bench disk``, ``tiers`` and ``variants``: the memory hierarchy's benchmarks
(disk to device, many models beyond host memory, variants held once), and ``bench llm``
(language models woken with pipelined loading), and ``bench cluster`` (routing on a local
Ray cluster), their options and their tables. The results go to JSON through the CLI's
common runner."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from timeshare.cli_options import arena_option, device_batch_option, json_option, models_option, plot_option

NAMES = ("disk", "tiers", "variants", "llm", "cluster", "overhead")


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

    p = bench.add_parser("disk", help="cold first inference from disk vs safetensors + load_state_dict",
                         description="The first inference of a model whose weights are only on disk (page cache "
                         "dropped for the file): timeshare streams the file group by group while earlier groups "
                         "are copied and computed, against safetensors load_file + load_state_dict + .to(device) "
                         "then the inference, and against the disk's own sequential read bandwidth measured in "
                         "the same run.")
    models_option(p)
    device_batch_option(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=3, help="cold runs per model (median)")
    arena_option(p, "4GiB")
    p.add_argument("--direct-io", action="store_true", help="the runtime reads with O_DIRECT where it can")
    json_option(p)
    plot_option(p, "write a bar chart as a PNG")

    p = bench.add_parser("tiers", help="many zoo-size models beyond host memory, served from disk, host and device",
                         description="N zoo-size models registered under a host budget of a fraction of their "
                         "bytes, requests with Zipf popularity served one at a time, every output compared with "
                         "plain PyTorch's; latency by where the model was, host and device evictions, against "
                         "plain PyTorch with an LRU of loaded modules in the same memory and the floor.")
    p.add_argument("--models", type=int, default=50)
    p.add_argument("--zoo", nargs="+", default=["resnet152", "inception_v3", "bert_base"],
                   help="zoo models the N models are made from, round robin, each with its own seed")
    p.add_argument("--host-fraction", type=float, default=0.2, help="the host budget, a fraction of all weights")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--device", default="auto")
    arena_option(p, "2GiB")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    json_option(p)

    _add_llm(bench)

    p = bench.add_parser("variants", help="fine-tuned BERT-base variants held once: bytes and switch latency",
                         description="N variants of BERT-base (one seeded base; each its own pooler and "
                         "classifier, and optionally its own last encoder layers) registered with dedup: host and "
                         "device bytes against separate copies, and the first inference after a switch between "
                         "two variants against a full load (timeshare without dedup, plain PyTorch) and the "
                         "floor; every output compared bitwise with plain PyTorch's.")
    p.add_argument("--variants", type=int, default=10)
    p.add_argument("--tuned-layers", type=int, default=0, help="last encoder layers each variant has of its own")
    p.add_argument("--size", choices=["base", "tiny"], default="base",
                   help="tiny: the zoo's 2-layer BERT (a quick check)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10, help="switches timed (median)")
    p.add_argument("--device", default="auto")
    arena_option(p, "2GiB")
    p.add_argument("--host-memory", default=None,
                   help="a host budget (e.g. 600MiB): a switch whose variant's own bytes come from disk is timed too")
    json_option(p)
    plot_option(p, "write the bytes and latencies as a PNG")


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


def _add_llm(bench) -> None:
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
    p.add_argument("--parts", nargs="+", default=["wake", "decode", "prefix", "fleet"],
                   choices=["wake", "decode", "prefix", "fleet"])
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
    if args.bench == "overhead":
        from timeshare.bench.overhead import OverheadBenchConfig
        from timeshare.bench.overhead import run as run_overhead

        overhead = OverheadBenchConfig(device=args.device, model=args.model, workers=args.workers, rounds=args.rounds,
                                       calls=args.calls, threads=tuple(args.threads),
                                       model_counts=tuple(args.model_counts), duration_s=args.duration,
                                       transfer_repeats=args.transfer_repeats, memory=args.memory,
                                       parts=tuple(args.parts))
        return run_bench(run_overhead, overhead, lambda r: _print_overhead(console, r), args.json)
    if args.bench == "cluster":
        from timeshare.bench.cluster import ClusterBenchConfig
        from timeshare.bench.cluster import plot as plot_cluster
        from timeshare.bench.cluster import run as run_cluster

        cluster = ClusterBenchConfig(replicas=args.replicas, models=args.models, requests=args.requests,
                                     clients=args.clients, zipf=args.zipf, memory=args.memory,
                                     policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
                                     drill=not args.no_drill, seed=args.seed)
        return run_bench(run_cluster, cluster, _shower(console, _print_cluster, plot_cluster, args.plot), args.json)
    if args.bench == "llm" and args.peer is not None:
        from timeshare.bench import llm_peer

        peer = llm_peer.PeerBenchConfig(peer=args.peer, python=args.peer_python, runs=args.peer_runs,
                                        repeats=args.peer_repeats,
                                        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                                        workers=args.workers, workdir=args.workdir, seed=args.seed)
        return run_bench(llm_peer.run, peer, _shower(console, _print_peer, llm_peer.plot, args.plot), args.json)
    if args.bench == "llm":
        from timeshare.bench.llm import LLMBenchConfig, parse_counts
        from timeshare.bench.llm import plot as plot_llm
        from timeshare.bench.llm import run as run_llm

        llm = LLMBenchConfig(arch=args.arch, size=args.size, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                             new_tokens=args.new_tokens, concurrent=parse_counts(args.concurrent),
                             repeats=args.repeats, baseline=not args.no_baseline,
                             fleet_models=args.fleet_models, fleet_requests=args.fleet_requests,
                             fleet_rate_per_s=args.fleet_rate, fleet_max_tokens=args.fleet_max_tokens,
                             zipf=args.zipf, device=args.device, seed=args.seed, workdir=args.workdir,
                             parts=tuple(args.parts), workers=args.workers, compile=args.compile,
                             modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
                             system_tokens=args.system_tokens, turn_tokens=args.turn_tokens)
        return run_bench(run_llm, llm, _shower(console, _print_llm, plot_llm, args.plot), args.json)
    if args.bench == "variants":
        from timeshare.bench.variants import VariantsBenchConfig
        from timeshare.bench.variants import plot as plot_variants
        from timeshare.bench.variants import run as run_variants

        variants = VariantsBenchConfig(variants=args.variants, tuned_layers=args.tuned_layers, batch=args.batch,
                                       repeats=args.repeats, device=args.device, memory=args.memory,
                                       size=args.size, host_memory=args.host_memory)

        return run_bench(run_variants, variants, _shower(console, _print_variants, plot_variants, args.plot),
                         args.json)
    if args.bench == "tiers":
        from timeshare.bench.tiers import TiersBenchConfig
        from timeshare.bench.tiers import run as run_tiers

        tiers = TiersBenchConfig(models=args.models, zoo=tuple(args.zoo), host_fraction=args.host_fraction,
                                 requests=args.requests, zipf=args.zipf, batch=args.batch, device=args.device,
                                 memory=args.memory, workers=args.workers, seed=args.seed)
        return run_bench(run_tiers, tiers, lambda r: _print_tiers(console, r), args.json)
    from timeshare.bench.disk import DEFAULT_MODELS, DiskBenchConfig, plot
    from timeshare.bench.disk import run as run_disk

    cfg = DiskBenchConfig(models=tuple(args.models or DEFAULT_MODELS), batch=args.batch, device=args.device,
                          repeats=args.repeats, memory=args.memory, direct_io=args.direct_io)

    return run_bench(run_disk, cfg, _shower(console, _print_disk, plot, args.plot), args.json)


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
        g = x["graphs"]
        extra = g.get("registration_reserved_bytes")
        console.print(f"{mode}: decode graphs: {g['captures']} captured ({g['compiled']} of a compiled step) in "
                      f"{g['capture_s']:.1f} s" + ("" if extra is None else
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


def _shower(console, table, plot, path: Path | None):
    """What a bench shows of its result: ``table(console, result)``, and with ``path`` the
    plot written there."""
    def show(result: dict) -> None:
        table(console, result)
        if path:
            plot(result, path)
            console.print(f"wrote {path}")

    return show


def _print_variants(console, r: dict) -> None:
    from timeshare.units import format_bytes as fb

    b = r["bytes"]
    console.print(f"bench variants: {r['config']['variants']} variants of BERT-{r['config']['size']} "
                  f"({r['config']['tuned']} tuned) on {r['environment']['device']}, batch {r['config']['batch']}")
    console.print(f"bytes: one model {fb(b['one_model'])}, separate copies {fb(b['separate_copies'])}; with dedup "
                  f"host {fb(b['host'])} ({b['host_of_one']:.2f}x one), device with all resident "
                  f"{fb(b['device_all_resident'])} ({b['device_of_one']:.2f}x one)")
    t = Table(title="first inference after a switch (median, seconds)")
    for col in ("", "latency", "overhead over resident", "bytes copied", "floor"):
        t.add_column(col, justify="left" if not col else "right")
    t.add_row("ready (model resident)", f"{r['ready_s']:.4f}", "-", "0", f"{r['ready_s']:.4f}")
    for label, key in (("variant switch (dedup)", "switch"), ("full load (no dedup)", "full_load")):
        x = r[key]
        t.add_row(label, f"{x['first_inference_s']:.4f}", f"{x['overhead_s']:.4f}", fb(x["moved_bytes"]),
                  f"{x['floor_s']:.4f}")
    h = r.get("host_tier")
    if h is not None:
        x = h["switch_from_disk"]
        t.add_row(f"variant switch from disk ({fb(x['read_bytes'])} read)", f"{x['first_inference_s']:.4f}", "-",
                  fb(x["moved_bytes"]), "-")
    t.add_row("plain PyTorch load", f"{r['plain_pytorch']['first_inference_s']:.4f}", "-", fb(b["one_model"]), "-")
    console.print(t)
    if h is not None:
        console.print(f"host budget {fb(h['budget'])}: {fb(h['used'])} used ({fb(h['shared_bytes'])} of shared "
                      f"tensors), {h['drops']} stores dropped, {h['fills']} read back")
    bound = "at least " if r["switch_overhead_within_noise"] else ""
    console.print(f"switch {r['switch_speedup_vs_full_load']:.2f}x faster than a full load; its overhead "
                  f"{bound}{r['switch_overhead_ratio_vs_full_load']:.1f}x smaller (noise "
                  f"{r['switch']['overhead_noise_s'] * 1e3:.1f} ms), {r['moved_ratio_vs_full_load']:.0f}x fewer "
                  f"bytes; outputs exact {r['outputs_exact']}/{r['outputs']}")


def _print_tiers(console, r: dict) -> None:
    from timeshare.units import format_bytes as fb

    console.print(f"bench tiers: {r['config']['models']} models, {fb(r['model_bytes_total'])} of weights, host "
                  f"budget {fb(r['host_budget_bytes'])}, arena {fb(r['arena_bytes'])}; {r['requests']} requests "
                  f"(Zipf {r['config']['zipf']}) over {r['distinct_models_requested']} models")
    console.print(f"registered in {r['register_s']:.1f} s, host memory after registering "
                  f"{fb(r['host_bytes_after_register'])}; each model profiled once in {r['profile_s']:.1f} s "
                  f"(untimed); outputs exact {r['requests_exact']}/{r['requests']}")
    t = Table(title="latency by where the model was")
    for col in ("where", "requests", "p50 s", "p95 s"):
        t.add_column(col, justify="left" if col == "where" else "right")
    for where, v in r["latency"].items():
        t.add_row(where, str(v["n"]), f"{v.get('p50_s', 0):.3f}", f"{v.get('p95_s', 0):.3f}")
    console.print(t)
    h = r["host_tier"]
    console.print(f"host: {h['drops']} drops, {h['fills']} fills ({h['streamed_fills']} streamed), "
                  f"{fb(h['bytes_read'])} read; device: {r['device_loads']} loads, {r['device_evictions']} evictions")
    console.print(f"total: timeshare {r['timeshare_total_s']:.1f} s, plain PyTorch LRU "
                  f"{r['plain_pytorch']['total_s']:.1f} s ({r['plain_pytorch']['misses']} misses), "
                  f"floor {r['floor_total_s']:.1f} s")


def _print_disk(console, result: dict) -> None:
    env = result["environment"]
    t = Table(title=f"bench disk: cold first inference on {env['device']}, batch {result['config']['batch']} "
                    "(seconds; page cache dropped before each cold run)")
    for col in ("model", "MB", "disk seq GB/s", "reader GB/s (direct)", "plain PyTorch", "timeshare cold",
                "speedup", "disk stage GB/s",
                "of seq", "floor", "ready", "exact"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in result["rows"]:
        tag = "" if r.get("direct_reader_was_direct", True) else ", buffered"
        reader = f"{r['reader_GBps']:.2f} ({r['direct_reader_GBps']:.2f}{tag})"
        t.add_row(r["model"], f"{r['bytes'] / 1e6:.0f}", f"{r['sequential_read_GBps']:.2f}", reader,
                  f"{r['baseline_first_inference_s']:.3f}", f"{r['cold_first_inference_s']:.3f}",
                  f"{r['speedup_vs_baseline']:.2f}x", f"{r['disk_stage_GBps']:.2f}",
                  f"{r['disk_stage_of_sequential']:.0%}", f"{r['floor_s']:.3f}", f"{r['ready_inference_s']:.3f}",
                  "yes" if r["bitwise_equal"] else "NO")
    console.print(t)


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
