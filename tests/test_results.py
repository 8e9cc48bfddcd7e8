"""The result table: a table with no rows has checked nothing, so it has not passed."""

import pytest

from course_lib.results import EXACT, Measured, Result


def test_a_result_with_no_rows_has_not_passed():
    empty = Result(title="nothing measured")
    assert not empty.passed
    assert empty.table() == "nothing measured\n(no rows)"
    assert Result().table() == "(no rows)"
    with pytest.raises(AssertionError, match="nothing measured: no rows were checked"):
        empty.assert_passed()
    values_only = Measured(values={"loss": 1.0})  # a Measured read as a dict, with no rows
    assert values_only["loss"] == 1.0 and not values_only.passed
    with pytest.raises(AssertionError, match="Measured: no rows were checked"):
        values_only.assert_passed()


def test_rows_decide_passed_once_there_are_some():
    r = Result(title="counts")
    r.exact("messages", 3, 3, "formula")
    assert r.passed
    r.assert_passed()
    assert "(no rows)" not in r.table() and "PASS" in r.table()
    r.equal("weights", {"w": 1.0}, {"w": 1.5}, EXACT)
    assert not r.passed and [row.quantity for row in r.failures()] == ["weights"]
    with pytest.raises(AssertionError, match="failed checks:\n  weights"):
        r.assert_passed()


def test_measured_and_timings_read_through_one_mapping_reader():
    from course_lib.results import MappingReader
    from course_lib.timing import Timing, Timings

    rows = Measured(values=[{"op": "all_reduce"}, {"op": "all_gather"}])
    assert isinstance(rows, MappingReader) and len(rows) == 2 and rows[1]["op"] == "all_gather"
    assert [r["op"] for r in rows] == ["all_reduce", "all_gather"]
    named = Measured(values={"loss": 1.0})
    assert "loss" in named and named.get("step", 0) == 0 and dict(named.items()) == {"loss": 1.0}
    with pytest.raises(KeyError, match="step"):
        named["step"]
    t = Timings(timings={"ddp": Timing((0.01, 0.02))})
    assert isinstance(t, MappingReader) and list(t) == ["ddp"] and t.get("fsdp") is None
    with pytest.raises(KeyError, match="'fsdp' was not timed: timed \\['ddp'\\]"):
        t["fsdp"]
