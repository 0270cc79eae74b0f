"""`specdeploy bench grammar` end to end on the tiny chat model (fast; the figures themselves are the
benchmark's to print, never asserted here)."""

from __future__ import annotations

from pathlib import Path

from infra.bench.grammar import run_grammar_benchmark


def test_the_report_has_both_sides_and_the_grammar_share_at_every_concurrency(tiny_chat_model: Path) -> None:
    report = run_grammar_benchmark(tiny_chat_model, [1, 3], output_len=12, repeats=1)
    for mode in ("unconstrained", "constrained"):
        assert set(report.tokens_per_s[mode]) == {1, 3} and all(v > 0 for v in report.tokens_per_s[mode].values())
    assert all(0.0 < share < 1.0 for share in report.grammar_share.values())
    out = report.to_dict()
    assert set(out["constrained_over_unconstrained"]) == {1, 3}
    assert out["ratio_implied_by_grammar_share"][3] == round(1 - report.grammar_share[3], 4)
