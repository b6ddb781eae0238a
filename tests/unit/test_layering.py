"""Which part of timeshare may import which (docs/architecture.md, "Packages and imports"),
checked on the source: every import statement, at any depth, of every module, top-level
modules included; and no cycle between the parts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "timeshare"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

# A part is a subpackage or a top-level module. Each may import only the parts listed
# here (besides itself); None: anything (the command line, benchmarks, the demo).
BASICS = {"errors", "units", "dtypes", "device", "tree", "seeding"}
_BELOW_WORKER = BASICS | {"memory", "transfer", "protocol", "models", "decode"}
_CONTROLLER = _BELOW_WORKER | {"scheduler", "options", "worker", "executor", "runtime", "config"}
ALLOWED: dict[str, set[str] | None] = {
    "errors": set(),
    "units": {"errors"},
    "dtypes": {"errors"},
    "device": {"errors"},
    "tree": {"errors"},
    "seeding": {"errors"},
    "memory": BASICS,
    "transfer": BASICS | {"memory"},
    "protocol": BASICS | {"memory", "transfer", "decode"},
    "decode": BASICS | {"models"},
    "models": BASICS | {"memory", "transfer"},
    "options": BASICS | {"memory", "transfer", "scheduler"},
    "config": BASICS | {"memory", "transfer", "models", "scheduler", "options"},
    "scheduler": {"errors", "units"},
    "worker": _BELOW_WORKER,
    "executor": _BELOW_WORKER | {"options", "worker"},
    "runtime": _BELOW_WORKER | {"scheduler", "options", "worker", "executor"},
    "sim": BASICS | {"memory", "transfer", "models", "scheduler"},
    "llm": _CONTROLLER,
    "cluster": _CONTROLLER | {"llm"},
    "server": _CONTROLLER | {"llm", "cluster"},
    # A server in a child process and its HTTP client, for benches, the demo and tests:
    # the server's wire format, never the server's insides.
    "harness": BASICS | {"server"},
    "bench": None,
    "cli": None,
    "demo": None,
    "__init__": None,
    "__main__": None,
}


def _part(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _imported(path: Path) -> set[str]:
    """The parts of timeshare a module imports (``timeshare.x...`` -> ``x``; ``from timeshare
    import x`` -> ``x`` when x is a part)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "timeshare":
                names += [f"timeshare.{a.name}" for a in node.names if a.name in ALLOWED]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "timeshare" and len(parts) > 1:
                out.add(parts[1])
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for m in sorted(SRC.rglob("*.py")):
        part = _part(m)
        graph.setdefault(part, set()).update(_imported(m) - {part})
    return graph


def test_every_part_has_a_rule():
    assert set(_graph()) <= set(ALLOWED), sorted(set(_graph()) - set(ALLOWED))


@pytest.mark.parametrize("part", sorted(p for p, allowed in ALLOWED.items() if allowed is not None))
def test_parts_import_only_what_the_layering_allows(part):
    modules = sorted((SRC / part).rglob("*.py")) if (SRC / part).is_dir() else [SRC / f"{part}.py"]
    assert modules and all(m.exists() for m in modules)
    allowed = ALLOWED[part]
    assert allowed is not None
    bad = {str(m.relative_to(SRC)): sorted(_imported(m) - allowed - {part}) for m in modules}
    assert {m: b for m, b in bad.items() if b} == {}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports between parts, as a path that ends where it starts; None: none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_cycle_between_parts():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_docs_table_names_every_part():
    """Each part with a rule is named in the first column of the docs' table."""
    lines = DOCS.read_text().split("## Packages and imports", 1)[1].split("\n## ", 1)[0].splitlines()
    first = " ".join(line.split("|")[1] for line in lines if line.startswith("| `"))
    missing = [p for p in ALLOWED if p not in ("__init__", "__main__") and f"`{p}`" not in first]
    assert missing == []


def test_the_device_side_of_a_step_imports_nothing_of_the_runtime_or_the_engine():
    """NOTE [One step, two places]: what runs where the weights are (``decode/``) is
    imported by worker processes and by the controller alike: it imports neither the
    runtime nor ``llm`` (which imports the runtime), and nothing about language models
    is under ``worker/`` but the step's handling (``Worker.run(..., step=...)``)."""
    graph = _graph()
    assert "llm" not in graph["worker"] and "llm" not in graph["decode"] and "runtime" not in graph["decode"]
    assert not {"batch.py", "generation.py", "paged.py", "decoding.py"} & {p.name for p in (SRC / "worker").iterdir()}


def test_no_production_code_branches_on_the_test_hook():
    """``in_process_worker()`` is a test hook (``executor/testing.py``): no module under
    ``src/`` outside the executor package calls it."""
    calls = []
    for m in sorted(SRC.rglob("*.py")):
        if m.relative_to(SRC).parts[0] == "executor":
            continue
        for node in ast.walk(ast.parse(m.read_text(), str(m))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "in_process_worker":
                calls.append(str(m.relative_to(SRC)))
    assert calls == []
