"""``timeshare bench disk``, ``tiers`` and ``variants``: the memory hierarchy's benchmarks
(disk to device, many models beyond host memory, variants held once), their options and
their tables. Part of the CLI layer; runs in the CLI's process.
"""

from __future__ import annotations

from rich.table import Table

from timeshare.cli.options import arena_option, device_batch_option, json_option, models_option, plot_option
from timeshare.cli.show import shower

NAMES = ("disk", "tiers", "variants")


def add_parsers(bench) -> None:
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


def run(args, console, run_bench) -> int:
    if args.bench == "variants":
        from timeshare.bench.variants import VariantsBenchConfig
        from timeshare.bench.variants import plot as plot_variants
        from timeshare.bench.variants import run as run_variants

        variants = VariantsBenchConfig(variants=args.variants, tuned_layers=args.tuned_layers, batch=args.batch,
                                       repeats=args.repeats, device=args.device, memory=args.memory,
                                       size=args.size, host_memory=args.host_memory)

        return run_bench(run_variants, variants, shower(console, _print_variants, plot_variants, args.plot),
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

    return run_bench(run_disk, cfg, shower(console, _print_disk, plot, args.plot), args.json)


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


