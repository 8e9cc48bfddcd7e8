"""Chapter 05 checker: the learner's 1F1B order, compared with the reference and then run on real ranks.

1. For every (p, m, stage) in a grid, the learner's list must equal ``pipeline.one_f_one_b``'s.
2. The learner's schedule (for every stage) drives a :class:`~course_lib.pipeline.PipelineRunner`
   over the GPT split into ``world`` stages: the gradients must equal one device's on the full
   batch within :data:`~course_lib.results.SGD` (micro-batches reorder the fp32 sums). One device
   is ``reference_run`` for one SGD step on this rank: its ``.grad`` is the full-batch gradient.
   This stage's peak live micro-batches must be ≤ p − stage.

Stuck: :func:`hint` gives the idea (level 1), then the API (level 2), never the code. An exercise
that still raises ``NotImplementedError`` is reported as unsolved with a pointer to the hints.
"""

from __future__ import annotations

import torch.distributed as dist

from . import layered_hint
from ..configs import parallel_config
from ..launch import device
from ..models import GPT
from ..pipeline import Action, PipelineRunner, measured_step, one_f_one_b, split_gpt
from ..results import SGD, max_abs_diff
from ..train import reference_run, step_batch

__all__ = ["GRID", "HINTS", "hint", "check_one_f_one_b_schedule"]

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8)]

HINTS: dict[str, tuple[str, str]] = {
    "one_f_one_b_schedule": (
        "What 1F1B bounds is memory: the micro-batches whose forward has run on this stage but "
        "whose backward has not. Stage `stage` may hold at most p − stage of them: one for "
        "itself and one for each stage after it. Ask how many forwards that lets the "
        "stage run before it needs its first backward, and how it keeps that count afterwards; "
        "count them along each rank's row of notebook 05's p = 4, 1F1B timeline.",
        "Return a list of course_lib.pipeline.Action(op, microbatch): op is 'F' or 'B', "
        "microbatch 0…m−1; every micro-batch once as 'F' and once as 'B', its 'F' first. "
        "pipeline.make_schedules(one_f_one_b_schedule, p, m) gives every stage's list (with "
        "'gpipe' in place of your function: GPipe's, in the same format); pipeline.simulate("
        "schedules, m) runs them on paper, raising if they cannot run, and viz.gantt draws its "
        "events as section 2 does. The checker compares every stage for p in 1…4 and m in "
        "{1, 2, 3, 4, 6, 8}, then trains with your lists on 2 ranks.",
    ),
}

UNSOLVED = (
    "one_f_one_b_schedule: implement it (hints in layers, the idea then the API: "
    "course_lib.checks.pipeline.hint('one_f_one_b_schedule', 1), then level 2)"
)


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` (1: the idea, 2: the API) for exercise ``name``; never the code."""
    return layered_hint(HINTS, name, level)


def _actions(fn, p: int, m: int, stage: int) -> list[Action]:
    """The learner's list for one stage; a TODO is reported with the pointer to the hints."""
    try:
        return [Action(*a) for a in fn(p, m, stage)]
    except NotImplementedError:
        raise NotImplementedError(UNSOLVED) from None


def _first_difference(fn) -> list[str]:
    rank = dist.get_rank()
    for q, m in GRID:
        for stage in range(q):
            got = _actions(fn, q, m, stage)
            want = one_f_one_b(q, m, stage)
            if got != want:
                i = next(
                    # the first difference; either list may be the shorter
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                    min(len(got), len(want)),
                )
                g = got[i] if i < len(got) else "(end of list)"
                return [
                    f"rank {rank}: p={q}, m={m}, stage={stage}: action {i} is {g!r}, 1F1B runs {want[i]!r} "
                    f"there (got {got}, expected {want})"
                ]
    return []


def check_one_f_one_b_schedule(fn) -> list[str]:
    problems = _first_difference(fn)
    if problems:
        return problems
    rank, p, dev = dist.get_rank(), dist.get_world_size(), device()
    config, m, batch = parallel_config(), 4, 8
    schedules = [fn(p, m, s) for s in range(p)]
    stages = split_gpt(GPT(config, seed=0).to(dev), p)
    shape = (batch // m, config.block_size, config.d_model)
    runner = PipelineRunner([stages[rank]], rank, schedules, m, activation_shape=shape, device=dev)
    stats = measured_step(runner, *step_batch(0, config, batch, dev))
    ref = dict(reference_run(config, 1, batch, "sgd")[0].named_parameters())
    for name, q in stages[rank].named_parameters():
        if not SGD.ok(q.grad, ref[name].grad):
            err = max_abs_diff(q.grad, ref[name].grad)
            problems.append(
                f"rank {rank}: running your schedule, {name}.grad differs from one device by "
                f"{err:.3g} (beyond {SGD})"
            )
    if stats.peak_live_microbatches > p - rank:
        problems.append(
            f"rank {rank}: {stats.peak_live_microbatches} micro-batches were alive at once, 1F1B keeps "
            f"at most p − stage = {p - rank}"
        )
    return problems
