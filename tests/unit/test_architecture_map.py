"""docs/architecture.md is a map of the code, and the code is its check: the map stays
small, every file it names exists, every ``Class.method``, ``Class.attr``, class and
``module.name`` it names in backticks (or in its diagrams) exists, and its index of the
code's notes is what ``scripts/note_index.py`` generates now. Every note the code, the
tests or the docs mention is defined in the code. The other docs (``docs/*.md`` but the
changelog, which is history and names what was there then, and ``README.md``) are held to
the same rule for ``Class.attr`` names.

How a name is looked up: classes, their members (methods, class attributes, fields,
``self.x`` assignments, ``__slots__``, inherited from classes of ours) and modules' top-level
names are read from the source (``ast``), so a name is found whether or not its module
imports here; a member inherited from outside (``threading.Thread``, ``enum.Enum``,
pydantic) is looked up on the imported class. ``Class(kw=...)`` and ``Class.method(kw=...)``
check the keyword against the signature. A lowercase first part is checked only when it is
one of ours: a part of timeshare (``protocol.RunModel``, ``server.serve.uvicorn_config``)
or a section of ``timeshare.yaml`` (``server.request_timeout_s``); anything else
(``turn.step``, ``torch.cuda``) is a variable or another library's and is not checked. A
name given with its file (a function "in" a module, a class followed by its file in
parentheses) must be defined in that file.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "timeshare"
DOCS = ROOT / "docs"
MAP = DOCS / "architecture.md"
MAX_BYTES = 25_000
# History: it names what the code had then. Every other doc names what it has now.
NOT_CHECKED = {"changelog.md"}
OTHER_DOCS = sorted([p for p in DOCS.glob("*.md") if p.name not in NOT_CHECKED and p != MAP] + [ROOT / "README.md"])


@functools.cache
def _generator():
    spec = importlib.util.spec_from_file_location("note_index", ROOT / "scripts" / "note_index.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("note_index", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------- the code's names
@dataclass
class _Class:
    module: str  # dotted, "timeshare.executor.pool"
    members: set[str]
    bases: list[str]  # the last part of each base's name


@dataclass
class _Code:
    classes: dict[str, list[_Class]] = field(default_factory=dict)  # by name: a name may be in several modules
    modules: dict[str, set[str]] = field(default_factory=dict)  # dotted module -> its top-level names
    defined: dict[str, set[str]] = field(default_factory=dict)  # ... those it defines (not imports)


def _module_of(path: Path) -> str:
    parts = ("timeshare", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _members(cls: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                out |= _targets(t)
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
                out |= {c.value for c in ast.walk(node.value)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    for node in ast.walk(cls):  # self.x = ..., self.x: T = ..., in any method
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for a in ast.walk(t):
                if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id in ("self", "cls"):
                    out.add(a.attr)
    return out


def _top_level(tree: ast.Module, imports: bool = True) -> set[str]:
    out: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                out |= _targets(t)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Import) and imports:
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and imports:
            out |= {a.asname or a.name for a in node.names}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(h for x in getattr(node, "handlers", []) for h in x.body)]
    return out


@functools.cache
def _code() -> _Code:
    code = _Code()
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module = _module_of(path)
        code.modules[module] = _top_level(tree)
        code.defined[module] = _top_level(tree, imports=False)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases]
                code.classes.setdefault(node.name, []).append(_Class(module, _members(node), bases))
    return code


def _imported(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # an optional dependency missing here: the source's answer stands
        return None


def _class_has(name: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether some class ``name`` of ours has ``attr``, its own or inherited."""
    for c in _code().classes.get(name, []):
        if attr in c.members:
            return True
        ours = [b for b in c.bases if b in _code().classes and b not in seen]
        if any(_class_has(b, attr, seen | {name}) for b in ours):
            return True
        if len(ours) < len(c.bases):  # a base from outside: look at the class itself
            cls = _imported(c.module, name)
            if cls is not None and (any(attr in vars(k) for k in inspect.getmro(cls))
                                    or attr in getattr(cls, "model_fields", {})):
                return True
    return False


def _known_name(name: str) -> bool:
    return name in _code().classes or any(name in names for names in _code().modules.values())


def _module_path(parts: list[str]) -> tuple[str, list[str]] | None:
    """The longest prefix of ``parts`` (after ``timeshare``) that is a module of ours, and
    the rest; None if the first part is not one of ours."""
    for i in range(len(parts), 0, -1):
        module = ".".join(["timeshare", *parts[:i]])
        if module in _code().modules:
            return module, parts[i:]
    return None


def _module_has(module: str, rest: list[str]) -> bool:
    if not rest:
        return True
    if rest[0] not in _code().modules[module]:
        return False
    if len(rest) > 1 and any(c.module == module for c in _code().classes.get(rest[0], [])):
        return _class_has(rest[0], rest[1])
    return True


@functools.cache
def _sections() -> dict[str, type]:
    """``timeshare.yaml``'s sections -> the model of one entry."""
    from timeshare.config.document import Config

    out = {}
    for name, f in Config.model_fields.items():
        kind = f.annotation
        while typing.get_origin(kind) is not None:  # list[X], X | None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        out[name] = kind
    return out


def _unknown_keywords(obj, keywords: list[str]) -> list[str]:
    """The keywords ``obj``'s signature does not take (none if it takes ``**kwargs``)."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [k for k in keywords if k not in params]


def _callee(chain: list[str]):
    """The class or method ``chain`` names (``Class`` or ``Class.method``), imported; None
    when it cannot be found unambiguously."""
    found = [c for c in _code().classes.get(chain[0], [])]
    if len(found) != 1:
        return None
    obj = _imported(found[0].module, chain[0])
    for attr in chain[1:]:
        obj = getattr(obj, attr, None)
    return obj


# ---------------------------------------------------------------------- the doc's names
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_CHAIN = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_IN_DIAGRAM = re.compile(r"\b[A-Z]\w*[a-z]\w*\.[a-z_]\w*")
_EXTENSIONS = (".py", ".md", ".yaml", ".toml", ".json", ".lock")
_PATH = re.compile(r"\.{0,2}/?[\w.-]+(?:/[\w.-]*)*")
_PATH_IN_TEXT = re.compile(r"(?<![\w/$.<-])(?:[a-z_][\w-]*/)+(?:[\w-]+\.(?:py|md|yaml|toml))?(?![\w/])")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_WITH_FILE = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`(?:\s+in\s+|\s+\(|,\s+)`([\w/]+\.py)`")


def spans(text: str) -> list[str]:
    """The inline code of ``text``, fenced blocks left out."""
    return _SPAN.findall(_FENCE.sub("", text))


def fenced(text: str) -> list[str]:
    return _FENCE.findall(text)


def _keywords(args: str) -> list[str]:
    """The keywords given at the top level of a call's parentheses."""
    depth, top = 0, []
    for ch in args[1:]:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth < 0:
            break
        top.append(ch if depth == 0 else " ")
    return re.findall(r"(?:^|,)\s*(\w+)\s*=(?!=)", "".join(top))


def stale_name(span: str, *, strict: bool) -> str | None:
    """Why ``span`` names something the code does not have (None: it exists, or it is not
    a name of ours). ``strict``: the map's rules (classes alone, modules, config keys);
    else only ``Class.attr`` and the keywords of ``Class(kw=...)``."""
    if span.endswith(_EXTENSIONS):
        return None  # a file: ``missing_paths`` checks it
    if span.startswith("timeshare."):
        span = span[len("timeshare."):]
    m = _CHAIN.match(span)
    if m is None:
        return None
    chain, rest = m.group(0).split("."), span[m.end():]
    if rest and not rest.startswith(("(", ".", "[", " ")):
        return None  # a path, an expression
    head = chain[0]
    if head.lstrip("_")[:1].isupper() and any(ch.islower() for ch in head):  # a class (not a CONSTANT)
        if len(chain) == 1:
            if not _known_name(head):  # another library's class, in the other docs
                return f"`{span}`: no class or name {head} in src/timeshare" if strict else None
        elif head not in _code().classes:
            return f"`{span}`: no class {head} in src/timeshare"
        elif not _class_has(head, chain[1]):
            return f"`{span}`: class {head} has no {chain[1]}"
        if rest.startswith("("):
            callee = _callee(chain[:2])
            bad = _unknown_keywords(callee, _keywords(rest)) if callee is not None else []
            if bad:
                return f"`{span}`: {'.'.join(chain[:2])} takes no keyword {bad[0]}"
        return None
    if not strict or len(chain) < 2:
        return None
    if head in _sections():
        if chain[1] in _sections()[head].model_fields:
            return None
        if _module_path(chain) is None:
            return f"`{span}`: the {head} section of timeshare.yaml has no {chain[1]}"
    found = _module_path(chain)
    if found is None:
        return None  # a variable, another library
    module, names = found
    if not _module_has(module, names):
        return f"`{span}`: {module} has no {'.'.join(names)}"
    return None


def misplaced(text: str) -> list[str]:
    """Names given with their file ("`choose` in `decode/sampler.py`", "`Segment.follow`
    (`executor/segments.py`)", "`Slot`, `models/binding.py`") that the file does not define."""
    out = []
    for name, path in _WITH_FILE.findall(_FENCE.sub("", text)):
        file = SRC / path
        if not file.is_file():
            continue  # ``missing_paths`` reports it
        module = _module_of(file)
        head = name.split(".")[0]
        if head not in _code().defined[module] or not _module_has(module, name.split(".")):
            out.append(f"`{name}` is not in {path}")
    return out


def stale_names(text: str, *, strict: bool) -> list[str]:
    out = [why for s in spans(text) if (why := stale_name(s.strip(), strict=strict))]
    if strict:
        for block in fenced(text):
            out += [why for s in _IN_DIAGRAM.findall(block) if (why := stale_name(s, strict=True))]
        out += misplaced(text)
    return sorted(set(out))


def _exists(name: str, base: Path) -> bool:
    name = name.rstrip("/")
    return any((root / name).exists() for root in (SRC, ROOT, base))


def missing_paths(text: str, doc: Path) -> list[str]:
    """The files and folders ``text`` names that do not exist: in inline code (a name with a
    ``/`` or a file's extension), in the text and its diagrams (``pkg/`` or ``pkg/file.py``),
    and as links; relative to ``src/timeshare/``, to the root or to the doc's folder."""
    names = set()
    for s in spans(text):
        s = s.strip()
        if s.startswith(("/", "$", "~", "http")) or not _PATH.fullmatch(s):
            continue
        if "/" in s or s.endswith(_EXTENSIONS):
            names.add(s)
    names |= set(_PATH_IN_TEXT.findall(re.sub(r"https?://\S+", "", text)))
    links = {link for link in _LINK.findall(text) if not link.startswith(("http", "mailto:"))}
    return sorted({n for n in names | links if not _exists(n, doc.parent)})


# ---------------------------------------------------------------------- the map
def test_the_map_is_small():
    size = len(MAP.read_bytes())
    assert size <= MAX_BYTES, f"docs/architecture.md is {size} bytes, over {MAX_BYTES}: a map, not a manual"


def test_every_file_the_map_names_exists():
    assert missing_paths(MAP.read_text(), MAP) == []


def test_every_name_the_map_gives_exists():
    assert stale_names(MAP.read_text(), strict=True) == []


def test_the_maps_note_index_is_the_generated_one():
    gen = _generator()
    assert gen.in_map(MAP.read_text()) is not None, "docs/architecture.md has no NOTE index markers"
    assert gen.in_map(MAP.read_text()) == gen.generated(), \
        "the NOTE index is stale: run python scripts/note_index.py --write"


def test_every_note_is_defined_once():
    assert _generator().definitions()[1] == []


def test_every_note_mentioned_is_defined():
    """In the code, the tests (which may define notes of their own) and the docs."""
    gen = _generator()
    defined = gen.definitions(SRC)[0].keys() | gen.definitions(ROOT / "tests")[0].keys()
    undefined = []
    for path in [*sorted(SRC.rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")), MAP, *OTHER_DOCS]:
        undefined += [f"{path.relative_to(ROOT)}: {t!r}" for t in sorted(gen.mentions(path.read_text()) - defined)]
    assert undefined == []


# ---------------------------------------------------------------------- the other docs
@pytest.mark.parametrize("doc", OTHER_DOCS, ids=lambda p: p.name)
def test_no_stale_class_attr_in_the_docs(doc):
    assert stale_names(doc.read_text(), strict=False) == []


# ---------------------------------------------------------------------- the checks themselves
def test_the_checks_find_what_is_gone():
    """Each check fails on a name that does not exist (the checks can fail)."""
    assert stale_name("Dispatcher.hold", strict=True) is None
    assert stale_name("Dispatcher.no_such_method", strict=True) is not None
    assert stale_name("WorkerHandle.channel", strict=True) is None  # set in __init__
    assert stale_name("ClockPolicy.candidates", strict=True) is None  # inherited from a class of ours
    assert stale_name("JobState.value", strict=True) is None  # inherited from enum.Enum
    assert stale_name("NoSuchClass", strict=True) is not None
    assert stale_name("NoSuchClass.attr", strict=False) is not None
    assert stale_name("ProcessPool(no_such_keyword=1)", strict=True) is not None
    assert stale_name("protocol.RunModel", strict=True) is None
    assert stale_name("protocol.NoSuchMessage", strict=True) is not None
    assert stale_name("server.request_timeout_s", strict=True) is None
    assert stale_name("server.no_such_key", strict=True) is not None
    assert stale_name("turn.step", strict=True) is None  # a variable: not checked
    assert misplaced("`choose` in `decode/sampler.py`, `Segment.follow` (`executor/segments.py`)") == []
    assert misplaced("`choose` in `decode/runner.py`") != []  # imported there, defined elsewhere
    assert missing_paths("`executor/pool.py` and `docs/changelog.md`", MAP) == []
    assert missing_paths("see `executor/no_such.py` and worker/gone.py", MAP) == ["executor/no_such.py",
                                                                                  "worker/gone.py"]
    gen = _generator()
    title = "Some" + " title"  # spelled apart, so that this file mentions no note
    assert gen.mentions("(NOTE" + f" [{title}])") == {title}
    assert gen.mentions("# see NOTE" + " [Some\n    # title] here") == {title}  # broken over two lines
