"""Chapter 05 checker: the learner's 1F1B order, compared with the reference and then run on real ranks.

1. For every (p, m, stage) in a grid, the learner's list must equal ``pipeline.one_f_one_b``'s.
2. The learner's schedule (for every stage) drives a :class:`~course_lib.pipeline.PipelineRunner`
   over the GPT split into ``world`` stages: the gradients must equal one device's on the full
   batch (computed here, on this rank), and this stage's peak live micro-batches must be ≤ p − stage.
"""
from __future__ import annotations

import torch.distributed as dist

from ..experiments.common import parallel_config, step_batch
from ..launch import device
from ..models import GPT
from ..pipeline import Action, PipelineRunner, one_f_one_b, split_gpt

__all__ = ["check_one_f_one_b_schedule"]

GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 6, 8)]


def check_one_f_one_b_schedule(fn) -> list[str]:
    rank, p, dev = dist.get_rank(), dist.get_world_size(), device()
    for q, m in GRID:
        for stage in range(q):
            got = [Action(*a) for a in fn(q, m, stage)]
            want = one_f_one_b(q, m, stage)
            if got != want:
                i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                g = got[i] if i < len(got) else "(end of list)"
                return [f"rank {rank}: p={q}, m={m}, stage={stage}: action {i} is {g!r}, 1F1B runs {want[i]!r} "
                        f"there (got {got}, expected {want})"]
    config, m, batch = parallel_config(), 4, 8
    schedules = [fn(p, m, s) for s in range(p)]
    stages = split_gpt(GPT(config, seed=0).to(dev), p)
    runner = PipelineRunner([stages[rank]], rank, schedules, m, activation_shape=(batch // m, config.block_size,
                                                                                  config.d_model), device=dev)
    x, y = step_batch(0, config, batch, dev)
    stats = runner.step(x, y)
    ref = GPT(config, seed=0).to(dev)
    ref(x, y)[1].backward()
    want = dict(ref.named_parameters())
    problems = []
    for name, q in stages[rank].named_parameters():
        err = (q.grad - want[name].grad).abs().max().item()
        if err > 1e-6:
            problems.append(f"rank {rank}: running your schedule, {name}.grad differs from one device by {err:.3g}")
    if stats.peak_live_microbatches > p - rank:
        problems.append(f"rank {rank}: {stats.peak_live_microbatches} micro-batches were alive at once, 1F1B keeps "
                        f"at most p − stage = {p - rank}")
    return problems
