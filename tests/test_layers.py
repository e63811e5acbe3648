"""The module graph: no import circles, and the layers the architecture promises.

Static (every import statement, the lazy ones inside functions included), so an import that only
runs on some path is caught too. Imports of a package's parent are not edges (Python runs the
parent's __init__ first whatever imports the child).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "prefill_server", "decode_server", "api_server", "pdkv")


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                # the longest known module the target names (a module, or a name inside one)
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    deps.add(target)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports():
    graph = _graph()
    assert "common.transfer.producer" in graph["prefill_server.server"] | graph["common.transfer"]
    assert "decode_server.server" in graph["pdkv.commands"]  # a lazy import counts
    assert "common.client" in graph["api_server.daemons"]


def test_no_module_imports_itself_through_others():
    assert _cycles(_graph()) == []


def test_common_never_imports_what_is_built_on_it():
    for name, deps in _graph().items():
        if name == "common" or name.startswith("common."):
            above = {
                d
                for d in deps
                if d.startswith(("prefill_server", "decode_server", "api_server", "pdkv"))
            }
            assert not above, f"{name} imports {above}"


def test_the_api_is_a_client_of_the_daemons_not_of_the_app():
    for name, deps in _graph().items():
        if name.startswith("api_server"):
            above = {d for d in deps if d.startswith(("prefill_server", "decode_server", "pdkv"))}
            assert not above, f"{name} imports {above}"


def test_the_daemons_meet_only_in_common():
    for name, deps in _graph().items():
        if name.startswith("prefill_server"):
            assert not any(d.startswith("decode_server") for d in deps), name
        if name.startswith("decode_server"):
            assert not any(d.startswith("prefill_server") for d in deps), name


def test_only_the_app_imports_the_app():
    for name, deps in _graph().items():
        if not name.startswith("pdkv"):
            assert not any(d == "pdkv" or d.startswith("pdkv.") for d in deps), name


WIRE = (
    "common.wire.channel",
    "common.wire.tcplink",
    "common.wire.fd_inbox",
    "common.wire.frame_reader",
)
TRANSFER = ("common.transfer", "common.transfer.cache_manager", "common.transfer.layerwise")


def _in(name: str, layer: tuple[str, ...]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in layer)


def test_the_wire_and_the_transfer_meet_only_in_the_message_types():
    """Frames, channels and links carry the transfer's messages and never import it; the
    transfer imports of the wire only its message types (common.protocol)."""
    graph = _graph()
    wire = [n for n in graph if _in(n, WIRE) or _in(n, ("common.protocol",))]
    assert {"common.wire.channel", "common.wire.tcplink", "common.wire.fd_inbox"} <= set(wire)
    for name in wire:
        into = {d for d in graph[name] if _in(d, TRANSFER)}
        assert not into, f"{name} imports {into}"
    transfer = [n for n in graph if _in(n, TRANSFER)]
    assert "common.transfer.registry" in transfer
    for name in transfer:
        down = {d for d in graph[name] if _in(d, WIRE)}
        assert not down, f"{name} imports {down} (the wire's message types are common.protocol)"


TRANSFER_FACE = {"common.transfer", "common.transfer.interface", "common.transfer.registry"}


def test_the_daemons_reach_the_transfer_only_through_its_interface():
    """No daemon module imports a transport's module (the IPC pair, NIXL's): they get their
    producer and consumers from the registry by link kind and read `caps`, so a new transport
    is a new module plus a `register` line, and no daemon code branches on which one it has."""
    graph = _graph()
    daemons = [n for n in graph if n.startswith(("prefill_server", "decode_server"))]
    assert "decode_server.peer" in daemons and "prefill_server.link" in daemons
    for name in daemons:
        inner = {
            d for d in graph[name] if d.startswith("common.transfer") and d not in TRANSFER_FACE
        }
        assert not inner, f"{name} imports {inner}: use common.transfer's interface and registry"


def test_shared_code_has_no_role_branches():
    """What differs between the daemons lives in each daemon (its config, its warm-up, its
    server's class attributes): no module of common/ compares a `.role` or `role` to a name."""
    found = []
    for path in sorted((ROOT / "common").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            names = {
                s.attr if isinstance(s, ast.Attribute) else getattr(s, "id", None) for s in sides
            }
            literal = any(
                isinstance(s, ast.Constant) and s.value in ("prefill", "decode") for s in sides
            )
            if "role" in names and literal:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
