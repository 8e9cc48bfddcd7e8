"""Chapter 05 checker: the learner's 1F1B order, compared with the reference and then run on real ranks.

1. For every (p, m, stage) in a grid, the learner's list must equal ``pipeline.one_f_one_b``'s.
2. The learner's schedule (for every stage) drives a :class:`~course_lib.pipeline.PipelineRunner`
   over the GPT split into ``world`` stages: the gradients must equal one device's on the full
   batch within :data:`~course_lib.results.SGD` (micro-batches reorder the fp32 sums). One device
   is ``reference_run`` for one SGD step on this rank: its ``.grad`` is the full-batch gradient.
   This stage's peak live micro-batches must be ≤ p − stage.
"""

from __future__ import annotations

import torch.distributed as dist

from ..configs import parallel_config
from ..launch import device
from ..models import GPT
from ..pipeline import Action, PipelineRunner, measured_step, one_f_one_b, split_gpt
from ..results import SGD, max_abs_diff
from ..train import reference_run, step_batch

__all__ = ["check_one_f_one_b_schedule"]

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8)]


def _first_difference(fn) -> list[str]:
    rank = dist.get_rank()
    for q, m in GRID:
        for stage in range(q):
            got = [Action(*a) for a in fn(q, m, stage)]
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
