"""examples/transfer_library.py runs (two real processes on CPU, every check of theirs holds), and
docs/library.md cannot drift from the code: its complete example is that file, byte for byte, and
its other snippets import only names that exist and call CacheManager / TransferTask / Cache only
through methods and keywords they have."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.transfer.cache_manager import Cache, CacheManager, TransferTask

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "transfer_library.py"
DOC = ROOT / "docs" / "library.md"
COMPLETE = "## A complete example"

# What the example must report: each a check that compares real values across the two processes
CHECKS = [
    "[peer] OK: the owner holds the prompt's blocks in [5, 2, 7]",
    "[peer] OK: pulled blocks [5, 2, 7] into [0, 1, 2]: values match",
    "[peer] OK: pulled block 5 into 3 layer by layer [0, 1]: values match",
    "[owner] OK: block 9 holds the values the peer pushed",
    "[peer] OK: pushed block 4 into the owner's block 9",
    "[peer] OK: a pull of a block the owner does not have is refused: source block ids [16]",
    "[owner] OK: the peer exited with 0",
    "[owner] all checks passed",
]


@pytest.fixture(scope="module")
def run() -> subprocess.CompletedProcess[str]:
    # from another directory, as a user would: the script needs only the installed package
    return subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd="/", capture_output=True, text=True, timeout=120
    )


def test_the_example_runs_two_processes_and_every_check_holds(run) -> None:  # type: ignore[no-untyped-def]
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    for check in CHECKS:
        assert any(line.startswith(check) for line in lines), f"{check!r} not in:\n{run.stdout}"
    assert "FAILED" not in run.stdout
    assert "Traceback" not in run.stderr


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def _split_doc() -> tuple[str, str]:
    text = DOC.read_text()
    assert text.count(COMPLETE) == 1
    head, complete = text.split(COMPLETE)
    return head, complete


def test_the_docs_complete_example_is_the_example_file() -> None:
    _, complete = _split_doc()
    blocks = _blocks(complete, "python")
    assert len(blocks) == 1
    assert blocks[0] == EXAMPLE.read_text(), "docs/library.md: paste examples/transfer_library.py"


def test_the_docs_shown_output_is_what_the_example_prints(run) -> None:  # type: ignore[no-untyped-def]
    _, complete = _split_doc()
    (shown,) = _blocks(complete, "text")
    # the checks' lines (payload sizes and the like may change without the doc lying)
    shown_checks = [line for line in shown.splitlines() if " OK: " in line]
    printed = run.stdout.splitlines()
    assert shown_checks and all(line in printed for line in shown_checks)


# the names the doc's snippets use for objects of the library's types
TYPES = {"mgr": CacheManager, "task": TransferTask, "mine": Cache, "theirs": Cache, "cache": Cache}


def _members(cls: type) -> set[str]:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return fields | set(dir(cls))


def _typed(node: ast.AST) -> type | None:
    """The library type of `node` when it is one of the names in TYPES."""
    return TYPES.get(node.id) if isinstance(node, ast.Name) else None


def _check_snippet(code: str) -> list[str]:
    """Problems of one snippet: imports that fail, members or keywords that do not exist."""
    problems = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            try:
                exec(compile(ast.Module([node], []), "<doc>", "exec"), {})
            except ImportError as exc:
                problems.append(f"import: {exc}")
        elif (
            isinstance(node, ast.Attribute)
            and (cls := _typed(node.value))
            and node.attr not in _members(cls)
        ):
            problems.append(f"{cls.__name__}.{node.attr}: no such member")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and (cls := _typed(node.func.value))
            and callable(method := getattr(cls, node.func.attr, None))
        ):
            params = inspect.signature(method).parameters
            problems += [
                f"{cls.__name__}.{node.func.attr}({kw.arg}=): no such keyword"
                for kw in node.keywords
                if kw.arg not in params
            ]
    return problems


def test_the_docs_snippets_use_only_names_that_exist() -> None:
    head, _ = _split_doc()
    snippets = _blocks(head, "python")
    assert len(snippets) >= 3
    problems = [p for code in snippets for p in _check_snippet(code)]
    assert problems == []


def test_the_snippet_check_catches_drift() -> None:  # the check above can fail
    assert _check_snippet("from common.transfer.cache_manager import CacheManger")
    assert _check_snippet("mgr.pull_block(theirs, mine, [0], [0])")
    assert _check_snippet("mgr.import_cache(payload, fds, devce='cpu')")
    assert _check_snippet("task.wait()")
    assert not _check_snippet("mgr.import_cache(payload, fds, device='cpu'); theirs.blocks()")
