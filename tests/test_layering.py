"""The layering of docs/ARCHITECTURE.md §2, checked on the source with `ast`.

    cli -> provision | inspect | bench | serve | connectors -> core -> native

- a face (any module of tract_cli outside tract_cli/core/) never reaches the
  C binding (`tract_cli.core.native`, `tract_cli._native`, so neither `lib`
  nor `ffi`): not by an import, nor `importlib.import_module`, `__import__`
  or `sys.modules[...]` with the name, nor an attribute chain from a name
  bound to core (`core.native.lib`, `c.native` after `import tract_cli.core
  as c`, `pool.lib` on a core module), nor any `x.native.lib`/`x.native.ffi`;
- a face never makes a C binding of its own (`import cffi`, `ctypes`);
- a face never imports a `_`-prefixed name from core and never touches a
  private attribute of core: `_x` anywhere on a chain rooted in a name bound
  to core (`core.region._params`, `Pool()._x`), `getattr(x, '_x')` on one,
  or an attribute or `getattr` name that core keeps private anywhere (its
  classes' `_x` methods, class attributes and `__slots__`, every `self._x` it
  assigns, its modules' own `_x` functions, classes and variables:
  `pool._r()`, `pool._mm`, `x._params`; computed from core's source, so a new
  one counts at once);
- core never imports a face: not by an import, a dynamic import, nor by
  naming one in a string (`-m tract_cli.cli`, a pattern
  `tract_cli\\.(cli|serve)`), docstrings aside, nor by launching the `tract`
  command by its script's name (`["tract", "check", ...]`, `which("tract")`);
- no face imports `tract_cli.cli` (any module of it), neither statically nor
  dynamically nor by an attribute chain (`tract_cli.cli.main`): a face runs
  another command by launching it as a child process (`module_command(
  "tract_cli.cli", ...)`, a string, which faces may write and core may not);
- a face imports another face only where FACE_IMPORTS (docs/ARCHITECTURE.md
  §2) says it may: `cli` any face but `connectors` (which the engine imports,
  never tract_cli), `bench` `serve`, `inspect` and `provision`, no other
  pair; the package's own `__init__` imports no face.

What a face needs of the core is a public method of it (docs/ARCHITECTURE.md
§2).  ALLOWED lists each exception with its reason; an entry that is
no longer needed fails too, so the list only shrinks; so does FACE_IMPORTS.
"""
from __future__ import annotations

import ast
import functools
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tract_cli"
FACES = ("cli", "bench", "serve", "inspect", "provision", "connectors")
BINDINGS = ("tract_cli.core.native", "tract_cli._native")
# the binding's names as a core module that imported it holds them (pool.lib, ...)
BINDING_NAMES = ("lib", "ffi", "native", "_native")
# private names of core's objects met in faces before the check existed; the
# ones core defines are added from its source (core_private_names)
KNOWN_PRIVATE = {"_r", "_mm", "_base", "_lib", "_region", "_local"}

# (importing face, imported face) -> why (docs/ARCHITECTURE.md §2): the only
# imports of a face by another face besides `cli`'s; a pair no longer used
# fails, so that this table and the document keep naming what the code does
FACE_IMPORTS: dict = {
    ("bench", "serve"):
        "a benchmark measures the serving path, not a copy of it: `--compute real`, "
        "`microbench serve` and `--engine vllm` drive serve's engine, model, client and "
        "worker launcher",
    ("bench", "inspect"):
        "`microbench inspect` times inspect's own snapshot of a region under load",
    ("bench", "provision"):
        "a report names the CPU it was measured on (bench/workload/session.py: provision/cpu.py)",
}
# the top face: it may import every face but these (the engine imports connectors)
TOP, NOT_IMPORTED_BY_TOP = "cli", ("connectors",)
# the `tract` command's script name (pyproject.toml): core launches no command
TRACT_SCRIPT = "tract"

# (file, rule, name) -> why it is allowed
ALLOWED: dict = {
    ("tract_cli/bench/micro/region.py", "foreign binding", "cffi"):
        "the copy benchmarks' reference is glibc memcpy itself, measured through an FFI "
        "of its own (dlopen(None)) so that the core's C library plays no part in it",
}


@dataclass(frozen=True)
class Violation:
    file: str        # relative to the repository root
    line: int
    rule: str        # "binding import", "private import", "private attribute", "foreign binding",
                     # "upward import", "upward name" (core), "cli import", "face import" (faces)
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


def _face_of(name: str) -> str | None:
    """The face a dotted module name lies in (`tract_cli.serve.x` -> 'serve')."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tract_cli" and parts[1] in FACES else None


def _face_rule(own: str | None, target: str) -> str | None:
    """The rule an import of face TARGET by a module of face OWN (None: the
    package's own `__init__`) breaks, if any."""
    if target == own:
        return None
    if target == TOP:
        return "cli import"
    if own is None:
        return "face import"
    if own == TOP:
        return "face import" if target in NOT_IMPORTED_BY_TOP else None
    return None if (own, target) in FACE_IMPORTS else "face import"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def core_private_names(package: Path) -> set[str]:
    """Private names of core: `_x` methods and class attributes of its
    classes (`__slots__` entries too), every `self._x` it assigns, and its
    modules' own `_x` functions, classes and variables (`region._params`)."""
    names = set(KNOWN_PRIVATE)
    for path in (package / "core").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for item in tree.body:
            names.update(_defined(item))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    names.update(_defined(item))
                    if isinstance(item, ast.Assign) and any(
                            isinstance(t, ast.Name) and t.id == "__slots__" for t in item.targets):
                        names.update(c.value for c in ast.walk(item.value)
                                     if isinstance(c, ast.Constant) and isinstance(c.value, str))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _defined(item: ast.stmt) -> list[str]:
    """The names a module- or class-level statement defines."""
    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [item.name]
    if isinstance(item, (ast.Assign, ast.AnnAssign)):
        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return []


# a face's module named in a string of core: `python -m tract_cli.cli`, or a
# pattern `tract_cli\.(cli|serve)` (a process boundary is still a call up)
UPWARD_NAME = re.compile(r"tract_cli(?:\.|\\\.)\(?(?:\?:)?([\w|]+)")


def _upward_name(text: str) -> str | None:
    """The first face a string of core names (`tract_cli.cli`, `tract_cli\\.(x|serve)`)."""
    for m in UPWARD_NAME.finditer(text):
        face = next((f for f in m.group(1).split("|") if f in FACES), None)
        if face:
            return f"tract_cli.{face}"
    return None
# a C binding of the face's own: FFI().dlopen, ctypes.CDLL
FOREIGN = ("cffi", "ctypes")


def _launches_tract(node: ast.AST) -> bool:
    """Whether NODE launches the `tract` script by name: an argv list
    `["tract", "check", ...]`, or `which("tract")`, `os.execvp("tract", ...)`,
    `os.spawnlp(..., "tract", ...)` (a tuple `("tract", x)` is not an argv)."""
    def is_str(n, value=None):
        return isinstance(n, ast.Constant) and isinstance(n.value, str) \
            and (value is None or n.value == value)
    if isinstance(node, ast.List):
        return len(node.elts) > 1 and is_str(node.elts[0], TRACT_SCRIPT) and is_str(node.elts[1])
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name == "which" or name.startswith("exec"):
            return bool(node.args) and is_str(node.args[0], TRACT_SCRIPT)
        if name.startswith("spawn"):
            return any(is_str(a, TRACT_SCRIPT) for a in node.args[:2])
    return False


def _dynamic_import(node: ast.AST) -> ast.Constant | None:
    """The constant module name of `importlib.import_module('m')`,
    `__import__('m')`, `sys.modules['m']` or `sys.modules.get('m')`."""
    arg = None
    if isinstance(node, ast.Call) and node.args:
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if name in ("import_module", "__import__"):
            arg = node.args[0]
        elif name == "get" and isinstance(f, ast.Attribute) and _is_sys_modules(f.value):
            arg = node.args[0]
    elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
        arg = node.slice
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg
    return None


def _is_sys_modules(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" \
        and isinstance(node.value, ast.Name) and node.value.id == "sys"


def _chain(node: ast.AST) -> tuple[str | None, list[str]]:
    """The root name of an attribute chain (through calls and subscripts) and
    the attributes after it: `core.region._params(x).y` -> ('core', ['region', '_params', 'y'])."""
    attrs = []
    while True:
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            break
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants of a module and its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            out.add(id(node.body[0].value))
    return out


def scan(package: Path = PACKAGE) -> list[Violation]:
    """Every breach of the layering in the package at PACKAGE."""
    return _scan(package)[0]


def face_imports(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """The (importing, imported) pairs of faces whose imports FACE_IMPORTS allows."""
    return _scan(package)[1]


@functools.lru_cache(maxsize=None)
def _scan(package: Path) -> tuple[list[Violation], set[tuple[str, str]]]:
    private = core_private_names(package)
    root = package.parent
    found = []
    edges = set()       # allowed face -> face imports met
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        rel = str(path.relative_to(root))
        in_core = _within(module, "tract_cli.core")
        own = _face_of(module)      # None: core, or the package's own __init__
        source = path.read_text()
        tree = ast.parse(source, str(path))
        bound = {}      # name bound here to a core module or object -> its dotted name
        faces_imported = set()      # faces an import of this file names (judged there)

        def hit(node, rule, name):
            found.append(Violation(rel, node.lineno, rule, name,
                                   ast.get_source_segment(source, node) or name))

        def check_imported(node, imported):
            """The rules for the modules an import (static or dynamic) names."""
            if in_core:
                for name in imported:
                    if any(_within(name, f"tract_cli.{f}") for f in FACES):
                        hit(node, "upward import", name)
                        return
                return
            for binding in BINDINGS:
                if any(_within(name, binding) for name in imported):
                    hit(node, "binding import", binding)
            for lib in FOREIGN:
                if any(_within(name, lib) for name in imported):
                    hit(node, "foreign binding", lib)
            check_faces(node, imported)

        def check_faces(node, imported):
            """A face's (or the package __init__'s) import of other faces: one
            breach reported per statement, allowed pairs recorded."""
            for name in imported:
                target = _face_of(name)
                if target is None or target == own:
                    continue
                faces_imported.add(target)
                rule = _face_rule(own, target)
                if rule:
                    hit(node, rule, name)
                    return
                if own is not None and own != TOP:
                    edges.add((own, target))

        consumed = set()    # constants already reported as a dynamic import
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if isinstance(node, ast.Import):
                    pairs = [(a.name, a.asname or a.name.split(".")[0]) for a in node.names]
                    pairs = [(full if a.asname else full.split(".")[0], b)
                             for (full, b), a in zip(pairs, node.names)]
                    imported = [a.name for a in node.names]
                else:
                    base = _resolve(node, module, path.name == "__init__.py")
                    pairs = [(f"{base}.{a.name}", a.asname or a.name) for a in node.names]
                    imported = [base] + [p for p, _ in pairs]
                    if not in_core and _within(base, "tract_cli.core"):
                        for a in node.names:
                            if _private(a.name):
                                hit(node, "private import", f"{base}.{a.name}")
                            elif a.name in BINDING_NAMES and not any(   # not already reported
                                    _within(n, b) for n in (base, f"{base}.{a.name}")
                                    for b in BINDINGS):
                                # the binding as a core module that imported it re-exports it
                                hit(node, "binding import", "tract_cli.core.native")
                                break                                      # once a statement
                check_imported(node, imported)
                for full, name in pairs:
                    if _within(full, "tract_cli"):
                        bound[name] = full
            else:
                const = _dynamic_import(node)
                if const is not None:
                    consumed.add(id(const))
                    check_imported(node, [const.value])
        if in_core:
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and id(node) not in consumed and id(node) not in docs:
                    name = _upward_name(node.value)
                    if name:
                        hit(node, "upward name", name)
                elif _launches_tract(node):
                    hit(node, "upward name", "tract_cli.cli")     # its entry point
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                base, attrs = _chain(node)
                dotted = ".".join([bound[base]] + attrs) if base in bound else None
                target = _face_of(dotted) if dotted and dotted.count(".") == 1 else None
                if target and target not in faces_imported:
                    # `tract_cli.cli.main` after `import tract_cli`: reached, not imported here
                    check_faces(node, [dotted])
                if dotted in BINDINGS:
                    hit(node, "binding import", dotted)      # core.native, tract_cli.core.native
                    continue
                in_binding = dotted is not None and any(_within(dotted, b) for b in BINDINGS)
                if not in_binding and (
                        # x.native.lib, x.native.ffi, whatever x is
                        (node.attr in ("lib", "ffi") and isinstance(node.value, ast.Attribute)
                         and node.value.attr in ("native", "_native"))
                        # pool.lib, pool.native: the binding a core module imported
                        or (node.attr in ("lib", "ffi", "native", "_native")
                            and isinstance(node.value, ast.Name) and node.value.id in bound
                            and _within(bound[node.value.id], "tract_cli.core"))):
                    hit(node, "binding import", "tract_cli.core.native")
                    continue
                if not _private(node.attr):
                    continue
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                on_core = dotted is not None and _within(dotted, "tract_cli.core") \
                    and not any(_private(a) for a in attrs[:-1])   # reported at the first
                if on_core or (node.attr in private and not own):
                    hit(node, "private attribute", node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in BINDING_NAMES:
                base, attrs = _chain(node.args[0])
                if base in bound and _within(".".join([bound[base]] + attrs), "tract_cli.core"):
                    hit(node, "binding import", "tract_cli.core.native")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value):
                base, attrs = _chain(node.args[0])
                on_core = base in bound and _within(".".join([bound[base]] + attrs),
                                                    "tract_cli.core")
                if on_core or node.args[1].value in private:
                    hit(node, "private attribute", node.args[1].value)
    return found, edges


FACE_RULES = ("cli import", "face import")


def test_faces_use_only_the_public_core_and_core_never_calls_up():
    found = [v for v in scan() if v.key not in ALLOWED and v.rule not in FACE_RULES]
    assert not found, ("layering breaches (docs/ARCHITECTURE.md §2: give core a public "
                       "method instead):\n" + "\n".join(map(str, found)))


def test_faces_import_no_cli_and_only_the_faces_section_2_names():
    found = [v for v in scan() if v.rule in FACE_RULES]
    assert not found, (
        "face imports docs/ARCHITECTURE.md §2 does not allow (a face runs another command "
        "as a child process, core.spawn.module_command('tract_cli.cli', ...), never imports "
        "tract_cli.cli; what two faces share belongs in core, or, if the dependency is "
        "meant, in FACE_IMPORTS and §2 together):\n" + "\n".join(map(str, found)))


def test_every_allowed_face_import_is_still_made():
    """FACE_IMPORTS names what the faces do: a pair no longer imported is
    removed from it and from docs/ARCHITECTURE.md §2."""
    stale = sorted(set(FACE_IMPORTS) - face_imports())
    assert not stale, f"no longer imported, so remove from FACE_IMPORTS in {__file__}: {stale}"


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
    # dynamic imports of the binding
    "import importlib\nimportlib.import_module('tract_cli.core.native').lib":
        ("binding import", "tract_cli.core.native"),
    "from importlib import import_module\nimport_module('tract_cli._native')":
        ("binding import", "tract_cli._native"),
    "__import__('tract_cli.core.native')": ("binding import", "tract_cli.core.native"),
    "import sys\nsys.modules['tract_cli.core.native'].ffi":
        ("binding import", "tract_cli.core.native"),
    "import sys\nsys.modules.get('tract_cli._native')": ("binding import", "tract_cli._native"),
    # the binding through a chain rooted in core
    "import tract_cli.core as c\nc.native.lib.tract_fence(None)":
        ("binding import", "tract_cli.core.native"),
    "from tract_cli import core\ncore.native.ffi": ("binding import", "tract_cli.core.native"),
    "from tract_cli.core import pool\npool.native": ("binding import", "tract_cli.core.native"),
    "from tract_cli.core import pool\npool.lib.tract_fence()":
        ("binding import", "tract_cli.core.native"),
    "from tract_cli.core import pool as p\np.ffi.new('int[1]')":
        ("binding import", "tract_cli.core.native"),
    "def f(m):\n    return m.native.lib": ("binding import", "tract_cli.core.native"),
    # the binding as a core module re-exports it
    "from tract_cli.core.pool import lib, ffi": ("binding import", "tract_cli.core.native"),
    "from tract_cli.core import pool\ngetattr(pool, 'ffi')":
        ("binding import", "tract_cli.core.native"),
    # private names on a chain rooted in core, and core's module-level privates
    "import tract_cli.core.region\ntract_cli.core.region._params(None)":
        ("private attribute", "_params"),
    "from tract_cli import core\ncore.region._params": ("private attribute", "_params"),
    "from tract_cli.core.pool import Pool\nPool()._anything.x": ("private attribute", "_anything"),
    "def f(m):\n    return m._helper_of_core()": ("private attribute", "_helper_of_core"),
    "def f(p):\n    return p._slot_of_core": ("private attribute", "_slot_of_core"),
    "from tract_cli.core import region\ngetattr(region, '_anything')":
        ("private attribute", "_anything"),
    "def f(r):\n    return getattr(r, '_helper_of_core')": ("private attribute", "_helper_of_core"),
    # a C binding of the face's own
    "import cffi\ncffi.FFI().dlopen(None)": ("foreign binding", "cffi"),
    "from cffi import FFI": ("foreign binding", "cffi"),
    "import ctypes\nctypes.CDLL(None)": ("foreign binding", "ctypes"),
    "from ctypes.util import find_library": ("foreign binding", "ctypes"),
    "import importlib\nimportlib.import_module('ctypes')": ("foreign binding", "ctypes"),
    # the command line imported by a face, statically, dynamically or by a chain
    "from tract_cli.cli import main": ("cli import", "tract_cli.cli"),
    "import tract_cli.cli.serve_cmd": ("cli import", "tract_cli.cli.serve_cmd"),
    "from ..cli import app": ("cli import", "tract_cli.cli"),
    "from .. import cli": ("cli import", "tract_cli.cli"),
    "from tract_cli import serve, cli": ("cli import", "tract_cli.cli"),
    "import importlib\nimportlib.import_module('tract_cli.cli.inspect_cmd')":
        ("cli import", "tract_cli.cli.inspect_cmd"),
    "def f():\n    return __import__('tract_cli.cli')": ("cli import", "tract_cli.cli"),
    "import sys\nsys.modules['tract_cli.cli'].main()": ("cli import", "tract_cli.cli"),
    "import sys\nsys.modules.get('tract_cli.cli.app')": ("cli import", "tract_cli.cli.app"),
    "import tract_cli\ntract_cli.cli.main()": ("cli import", "tract_cli.cli"),
    "import tract_cli as t\nt.cli.app": ("cli import", "tract_cli.cli"),
    # a face the table does not let bench import
    "from tract_cli.connectors import vllm": ("face import", "tract_cli.connectors"),
    "import importlib\nimportlib.import_module('tract_cli.connectors.vllm')":
        ("face import", "tract_cli.connectors.vllm"),
    "import tract_cli\ntract_cli.connectors.vllm": ("face import", "tract_cli.connectors"),
}

# core calling up: a face imported dynamically, or named in a string
CORE_CASES = {
    "import importlib\nimportlib.import_module('tract_cli.serve.worker')":
        ("upward import", "tract_cli.serve.worker"),
    "def f():\n    return __import__('tract_cli.cli')": ("upward import", "tract_cli.cli"),
    "import sys\nsys.modules['tract_cli.bench']": ("upward import", "tract_cli.bench"),
    "import sys\nCMD = [sys.executable, '-m', 'tract_cli.cli', 'agent']":
        ("upward name", "tract_cli.cli"),
    "CMD = f'python -m tract_cli.provision.doctor {1}'": ("upward name", "tract_cli.provision"),
    "import re\nPAT = re.compile(r'tract_cli\\.(cli|serve)')": ("upward name", "tract_cli.cli"),
    "PAT = r'tract_cli\\.(?:inspect)\\b'": ("upward name", "tract_cli.inspect"),
    # the `tract` command launched by its script's name
    "import subprocess\nsubprocess.run(['tract', 'check', '/dev/dax0.0'])":
        ("upward name", "tract_cli.cli"),
    "import shutil\nEXE = shutil.which('tract')": ("upward name", "tract_cli.cli"),
    "import os\nos.execvp('tract', ['tract'])": ("upward name", "tract_cli.cli"),
    "import os\nos.spawnlp(os.P_NOWAIT, 'tract', 'tract', 'agent')":
        ("upward name", "tract_cli.cli"),
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
        class Slotted:
            __slots__ = ("_slot_of_core",)
        def _helper_of_core():
            pass
    """))
    (package / "bench" / "x.py").write_text(source + "\n")
    found = [(v.file, v.rule, v.name) for v in scan(package)]
    assert found == [("tract_cli/bench/x.py", *CASES[source])], found


@pytest.mark.parametrize("source", list(CORE_CASES), ids=range(len(CORE_CASES)))
def test_the_check_finds_core_calling_up_by_name(tmp_path, source):
    package = tmp_path / "tract_cli"
    (package / "core").mkdir(parents=True)
    (package / "core" / "spawn.py").write_text(
        '"""Starts `python -m tract_cli.cli`: a docstring may name a face."""\n' + source + "\n")
    found = [(v.file, v.rule, v.name) for v in scan(package)]
    assert found == [("tract_cli/core/spawn.py", *CORE_CASES[source])], found


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


# (face of the importing module, its source) -> the breach, or None where the
# table lets the import through
FACE_CASES = {
    ("serve", "from tract_cli.bench import session"): ("face import", "tract_cli.bench"),
    ("inspect", "from tract_cli.serve.engine import Engine"):
        ("face import", "tract_cli.serve.engine"),
    ("provision", "from tract_cli.inspect import snapshot"):
        ("face import", "tract_cli.inspect"),
    ("connectors", "import importlib\nimportlib.import_module('tract_cli.serve.model')"):
        ("face import", "tract_cli.serve.model"),
    ("serve", "from ..cli import serve_cmd"): ("cli import", "tract_cli.cli"),
    ("cli", "from tract_cli.connectors.vllm import TractConnector"):
        ("face import", "tract_cli.connectors.vllm"),
    ("", "from tract_cli import serve"): ("face import", "tract_cli.serve"),   # __init__
    ("", "from tract_cli.cli import main"): ("cli import", "tract_cli.cli"),
    # what the table allows
    ("bench", "from tract_cli.serve.launch import WorkerProcess"): None,
    ("bench", "from tract_cli.inspect import snapshot"): None,
    ("bench", "from ..provision.cpu import model_name"): None,
    ("cli", "from tract_cli.bench import plot\nfrom tract_cli.serve import app"): None,
    ("cli", "import tract_cli\ntract_cli.provision.doctor"): None,
    ("serve", "from tract_cli.serve import model\nfrom . import engine"): None,
}


@pytest.mark.parametrize("face,source", list(FACE_CASES), ids=range(len(FACE_CASES)))
def test_the_check_finds_each_face_import_the_table_does_not_allow(tmp_path, face, source):
    package = tmp_path / "tract_cli"
    (package / "core").mkdir(parents=True)
    (package / "core" / "__init__.py").write_text("")
    if face:
        (package / face).mkdir()
        (package / face / "__init__.py").write_text("")
        path = package / face / "x.py"
    else:
        path = package / "__init__.py"
    path.write_text(source + "\n")
    found = [(v.file, v.rule, v.name) for v in scan(package)]
    expected = FACE_CASES[(face, source)]
    rel = str(path.relative_to(tmp_path))
    assert found == ([(rel, *expected)] if expected else []), found
    if expected is None and face == "bench":
        assert len(face_imports(package)) == 1, "an allowed import is recorded as made"


def test_the_check_lets_a_face_launch_the_tract_command(tmp_path):
    """A face runs another command as a child process: that names
    `tract_cli.cli` (or the `tract` script) in a string, and is no import."""
    package = tmp_path / "tract_cli"
    for d in ("core", "serve", "bench"):
        (package / d).mkdir(parents=True)
        (package / d / "__init__.py").write_text("")
    (package / "serve" / "launch.py").write_text(textwrap.dedent("""
        import subprocess
        import sys
        from tract_cli.core.spawn import module_command
        subprocess.Popen(module_command("tract_cli.cli", "serve-prefill"))
        subprocess.run([sys.executable, "-m", "tract_cli.cli", "check", "/dev/dax0.0"])
    """))
    (package / "bench" / "x.py").write_text("import subprocess\n"
                                            "subprocess.run(['tract', 'inspect', 'p'])\n")
    assert scan(package) == []
