"""What a benchmark or a simulation shows of its result: its table, and its plot where
asked. Part of the CLI layer.
"""

from __future__ import annotations

from pathlib import Path


def shower(console, table, plot, path: Path | None):
    """What a bench shows of its result: ``table(console, result)``, and with ``path`` the
    plot written there."""
    def show(result: dict) -> None:
        table(console, result)
        if path:
            plot(result, path)
            console.print(f"wrote {path}")

    return show


