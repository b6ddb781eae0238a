"""The campaign summary's readers and tables for the steps beyond first inference: language
models (``bench llm``), many small models and training side by side (``bench lanes``), a
resident model through a worker (``bench switch``'s ready beside plain PyTorch), variants
held once (``bench variants``) and cold loads from disk (``bench disk``).

Each reader takes one step's JSON and returns the rows it contributes, built whole before
they are returned: ``campaign_summary.summarize`` calls it, and a file that lacks a key the
reader needs is reported there as not summarized, never half-added. Each table turns those
rows into Markdown lines. Pure reading of files; it runs in the CLI's process on any machine.
"""

from __future__ import annotations


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def fmt(v: object, digits: int = 2) -> str:
    """A number for a table cell; '-' for a value the step did not record (and anything else
    a file holds there, shown as it is rather than failing the summary)."""
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if _number(v) else str(v)


def count(v: object) -> str:
    """A rate in whole units with thousands separators ('1,234'); '-' where not recorded."""
    return f"{v:,.0f}" if _number(v) else fmt(v)


def times(v: object, digits: int = 2) -> str:
    """A ratio for a table cell ('1.23x'); '-' where the step did not record it."""
    return f"{v:.{digits}f}x" if _number(v) else fmt(v)


def yes_no(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# ---------------------------------------------------------------------- readers
def llm_rows(step: str, r: dict) -> list[dict]:
    """``bench llm``: the wake (time to first token, model resident vs copied in) and the
    decode (tokens/s against transformers), whichever parts the run had: a row for each
    mode it ran in (``in-process``, ``workers``), or one for a run from before the modes."""
    if "modes" in r:
        return [row for mode, x in r["modes"].items() for row in _llm_rows(f"{step} ({mode})", r, x)]
    return _llm_rows(step, r, r)


def _llm_rows(step: str, r: dict, parts: dict) -> list[dict]:
    wake, decode = parts.get("wake"), parts.get("decode")
    if wake is None and decode is None:
        return []
    cfg = r.get("config") or {}
    models = r.get("models") or [{}]
    row: dict = {"step": step, "model": f"{cfg.get('arch', '?')} {cfg.get('size', '?')} {cfg.get('dtype', '?')}",
                 "parameters": models[0].get("parameters"), "wake": None, "decode": None}
    if wake is not None:
        row["wake"] = {
            "GB": wake["bytes"] / 1e9, "link_GBps": wake.get("link_GBps"), "copy_ms": _ms(wake.get("copy_s")),
            "warm_ttft_ms": wake["warm_ttft_s"] * 1e3, "cold_ttft_ms": wake["cold_ttft_s"] * 1e3,
            "floor_ms": _ms(wake.get("floor_s")), "cold_over_floor": wake.get("cold_over_floor"),
            "cold_over_warm_plus_copy": wake.get("cold_over_warm_plus_copy"),
            "load_then_generate_ms": _ms(wake.get("load_then_generate_s")),
            "speedup_vs_load_then_generate": wake.get("speedup_vs_load_then_generate"),
            "cold_tokens_exact": wake.get("cold_tokens_exact"), "cold_runs": wake.get("cold_runs"),
        }
    if decode is not None:
        row["decode"] = {"tokens": decode.get("tokens"), "rows": _decode_rows(decode)}
    return [row]


def _decode_rows(decode: dict) -> list[dict]:
    """One row per count of sequences decoded together: ``rows`` as bench llm writes them
    since it decodes at several counts, or the one sequence (and the ours-only batched
    figure) of a run before that."""
    if "rows" in decode:
        return [{"sequences": x["sequences"], "ours": x["ours_tokens_per_s"], "plain": x.get("plain_tokens_per_s"),
                 "ratio": x.get("ours_over_plain"), "exact": x.get("tokens_exact"),
                 "compared": x.get("sequences_compared")} for x in decode["rows"]]
    rows = [{"sequences": 1, "ours": decode["ours_tokens_per_s"], "plain": decode.get("plain_tokens_per_s"),
             "ratio": decode.get("ours_over_plain"), "exact": None, "compared": None}]
    if decode.get("ours_batched_tokens_per_s") is not None:
        rows.append({"sequences": decode.get("concurrent"), "ours": decode["ours_batched_tokens_per_s"],
                     "plain": None, "ratio": None, "exact": None, "compared": None})
    return rows


def lanes_rows(step: str, r: dict) -> list[dict]:
    """``bench lanes``' serving rows: N copies of a small model under FIFO and PACK."""
    return [{"step": step, "models": x["models"], "fifo_req_per_s": x["fifo"]["req_per_s"],
             "pack_req_per_s": x["pack"]["req_per_s"], "plain_req_per_s": x["plain_pytorch_req_per_s"],
             "fifo_vs_plain": x["fifo"]["req_per_s"] / x["plain_pytorch_req_per_s"],
             "pack_over_fifo": x["pack_over_fifo"],
             "fifo_added_ms": x["fifo"].get("added_latency_ms"), "pack_added_ms": x["pack"].get("added_latency_ms"),
             "exact": x["fifo"].get("outputs_exact", False) and x["pack"].get("outputs_exact", False)}
            for x in r.get("rows") or []]


def lanes_training_rows(step: str, r: dict) -> list[dict]:
    """``bench lanes``' training row: two jobs packed against FIFO, and whether each ended
    with the weights of the job alone. Older runs recorded ``weights_exact`` per mode and
    did not run the job alone twice; newer ones say whether alone repeats at all."""
    t = r.get("training")
    if not t:
        return []
    fifo, pack = t["fifo"], t["pack"]
    return [{"step": step, "workload": t.get("workload"), "iterations": t.get("iterations"),
             "workers": t.get("workers"), "fifo_it_per_s": fifo["it_per_s"], "pack_it_per_s": pack["it_per_s"],
             "fifo_makespan_s": fifo.get("makespan_s"), "pack_makespan_s": pack.get("makespan_s"),
             "pack_over_fifo": t.get("pack_over_fifo", pack["it_per_s"] / fifo["it_per_s"]),
             "deterministic": t.get("deterministic"), "alone_repeatable": t.get("alone_repeatable"),
             "fifo_as_alone": t.get("time_sliced_equals_alone", fifo.get("weights_exact")),
             "pack_as_alone": t.get("packed_equals_alone", pack.get("weights_exact"))}]


def ready_rows(step: str, r: dict) -> list[dict]:
    """A resident model through a worker (``bench switch``'s ready) against plain PyTorch in
    the bench's own process, where the run measured both."""
    return [{"step": step, "model": x["model"], "dtype": (r.get("config") or {}).get("dtype"),
             "native_ms": x["native_ms"], "ready_ms": x["ready_ms"], "ready_vs_native": x["ready_ms"] / x["native_ms"],
             "worker_overhead_ms": x["ready_ms"] - x["native_ms"], "exact": x["outputs_match_ready"]}
            for x in r.get("results") or [] if x.get("native_ms") is not None]


def variants_rows(step: str, r: dict) -> list[dict]:
    """``bench variants``: fine-tuned variants of one model held once; a switch between two
    of them against a full load of one."""
    b, sw, full = r["bytes"], r["switch"], r["full_load"]
    plain = r.get("plain_pytorch") or {}
    return [{"step": step, "variants": (r.get("config") or {}).get("variants"), "one_model_MB": b["one_model"] / 1e6,
             "device_all_MB": b["device_all_resident"] / 1e6, "device_of_one": b.get("device_of_one"),
             "ready_ms": _ms(r.get("ready_s")), "switch_ms": sw["first_inference_s"] * 1e3,
             "switch_overhead_ms": _ms(sw.get("overhead_s")), "full_load_ms": full["first_inference_s"] * 1e3,
             "full_load_overhead_ms": _ms(full.get("overhead_s")), "plain_load_ms": _ms(plain.get("first_inference_s")),
             "switch_speedup": r.get("switch_speedup_vs_full_load"),
             "overhead_ratio": r.get("switch_overhead_ratio_vs_full_load"),
             "moved_MB": sw["moved_bytes"] / 1e6, "full_moved_MB": full["moved_bytes"] / 1e6,
             "moved_ratio": r.get("moved_ratio_vs_full_load"),
             "outputs_exact": r.get("outputs_exact"), "outputs": r.get("outputs")}]


def disk_rows(step: str, r: dict) -> list[dict]:
    """``bench disk``: the first inference of a model whose weights are only on disk."""
    return [{"step": step, "model": x["model"], "MB": x["bytes"] / 1e6, "sequential_GBps": x["sequential_read_GBps"],
             "reader_GBps": x.get("reader_GBps"), "direct_reader_GBps": x.get("direct_reader_GBps"),
             "plain_s": x["baseline_first_inference_s"], "cold_s": x["cold_first_inference_s"],
             "speedup": x["speedup_vs_baseline"], "disk_stage_GBps": x.get("disk_stage_GBps"),
             "disk_stage_of_sequential": x.get("disk_stage_of_sequential"), "floor_s": x.get("floor_s"),
             "over_floor": x.get("over_floor"), "ready_s": x.get("ready_inference_s"), "exact": x.get("bitwise_equal")}
            for x in r["rows"]]


# ---------------------------------------------------------------------- tables
def llm_table(rows: list[dict]) -> list[str]:
    lines = ["", "## A language model: wake and decode (bench llm)"]
    wakes = [r for r in rows if r["wake"]]
    if wakes:
        lines += ["", "Time to first token (ms, median) with the model resident (warm) and with its weights copied "
                  "in from pinned host memory first (cold); the floor is the copy at the link's speed, or warm if "
                  "longer.", "",
                  "| step | model | GB | link GB/s | copy | TTFT warm | TTFT cold | floor | cold / floor | "
                  "cold / (warm + copy) | load-then-generate | speed-up | cold tokens exact |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in wakes:
            w = r["wake"]
            exact = "-" if w["cold_tokens_exact"] is None else f"{w['cold_tokens_exact']}/{w['cold_runs']}"
            lines.append(f"| {r['step']} | {r['model']} | {fmt(w['GB'], 2)} | {fmt(w['link_GBps'], 1)} | "
                         f"{fmt(w['copy_ms'], 1)} | {fmt(w['warm_ttft_ms'], 1)} | {fmt(w['cold_ttft_ms'], 1)} | "
                         f"{fmt(w['floor_ms'], 1)} | {times(w['cold_over_floor'])} | "
                         f"{times(w['cold_over_warm_plus_copy'])} | {fmt(w['load_then_generate_ms'], 1)} | "
                         f"{times(w['speedup_vs_load_then_generate'], 1)} | {exact} |")
    decodes = [r for r in rows if r["decode"]]
    if decodes:
        lines += ["", "Decode, model resident (tokens/s, all sequences together; exact: sequences whose greedy "
                  "tokens equal transformers' on the same batch):", "",
                  "| step | model | tokens | sequences | timeshare | transformers | timeshare / transformers | exact |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in decodes:
            for d in r["decode"]["rows"]:
                exact = "-" if d["exact"] is None else f"{d['exact']}/{d['compared']}"
                lines.append(f"| {r['step']} | {r['model']} | {r['decode']['tokens'] or '-'} | {d['sequences']} | "
                             f"{fmt(d['ours'], 1)} | {fmt(d['plain'], 1)} | {times(d['ratio'])} | {exact} |")
    return lines


def lanes_table(rows: list[dict], training: list[dict]) -> list[str]:
    lines = ["", "## Many small models, and two training jobs (bench lanes)"]
    if rows:
        lines += ["", "| step | models | plain req/s | FIFO req/s | PACK req/s | FIFO/plain | PACK/FIFO | "
                  "added ms FIFO / PACK | exact |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['step']} | {r['models']} | {count(r['plain_req_per_s'])} | "
                         f"{count(r['fifo_req_per_s'])} | {count(r['pack_req_per_s'])} | {fmt(r['fifo_vs_plain'])} | "
                         f"{fmt(r['pack_over_fifo'])} | {fmt(r['fifo_added_ms'], 1)} / {fmt(r['pack_added_ms'], 1)} | "
                         f"{yes_no(r['exact'])} |")
    if training:
        lines += ["", "| step | jobs | FIFO it/s | PACK it/s | PACK/FIFO | deterministic kernels | alone repeats | "
                  "weights as alone, FIFO / PACK |", "|---|---|---|---|---|---|---|---|"]
        for t in training:
            lines.append(f"| {t['step']} | 2 x {t['workload']} x {t['iterations']} | {fmt(t['fifo_it_per_s'], 1)} | "
                         f"{fmt(t['pack_it_per_s'], 1)} | {fmt(t['pack_over_fifo'])} | {yes_no(t['deterministic'])} | "
                         f"{yes_no(t['alone_repeatable'])} | {yes_no(t['fifo_as_alone'])} / "
                         f"{yes_no(t['pack_as_alone'])} |")
    return lines


def ready_table(rows: list[dict]) -> list[str]:
    lines = ["", "## A resident model through a worker (ms, median)", "",
             "| step | model | dtype | plain PyTorch | ready (worker) | worker overhead | ready/plain | exact |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['model']} | {r['dtype'] or '-'} | {fmt(r['native_ms'])} | "
                     f"{fmt(r['ready_ms'])} | {fmt(r['worker_overhead_ms'])} | {fmt(r['ready_vs_native'])} | "
                     f"{yes_no(r['exact'])} |")
    return lines


def variants_table(rows: list[dict]) -> list[str]:
    lines = ["", "## Variants of one model held once (bench variants, first inference in ms)", "",
             "| step | variants | one model MB | all on the device MB (of one) | ready | switch (overhead) | "
             "full load (overhead) | plain PyTorch load | switch vs full load | MB moved, switch / full | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        exact = "-" if r["outputs_exact"] is None else f"{r['outputs_exact']}/{r['outputs']}"
        lines.append(f"| {r['step']} | {r['variants'] or '-'} | {fmt(r['one_model_MB'], 0)} | "
                     f"{fmt(r['device_all_MB'], 0)} ({times(r['device_of_one'], 3)}) | {fmt(r['ready_ms'])} | "
                     f"{fmt(r['switch_ms'])} ({fmt(r['switch_overhead_ms'])}) | {fmt(r['full_load_ms'])} "
                     f"({fmt(r['full_load_overhead_ms'])}) | {fmt(r['plain_load_ms'], 1)} | "
                     f"{times(r['switch_speedup'])} faster, overhead {times(r['overhead_ratio'], 1)} smaller | "
                     f"{fmt(r['moved_MB'], 1)} / {fmt(r['full_moved_MB'], 0)} ({times(r['moved_ratio'], 0)} fewer) | "
                     f"{exact} |")
    return lines


def disk_table(rows: list[dict]) -> list[str]:
    lines = ["", "## Cold first inference from disk (bench disk, seconds, median)", "",
             "| step | model | MB | disk sequential GB/s | our reader GB/s, buffered / O_DIRECT | plain PyTorch | "
             "timeshare cold | speed-up | disk stage GB/s (of sequential) | floor | cold / floor | ready | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = r["disk_stage_of_sequential"]
        of_seq = f"{share * 100:.0f}%" if _number(share) else fmt(share)
        lines.append(f"| {r['step']} | {r['model']} | {fmt(r['MB'], 0)} | {fmt(r['sequential_GBps'], 2)} | "
                     f"{fmt(r['reader_GBps'])} / {fmt(r['direct_reader_GBps'])} | {fmt(r['plain_s'], 3)} | "
                     f"{fmt(r['cold_s'], 3)} | {fmt(r['speedup'], 2)}x | {fmt(r['disk_stage_GBps'])} ({of_seq}) | "
                     f"{fmt(r['floor_s'], 3)} | {times(r['over_floor'])} | {fmt(r['ready_s'], 3)} | "
                     f"{yes_no(r['exact'])} |")
    return lines
