"""The exercise checker: solutions pass, shipped exercises are reported unsolved, wrong answers fail clearly."""

from pathlib import Path

import pytest

from course_lib.check import EXERCISES, check

ROOT = Path(__file__).resolve().parents[1]


def test_exercises_and_solutions_mirror_each_other():
    ex = sorted(p.name for p in (ROOT / "exercises").glob("*.py"))
    sol = sorted(p.name for p in (ROOT / "solutions").glob("*.py"))
    assert ex == sol


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for every launcher="parent" (Ray) check in this module: the runners use a running one."""
    ray_train = pytest.importorskip("course_lib.ray_train")
    ray_train.start(num_cpus=2)
    yield
    ray_train.stop()


def _session_for(name, request):
    if EXERCISES[name].launcher == "parent":
        request.getfixturevalue("ray_session")


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_solution_passes(name, request):
    _session_for(name, request)
    result = check(name, package="solutions")
    assert result.passed, str(result)


@pytest.mark.parametrize("name", sorted(EXERCISES))
def test_shipped_exercise_is_reported_unsolved(name, request):
    _session_for(name, request)
    result = check(name, package="exercises")
    assert result.status == "unsolved", str(result)
    assert "hint" in result.message or "implement" in result.message


def test_wrong_answer_names_rank_tensor_and_error(learner_answer):
    run = learner_answer(
        "collectives",
        "import torch.distributed as dist\n"
        "def ring_all_reduce(t):\n"
        "    return t * dist.get_world_size()  # wrong: not a sum over ranks\n",
    )
    result = run("ring_all_reduce")
    assert result.status == "failed"
    assert "rank 0, tensor of 1 elements: max |error|" in result.message


def _ray_train_answer(old: str, new: str) -> str:
    """The ch07 solution with one line changed: a learner's almost-right answer."""
    source = (ROOT / "solutions" / "ray_train.py").read_text(encoding="utf-8")
    assert source.count(old) == 1, old
    return source.replace(old, new)


def test_ray_train_loop_without_set_epoch_fails_with_the_weight_difference(
    learner_answer, ray_session
):
    """Forgetting set_epoch repeats epoch 0's order: a real TorchTrainer run, weights differ from one device."""
    run = learner_answer(
        "ray_train",
        _ray_train_answer(
            "            loader.sampler.set_epoch(epoch)",
            "            pass  # forgot set_epoch(epoch)",
        ),
    )
    result = run("ray_train_loop")
    assert result.status == "failed", str(result)
    assert "differ from one device trained on the same global batches by max |Δ|" in result.message
    assert "set_epoch" in result.message


def test_ray_train_loop_that_raises_reports_the_error_and_the_learners_line(
    learner_answer, ray_session
):
    """An exception inside a Ray worker comes back as 'error' with its type, message and the learner's line."""
    source = _ray_train_answer(
        'size=config["global_batch"] //', 'size=config["global_batch_size"] //'
    )
    line = 1 + next(i for i, ln in enumerate(source.splitlines()) if '"global_batch_size"' in ln)
    result = learner_answer("ray_train", source)("ray_train_loop")
    assert result.status == "error", str(result)
    assert result.message == (
        f"KeyError: 'global_batch_size' (at exercises/ray_train.py, line {line}, in ray_train_loop)"
    )


def test_unknown_exercise():
    with pytest.raises(ValueError, match=r"unknown exercise 'nope'; available: .*ring_all_reduce"):
        check("nope")
