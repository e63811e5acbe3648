"""docs/operations.md's settings tables, rendered from the config classes' declared settings
(common.settings): `python -m pdkv.settings_doc [FILE]` rewrites each table between its
`<!-- settings: NAME -->` and `<!-- /settings -->` lines; tests/test_settings.py fails when a
table differs from its rendering."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from api_server.config import ApiConfig
from common.settings import Setting, declared
from decode_server.config import DecodeConfig
from prefill_server.config import PrefillConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
_BLOCK = re.compile(r"(<!-- settings: (\w+) -->\n)(.*?)(<!-- /settings -->)", re.S)


def default_text(s: Setting) -> str:
    """A setting's default as the docs write it: 10 (seconds), on, a phrase, or — for none."""
    if isinstance(s.option.show_default, str):
        return s.option.show_default
    if s.type is bool:
        return "on" if s.default else "off"
    if s.default is None or s.default == ():
        return "—"
    return f"{s.default:g}" if isinstance(s.default, float) else str(s.default)


def _flags(s: Setting) -> str:
    o = s.option
    return f"`{o.flag}` / `{o.no_flag}`" if o.negatable else f"`{o.flag}`"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def daemons_table() -> str:
    """Both daemons' settings: the shared ones first, then the decode's, then the prefill's."""
    decode, prefill = declared(DecodeConfig), declared(PrefillConfig)
    shared = {s.name for s in decode} & {s.name for s in prefill}
    rows = [(s, "both") for s in prefill if s.name in shared]
    rows += [(s, "decode") for s in decode if s.name not in shared]
    rows += [(s, "prefill") for s in prefill if s.name not in shared]
    lines = ["| Option | Environment | Default | Daemon | Meaning |", "|---|---|---|---|---|"]
    for s, role in rows:
        lines.append(_row([_flags(s), f"`{s.option.env}`", default_text(s), role, s.option.help]))
    return "\n".join(lines) + "\n"


def api_table() -> str:
    lines = ["| Option | Environment | Default | Meaning |", "|---|---|---|---|"]
    for s in declared(ApiConfig):
        lines.append(_row([_flags(s), f"`{s.option.env}`", default_text(s), s.option.help]))
    return "\n".join(lines) + "\n"


TABLES = {"daemons": daemons_table, "api": api_table}


def tables_in(text: str) -> dict[str, str]:
    """Each marked table of `text` by its name."""
    return {m.group(2): m.group(3) for m in _BLOCK.finditer(text)}


def render(text: str) -> str:
    """`text` with every marked table replaced by its rendering."""
    return _BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)]() + m.group(4), text)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else DOC
    path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
