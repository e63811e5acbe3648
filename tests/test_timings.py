"""common.timings: spans between named marks, rendered in their order, absent when a mark is."""

from __future__ import annotations

from common.timings import Marks, Span

SPANS = (
    Span("a_to_b_us", "a", "b"),
    Span("b_to_c_us", "b", "c"),
    Span("total_ms", "a", "c", 10**6),
)


def test_render_reports_only_spans_with_both_marks_in_declared_order() -> None:
    m = Marks()
    m.stamp("a", 1_000)
    m.stamp("b", 3_500)
    assert m.render(SPANS) == {"a_to_b_us": 2.5}
    m.stamp("c", 2_004_000)
    assert list(m.render(SPANS)) == ["a_to_b_us", "b_to_c_us", "total_ms"]
    assert m.render(SPANS)["total_ms"] == 2.003


def test_a_zero_clock_sets_no_mark_and_a_restamp_moves_it() -> None:
    m = Marks()
    assert m.stamp("sent", 0) == 0 and "sent" not in m
    m.stamp("x", 10)
    m.stamp("x", 30)
    assert m.get("x") == 30 and m.since("x", now=1030) == 1.0 and m.since("nope") == 0.0


def test_an_always_span_reads_zero_without_its_marks() -> None:
    m = Marks()
    m.stamp("a", 1_000)
    spans = (Span("kept_us", "a", "b", always=True), Span("gone_us", "a", "b"))
    assert m.render(spans) == {"kept_us": 0.0}
