"""The exercise checker: solutions pass, shipped exercises are reported unsolved, wrong answers fail clearly.

Every exercise's checker runs on its solution and on its shipped stub. A ``check()`` call spawns fresh
ranks per world size (what a learner runs); here the spawn-launcher checkers share ranks instead: one
spawn per world size runs every checker of that size on the solutions, one spawn of 2 ranks runs every
stub's checker (a spawn costs seconds: 20 of them were a third of this file). ``check()`` itself — loading
the learner's file, one spawn per world size, a pass, an unsolved stub, a failure, an error — is tested
through its own path below, once per launcher and outcome.
"""

import importlib
import sys
from pathlib import Path

import pytest

from course_lib.check import EXERCISES, check
from course_lib.launch import spawn

ROOT = Path(__file__).resolve().parents[1]
SPAWNED = sorted(n for n, ex in EXERCISES.items() if ex.launcher == "spawn")
PARENT = sorted(n for n, ex in EXERCISES.items() if ex.launcher == "parent")


def test_exercises_and_solutions_mirror_each_other():
    ex = sorted(p.name for p in (ROOT / "exercises").glob("*.py"))
    sol = sorted(p.name for p in (ROOT / "solutions").glob("*.py"))
    assert ex == sol


def _run_checkers(names: list, package: str) -> dict:
    """Rank function: each named exercise's checker on ``package``'s answer, one after another.

    Per exercise: ``("ok", problems)`` or, when the checker raised, ``(type name, message)``. The stubs
    raise at the same point on every rank (before any collective they would leave unmatched).
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = {}
    for name in names:
        ex = EXERCISES[name]
        fn = getattr(importlib.import_module(f"{package}.{ex.module}"), ex.function)
        try:
            out[name] = ("ok", list(ex.runner(fn) or []))
        except Exception as exc:  # noqa: BLE001 - a stub's NotImplementedError is the result
            out[name] = (type(exc).__name__, str(exc))
    return out


@pytest.fixture(scope="module")
def solved() -> dict:
    """``{(name, world): rank 0's result}``: each world size of every checker, on its solution."""
    out = {}
    for world in sorted({w for n in SPAWNED for w in EXERCISES[n].world_sizes}):
        names = [n for n in SPAWNED if world in EXERCISES[n].world_sizes]
        per_rank = spawn(_run_checkers, world, args=(names, "solutions"), timeout=280)
        for name in names:
            results = [r[name] for r in per_rank]
            kinds = {kind for kind, _ in results}
            problems = [p for kind, ps in results if kind == "ok" for p in ps]
            out[name, world] = (kinds, problems, results)
    return out


@pytest.fixture(scope="module")
def stubs() -> list:
    """Every rank's result of every spawn-launcher checker on its shipped stub (2 ranks, as check())."""
    return spawn(_run_checkers, 2, args=(SPAWNED, "exercises"), timeout=200)


@pytest.mark.parametrize("name", SPAWNED)
def test_solution_passes_on_every_world_size(name, solved):
    for world in EXERCISES[name].world_sizes:
        kinds, problems, results = solved[name, world]
        assert kinds == {"ok"}, f"world_size={world}: {results}"
        assert problems == [], f"world_size={world}: {problems[0]}"


@pytest.mark.parametrize("name", SPAWNED)
def test_shipped_stub_raises_not_implemented_with_its_hint(name, stubs):
    """What check() reports as unsolved: NotImplementedError on the ranks, its message the hint."""
    ex = EXERCISES[name]
    for rank, results in enumerate(stubs):
        kind, message = results[name]
        assert kind == "NotImplementedError", f"rank {rank}: {kind}: {message}"
        hint = message.removeprefix("_")  # _ShardedLinearFunction: the ShardedLinear exercise
        assert hint.startswith(ex.function), f"rank {rank}: the hint names the function: {message}"


def test_check_passes_a_solution_on_its_world_sizes():
    """check()'s own path for a pass: load solutions/, spawn per world size, the sentence."""
    result = check("one_f_one_b_schedule", package="solutions")
    assert result.passed, str(result)
    assert str(result) == "[PASS] one_f_one_b_schedule: matches the reference on world sizes 2"


def test_check_refuses_a_world_size_the_exercise_is_not_checked_on():
    with pytest.raises(ValueError, match=r"checked on world sizes \(2, 4\), not \(3,\)"):
        check("column_parallel_linear", package="solutions", world_sizes=(3,))


def test_check_reports_a_shipped_exercise_unsolved_with_its_hint():
    """check()'s own path for a spawned stub: the rank's NotImplementedError becomes 'unsolved'."""
    result = check("count_model_state_bytes")
    assert result.status == "unsolved", str(result)
    assert result.message.startswith("not implemented yet — notebook 01's exercise"), str(result)
    assert "data_ptr" not in result.message  # the hint points at the notebook, never at the code


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray session for every launcher="parent" (Ray) check in this module: the runners use a
    running one."""
    ray_train = pytest.importorskip("course_lib.ray_train")
    ray_train.start(num_cpus=2)
    yield
    ray_train.stop()


@pytest.mark.parametrize("name", PARENT)
def test_parent_solution_passes(name, ray_session):
    result = check(name, package="solutions")
    assert result.passed, str(result)


@pytest.mark.parametrize("name", PARENT)
def test_parent_shipped_exercise_is_reported_unsolved(name, ray_session):
    """ray_train_loop's stub raises inside a Ray worker (Ray wraps it); ray_data's in this process."""
    result = check(name, package="exercises")
    assert result.status == "unsolved", str(result)
    assert result.message.startswith("not implemented yet — "), str(result)
    assert "hint" in result.message, str(result)


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


def _solution_with(module: str, old: str, new: str) -> str:
    """``solutions/<module>.py`` with one line changed: a learner's almost-right answer."""
    source = (ROOT / "solutions" / f"{module}.py").read_text(encoding="utf-8")
    assert source.count(old) == 1, old
    return source.replace(old, new)


_LAUNCH_AT_THE_END = """

class _LaunchAtTheEnd(BucketedReducer):
    \"\"\"Every bucket launched from one end-of-backward callback: inside backward(), no overlap.\"\"\"

    queued = False

    def _on_grad_ready(self, p):
        self.slot[p].copy_(p.grad)
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._launch_all)

    def _launch_all(self):
        for i, flat in enumerate(self.flat):
            flat.div_(self.world_size)
            self.works.append((i, comm.all_reduce(flat, async_op=True, tag="grad")))
        self.queued = False
"""


def test_overlapped_ddp_launching_every_bucket_at_the_end_of_backward_fails(learner_answer):
    """All-reduces launched inside backward() but after its last gradient (a queue_callback) overlap
    nothing: the checker's own gradient hooks see no launch while a gradient is still pending."""
    source = _solution_with(
        "ddp", "self.reducer = BucketedReducer(module,", "self.reducer = _LaunchAtTheEnd(module,"
    )
    source += _LAUNCH_AT_THE_END
    result = learner_answer("ddp", source)("overlapped_ddp")
    assert result.status == "failed", str(result)
    assert "launched while gradients were still pending" in result.message, str(result)
    assert "as soon as it is complete" in result.message, str(result)


def test_ray_train_loop_without_set_epoch_fails_with_the_weight_difference(
    learner_answer, ray_session
):
    """Forgetting set_epoch repeats epoch 0's order: a real TorchTrainer run, weights differ from one device."""
    run = learner_answer(
        "ray_train",
        _solution_with(
            "ray_train",
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
    source = _solution_with(
        "ray_train", 'size=config["global_batch"] //', 'size=config["global_batch_size"] //'
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


# --------------------------------------------------------------------------- chapter 04: FlatUnit


def test_flat_unit_that_keeps_the_weights_after_forward_fails_on_memory(learner_answer):
    """No free after forward: the full weights stay between forward and backward, and no re-gather comes."""
    run = learner_answer(
        "fsdp",
        _solution_with(
            "fsdp",
            "        out = functional_call(self.module, self._views(flat), args)\n        self._free()\n",
            "        out = functional_call(self.module, self._views(flat), args)\n",
        ),
    )
    result = run("flat_unit")
    assert result.status == "failed", str(result)
    assert "between forward and backward the unit and autograd hold" in result.message
    assert "free the gathered weights right after forward" in result.message


def test_flat_unit_that_sums_the_gradients_fails_with_the_factor(learner_answer):
    """A reduce-scatter sums: without the division the shard's gradient is N× one device's."""
    run = learner_answer(
        "fsdp",
        _solution_with("fsdp", "return grad.div_(unit.world_size), None", "return grad, None"),
    )
    result = run("flat_unit")
    assert result.status == "failed", str(result)
    assert "it is 2× too large: the reduce-scatter sums, divide by N" in result.message


def test_flat_unit_hints_come_in_two_layers_and_never_the_code():
    from course_lib.checks.fsdp import HINTS, hint

    assert set(HINTS) == {"flat_unit"}
    idea, api = hint("flat_unit", 1), hint("flat_unit", 2)
    assert idea != api and "all_gather_into_tensor" in api and "all_gather" not in idea
    with pytest.raises(ValueError, match="level"):
        hint("flat_unit", 3)
