"""The exercise checker: solutions pass, shipped exercises are reported unsolved, wrong answers fail clearly."""
from pathlib import Path

import pytest

from course_lib.check import EXERCISES, check

ROOT = Path(__file__).resolve().parents[1]


def test_exercises_and_solutions_mirror_each_other():
    ex = sorted(p.name for p in (ROOT / "exercises").glob("*.py"))
    sol = sorted(p.name for p in (ROOT / "solutions").glob("*.py"))
    assert ex == sol


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_solution_passes(name):
    result = check(name, package="solutions")
    assert result.passed, str(result)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_shipped_exercise_is_reported_unsolved(name):
    result = check(name, package="exercises")
    assert result.status == "unsolved", str(result)
    assert "hint" in result.message or "implement" in result.message


def test_wrong_answer_names_rank_tensor_and_error(learner_answer):
    run = learner_answer("ch00_collectives",
                         "import torch.distributed as dist\n"
                         "def ring_all_reduce(t):\n"
                         "    return t * dist.get_world_size()  # wrong: not a sum over ranks\n")
    result = run("ring_all_reduce")
    assert result.status == "failed"
    assert "rank 0, tensor of 1 elements: max |error|" in result.message


def test_unknown_exercise():
    with pytest.raises(ValueError, match=r"unknown exercise 'nope'; available: .*ring_all_reduce"):
        check("nope")
