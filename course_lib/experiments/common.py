"""The experiments' harness: everything a chapter's rank functions share beyond the foundation.

Every chapter's rank functions (``experiments/<topic>.py``) and every test build on these, so
that "the ZeRO model", "AdamW" or "rank r's slice of step k's batch" mean the same thing everywhere.
The pieces a checker also needs live in foundation modules and are re-exported here:

* **Configs and optimizers** — :mod:`course_lib.configs` (:func:`small_config`, :func:`zero_config`,
  :func:`bench_config`, :func:`parallel_config`, :data:`OPTIMIZERS`, :func:`make_optimizer`).
* **Batches and steps** — :mod:`course_lib.train` (:func:`step_batch`, :func:`shard_batch`,
  :func:`train_step`, :func:`reference_run`): every single-program loop steps through ``train_step``.
* **Results and tolerances** — :mod:`course_lib.results` (:class:`Result`: quantity, measured, reference,
  tolerance, verdict; the named tolerances ``SGD``, ``ADAMW``, ``BF16``, …).

Defined here:

* **Reductions over ranks** — :func:`mean_over_ranks`, :func:`max_over_ranks`, :func:`min_over_ranks`.
* **Differences** — :func:`max_abs_diff`, :func:`state_diff` (models or state dicts).
* **Races** — :func:`race`: :func:`course_lib.timing.time_steps`'s rounds as a plain dict.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.distributed as dist

from ..configs import (
    OPTIMIZERS,
    bench_config,
    make_optimizer,
    parallel_config,
    small_config,
    zero_config,
)
from ..launch import device
from ..results import Result
from ..timing import time_steps
from ..train import check_global_batch, reference_run, shard_batch, step_batch, train_step

__all__ = [
    "small_config",
    "zero_config",
    "bench_config",
    "parallel_config",
    "OPTIMIZERS",
    "make_optimizer",
    "check_global_batch",
    "step_batch",
    "shard_batch",
    "train_step",
    "reference_run",
    "mean_over_ranks",
    "max_over_ranks",
    "min_over_ranks",
    "max_abs_diff",
    "state_diff",
    "race",
    "median_times",
    "Result",
]


# =========================================================================== over ranks


def mean_over_ranks(value: float, group=None) -> float:
    """The average of a per-rank number over ranks (of equal-sized shards' losses: the global-batch loss)."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def max_over_ranks(value: float, group=None) -> float:
    """The largest per-rank number (a synchronous step lasts as long as its slowest rank)."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def min_over_ranks(value: float, group=None) -> float:
    """The smallest per-rank number (one clock rate for every rank: the slowest rank's)."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.item()


def max_abs_diff(a: dict, b: dict) -> float:
    """max |a[k] − b[k]| over the keys of ``b`` (state dicts: full tensors)."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def state_diff(model_or_state, reference) -> float:
    """max |Δ| between a model (or a full state dict) and a reference model, over the reference's keys."""
    got = model_or_state if isinstance(model_or_state, dict) else model_or_state.state_dict()
    want = reference if isinstance(reference, dict) else reference.state_dict()
    return max_abs_diff(got, want)


# =========================================================================== races


def race(
    steps: dict[str, Callable[[], None]],
    rounds: int,
    steps_per_round: int = 1,
    warmup: int = 1,
    group=None,
) -> dict[str, list[float]]:
    """Time ``{name: one_step()}`` fairly; returns seconds per step for each name and round.

    :func:`course_lib.timing.time_steps` (warm-up, interleaved rounds in a rotated order, a barrier
    before each block, the max over ranks), read as ``{name: [seconds per round]}``. Report the
    median over rounds (:func:`median_times`), or call ``time_steps`` for ranges and verdicts.
    """
    return time_steps(steps, rounds, steps_per_round, warmup, group=group).samples()


def median_times(times: dict[str, list[float]]) -> dict[str, float]:
    """``{name: median seconds}`` of :func:`race`'s rounds."""
    return {name: statistics.median(ts) for name, ts in times.items()}
