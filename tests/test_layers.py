"""The layering rules of docs/DESIGN.md, checked on the source (ast only: nothing is imported).

Packages, bottom to top: ``tiers`` <- ``cachestore`` <- ``connectors``; ``engine`` beside them,
reaching a connector only through the registry in ``engine/kv_connector.py`` (which names its
module as a string). Rules:

- ``cachestore/`` and ``tiers/`` import no torch at module level, not even through another
  module (``tiers/host.py`` imports it inside the functions that pin memory); neither does the
  offload connector's scheduler side (it runs on the scheduler thread, torch-free).
- ``tiers/`` imports nothing from ``cachestore/``, ``engine/`` or ``connectors/``;
  ``cachestore/`` nothing from ``engine/`` or ``connectors/``; ``engine/`` nothing from
  ``connectors/``. Every import counts here (module level, inside a function, or for typing).
- vLLM is imported only by ``connectors.vllm.connector`` and ``connectors.vllm.metrics`` (the
  vLLM connector's adapter; vLLM loads it by name, nothing of kvtier imports it), so no module
  of the project needs vLLM installed; the rest of ``connectors/vllm/`` is vLLM-free, and its
  scheduler side torch-free too.
- Inside ``cachestore/`` and ``tiers/``, only ``cachestore/server/`` (the daemon) and
  ``tiers/remote/`` (its client and the wire both share) import zmq, sockets or the HTTP
  server stack. (``engine/core`` talks ZMQ between its own processes; that is the engine's.)
- No import circle between modules of these packages, counting every import (a lazy or
  typing-only import still ties the two modules together).
- ``bench/`` may import anything of the product (and vLLM, to compare with it); no product
  package imports ``bench``.
- Inside ``engine/``, concepts sit on floors (``ENGINE_FLOORS``, bottom to top: the shared
  contract types at engine/'s root; kernels; attention and ``sched/``; ``models/``;
  ``runner/``; the offline engine ``llm_engine``/``llm``; ``core/``, the drivers;
  ``server/``; the ``engine`` facade and ``demo/``). An import goes to a lower floor or stays in
  its own concept: ``sched/`` never reaches ``runner/``, ``models/`` or ``attention/``,
  nothing below reaches ``core/`` or ``server/``. ``sched/`` also imports no device library
  (torch, triton, flashinfer), not even through another module.

A rule broken by the tree is a test failure naming the file and the import. ``ALLOWED`` lists
breaks the tree may still have, exactly (an entry that no longer occurs fails too, so the list
only shrinks); it is empty since the layout of issue 19. A module named only in a string (the
registries' ``importlib.import_module``) is no import here: that is how engine/ names a
connector without depending on it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("tiers", "cachestore", "connectors", "engine")
PACKAGES = (*PRODUCT, "bench")
NETWORK = ("zmq", "socket", "socketserver", "fastapi", "uvicorn", "starlette")
NETWORK_OWNERS = ("cachestore.server", "tiers.remote")
# The connectors' scheduler sides: torch-free even through what they import.
TORCH_FREE_EXTRA = (
    "connectors.offload.scheduler",
    "connectors.vllm.scheduler",
    "connectors.vllm.lookup",
    "connectors.vllm.config",
    "connectors.sglang.config",
    "connectors.sglang.keys",
    "connectors.sglang.stats",
)
# The only product modules that may import vllm (every import counts, as for the arrows);
# bench/ imports it to compare with it.
VLLM_OWNERS = ("connectors.vllm.connector", "connectors.vllm.metrics")
# The only module that may import sglang (SGLang's HiCache storage backend).
SGLANG_OWNERS = ("connectors.sglang.storage",)
# rule -> "path imports module" strings (no line numbers) still tolerated; see the docstring.
ALLOWED: dict[str, set[str]] = {
    "torch": set(),
    "arrows": set(),
    "network": set(),
    "vllm": set(),
    "sglang": set(),
    "circle": set(),
    "missing": set(),
    "floors": set(),
    "device": set(),
}
FORBIDDEN = {
    "tiers": ("cachestore", "engine", "connectors", "bench"),
    "cachestore": ("engine", "connectors", "bench"),
    "connectors": ("bench",),
    "engine": ("connectors", "bench"),
}
# engine/'s concepts, bottom to top: (floor, module prefixes). A module belongs to the concept
# of its longest matching prefix. engine.cli (the console script's table: it names its
# subcommands' modules as strings) sits at the bottom because the server asks it the version.
ENGINE_FLOORS: dict[str, tuple[int, tuple[str, ...]]] = {
    "contract": (
        0,
        tuple(
            f"engine.{m}"
            for m in (
                "config",
                "core_types",
                "request",
                "outputs",
                "sampling_params",
                "ttft",
                "kv_connector",
                "kv_cache",
                "request_log",
                "step_log",
                "gc_clock",
                "tokenizer",
                "chat_tokens",
                "startup_log",
                "cache_dir",
                "kv_stats",
                "grammar",
            )
        ),
    ),
    "cli": (0, ("engine.cli",)),
    "kernels": (1, ("engine.kernels",)),
    "attention": (2, ("engine.attention",)),
    "sched": (2, ("engine.sched",)),
    "models": (3, ("engine.models",)),
    "runner": (4, ("engine.runner",)),
    "llm": (5, ("engine.llm_engine", "engine.llm", "engine.llm_requests", "engine.llm_stats")),
    "core": (6, ("engine.core",)),
    "server": (7, ("engine.server",)),
    "top": (8, ("engine", "engine.demo")),
}
DEVICE_LIBRARIES = ("torch", "triton", "flashinfer", "cupy")


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module (or package), dotted
    line: int
    module_level: bool  # runs when the source module is imported (not in a function/typing)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, module_level: bool):
    """Yield (import node, module_level) for every import under ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, module_level
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, False)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), False)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), module_level)
        else:
            yield from _walk(child, module_level)


def _scan() -> tuple[set[str], list[Import]]:
    modules: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            modules[_module_name(path)] = path
    imports: list[Import] = []
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, module_level in _walk(tree, True):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # ``from pkg import submodule`` imports the submodule.
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules]
                targets = subs + ([mod] if len(subs) < len(node.names) else [])
            for target in targets:
                imports.append(Import(name, target, node.lineno, module_level))
    return set(modules), imports


MODULES, IMPORTS = _scan()


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _path(module: str) -> str:
    return module.replace(".", "/") + (
        "/__init__.py" if (ROOT / module.replace(".", "/")).is_dir() else ".py"
    )


def _where(imp: Import) -> str:
    return f"{_path(imp.source)} imports {imp.target}"


def _check(rule: str, found: list[str], what: str) -> None:
    """Fail on a break not in ALLOWED[rule], and on an allowed one that no longer occurs."""
    new = sorted(set(found) - ALLOWED[rule])
    stale = sorted(ALLOWED[rule] - set(found))
    assert not new, f"{what}:\n" + "\n".join(new)
    assert not stale, f"ALLOWED[{rule!r}] lists breaks that are gone; remove:\n" + "\n".join(stale)


def _chain(closure: dict[str, Import], target: str) -> str:
    """The import path that brought ``target`` in: ``a -> b -> target``."""
    path = [target]
    while path[-1] in closure and len(path) < 50:
        path.append(closure[path[-1]].source)
    return " -> ".join(reversed(path))


def _closure(start: str) -> dict[str, Import]:
    """Every module imported (at module level, transitively, parent packages included) when
    ``start`` is imported, each mapped to the import that first brought it in."""
    by_source: dict[str, list[Import]] = {}
    for imp in IMPORTS:
        if imp.module_level:
            by_source.setdefault(imp.source, []).append(imp)
    seen: dict[str, Import] = {}
    stack = [start]
    while stack:
        mod = stack.pop()
        parts = mod.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        for parent in parents:  # importing a.b.c runs a/__init__ and a/b/__init__ first
            if parent in MODULES and parent not in seen and parent != start:
                seen[parent] = Import(mod, parent, 0, True)
                stack.append(parent)
        for imp in by_source.get(mod, ()):
            if imp.target not in seen and imp.target != start:
                seen[imp.target] = imp
                if imp.target in MODULES:
                    stack.append(imp.target)
    return seen


def test_scan_sees_the_packages():
    # A rule checked over nothing passes vacuously: the scan must see the real tree.
    assert any(
        i.source == "engine.sched.block_pool" and i.target == "cachestore.hashing" for i in IMPORTS
    )
    missing = [
        m
        for m in (
            "tiers.base",
            "tiers.config",
            "tiers.remote.protocol",
            "cachestore.store",
            "cachestore.server",
            "cachestore.cost",
            "connectors.offload.scheduler",
            "connectors.device",
            "connectors.vllm.connector",
            "connectors.vllm.scheduler",
            "engine.kv_connector",
            "engine.sched.scheduler",
            "engine.runner.model_runner",
            "engine.models.loader",
            "engine.core.async_engine",
            "engine.demo.run",
            "bench.common",
            "bench.offload.main",
        )
        if m not in MODULES
    ]
    _check("missing", missing, "modules of the layout missing")


def _torch_free_roots() -> list[str]:
    roots = [m for m in MODULES if _within(m, "cachestore") or _within(m, "tiers")]
    return sorted(roots) + list(TORCH_FREE_EXTRA)


@pytest.mark.parametrize("module", _torch_free_roots())
def test_no_torch_at_module_level(module):
    if module not in MODULES:
        assert module in ALLOWED["missing"], f"{module} is missing"
        return
    closure = _closure(module)
    torch = sorted(t for t in closure if _within(t, "torch"))
    found = [f"{_path(module)} imports torch" for _ in torch[:1]]
    _check(
        "torch",
        found,
        f"{module} imports torch at module level: " + (_chain(closure, torch[0]) if torch else ""),
    )


def test_arrows_run_one_way():
    bad = [
        _where(imp)
        for imp in IMPORTS
        for package, above in FORBIDDEN.items()
        if _within(imp.source, package) and any(_within(imp.target, up) for up in above)
    ]
    _check("arrows", bad, f"arrows that run back up ({FORBIDDEN})")


def test_only_the_daemon_and_the_remote_tier_touch_the_network():
    bad = [
        _where(imp)
        for imp in IMPORTS
        if (_within(imp.source, "cachestore") or _within(imp.source, "tiers"))
        and any(_within(imp.target, net) for net in NETWORK)
        and not any(_within(imp.source, owner) for owner in NETWORK_OWNERS)
    ]
    _check("network", bad, f"only {NETWORK_OWNERS} may import {NETWORK}")


def test_only_the_vllm_adapter_imports_vllm():
    bad = [
        _where(imp)
        for imp in IMPORTS
        if _within(imp.target, "vllm")
        and imp.source not in VLLM_OWNERS
        and not _within(imp.source, "bench")
    ]
    _check("vllm", bad, f"only {VLLM_OWNERS} may import vllm")
    # The package vLLM names (``connectors.vllm``) imports nothing of kvtier or vLLM when
    # imported: the connector class loads on first access.
    eager = [
        _where(imp)
        for imp in IMPORTS
        if imp.source == "connectors.vllm"
        and imp.module_level
        and (imp.target in MODULES or _within(imp.target, "vllm"))
    ]
    assert not eager, "connectors/vllm/__init__.py must import lazily:\n" + "\n".join(eager)


def _cycles() -> list[list[str]]:
    """Strongly connected components (more than one module) of the full import graph."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        if imp.target in MODULES and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graph is a few hundred nodes deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    _check("circle", [" <-> ".join(c) for c in _cycles()], "import circles")


def test_only_the_sglang_backend_imports_sglang():
    bad = [
        _where(imp)
        for imp in IMPORTS
        if _within(imp.target, "sglang") and imp.source not in SGLANG_OWNERS
    ]
    _check("sglang", bad, f"only {SGLANG_OWNERS} may import sglang")
    # SGLang's factory imports ``connectors.sglang``: it imports nothing until the class is
    # asked for, so the rest of kvtier never needs SGLang.
    eager = [
        _where(imp)
        for imp in IMPORTS
        if imp.source == "connectors.sglang"
        and imp.module_level
        and (imp.target in MODULES or _within(imp.target, "sglang"))
    ]
    assert not eager, "connectors/sglang/__init__.py must import lazily:\n" + "\n".join(eager)


def _engine_concept(module: str) -> str | None:
    """The concept (an ``ENGINE_FLOORS`` key) of an engine module, by longest prefix."""
    best, best_len = None, -1
    for concept, (_, prefixes) in ENGINE_FLOORS.items():
        for prefix in prefixes:
            if _within(module, prefix) and len(prefix) > best_len:
                best, best_len = concept, len(prefix)
    return best


def test_every_engine_module_has_a_floor():
    # A new module at engine/'s root must be placed (in the contract, or a concept of its own).
    unplaced = [
        m
        for m in MODULES
        if _within(m, "engine")
        and _engine_concept(m) in (None, "top")
        and m != "engine"
        and not _within(m, "engine.demo")
    ]
    assert not unplaced, f"engine modules on no floor (add them to ENGINE_FLOORS): {unplaced}"


def test_engine_concepts_import_down():
    bad = []
    for imp in IMPORTS:
        if not (_within(imp.source, "engine") and _within(imp.target, "engine")):
            continue
        src, dst = _engine_concept(imp.source), _engine_concept(imp.target)
        if src is None or dst is None or src == dst:
            continue
        if ENGINE_FLOORS[dst][0] >= ENGINE_FLOORS[src][0]:
            bad.append(f"{_where(imp)} ({src} -> {dst})")
    _check("floors", bad, "engine/ imports that do not run down a floor (ENGINE_FLOORS)")


def test_the_scheduler_imports_no_device_library():
    direct = [
        _where(imp)
        for imp in IMPORTS
        if _within(imp.source, "engine.sched")
        and any(_within(imp.target, lib) for lib in DEVICE_LIBRARIES)
    ]
    _check("device", direct, "engine/sched imports a device library")
    for module in sorted(m for m in MODULES if _within(m, "engine.sched")):
        closure = _closure(module)
        found = sorted(t for t in closure if any(_within(t, lib) for lib in DEVICE_LIBRARIES))
        assert not found, f"{module} imports {found[0]} at module level: " + _chain(
            closure, found[0]
        )
