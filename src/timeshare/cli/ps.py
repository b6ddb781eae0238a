"""``timeshare ps``: what a running server holds (as ``ollama ps``): argument parsing and
printing. Runs in the CLI's process.

    timeshare ps [--url http://127.0.0.1:8000] [--token T] [--json]
"""

from __future__ import annotations

from rich.table import Table

from timeshare.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("ps", help="what a running server holds: each model's state, device bytes, last use, queue",
                       description="Asks a running `timeshare serve` (its admin plane, /admin/ps) what it serves: "
                       "each model and language model, its state, the device memory it holds now, whether it is "
                       "pinned, when it last ran and what waits for it.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--token", default=None, help="the admin token (default: $TIMESHARE_ADMIN_TOKEN; none needed "
                   "from the server's own machine)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")


def run(args, console) -> int:
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
    models, adapters = r.json()["models"], r.json().get("adapters", [])
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
    if adapters:  # NOTE [Adapter residency]: which are on the device
        shown = Table()
        for col in ("adapter", "parent", "rank", "size", "device", "pinned"):
            shown.add_column(col, justify="right" if col in ("rank", "size") else "left")
        for a in adapters:
            shown.add_row(a["name"], a["parent"], str(a["rank"]), format_bytes(a["nbytes"]),
                          f"slot {a['slot']}" if a["slot"] is not None
                          else "host memory" if a.get("in_host", True) else "disk", "yes" if a["pinned"] else "")
        console.print(shown)
    return 0


