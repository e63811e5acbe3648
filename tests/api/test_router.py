"""One API in front of two prefill daemons (`--client-socket` twice), each linked to both of two
decode daemons: real processes, the official `openai` client. Requests reach both prefills and
both decodes, repeats of one prompt go to one prefill, and a prefill killed under the API leaves
the other serving every request after it; nothing leaks."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api_server.daemons import STATUS_FRESH_S
from common import client
from tests.support.api import MODEL, start_api
from tests.support.daemons import Pair, short_dir, wait_ready
from tests.support.wait import poll


def _status(path: Path | str):  # type: ignore[no-untyped-def]
    return asyncio.run(client.status(str(path), timeout=5))


@pytest.fixture
def fleet(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Decodes d0, d1; prefills p0, p1 (each linked to both); the API in front of p0 and p1."""
    pairs = {n: Pair(short_dir(tmp_path_factory, f"rt{n}")) for n in ("d0", "d1", "p0", "p1")}
    decodes = [pairs[n].start("decode") for n in ("d0", "d1")]
    links = [a for d in decodes for a in ("--decode", str(d.socket))]
    prefills = [pairs[n].start("prefill", *links, wait=False) for n in ("p0", "p1")]
    for p in prefills:
        wait_ready(p, linked=True)
    api = start_api(
        pairs["p0"].runtime,
        *[a for p in prefills for a in ("--client-socket", str(p.socket))],
        "--link-socket",
        str(decodes[0].socket),
    )
    yield decodes, prefills, api
    api.stop()
    for pair in pairs.values():
        pair.kill_all()


def _metrics_once_reported(api, prefill: str, decodes) -> dict:  # type: ignore[no-untyped-def]
    """/metrics's samples by (name, sorted labels), once the first prefill has a load report
    (a heartbeat's PONG) from every decode: a link not yet reported has no load sample."""
    deadline = time.monotonic() + 10
    while True:
        status, _, body = api.get("/metrics")
        assert status == 200
        got = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }
        keys = [(("decode", str(d.socket)), ("pdkv_instance", prefill)) for d in decodes]
        if all(("pdkv_decode_free_blocks", k) in got for k in keys):
            return got
        assert time.monotonic() < deadline, "a decode's load never reached /metrics"
        time.sleep(0.2)


def _idle(path: Path | str) -> bool:
    """The daemon holds no request and no block."""
    st = _status(path)
    return st.inflight == 0 and st.pool["free"] == st.pool["total"]


def _complete(api, prompt: str) -> str:  # type: ignore[no-untyped-def]
    out = api.sync_client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0
    )
    return out.choices[0].text


def test_requests_reach_every_daemon_and_a_prefix_stays_on_one_prefill(fleet) -> None:  # type: ignore[no-untyped-def]
    decodes, prefills, api = fleet
    texts = {f"prompt number {i}: " + "x" * (i % 7): None for i in range(16)}
    for prompt in texts:
        texts[prompt] = _complete(api, prompt)
    served = [_status(p.socket).served for p in prefills]
    assert sum(served) == 16 and min(served) > 0, f"one prefill got everything: {served}"
    assert min(_status(d.socket).served for d in decodes) > 0
    # the same prompt again, 6 times: all on one prefill, and the same greedy text
    before = [_status(p.socket).served for p in prefills]
    prompt = next(iter(texts))
    assert all(_complete(api, prompt) == texts[prompt] for _ in range(6))
    after = [_status(p.socket).served for p in prefills]
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 6]
    status, _, body = api.get("/health")
    assert status == 200 and b'"ok"' in body
    # each daemon's series carry its own name (pdkv_instance), the one its STATUS reports
    names = [_status(p.socket).instance for p in prefills]
    assert len(set(names)) == 2 and all(n.startswith("prefill@") for n in names)
    got = _metrics_once_reported(api, names[0], decodes)
    for d in decodes:
        key = (("decode", str(d.socket)), ("pdkv_instance", names[0]))
        assert got[("pdkv_decode_link_up", key)] == 1
        # the load the decode reports on its heartbeat: blocks it has, sequences (none left)
        total = _status(d.socket).pool["total"]
        assert 0 < got[("pdkv_decode_free_blocks", key)] <= total
        assert got[("pdkv_decode_sequences", key)] >= 0
    for role, name in (("prefill", names[0]), (f"prefill@{prefills[1].socket}", names[1])):
        assert got[("pdkv_daemon_up", (("pdkv_instance", name), ("role", role)))] == 1
    # both decodes' own series: the --link-socket one as "decode", the other found through the
    # prefills' links as "decode@PATH"
    for role, d in (("decode", decodes[0]), (f"decode@{decodes[1].socket}", decodes[1])):
        who = (("pdkv_instance", _status(d.socket).instance), ("role", role))
        assert got[("pdkv_daemon_up", who)] == 1
        assert (
            got[("pdkv_pool_blocks", (*who, ("state", "total")))] == _status(d.socket).pool["total"]
        )
    logged = api.log.read_text()  # each request's line names its prefill and decode
    assert logged.count('"request_finished"') == 22
    for p in prefills:
        assert f'"prefill": "{p.socket}"' in logged
    for d in decodes:
        assert f'@{d.socket}"' in logged


def test_a_killed_prefill_leaves_the_other_serving(fleet) -> None:  # type: ignore[no-untyped-def]
    decodes, prefills, api = fleet
    prefills[0].stop(signal.SIGKILL)
    # The API takes a prefill's STATUS as its state for STATUS_FRESH_S (on the one monotonic
    # clock of the host), then asks again before a request and leaves out one that does not
    # answer. Its last STATUS of p0, if any, came before the kill (none was in flight): once the
    # clock is STATUS_FRESH_S past the kill, no request can go to p0. Not observable from outside
    # the API other than by that clock.
    time.sleep(STATUS_FRESH_S)
    texts = [_complete(api, f"after the kill {i}") for i in range(8)]
    assert all(isinstance(t, str) for t in texts)
    assert _status(prefills[1].socket).served == 8
    status, _, body = api.get("/health")
    assert status == 200 and b"degraded" in body and str(prefills[0].socket).encode() in body
    for d in (prefills[1], *decodes):  # a request's blocks are freed after its FINISH went out
        poll(lambda d=d: _idle(d.socket), timeout=10, what=f"{d.role} at {d.socket} idle")
