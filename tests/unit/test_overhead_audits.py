"""bench/overhead.py's per-audit figures: each audited step against the variant's own
steps without an audit, in plain steps, the first apart from the later ones."""

from __future__ import annotations

import pytest
from bench.overhead import audit_costs, defaults_parts, summarize


def _times() -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    plain = [0.100] * 10
    # 0.105 s a step without an audit; an audit at steps 2 and 7: the first 3 plain steps
    # more, the second 1.
    audited = [0.105] * 10
    audited[2] = 0.105 + 0.300
    audited[7] = 0.105 + 0.100
    return {"plain": plain, "replay_every_50_only": audited}, {"replay_every_50_only": [2, 7]}


def test_each_audit_in_plain_steps_first_apart() -> None:
    times, audited = _times()
    got = audit_costs(times, audited)["replay_every_50_only"]
    assert got["audits"] == 2
    assert got["each_audit_steps"] == [3.0, 1.0]
    assert got["first_audit_steps"] == 3.0
    assert got["later_audits_steps_median"] == 1.0
    assert got["replay_every"] == 50
    assert got["steady_overhead"] == pytest.approx(1.0 / 50)
    # The audits' share of the mean overhead: 0.4 s over 10 steps of a 0.1 s plain step.
    assert got["of_overhead"] == pytest.approx(0.4)


def test_one_audit_has_no_steady_figure_and_unaudited_variants_none() -> None:
    times, _ = _times()
    times["hook_only"] = [0.101] * 10
    got = audit_costs(times, {"replay_every_50_only": [2]})
    assert set(got) == {"replay_every_50_only"}
    assert got["replay_every_50_only"]["later_audits_steps_median"] is None
    assert got["replay_every_50_only"]["steady_overhead"] is None


def test_summarize_keeps_its_keys_and_adds_the_audits() -> None:
    times, audited = _times()
    without = summarize(times)
    with_audits = summarize(times, audited)
    row = with_audits["variants"]["replay_every_50_only"]
    assert row["audits"]["audits"] == 2
    assert {k: v for k, v in row.items() if k != "audits"} == without["variants"][
        "replay_every_50_only"
    ]


def test_defaults_parts_gives_the_audits_own_share_next_to_the_difference_of_means() -> None:
    times, audited = _times()
    # Steps without an audit 5 % slower than hook_only's: noise the difference of the means
    # counts as the audit's, and the audited steps' own share does not.
    times["hook_only"] = [0.100] * 10
    times["plain_hook_check"] = [0.101] * 10
    times["nonfinite_only"] = [0.102] * 10
    times["weights_every_1_only"] = [0.120] * 10
    times["defaults"] = [0.110] * 10
    parts = defaults_parts(summarize(times, audited), {"sum_ms": 1.0})
    assert parts is not None
    assert parts["audit"]["measured"] == pytest.approx(0.45)
    assert parts["audit"]["audited_steps"] == pytest.approx(0.4)
    assert parts["audit"]["floor"] == pytest.approx(1 / 50)
    assert "audited_steps" not in defaults_parts(summarize(times), {"sum_ms": 1.0})["audit"]  # type: ignore[index]
