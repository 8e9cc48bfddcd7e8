"""`course-lib smoke`: every chapter's rank functions run once with backend="auto" and report where they ran."""

import pytest

from course_lib.chapters import CHAPTERS
from course_lib.experiments.smoke import (
    SMOKE,
    SMOKE_RAY,
    format_smoke,
    run_smoke,
    smoke_entries,
    smoke_world,
)
from course_lib.experiments.smoke import _assert_passed
from course_lib.launch import resolve_backend


def test_chapters_are_chosen_by_topic_or_by_number():
    topics = {c.topic for c in CHAPTERS}
    assert {e[0] for e in smoke_entries()} == topics  # every chapter has an entry, named by topic
    assert smoke_entries(["02"]) == smoke_entries(["ddp"]) == smoke_entries([2])
    assert {e[0] for e in smoke_entries(["ddp", "ray-data"])} == {"ddp", "ray-data"}
    with pytest.raises(ValueError, match="is not one of the topics"):
        smoke_entries(["dpp"])


def test_a_passes_entry_fails_on_a_failed_row_or_on_no_result():
    from course_lib.results import Result

    res = Result(title="t")
    res.exact("count", 2, 2, "two")
    _assert_passed({"a": res}, "rank 0: f")  # every row passed
    res.exact("bytes", 3, 4, "four")
    with pytest.raises(AssertionError, match="rank 0: f: failed checks"):
        _assert_passed(res, "rank 0: f")
    with pytest.raises(TypeError, match="returned no Result"):
        _assert_passed({"x": 1}, "rank 0: f")


def test_an_entry_that_needs_more_ranks_is_a_skip_row_naming_why(monkeypatch):
    import course_lib.experiments.smoke as smoke

    p2p = [e for e in SMOKE if e[2].get(smoke.MIN_WORLD, 1) > 1]
    assert p2p, "the point-to-point benchmark needs 2 ranks (one GPU runs world 1)"
    monkeypatch.setattr(smoke, "SMOKE", p2p)
    monkeypatch.setattr(smoke, "SMOKE_RAY", [])
    rows = run_smoke(1)  # nothing is spawned: every entry needs more ranks than 1
    assert [r.status for r in rows] == ["skip"] * len(p2p)
    assert all("needs 2 ranks, this machine runs 1" in r.error for r in rows)
    assert format_smoke(rows).splitlines()[-1] == f"0/0 passed, {len(p2p)} skipped"


@pytest.mark.timeout(
    900
)  # one spawn for ~50 entries and one Ray session: ~2-3 min on an idle 2-core machine
def test_smoke_runs_every_chapters_rank_functions_on_the_auto_backend():
    world = smoke_world()
    rows = run_smoke(world)
    table = format_smoke(rows)
    assert len(rows) == len(SMOKE) + len(SMOKE_RAY)
    assert [r.function for r in rows if r.status != "pass"] == [], table
    backend = resolve_backend("auto", world)
    assert {r.backend for r in rows} == {backend}, table
    assert {r.device.split(":")[0] for r in rows} == {"cuda" if backend == "nccl" else "cpu"}, table
    assert {r.chapter for r in rows} == {c.topic for c in CHAPTERS}, table
    assert table.splitlines()[-1] == f"{len(rows)}/{len(rows)} passed"
