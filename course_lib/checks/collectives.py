"""Chapter 00 checker: ``ring_all_reduce`` == ``dist.all_reduce``, with send/recv only.

What it compares (the notebook states the same): on every rank, for tensors of 1, 10 and 1003
elements, the learner's result against ``dist.all_reduce`` of the same tensor within ``SGD``
(another order of the same fp32 sums); no collective through ``comm``; and the bytes that all ranks
together send through ``comm.isend`` / ``comm.send``, against the bandwidth-optimal ring's
2(N−1) × the tensor's bytes. The messages say what differs, never how to write the ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..launch import device
from ..results import SGD, max_abs_diff

__all__ = ["check_ring_all_reduce"]

_POINT_TO_POINT = ("send", "recv")


def _sent_by_all_ranks(log: comm.CommLog) -> int:
    """Bytes this rank sent through comm, summed over ranks (a collective of the checker's own)."""
    sent = torch.tensor([float(log.total("tensor_bytes", op="send"))], device=device())
    dist.all_reduce(sent)
    return int(sent.item())


def check_ring_all_reduce(fn) -> list[str]:
    """Tensors of 1, 10 and 1003 elements (uneven chunks): every rank's result == the library all-reduce."""
    rank, n, dev = dist.get_rank(), dist.get_world_size(), device()
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
        where = f"rank {rank}, tensor of {numel} elements"
        collectives = sorted({r.op for r in log.records if r.op not in _POINT_TO_POINT})
        if collectives:
            problems.append(
                f"{where}: called {', '.join(collectives)}; the exercise allows send/recv only"
            )
        sent, optimal = _sent_by_all_ranks(log), 2 * (n - 1) * numel * x.element_size()
        if out.shape != expected.shape:
            problems.append(
                f"{where}: returned shape {tuple(out.shape)}, expected {tuple(expected.shape)}"
            )
            continue
        # Another order of the same fp32 sums; the values are O(1), so SGD's atol (1e-6), not REORDERED's.
        if not SGD.ok(out, expected):
            problems.append(
                f"{where}: max |error| {max_abs_diff(out, expected):.3g} vs dist.all_reduce ({SGD})"
            )
        elif not torch.equal(got, out):
            problems.append(
                f"{where}: the returned tensor is right, but `tensor` was not summed in place"
            )
        if sent != optimal:
            problems.append(
                f"{where}: all ranks together sent {sent:,} bytes through comm.isend/comm.send; "
                f"a bandwidth-optimal ring sends 2(N−1) × {numel * x.element_size():,} = {optimal:,}"
                + (
                    " (nothing counted: send through comm, which counts the bytes)"
                    if sent == 0
                    else ""
                )
            )
    return problems
