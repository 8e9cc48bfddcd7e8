"""Chapter 00 checker: ``ring_all_reduce`` == ``dist.all_reduce``, with send/recv only."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..launch import device
from ..results import SGD, max_abs_diff

__all__ = ["check_ring_all_reduce"]


def check_ring_all_reduce(fn) -> list[str]:
    """Tensors of 1, 10 and 1003 elements (uneven chunks): every rank's result == the library all-reduce."""
    rank, dev = dist.get_rank(), device()
    problems = []
    for numel in (1, 10, 1003):
        gen = torch.Generator().manual_seed(1000 * rank + numel)
        x = torch.randn(numel, generator=gen).to(
            dev
        )  # drawn on the CPU: the same numbers on any device
        expected = x.clone()
        dist.all_reduce(expected)
        got = x.clone()
        with comm.CommLog() as log:
            out = fn(got)
        if out is None:
            out = got
        if out.shape != expected.shape:
            problems.append(
                f"rank {rank}, tensor of {numel} elements: returned shape {tuple(out.shape)}, "
                f"expected {tuple(expected.shape)}"
            )
            continue
        # Another order of the same fp32 sums; the values are O(1), so SGD's atol (1e-6), not REORDERED's.
        if not SGD.ok(out, expected):
            problems.append(
                f"rank {rank}, tensor of {numel} elements: max |error| "
                f"{max_abs_diff(out, expected):.3g} vs dist.all_reduce ({SGD})"
            )
        if log.count(op="all_reduce"):
            problems.append(f"rank {rank}: used all_reduce; the exercise asks for send/recv only")
    return problems
