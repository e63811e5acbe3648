"""bench/api_soak.py through real daemons and a real two-worker API on CPU: with workers killed
under it, every answered request has its prompt's one greedy text, every failure is a broken
connection, the API stays up and stops cleanly, no daemon holds a block afterwards, and the
daemons stop cleanly."""

from __future__ import annotations

from pathlib import Path

import api_soak


def test_killed_workers_lose_only_their_own_requests(tmp_path: Path) -> None:
    argv = ["--requests", "600", "--kill-every", "1.0", "--out", str(tmp_path / "api_soak.json")]
    res = api_soak.run(api_soak.parse_args(argv))
    assert res["kills"] >= 1 and res["wrong"] == []
    assert all(k.split(":")[0] in api_soak.BROKEN for k in res["failures"]), res["failures"]
    assert res["api_up"] and res["api_stopped"] and res["daemons_stopped"]
    assert res["ok"] >= 300  # most requests reach a live worker
    nothing = {"owned": 0, "leased": 0, "requests": 0}
    assert res["held"] == {"prefill": nothing, "decode": nothing}
    assert res["clean"]
