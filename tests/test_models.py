"""`pdkv model get` (pdkv/models.py) as a new user meets it: a missing package is named in one
line, and the README's install line names every package the command needs beyond pdkv's own
dependencies (what `make demo` installs)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from pdkv import models

ROOT = Path(__file__).resolve().parents[1]
#: Runs `pdkv model get` in a child process whose imports of one package fail as if it were not
#: installed: a meta path finder, first on sys.meta_path, refuses the package and its submodules.
BLOCKED_RUN = """
import importlib.abc, sys
blocked = sys.argv.pop(1)

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == blocked or name.startswith(blocked + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
from pdkv.cli import main
sys.argv[0] = "pdkv"
main()
"""


def _model_get_without(module: str, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    """`pdkv model get --cache-dir CACHE_DIR` where `module` cannot be imported."""
    argv = [sys.executable, "-c", BLOCKED_RUN, module, "model", "get"]
    argv += ["--cache-dir", str(cache_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_model_get_names_a_missing_converter_package_in_one_line(tmp_path: Path) -> None:
    for module in ("transformers", "gguf"):
        proc = _model_get_without(module, tmp_path / module)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stdout == ""
        assert "Traceback" not in proc.stderr, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, proc.stderr
        assert module in lines[0] and "not installed" in lines[0], lines[0]
        assert "pip install" in lines[0], lines[0]


def _readme_install_line() -> list[str]:
    """The packages of the README's `pip install --no-deps WHEEL && pip install ...` line."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(r"^pip install --no-deps (\S+) && pip install ([^\n]+)$", text, re.M)
    assert len(found) == 1, found
    wheel, rest = found[0]
    return [wheel, *rest.split()]


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _imported_top_modules(path: Path) -> set[str]:
    """Every top-level module `path` imports, lazily inside functions included."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def test_readme_install_line_names_every_package_model_get_needs() -> None:
    named = {_name(p) for p in _readme_install_line()}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = {_name(re.match(r"[A-Za-z0-9_.-]+", d).group()) for d in project["dependencies"]}
    dists = importlib.metadata.packages_distributions()
    needed = {_name(models.MODELS[models.DEFAULT_MODEL].package)}
    for module in _imported_top_modules(ROOT / "pdkv" / "models.py") | set(
        models.CONVERTER_MODULES
    ):
        if module in sys.stdlib_module_names or (ROOT / module).is_dir():
            continue
        provided = {_name(d) for d in dists.get(module, [module])}
        if not provided & own:
            needed |= provided
    assert "transformers" in needed  # the conversion's own import, not one of pdkv's dependencies
    assert needed <= named, f"the README's install line lacks {sorted(needed - named)}"
    # the line `pdkv model get` prints when a package is missing installs the same packages
    command = models.install_command(models.MODELS[models.DEFAULT_MODEL])
    printed = {_name(w) for w in command.split() if not w.startswith("-")}
    assert named <= printed, command
