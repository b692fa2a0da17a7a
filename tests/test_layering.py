"""The layering of docs/ARCHITECTURE.md §2, checked on the source with `ast`.

    cli -> provision | inspect | bench | serve | connectors -> core -> native

- a face (any module of tract_cli outside tract_cli/core/) never imports the
  C binding (`tract_cli.core.native`, `tract_cli._native`, so neither `lib`
  nor `ffi`), never imports a `_`-prefixed name from core, and never touches
  a private attribute of core: `_x` on a name it imported from core, or an
  attribute whose name core's own classes keep private (`pool._r()`,
  `pool._mm`, `pool._base`, ...; computed from core's source, so a new one
  counts at once);
- core never imports a face.

What a face needs of the core is a public method of it (docs/ARCHITECTURE.md
§2).  ALLOWED lists, with the reason, what is not fixed yet; an entry that is
no longer needed fails too, so the list only shrinks.
"""
from __future__ import annotations

import ast
import functools
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tract_cli"
FACES = ("cli", "bench", "serve", "inspect", "provision", "connectors")
BINDINGS = ("tract_cli.core.native", "tract_cli._native")
# private names of core's objects met in faces before the check existed; the
# ones core defines are added from its source (core_private_names)
KNOWN_PRIVATE = {"_r", "_mm", "_base", "_lib", "_region", "_local"}

# (file, rule, name) -> why it is allowed for now: nothing is, today
ALLOWED: dict = {}


@dataclass(frozen=True)
class Violation:
    file: str        # relative to the repository root
    line: int
    rule: str        # "binding import", "private import", "private attribute", "upward import"
    name: str        # what was imported or touched
    text: str        # the offending source, for the message

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.file, self.rule, self.name)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.rule} {self.name}: {self.text}"


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def core_private_names(package: Path) -> set[str]:
    """Private attribute names of core's objects: `_x` methods and class
    attributes of its classes, and every `self._x` it assigns."""
    names = set(KNOWN_PRIVATE)
    for path in (package / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        names.update(t.id for t in targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {n for n in names if _private(n)}


@functools.lru_cache(maxsize=None)
def scan(package: Path = PACKAGE) -> list[Violation]:
    """Every breach of the layering in the package at PACKAGE."""
    private = core_private_names(package)
    root = package.parent
    found = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        rel = str(path.relative_to(root))
        in_core = _within(module, "tract_cli.core")
        source = path.read_text()
        tree = ast.parse(source, str(path))
        from_core = set()       # names bound here to core modules or objects

        def hit(node, rule, name):
            found.append(Violation(rel, node.lineno, rule, name,
                                   ast.get_source_segment(source, node) or name))

        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.Import):
                    pairs = [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
                    imported = [a.name for a in node.names]
                else:
                    base = _resolve(node, module, path.name == "__init__.py")
                    pairs = [(f"{base}.{a.name}", a.asname or a.name) for a in node.names]
                    imported = [base] + [p for p, _ in pairs]
                    if not in_core and _within(base, "tract_cli.core"):
                        for a in node.names:
                            if _private(a.name):
                                hit(node, "private import", f"{base}.{a.name}")
                if in_core:
                    for name in imported:
                        face = next((f for f in FACES if _within(name, f"tract_cli.{f}")), None)
                        if face:
                            hit(node, "upward import", name)
                            break
                    continue
                for binding in BINDINGS:
                    if any(_within(name, binding) for name in imported):
                        hit(node, "binding import", binding)
                for full, bound in pairs:
                    if _within(full, "tract_cli.core") or (isinstance(node, ast.Import)
                                                           and _within(full, "tract_cli")):
                        from_core.add(bound)
        if in_core:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if node.attr in ("native", "_native") and ast.unparse(node) in BINDINGS:
                    hit(node, "binding import", ast.unparse(node))   # after `import tract_cli`
                    continue
                if not _private(node.attr):
                    continue
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                on_core = isinstance(node.value, ast.Name) and node.value.id in from_core
                if on_core or (node.attr in private and not own):
                    hit(node, "private attribute", node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in private:
                hit(node, "private attribute", node.args[1].value)
    return found


def test_faces_use_only_the_public_core_and_core_never_calls_up():
    found = [v for v in scan() if v.key not in ALLOWED]
    assert not found, ("layering breaches (docs/ARCHITECTURE.md §2: give core a public "
                       "method instead):\n" + "\n".join(map(str, found)))


def test_every_allowed_breach_still_exists():
    """The allow-list only shrinks: an entry whose breach is gone is removed."""
    seen = {v.key for v in scan()}
    stale = [k for k in ALLOWED if k not in seen]
    assert not stale, f"fixed, so remove from ALLOWED in {__file__}: {stale}"


CASES = {
    "from tract_cli.core.native import ffi, lib": ("binding import", "tract_cli.core.native"),
    "from tract_cli.core import native": ("binding import", "tract_cli.core.native"),
    "import tract_cli.core.native as n": ("binding import", "tract_cli.core.native"),
    "from tract_cli._native import lib": ("binding import", "tract_cli._native"),
    "from ..core.native import lib": ("binding import", "tract_cli.core.native"),
    "import tract_cli\ntract_cli.core.native.lib.tract_fence(None)":
        ("binding import", "tract_cli.core.native"),
    "from tract_cli.core.region import _params": ("private import", "tract_cli.core.region._params"),
    "def f(pool):\n    return pool._r()": ("private attribute", "_r"),
    "def f(w):\n    return w.pool._mm": ("private attribute", "_mm"),
    "def f(pool):\n    return getattr(pool, '_base')": ("private attribute", "_base"),
    "from tract_cli.core import medium\nmedium._materialize(0, 0, 1)":
        ("private attribute", "_materialize"),
    "def f(pool):\n    return pool._secret_of_core": ("private attribute", "_secret_of_core"),
}


@pytest.mark.parametrize("source", list(CASES), ids=range(len(CASES)))
def test_the_check_finds_each_kind_of_breach(tmp_path, source):
    package = tmp_path / "tract_cli"
    (package / "core").mkdir(parents=True)
    (package / "bench").mkdir()
    for init in (package, package / "core", package / "bench"):
        (init / "__init__.py").write_text("")
    (package / "core" / "pool.py").write_text(textwrap.dedent("""
        class Pool:
            def __init__(self):
                self._secret_of_core = 1
            def public(self):
                return self._secret_of_core
    """))
    (package / "bench" / "x.py").write_text(source + "\n")
    found = [(v.file, v.rule, v.name) for v in scan(package)]
    assert found == [("tract_cli/bench/x.py", *CASES[source])], found


def test_the_check_leaves_faces_own_privates_and_finds_core_calling_up(tmp_path):
    package = tmp_path / "tract_cli"
    (package / "core").mkdir(parents=True)
    (package / "serve").mkdir()
    (package / "core" / "pool.py").write_text("class Pool:\n    def _r(self):\n        pass\n")
    (package / "core" / "agent.py").write_text(
        "def f():\n    from tract_cli.serve import worker\n    from ..cli import app\n")
    (package / "serve" / "worker.py").write_text(textwrap.dedent("""
        from tract_cli.core.pool import Pool
        class W:
            def __init__(self):
                self._r = Pool()
            def go(self):
                return self._r, Pool.public
    """))
    found = [(v.file, v.line, v.rule, v.name) for v in scan(package)]
    assert found == [("tract_cli/core/agent.py", 2, "upward import", "tract_cli.serve"),
                     ("tract_cli/core/agent.py", 3, "upward import", "tract_cli.cli")], found
