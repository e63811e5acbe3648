"""The decode sequence's phase table (decode_server/phase.py): the paths a sequence takes, every
event walked in every phase (moved as the table says, or refused with an error naming the
request, the event and the phase), the table's promises about transfers and the batch, and
SequenceTable._move as the only writer of a phase."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from decode_server.phase import (
    AWAITING,
    ENDED,
    FIRST_DUE,
    IN_BATCH,
    TRANSFER_DUE,
    Event,
    IllegalEvent,
    Phase,
    accepts,
    next_phase,
)

E, P = Event, Phase
ROOT = Path(__file__).resolve().parents[2]

PATHS = {
    "late handoff, CPU copy inside the start": (
        [E.PULL, E.PULL_DONE, E.JOIN, E.STEP, E.END, E.FREE],
        [P.PULLING, P.PULLED, P.DECODING, P.DECODING, P.ENDING, P.ENDED],
    ),
    "early handoff, stream-ordered pull (CUDA)": (
        [E.EARLY, E.PULL, E.JOIN, E.STEP, E.PULL_DONE, E.STEP, E.END, E.FREE],
        [
            *(P.AWAITING_KV, P.PULLING, P.DECODING_PULL, P.DECODING_PULL, P.DECODING, P.DECODING),
            P.ENDING,
            P.ENDED,
        ],
    ),
    "finished by its first token: FINISH after the pull": (
        [E.PULL, E.PULL_DONE, E.END, E.FREE],
        [P.PULLING, P.PULLED, P.ENDING, P.ENDED],
    ),
    "KV_LAUNCHED, nothing started on it, then KV_READY": (
        [E.EARLY, E.LAUNCH_SEEN, E.LAUNCH_SEEN, E.PULL, E.JOIN, E.PULL_DONE],
        [
            *(P.AWAITING_KV, P.AWAITING_READY, P.AWAITING_READY, P.PULLING, P.DECODING_PULL),
            P.DECODING,
        ],
    ),
    "started on KV_LAUNCHED, KV_READY before the pull is done": (
        [E.EARLY, E.PULL_LAUNCHED, E.FIRST_READY, E.PULL_DONE, E.STEP],
        [P.AWAITING_KV, P.FIRST_PENDING, P.DECODING_PULL, P.DECODING, P.DECODING],
    ),
    "started on KV_LAUNCHED, the pull done before KV_READY (RELEASE waits)": (
        [E.EARLY, E.PULL_LAUNCHED, E.PULL_DONE, E.FIRST_READY],
        [P.AWAITING_KV, P.FIRST_PENDING, P.FIRST_PULLED, P.DECODING],
    ),
    "aborted while its pull is in flight: RELEASE when it is done": (
        [E.PULL, E.JOIN, E.ABORT, E.PULL_DONE, E.FREE],
        [P.PULLING, P.DECODING_PULL, P.ABORTED_PULL, P.ENDING, P.ENDED],
    ),
    "aborted while its pull is in flight, the pull fails: ERROR": (
        [E.EARLY, E.PULL_LAUNCHED, E.ABORT, E.FAIL, E.FREE],
        [P.AWAITING_KV, P.FIRST_PENDING, P.ABORTED_PULL, P.ENDING, P.ENDED],
    ),
    "link lost before its KV, a discarded push may still land": (
        [E.EARLY, E.END_LANDING, E.LANDED, E.FREE],
        [P.AWAITING_KV, P.ENDING_PULL, P.ENDING, P.ENDED],
    ),
    "shut down while pulling": (
        [E.PULL, E.END, E.PULL_DONE, E.FREE],
        [P.PULLING, P.ENDING_PULL, P.ENDING, P.ENDED],
    ),
    "the early plan could not be made": ([E.FAIL, E.FREE], [P.ENDING, P.ENDED]),
}


@pytest.mark.parametrize("name", PATHS)
def test_a_path_moves_through_the_phases_it_names(name: str) -> None:
    events, phases = PATHS[name]
    phase = P.NEW
    seen = []
    for event in events:
        phase = next_phase("r-7", phase, event)
        seen.append(phase)
    assert seen == phases


def test_every_event_in_every_phase_moves_as_the_table_says_or_is_refused_by_name() -> None:
    moved = 0
    for phase, event in itertools.product(P, E):
        if accepts(phase, event):
            assert isinstance(next_phase("r-7", phase, event), Phase)
            moved += 1
            continue
        with pytest.raises(IllegalEvent) as info:
            next_phase("r-7", phase, event)
        err = info.value
        assert (err.request_id, err.phase, err.event) == ("r-7", phase, event)
        assert event.name in str(err) and phase.name in str(err) and "r-7" in str(err)
    assert moved == sum(len(m) for m in _moves().values())


def _moves() -> dict[Event, dict[Phase, Phase]]:
    return {e: {p: next_phase("r", p, e) for p in P if accepts(p, e)} for e in E}


def _reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for moves in _moves().values():
            to = moves.get(here)
            if to is not None and to not in seen:
                seen.add(to)
                todo.append(to)
    return seen


def test_every_phase_is_reached_from_new_and_every_one_can_end() -> None:
    assert _reachable(P.NEW) == set(P)
    for phase in P:
        assert P.ENDED in _reachable(phase), phase
    assert not any(accepts(P.ENDED, e) for e in E)  # out of the table: nothing moves it


def test_only_a_transfers_completion_or_failure_ends_its_transfer() -> None:
    """A phase whose transfer may still write the blocks is left for one without only when
    that transfer reports (done, landed, failed): nothing frees blocks a copy still writes."""
    for event, moves in _moves().items():
        for here, to in moves.items():
            if here in TRANSFER_DUE and to not in TRANSFER_DUE:
                assert event in (E.PULL_DONE, E.LANDED, E.FAIL), (event, here, to)


def test_the_batch_is_joined_only_by_join_or_a_launched_start_and_left_by_an_ending() -> None:
    for event, moves in _moves().items():
        for here, to in moves.items():
            if to in IN_BATCH and here not in IN_BATCH:
                assert event in (E.JOIN, E.PULL_LAUNCHED), (event, here, to)
            if here in IN_BATCH and to not in IN_BATCH:
                assert event in (E.END, E.ABORT, E.FAIL), (event, here, to)
            if here in ENDED:
                assert to in ENDED, (event, here, to)  # an ended one never comes back


def test_a_first_token_due_on_the_host_is_cleared_only_by_kv_ready_or_an_ending() -> None:
    for event, moves in _moves().items():
        for here, to in moves.items():
            if here in FIRST_DUE and to not in FIRST_DUE:
                assert event in (E.FIRST_READY, E.END, E.ABORT, E.FAIL), (event, here, to)
    assert all(accepts(p, E.PULL) for p in AWAITING)  # KV_READY starts either awaiting one


def test_only_the_phase_table_writes_a_sequences_phase() -> None:
    """Every `x.phase = ...` in decode_server is SequenceTable._move's (the dataclass default
    and phase.py's own IllegalEvent aside): a hand-set phase beside the table fails here."""
    writers = []
    for path in sorted((ROOT / "decode_server").glob("*.py")):
        if path.name == "phase.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else []
                if isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute) and leaf.attr == "phase":
                            writers.append(f"{path.name}:{fn.name}")
    assert writers == ["table.py:_move"]
