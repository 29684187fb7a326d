"""The shape of moe_autograd/remote: layers that import only downwards (no
circle, function-level imports included), two engines that do not know each
other, a client's side and a server's side that share only the wire, and no
module that could turn received bytes into code."""
import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2] / "moe_autograd"

#: Each module of remote/ and its layer (the table of remote/__init__.py's
#: docstring): a module may import only modules of lower layers.
LAYERS: Dict[str, int] = {
    "errors": 0, "frame": 0, "compression": 0, "factory": 0, "deadlines": 0, "stopping": 0,
    "balance": 0,
    "wire": 1, "auth": 1,
    "transport": 2, "rpc_bind": 2, "durable": 2, "lineage": 2,
    "endpoint": 3,
    "rpc_engine": 4, "ray_engine": 4, "channel": 4,
    "sizes": 5, "state": 5, "execution": 5, "gather": 5, "membership": 5, "registry": 5,

    "server": 6,
    "batch_server": 7,
    "batching": 8,
    "client": 9,
    "mirrored": 10, "loopback": 10,
    "replicas": 11,
    "fleet": 12, "elastic": 12, "ray_fleet": 12, "ray_server": 12, "job": 12,
    "cli": 13,
    "__init__": 14,
}
SERVER_SIDE = {"endpoint", "server", "batch_server", "state", "sizes", "execution", "gather"}
CLIENT_SIDE = {"channel", "batching", "client", "replicas", "balance"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: Dict[str, Path]) -> Set[str]:
    """Every moe_autograd module ``name`` imports, at any level of its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != name}


def _graph() -> Dict[str, Set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _remote_edges() -> List[Tuple[str, str]]:
    prefix = "moe_autograd.remote"
    edges = []
    for name, targets in _graph().items():
        if name == prefix or name.startswith(prefix + "."):
            mine = name[len(prefix) + 1:] or "__init__"
            for target in targets:
                if target.startswith(prefix + "."):
                    edges.append((mine, target[len(prefix) + 1:]))
    return edges


def test_every_remote_module_has_a_layer() -> None:
    modules = {p.stem for p in (ROOT / "remote").glob("*.py")}
    assert modules == set(LAYERS), sorted(modules ^ set(LAYERS))


def test_remote_imports_only_downwards() -> None:
    upward = [(a, b) for a, b in _remote_edges() if LAYERS[b] >= LAYERS[a]]
    assert upward == [], upward


def test_the_engines_and_the_two_sides_do_not_know_each_other() -> None:
    edges = set(_remote_edges())
    assert ("rpc_engine", "ray_engine") not in edges and ("ray_engine", "rpc_engine") not in edges
    assert not {(a, b) for a, b in edges if a in SERVER_SIDE and b in CLIENT_SIDE}
    assert not {(a, b) for a, b in edges if a in CLIENT_SIDE and b in SERVER_SIDE}
    assert "transport" not in {a for a, b in edges if b in ("rpc_engine", "ray_engine")}


def test_no_remote_import_circle() -> None:
    circles = [c for c in _cycles(_graph()) if any(m.startswith("moe_autograd.remote") for m in c)]
    assert circles == []


@pytest.mark.xfail(strict=True, reason="skip/'s layout, skippable and tracker still import each "
                                       "other (function-level imports); not touched this round")
def test_no_import_circle_in_the_package() -> None:
    assert _cycles(_graph()) == []


FORBIDDEN_MODULES = {"pickle", "cloudpickle", "marshal", "dill", "shelve", "copyreg", "_pickle"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_no_remote_module_can_turn_bytes_into_code() -> None:
    offences = []
    for path in sorted((ROOT / "remote").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                offences += [(path.name, a.name) for a in node.names
                             if a.name.split(".")[0] in FORBIDDEN_MODULES]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                if (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                    offences.append((path.name, node.module))
            elif isinstance(node, ast.Call):
                fn = node.func
                called = ast.unparse(fn)
                if (isinstance(fn, ast.Name) and fn.id in FORBIDDEN_CALLS) \
                        or called in ("torch.load", "builtins.eval", "builtins.exec"):
                    offences.append((path.name, called))
    assert offences == [], offences
