"""The test suite's own layering: what test modules share lives in tests/support, the one part of
tests/ that any module imports. A test module or a conftest.py imported by another module is
loaded a second time under another name (pytest imports it under its own: `api.conftest`, not
`tests.api.conftest`), with its own copies of classes and module state, and a helper kept in a
test module ties the tests that import it to that module's edits. A conftest.py holds fixtures
and hooks only: what it would share with others belongs in tests/support.

Every module under tests/ is read with `ast`, imports inside functions included; so are string
constants that name a module to run (`python -m tests.x.y`, `importlib.import_module`)."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS / "support"


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _in_support(path: Path) -> bool:
    return path == SUPPORT or SUPPORT in path.parents


def _dotted(path: Path, tests: Path) -> str:
    """`tests.a.b` for tests/a/b.py, `tests.a` for tests/a/__init__.py."""
    parts = path.relative_to(tests.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _bare_names() -> dict[str, Path]:
    """Top-level names under which a module of tests/ outside tests/support imports when its
    directory is on sys.path (pytest puts the first directory above a test module that is not a
    package there; a conftest may add one): a module's file name, a package's directory name.
    Names of the standard library are left out (a test's `import random` is not tests/...)."""
    names: dict[str, Path] = {}
    for path in _modules():
        if _in_support(path):
            continue
        stem = path.parent.name if path.name == "__init__.py" else path.stem
        if stem not in sys.stdlib_module_names:
            names.setdefault(stem, path)
    return names


def _imports(path: Path, tests: Path = TESTS) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every module `path` (in the tree `tests`) imports, and of
    every string constant that is a dotted name under `tests.`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _dotted(path if path.name == "__init__.py" else path.parent, tests)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from tests import api`: a module, not a name
                if alias.name != "*":
                    yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Constant) and _names_a_module(node.value, tests):
            yield node.lineno, node.value


def _names_a_module(value: object, tests: Path) -> bool:
    """`value` is the dotted name of a module in the tree `tests` (`python -m tests.a.b`)."""
    if not isinstance(value, str) or not value.startswith("tests.") or " " in value:
        return False
    path = tests.parent.joinpath(*value.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _forbidden(module: str, bare: dict[str, Path]) -> str | None:
    """Why importing `module` breaks the layering, or None."""
    parts = module.split(".")
    if parts[0] == "tests":
        if len(parts) == 1 or parts[1] == "support":
            return None
        return "a module of tests/ outside tests/support"
    if parts[0] in bare:
        return f"tests/{bare[parts[0]].relative_to(TESTS)} by its bare name"
    return None


def test_only_tests_support_is_imported() -> None:
    """By the modules of tests/, and by the benches (which may share tests/support too)."""
    bare = _bare_names()
    benches = sorted((TESTS.parent / "bench").glob("*.py"))
    found: dict[str, str] = {}
    for path in [*_modules(), *benches]:
        for line, module in _imports(path):
            why = _forbidden(module, bare if path.is_relative_to(TESTS) else {})
            where = f"{path.relative_to(TESTS.parent)}:{line}"
            if why is not None and where not in found:  # `from m import a, b`: m, once
                found[where] = f"{where}: {module} ({why})"
    assert not found, "move what they share into tests/support:\n" + "\n".join(found.values())


def _is_fixture(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
    return False


def test_a_conftest_holds_fixtures_and_hooks_only() -> None:
    found = []
    for path in _modules():
        if path.name != "conftest.py":
            continue
        for node in ast.parse(path.read_text()).body:
            where = f"{path.relative_to(TESTS.parent)}:{node.lineno}"
            if isinstance(node, ast.ClassDef):
                found.append(f"{where}: class {node.name}")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                private = node.name.startswith("_")
                if not (_is_fixture(node) or node.name.startswith("pytest_") or private):
                    found.append(f"{where}: def {node.name} (neither a fixture nor a hook)")
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name) and not t.id.startswith("_"):
                        found.append(f"{where}: {t.id} = ...")
    assert not found, "a conftest.py shares nothing but fixtures (tests/support):\n" + "\n".join(
        found
    )


def test_the_checks_see_what_they_forbid(tmp_path: Path) -> None:
    """The walk above finds each way of importing another test module."""
    bare = {"protocol_strategies": TESTS / "protocol" / "x.py", "api": TESTS / "api" / "x.py"}
    cases = {
        "from tests.api.conftest import Stack": True,
        "import tests.decode.test_requests": True,
        "from tests import api": True,
        "from tests.support.api import Stack": False,
        "from tests.support import gpu_procs": False,
        "import protocol_strategies": True,
        "from api import conftest": True,
        "def f():\n    from tests.faults.fakes import FakeDecode": True,
        "MODULE = 'tests.faults.wrapped_daemon'": True,
        "MODULE = 'tests.support.wrapped_daemon'": False,
        "import random": False,
    }
    package = tmp_path / "tests" / "x"
    package.mkdir(parents=True)
    for name in ("faults/wrapped_daemon.py", "support/wrapped_daemon.py"):
        (tmp_path / "tests" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "tests" / name).touch()
    for i, (src, bad) in enumerate(cases.items()):
        path = package / f"case{i}.py"
        path.write_text(src + "\n")
        mods = [m for _, m in _imports(path, tmp_path / "tests")]
        assert any(_forbidden(m, bare) for m in mods) == bad, src
    rel = package / "rel.py"
    rel.write_text("from .conftest import Stack\nfrom ..support import api\n")
    assert [m for _, m in _imports(rel, tmp_path / "tests")] == [
        "tests.x.conftest",
        "tests.x.conftest.Stack",
        "tests.support",
        "tests.support.api",
    ]
