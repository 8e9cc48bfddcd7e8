"""Chapter 00's measurements: bus bandwidth per message size, and when data parallelism pays.

Rank functions (run them with ``launch.spawn``): :func:`bandwidth_benchmark` (nccl-tests style
algbw / busbw per op and size) and :func:`toy_data_parallel_step` (one linear layer trained
data-parallel: compute shrinks with N, the gradient all-reduce does not). :func:`busbw_table`
formats the benchmark's rows.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.distributed as dist

from ..comm import ring_factor
from ..launch import device

__all__ = ["bandwidth_benchmark", "busbw_table", "toy_data_parallel_step"]


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
