"""Chapter 05's exercise hints: two layers (the idea, then the API), never the code.

The unsolved stub is reported with a pointer to the hints, not with the algorithm spelled out.
"""

import pytest

from course_lib.checks.pipeline import HINTS, UNSOLVED, _first_difference, hint


def test_hints_come_in_two_layers_and_never_hold_the_algorithm():
    idea, api = hint("one_f_one_b_schedule", 1), hint("one_f_one_b_schedule", 2)
    assert idea != api and "Action(" in api
    for text in HINTS["one_f_one_b_schedule"]:
        # the warm-up count and the steady-state alternation are the exercise's answer
        assert "p − 1 − stage" not in text and "min(" not in text and "alternat" not in text
    with pytest.raises(ValueError, match="no level with the code"):
        hint("one_f_one_b_schedule", 3)
    with pytest.raises(ValueError, match="no hints"):
        hint("nope")


def test_an_unsolved_stub_points_to_the_hints(monkeypatch):
    def stub(p, m, stage):
        raise NotImplementedError("a message that spells out the answer")

    monkeypatch.setattr("course_lib.checks.pipeline.dist.get_rank", lambda: 0)
    with pytest.raises(NotImplementedError) as err:
        _first_difference(stub)
    assert str(err.value) == UNSOLVED
    assert (
        UNSOLVED.startswith("one_f_one_b_schedule:")
        and "hint('one_f_one_b_schedule', 1)" in UNSOLVED
    )
