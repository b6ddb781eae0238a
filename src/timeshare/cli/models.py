"""``timeshare models`` (``zoo``): the model zoo, or the models of a config. Runs in the
CLI's process.

    timeshare models [--config timeshare.yaml] [--generate]
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table


def add_parser(sub) -> None:
    p = sub.add_parser("models", aliases=["zoo"], help="list the model zoo, or the models of a config",
                       description="The zoo's models (built from code, seeded weights), or with --config the "
                       "models a server would serve and where each comes from.")
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--generate", action="store_true", help="generate and cache every zoo model's weights")


def run(args, console) -> int:
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

