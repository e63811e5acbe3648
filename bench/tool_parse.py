"""What reading tool calls costs the API per streamed piece: one answer of a text and one hermes
call with ~3 KB of arguments, fed 4 characters at a time (about a token), the calls rescanned as
they grow (api_server.tools). One process, no daemons.

    .venv/bin/python bench/tool_parse.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from api_server.tools.assembler import ToolAssembler, fold
from api_server.tools.parsers import Hermes


def one_answer(pieces: list[str]) -> tuple[float, dict]:
    started = time.perf_counter()
    asm = ToolAssembler(Hermes())
    deltas = [d for p in pieces for d in asm.feed(p)]
    deltas += asm.finish("stop")[0]
    return time.perf_counter() - started, fold(deltas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    arguments = json.dumps(
        {"items": [{"name": f"item {i}", "tags": ["a", 'b"c'], "n": i} for i in range(60)]}
    )
    text = f'Sure. <tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    times = []
    for _ in range(args.rounds):
        seconds, message = one_answer(pieces)
        assert message["tool_calls"][0]["function"]["arguments"] == arguments
        times.append(seconds / len(pieces))
    print(
        f"{len(text)} chars in {len(pieces)} pieces: {statistics.median(times) * 1e6:.1f} µs a "
        f"piece (median of {args.rounds}; min {min(times) * 1e6:.1f})"
    )


if __name__ == "__main__":
    main()
