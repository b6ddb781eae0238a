"""The operator's commands of the CLI: what a running server holds (``timeshare ps``, as
``ollama ps``), and the model zoo or a config's models (``timeshare models``). Argument
parsing and printing only. Runs in the CLI's process.

    timeshare ps [--url http://127.0.0.1:8000] [--token T] [--json]
    timeshare models [--config timeshare.yaml] [--generate]
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from timeshare.errors import ConfigError

NAMES = ("ps", "models", "zoo")


def add_parsers(sub) -> None:
    p = sub.add_parser("ps", help="what a running server holds: each model's state, device bytes, last use, queue",
                       description="Asks a running `timeshare serve` (its admin plane, /admin/ps) what it serves: "
                       "each model and language model, its state, the device memory it holds now, whether it is "
                       "pinned, when it last ran and what waits for it.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--token", default=None, help="the admin token (default: $TIMESHARE_ADMIN_TOKEN; none needed "
                   "from the server's own machine)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")

    p = sub.add_parser("models", aliases=["zoo"], help="list the model zoo, or the models of a config",
                       description="The zoo's models (built from code, seeded weights), or with --config the "
                       "models a server would serve and where each comes from.")
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--generate", action="store_true", help="generate and cache every zoo model's weights")


def run(args, console) -> int:
    return _ps(args, console) if args.command == "ps" else _models(args, console)


def _ps(args, console) -> int:
    import json
    import os

    import httpx

    from timeshare.units import format_bytes

    token = args.token or os.environ.get("TIMESHARE_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = args.url.rstrip("/") + "/admin/ps"
    try:
        r = httpx.get(url, headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise ConfigError(f"no timeshare server answered at {args.url}: {exc}") from None
    if r.status_code != 200:
        raise ConfigError(f"{url} answered {r.status_code}: {r.text[:300]}")
    models = r.json()["models"]
    if args.json:
        console.print(json.dumps(models, indent=1), markup=False, highlight=False)
        return 0
    table = Table()
    for col in ("name", "kind", "state", "device", "pinned", "last used", "waiting", "running"):
        table.add_column(col, justify="right" if col in ("device", "last used", "waiting", "running") else "left")
    for m in models:
        last = m["last_used_s"]
        table.add_row(m["name"], m["kind"], m["state"],
                      "-" if m["device_bytes"] is None else format_bytes(m["device_bytes"]),
                      "yes" if m["pinned"] else "", "never" if last is None else f"{last:.0f} s ago",
                      str(m["waiting"]), str(m["running"]) if m["kind"] == "language model" else "")
    console.print(table)
    return 0


def _models(args, console) -> int:
    from timeshare.models.zoo import ZOO, weights_path

    if args.config is not None:
        from timeshare.config import load_config

        config = load_config(args.config)
        table = Table()
        for col in ("name", "source", "weights", "pinned", "priority", "SLO ms", "max batch"):
            table.add_column(col)
        for m in config.models:
            table.add_row(m.name, f"zoo:{m.zoo}" if m.zoo else m.build,
                          m.weights or ("seeded" if m.zoo else "module's own"),
                          "yes" if m.pinned else "", m.priority, "-" if m.slo_ms is None else f"{m.slo_ms:.1f}",
                          str(m.max_batch))
        for lm in config.llms:  # language models: the OpenAI-compatible API, a sequence batch
            table.add_row(lm.name, f"language model: {lm.path}", "the directory's", "yes" if lm.pinned else "",
                          lm.priority, "", f"{lm.max_sequences} sequences")
        console.print(table)
        return 0
    table = Table()
    for col in ["name", "parameters", "inputs", "builder", "description"]:
        table.add_column(col)
    for zm in ZOO.values():
        table.add_row(zm.name, f"{zm.parameters:,}", ", ".join(zm.input_names), zm.builder, zm.description)
        if args.generate:
            weights_path(zm.name)
    console.print(table)
    return 0

