"""`course-lib smoke`: every chapter's rank functions run once with backend="auto" and report where they ran."""
import pytest

from course_lib.experiments.smoke import SMOKE, SMOKE_RAY, format_smoke, run_smoke, smoke_world
from course_lib.launch import resolve_backend


@pytest.mark.timeout(900)  # ~60 spawns and one Ray session: ~4 min on an idle 2-core machine
def test_smoke_runs_every_chapters_rank_functions_on_the_auto_backend():
    world = smoke_world()
    rows = run_smoke(world)
    table = format_smoke(rows)
    assert len(rows) == len(SMOKE) + len(SMOKE_RAY)
    assert [r.function for r in rows if r.status != "pass"] == [], table
    backend = resolve_backend("auto", world)
    assert {r.backend for r in rows} == {backend}, table
    assert {r.device.split(":")[0] for r in rows} == {"cuda" if backend == "nccl" else "cpu"}, table
    assert {r.chapter for r in rows} == {f"{c:02d}" for c in range(10)}, table
    assert table.splitlines()[-1] == f"{len(rows)}/{len(rows)} passed"
