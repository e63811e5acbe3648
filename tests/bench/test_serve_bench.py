"""bench/serve.py for real: its own daemon pair, an API server of its own in front of it, and the
in-process engine, tiny model, a handful of requests; checks the JSON it writes (what ran, not how
fast) and that nothing of the pair or the API is left behind."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.model.tokenizer import ByteTokenizer

SERVE = Path(__file__).resolve().parents[2] / "bench" / "serve.py"
PROMPT, OUTPUT = "3:20", "2:6"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cwd = tmp_path_factory.mktemp("elsewhere")  # not the repo: the script must find its way
    out = cwd / "serve.json"
    argv = [sys.executable, str(SERVE), "--requests", "6", "--rate", "50", "--warmup", "0"]
    argv += ["--prompt-len", PROMPT, "--output-len", OUTPUT, "--seed", "3"]
    argv += ["--target", "all", "--device", "cpu", "--json", str(out)]
    argv += ["--api-workers", "2"]  # the API as two processes: the CPU is summed over them
    tmp = tmp_path_factory.mktemp("tmp")  # where the bench makes its pair's runtime dir
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not list(tmp.iterdir()), "the pair's runtime dir (sockets, logs) is removed"
    assert not _processes_under(tmp), "the daemons and the API are stopped"
    assert "TTFT p99" in proc.stdout
    assert all(f"\n{t} " in proc.stdout for t in ("daemons", "api", "local")), proc.stdout
    assert "same tokens from daemons and local at 50/s: 6/6 requests" in proc.stdout
    assert "same text from api as daemons' tokens at 50/s: 6/6 requests" in proc.stdout
    assert not list(cwd.glob("*.png")), "no plot without --sweep"
    return {**json.loads(out.read_text()), "stdout": proc.stdout}


def _processes_under(path: Path) -> list[str]:
    """Command lines of live processes that name `path` (the bench's runtime dir is under it)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(path) in text:
            found.append(text)
    return found


def test_every_target_ran_the_same_workload(report: dict) -> None:
    runs = [(r["target"], r["rate"]) for r in report["runs"]]
    assert runs == [("daemons", 50), ("api", 50), ("local", 50)]
    daemons, api, local = (r["requests"] for r in report["runs"])
    drawn = [(q["prompt_len"], q["output_len"]) for q in daemons]
    assert drawn == [(q["prompt_len"], q["output_len"]) for q in api]
    assert drawn == [(q["prompt_len"], q["output_len"]) for q in local]
    assert len(drawn) == 6 and len(set(drawn)) > 1, "lengths are drawn, not fixed"
    for p, o in drawn:
        assert 3 <= p <= 20 and 2 <= o <= 6


def test_every_request_completed_with_its_drawn_length(report: dict) -> None:
    for run in report["runs"]:
        s = run["summary"]
        assert (s["requests"], s["completed"], s["failed"]) == (6, 6, 0), s["errors"]
        for q in run["requests"]:
            assert q["ok"] and q["error"] is None
            assert q["output_tokens"] == q["output_len"], q  # the api's: its usage count
            if run["target"] == "api":  # chunks of text: a partial UTF-8 character is held back
                assert q["tokens"] == [] and q["text"]
                assert len(q["itl_ms"]) <= q["output_len"] - 1
            else:  # a frame per token, unless the relay merged steps queued while the client
                # lagged (prefill_server/pipeline.py `_relay`), as on a loaded 2-vCPU machine
                assert 1 <= len(q["itl_ms"]) <= q["output_len"] - 1
            assert 0 < q["ttft_ms"] <= q["e2e_ms"]
        assert s["output_tokens"] == sum(q["output_len"] for q in run["requests"])


def test_greedy_output_is_the_same_through_every_target(report: dict) -> None:
    daemons, api, local = (r["requests"] for r in report["runs"])
    assert [q["tokens"] for q in daemons] == [q["tokens"] for q in local]
    decode = ByteTokenizer().decode  # the tiny model's
    assert [decode(q["tokens"]) for q in daemons] == [q["text"] for q in api]


def test_summary_figures_are_consistent(report: dict) -> None:
    for run in report["runs"]:
        s = run["summary"]
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            d = s[key]
            assert 0 <= d["p50"] <= d["p99"], (run["target"], key, d)
        assert s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"] + 1e-9
        assert s["request_throughput"] > 0 and s["output_throughput"] > 0
        assert s["duration_s"] > 0
        lag = s["send_lag_ms"]  # every request went, none before it was due
        assert 0 <= lag["p50"] <= lag["p99"], (run["target"], lag)
        for q in run["requests"]:
            assert q["sent_s"] >= q["start_s"], q


@pytest.fixture(scope="module")
def late_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The daemons alone with the early handoff off: the HANDOFF carries the first token."""
    out = tmp_path_factory.mktemp("late") / "serve.json"
    argv = [sys.executable, str(SERVE), "--requests", "6", "--rate", "50", "--warmup", "0"]
    argv += ["--prompt-len", PROMPT, "--output-len", OUTPUT, "--seed", "3"]
    argv += ["--target", "daemons", "--device", "cpu", "--json", str(out)]
    env = dict(os.environ, PDKV_EARLY_HANDOFF="0")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def _check_timings(t: dict, *, early: bool) -> None:
    """One request's FINISH timings (both daemons'), for the way its HANDOFF went."""
    assert t["handoff_us"] > 0 and t["decode_handoff_us"] > 0 and t["pull_us"] >= 0, t
    assert 0 < t["usable_us"] < t["total_ms"] * 1000, t
    # decode_ms is rounded to the microsecond, first_step_us to a tenth: a one-step decode can
    # read 1257.1 µs against 1.257 ms
    assert 0 < t["first_step_us"] <= t["decode_ms"] * 1000 + 0.5, t
    assert t["read_us"] > 0 and t["admit_us"] > 0 and t["enqueue_us"] > 0, t
    assert 0 < t["wire_us"] <= t["read_us"], t
    if early:  # the HANDOFF left before the first token; its TOKENS started the pull
        assert t["handoff_after_first_us"] < 0 and t["first_wait_us"] > 0, t
        assert t["first_read_us"] > 0, t
        assert t["first_read_us"] + t["enqueue_us"] <= t["usable_us"] + 1, t
    else:
        assert t["handoff_after_first_us"] > 0 and "first_wait_us" not in t, t
        assert t["read_us"] + t["admit_us"] + t["enqueue_us"] <= t["usable_us"] + 1, t


def test_the_daemons_report_their_own_timings(report: dict, late_report: dict) -> None:
    daemons, api, local = report["runs"]
    for q in daemons["requests"]:  # from each FINISH: the handoff as both daemons saw it
        _check_timings(q["server_timings"], early=True)  # the default on a Unix socket
    for q in late_report["runs"][0]["requests"]:
        _check_timings(q["server_timings"], early=False)
    assert [q["tokens"] for q in late_report["runs"][0]["requests"]] == [
        q["tokens"] for q in daemons["requests"]
    ]
    handoff = daemons["summary"]["server_timings"]["handoff_us"]
    assert 0 < handoff["p50"] <= handoff["p99"]
    assert api["summary"]["server_timings"] == local["summary"]["server_timings"] == {}
    # the API of its own: its process's CPU per output token, which only the api run has
    assert api["summary"]["server_cpu_us_per_token"] > 0
    assert 0 < api["summary"]["server_cpu_share"] < 4
    assert "server_cpu_us_per_token" not in daemons["summary"]
    assert "the API's CPU (its workers' too): " in report["stdout"]
    second = daemons["summary"]["second_token_ms"]
    assert 0 < second["p50"] <= second["p99"]
    assert "server's own timings p50/p99: " in report["stdout"]


def test_nano_is_nano_vllms_shape_and_sizes_the_pool_for_it() -> None:
    import serve

    args = serve.parse_args(["--nano", "--block-size", "16"])
    assert (args.requests, args.rates) == (256, [float("inf")])
    assert args.prompt_len == args.output_len == (100, 1024)
    assert args.max_batch == 256 and args.num_blocks >= 256 * 2048 // 16
    with pytest.raises(SystemExit):
        serve.parse_args(["--nano", "--sweep", "1,2"])


def test_workload_sets_fixed_lengths() -> None:
    import serve

    args = serve.parse_args(["--workload", "2048x512", "--rate", "2"])
    assert (args.prompt_len, args.output_len, args.rates) == ((2048, 2048), (512, 512), [2.0])
    for bad in (["--workload", "2048"], ["--workload", "0x5"], ["--workload", "1x1", "--nano"]):
        with pytest.raises(SystemExit):
            serve.parse_args(bad)


def test_auto_pools_are_for_a_pair_the_bench_starts() -> None:
    import serve

    args = serve.parse_args(["--num-blocks", "auto", "--memory-fraction", "0.3"])
    assert (args.num_blocks, args.memory_fraction) == ("auto", 0.3)
    assert serve.parse_args(["--nano", "--num-blocks", "auto"]).num_blocks == "auto"
    for bad in (
        ["--num-blocks", "auto", "--target", "local"],
        ["--num-blocks", "auto", "--client-socket", "/tmp/x.sock"],
        ["--num-blocks", "auto", "--target", "tier", "--turns", "2"],
        ["--memory-fraction", "0.3"],
        ["--num-blocks", "0"],
    ):
        with pytest.raises(SystemExit):
            serve.parse_args(bad)


def test_auto_pools_size_the_pair_and_one_process_gets_the_decodes(tmp_path: Path) -> None:
    out = tmp_path / "auto.json"
    argv = [sys.executable, str(SERVE), "--requests", "3", "--rate", "50", "--warmup", "0"]
    argv += ["--prompt-len", PROMPT, "--output-len", OUTPUT, "--device", "cpu"]
    argv += ["--num-blocks", "auto", "--memory-fraction", "0.02", "--max-batch", "4"]
    argv += ["--json", str(out)]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same tokens from daemons and local at 50/s: 3/3 requests" in proc.stdout
    report = json.loads(out.read_text())
    pools = report["pools"]
    assert report["num_blocks"] == "auto" and report["memory_fraction"] == 0.02
    assert pools["local"] == pools["decode"] > 1024 and pools["prefill"] > 512, pools


def test_cache_target_with_shared_prefix_and_turns(tmp_path: Path) -> None:
    """Target cache: one workload of conversations behind a shared prefix on a pair with the
    prefix cache and one without; the same tokens from both, and every later turn reused at
    least its previous turn's full blocks."""
    out = tmp_path / "cache.json"
    argv = [sys.executable, str(SERVE), "--requests", "6", "--rate", "50", "--warmup", "0"]
    argv += ["--prompt-len", "5:9", "--output-len", "3:3", "--seed", "2", "--target", "cache"]
    argv += ["--shared-prefix", "40", "--turns", "3", "--device", "cpu", "--json", str(out)]
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same tokens from daemons and daemons-no-cache at 50/s: 6/6 requests" in proc.stdout
    report = json.loads(out.read_text())
    on, off = report["runs"]
    assert (on["target"], off["target"]) == ("daemons", "daemons-no-cache")
    turns = [q["turn"] for q in on["requests"]]
    assert turns == [0, 1, 2, 0, 1, 2]
    assert set(on["summary"]["ttft_ms_by_turn"]) == {"0", "1", "2"}
    reqs = on["requests"]
    for prev, q in itertools.pairwise(reqs):
        if q["turn"]:  # sent after its previous turn ended: that prompt's full blocks are cached
            assert q["server_timings"]["cached_tokens"] >= prev["prompt_len"] // 16 * 16, q
    assert all(q["server_timings"]["cached_tokens"] == 0 for q in off["requests"])
    # the decode pulls less with its cache: a later turn moves only its new blocks
    pulled_on, pulled_off = on["summary"]["pulled_blocks"], off["summary"]["pulled_blocks"]
    assert 0 < pulled_on < pulled_off, (pulled_on, pulled_off)
    assert on["summary"]["pulled_mib"] < off["summary"]["pulled_mib"]


def test_a_request_is_never_sent_before_it_is_due() -> None:
    sys.path.insert(0, str(SERVE.parent))
    import asyncio
    import time

    from serve_load import SPIN_S, until

    async def lateness(ahead: float) -> float:
        due = time.perf_counter() + ahead
        await until(due)
        return time.perf_counter() - due

    for ahead in (0.0, SPIN_S / 2, SPIN_S * 3, -1.0):  # within the spin, past it, overdue
        assert asyncio.run(lateness(ahead)) >= 0, ahead


def test_kept_logs_give_the_prefills_idle_between_queued_forwards(tmp_path: Path) -> None:
    """PDKV_BENCH_LOGS keeps the pair's INFO logs; bench/forward_gaps.py reads from the
    prefill's the gaps between forwards that had prompts queued (a burst: one prompt a forward
    on CPU, so all but the first queue behind another)."""
    logs, out = tmp_path / "logs", tmp_path / "gaps.json"
    argv = [sys.executable, str(SERVE), "--requests", "8", "--rate", "inf", "--warmup", "0"]
    argv += ["--prompt-len", "30:60", "--output-len", "2:2", "--target", "daemons"]
    env = dict(os.environ, PDKV_BENCH_LOGS=str(logs))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["pair1-decode.log", "pair1-prefill.log"]
    gaps = SERVE.with_name("forward_gaps.py")
    argv = [sys.executable, str(gaps), str(logs / "pair1-prefill.log"), "--json", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())
    assert row["forwards"] >= 8 and 1 <= row["queued_gaps"] < row["forwards"], row
    assert row["forward_ms"] > 0 and row["gap_ms"] > 0 and 0 < row["gap_share"] < 1, row
    assert 0 < row["gap_p50_ms"] <= row["gap_max_ms"], row
    assert "idle between them" in proc.stdout


def test_tier_target_runs_real_conversations_on_and_off(tmp_path: Path) -> None:
    """Target tier: conversations carrying the model's answers, through a pair with the host
    tier and one without; the same tokens from both, the tier's pair computing only each later
    turn's new message and the rest of the block its answer ended in; the tier file removed."""
    out = tmp_path / "tier.json"
    argv = [sys.executable, str(SERVE), "--target", "tier", "--turns", "3", "--requests", "3"]
    argv += ["--prompt-len", "40:40", "--message-len", "10:10", "--output-len", "20:20"]
    argv += ["--num-blocks", "16", "--host-cache-gb", "0.01", "--device", "cpu"]
    argv += ["--json", str(out)]
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens equal with the tier on and off: True" in proc.stdout
    on, off = json.loads(out.read_text())["runs"]
    assert (on["host_tier"], off["host_tier"]) == (True, False)
    assert [on["turns"][t]["prompt_mean"] for t in ("0", "1", "2")] == [40, 70, 100]
    for t in ("1", "2"):  # the answer's last token and the message, the rest of a block at most
        assert on["turns"][t]["computed_mean"] <= 10 + 16 + 1
        assert on["turns"][t]["computed_mean"] < off["turns"][t]["computed_mean"]
