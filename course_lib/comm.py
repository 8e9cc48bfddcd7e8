"""Collectives with accounting: what every from-scratch technique in the course calls.

Each function is a thin, named wrapper over ``torch.distributed`` that also records
the call in every active :class:`CommLog`. Two byte counts per call:

* ``tensor_bytes`` — the size nccl-tests reports: the all_reduce buffer, the
  reduce_scatter *input* (the full tensor), the all_gather *output* (the full tensor),
  the broadcast buffer, the sent/received tensor.
* ``ring_bytes`` — what one rank sends with a ring algorithm (N ranks):

  ====================  =====================================
  all_reduce            tensor_bytes · 2(N−1)/N
  reduce_scatter        tensor_bytes · (N−1)/N
  all_gather            tensor_bytes · (N−1)/N
  broadcast             tensor_bytes            (pipelined chain)
  send / recv           tensor_bytes / 0
  ====================  =====================================

  All-reduce = reduce-scatter + all-gather, which is why its factor is the sum of theirs.
  These are also the nccl-tests "bus bandwidth" factors: ``busbw = algbw · factor``.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["CommLog", "CommRecord", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv",
           "isend", "irecv", "ring_factor", "bandwidth_benchmark", "busbw_table"]

_ACTIVE: list["CommLog"] = []


def ring_factor(op: str, world_size: int) -> float:
    """Bytes one rank sends in a ring, per byte of ``tensor_bytes``."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
               "broadcast": 1.0 if n > 1 else 0.0, "send": 1.0, "recv": 0.0}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; expected one of {sorted(factors)}")
    return factors[op]


@dataclass(frozen=True)
class CommRecord:
    op: str
    tag: str | None
    dtype: str
    numel: int
    tensor_bytes: int
    ring_bytes: float
    world_size: int


class CommLog:
    """Context manager that records every collective issued through this module.

    >>> with CommLog() as log:
    ...     all_reduce(grad, tag="grad")
    >>> log.total("tensor_bytes", tag="grad")
    """

    def __init__(self):
        self.records: list[CommRecord] = []

    def __enter__(self) -> "CommLog":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def select(self, *, op: str | None = None, tag: str | None = None) -> list[CommRecord]:
        return [r for r in self.records if (op is None or r.op == op) and (tag is None or r.tag == tag)]

    def total(self, field: str = "tensor_bytes", *, op: str | None = None, tag: str | None = None) -> float:
        return sum(getattr(r, field) for r in self.select(op=op, tag=tag))

    def count(self, *, op: str | None = None, tag: str | None = None) -> int:
        return len(self.select(op=op, tag=tag))

    def summary(self) -> list[dict]:
        """One row per (op, tag, dtype): calls, Σ tensor_bytes, Σ ring_bytes."""
        rows: dict[tuple, dict] = {}
        for r in self.records:
            row = rows.setdefault((r.op, r.tag, r.dtype), {"op": r.op, "tag": r.tag, "dtype": r.dtype, "calls": 0,
                                                          "tensor_bytes": 0, "ring_bytes": 0.0})
            row["calls"] += 1
            row["tensor_bytes"] += r.tensor_bytes
            row["ring_bytes"] += r.ring_bytes
        return list(rows.values())

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]


def _world(group) -> int:
    return dist.get_world_size(group)


def _record(op: str, t: torch.Tensor, tag: str | None, group, nbytes: int | None = None) -> None:
    if not _ACTIVE:
        return
    n = _world(group)
    tb = t.numel() * t.element_size() if nbytes is None else nbytes
    rec = CommRecord(op, tag, str(t.dtype).replace("torch.", ""), tb // t.element_size(), tb,
                     tb * ring_factor(op, n), n)
    for log in _ACTIVE:
        log.records.append(rec)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, *, group=None, async_op: bool = False, tag=None):
    """In place: every rank ends with the reduction (default: sum) of all ranks' ``tensor``."""
    _record("all_reduce", tensor, tag, group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, *, group=None,
                   async_op: bool = False, tag=None):
    """Rank r receives chunk r of the reduction of every rank's ``input`` (``input.numel() == N·output.numel()``)."""
    n = _world(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected world_size={n} × "
                         f"output's {output.numel()} = {n * output.numel()}")
    _record("reduce_scatter", input, tag, group)
    return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False, tag=None):
    """``output`` = concatenation of every rank's ``input`` in rank order (``output.numel() == N·input.numel()``)."""
    n = _world(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected world_size={n} × "
                         f"input's {input.numel()} = {n * input.numel()}")
    _record("all_gather", output, tag, group)
    return dist.all_gather_single(output, input, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, *, group=None, async_op: bool = False, tag=None):
    """In place: every rank ends with rank ``src``'s ``tensor``."""
    _record("broadcast", tensor, tag, group)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, *, group=None, tag=None) -> None:
    _record("send", tensor, tag, group)
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, *, group=None, tag=None) -> None:
    _record("recv", tensor, tag, group)
    dist.recv(tensor, src=src, group=group)


def isend(tensor: torch.Tensor, dst: int, *, group=None, tag=None):
    """Non-blocking send; returns a Work whose ``.wait()`` completes it."""
    _record("send", tensor, tag, group)
    return dist.isend(tensor, dst=dst, group=group)


def irecv(tensor: torch.Tensor, src: int, *, group=None, tag=None):
    """Non-blocking receive into ``tensor``; call ``.wait()`` before reading it."""
    _record("recv", tensor, tag, group)
    return dist.irecv(tensor, src=src, group=group)


# --------------------------------------------------------------------------- bandwidth benchmark


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_benchmark(sizes_bytes: Iterable[int] = (2**10, 2**14, 2**18, 2**20, 2**22), ops=("all_reduce",),
                        iters: int = 10, warmup: int = 2) -> list[dict]:
    """Rank function: time each op over message sizes (fp32), nccl-tests style.

    Returns rows {op, bytes, time_s, algbw_GBps, busbw_GBps}; time is the max over ranks
    of the mean per-iteration time (the slowest rank sets the pace). ``algbw = bytes / time``
    and ``busbw = algbw · ring_factor`` — busbw is comparable across ops and world sizes.
    """
    from .launch import device

    dev = device()
    n = dist.get_world_size()
    rows = []
    for op in ops:
        for size in sizes_bytes:
            numel = max(n, size // 4 // n * n)
            full = torch.ones(numel, device=dev)
            part = torch.ones(numel // n, device=dev)
            calls = {"all_reduce": lambda: dist.all_reduce(full),
                     "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
                     "all_gather": lambda: dist.all_gather_single(full, part),
                     "broadcast": lambda: dist.broadcast(full, src=0)}
            if op not in calls:
                raise ValueError(f"bandwidth_benchmark: unsupported op {op!r}; choose from {sorted(calls)}")
            for _ in range(warmup):
                calls[op]()
            _sync(dev)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                calls[op]()
            _sync(dev)
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=dev)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            nbytes = numel * 4
            t = elapsed.item()
            algbw = nbytes / t / 1e9
            rows.append({"op": op, "bytes": nbytes, "time_s": t, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * ring_factor(op, n), "world_size": n})
    return rows


def busbw_table(rows: list[dict]) -> str:
    """Format :func:`bandwidth_benchmark` rows as a fixed-width table."""
    lines = [f"{'op':<15}{'bytes':>10}{'time (us)':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in rows:
        lines.append(f"{r['op']:<15}{r['bytes']:>10}{r['time_s'] * 1e6:>12.1f}{r['algbw_GBps']:>12.3f}"
                     f"{r['busbw_GBps']:>12.3f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- "is distributed always faster?"


def toy_data_parallel_step(d_model: int = 512, global_batch: int = 64, steps: int = 10, warmup: int = 2) -> dict:
    """Rank function: one data-parallel step of a ``d_model × d_model`` linear layer, timed.

    Each rank computes forward + backward on ``global_batch / N`` rows (compute shrinks
    with N), then all-reduces the ``d_model²`` gradient (communication does not shrink:
    a ring moves 2(N−1)/N × 4·d_model² bytes per rank). With a small batch the gradient
    all-reduce dominates and more ranks are *slower*; with a large batch compute dominates
    and more ranks are faster. Returns mean seconds per step (max over ranks), split into
    compute and communication.
    """
    from .launch import device

    n = dist.get_world_size()
    if global_batch % n:
        raise ValueError(f"global_batch={global_batch} is not divisible by world_size={n}")
    dev = device()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(d_model, d_model, generator=gen).to(dev).requires_grad_()
    x = torch.randn(global_batch, d_model, generator=gen).to(dev)
    local = x.chunk(n)[dist.get_rank()]
    t_comp = t_comm = 0.0
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = (local @ w).square().mean()
        loss.backward()
        _sync(dev)
        t1 = time.perf_counter()
        if n > 1:
            dist.all_reduce(w.grad)
        _sync(dev)
        t2 = time.perf_counter()
        w.grad = None
        if i >= warmup:
            t_comp += t1 - t0
            t_comm += t2 - t1
    times = torch.tensor([t_comp / steps, t_comm / steps], dtype=torch.float64, device=dev)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    comp, comm_t = times.tolist()
    return {"world_size": n, "compute_s": comp, "comm_s": comm_t, "step_s": comp + comm_t,
            "grad_bytes": 4 * d_model * d_model, "rows_per_rank": global_batch // n}
