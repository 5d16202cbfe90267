"""The import rule, read from the source: the process packages never import one another (only
proto/ and common/), common/ and proto/ import no torch and no process package, and there is no
import circle among the modules of the packages below (every import counts, also the ones made
inside a function or under TYPE_CHECKING)."""

from __future__ import annotations

import ast
import os

from tests.helpers.server import ROOT

PROCESSES = ("tokenizer_proc", "scheduler_proc", "gpu_worker", "router")
SHARED = ("proto", "common")
CHECKED_FOR_CIRCLES = ("common", "proto", "router", "tandem", "tokenizer_proc", "scheduler_proc")


def _modules(package: str) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(dirpath, name)
    return out


def _imports(path: str, module: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                parts = module.split(".")[: -node.level] if not path.endswith("__init__.py") else \
                    module.split(".")[: len(module.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def _graph(packages) -> dict[str, set[str]]:
    mods: dict[str, str] = {}
    for p in packages:
        mods.update(_modules(p))
    return {m: {i for i in _imports(path, m) if i in mods and i != m} for m, path in mods.items()}


def test_process_packages_share_only_proto_and_common():
    for pkg in PROCESSES:
        for mod, path in _modules(pkg).items():
            others = {i.split(".")[0] for i in _imports(path, mod)} & {*PROCESSES, "tandem"}
            assert others <= {pkg}, f"{mod} imports {others - {pkg}}"


def test_common_and_proto_import_no_torch_and_no_process_package():
    for pkg in SHARED:
        for mod, path in _modules(pkg).items():
            tops = {i.split(".")[0] for i in _imports(path, mod)}
            assert not tops & {"torch", "triton", *PROCESSES, "tandem"}, f"{mod}: {tops}"


def test_no_import_circles():
    graph = _graph(CHECKED_FOR_CIRCLES)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
