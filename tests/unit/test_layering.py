"""Which package may import which (docs/architecture.md, "Packages and imports"),
checked on the source: every import statement, at any depth, of every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "timeshare"

# package -> packages of timeshare it must never import
FORBIDDEN = {
    "worker": {"runtime", "server", "bench", "sim", "cli"},
    "transfer": {"runtime", "server", "bench", "sim", "worker", "models", "scheduler", "cli"},
    "memory": {"runtime", "server", "bench", "sim", "worker", "transfer", "models", "scheduler", "cli"},
    "models": {"runtime", "server", "bench", "sim", "worker", "scheduler", "cli"},
    "scheduler": {"runtime", "server", "bench", "sim", "worker", "transfer", "memory", "cli"},
    "runtime": {"server", "bench", "sim", "cli"},
    "server": {"bench", "sim", "cli"},
    "sim": {"runtime", "server", "bench", "worker", "cli"},
    "llm": {"server", "bench", "sim", "cli"},
    "cluster": {"server", "bench", "sim", "cli"},
}


def _imported(path: Path) -> set[str]:
    """The timeshare subpackages a module imports (``timeshare.x...`` -> ``x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "timeshare" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_workers_import_of_llm_only_the_decode_batch():
    """NOTE [Generation in worker processes]: a worker keeps decode batches, and nothing
    else of ``llm`` (which imports the runtime)."""
    for m in sorted((SRC / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(m.read_text(), str(m))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("timeshare.llm"):
                assert node.module == "timeshare.llm.batch", (m, node.module)
    batch = ast.parse((SRC / "llm" / "batch.py").read_text())
    assert _imported(SRC / "llm" / "batch.py") <= {"errors"}, batch


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_the_layering_allows(package):
    modules = sorted((SRC / package).rglob("*.py"))
    assert modules
    bad = {str(m.relative_to(SRC)): sorted(_imported(m) & FORBIDDEN[package]) for m in modules}
    assert {m: b for m, b in bad.items() if b} == {}
