"""Chapter 00's measurements: collective timings, the α–β cost model, and when data parallelism pays.

Rank functions (run them with ``launch.spawn``): :func:`bandwidth_benchmark` (nccl-tests style
algbw / busbw per op and size, median of repeats with spread) and :func:`toy_data_parallel_step`
(one linear layer trained data-parallel: compute shrinks with N, the gradient all-reduce does not).
Parent-side helpers: :func:`fit_alpha_beta` fits ``time = α + ring_factor · bytes / β`` per op to
the sweep's rows; :func:`measure_alpha_beta` spawns a short sweep and fits it (a few seconds),
so any notebook can re-derive the cost model it predicts with. :func:`busbw_table` formats rows.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

from ..comm import ring_factor
from ..launch import device, spawn

__all__ = [
    "AlphaBeta",
    "bandwidth_benchmark",
    "busbw_table",
    "fit_alpha_beta",
    "measure_alpha_beta",
    "toy_data_parallel_step",
    "OPS",
    "FIT_SIZES",
]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
# 1 KiB … 16 MiB: ≤ 4 KiB is the latency regime, from 1 MiB on the bandwidth regime.
FIT_SIZES = (2**10, 2**12, 2**16, 2**20, 2**22, 2**24)


def _factor(op: str, n: int) -> float:
    """Ring factor of ``op``; ``send_recv`` (one ring step: send right, receive left) moves its tensor once."""
    return 1.0 if op == "send_recv" else ring_factor(op, n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_benchmark(
    sizes_bytes: Iterable[int] = (2**10, 2**14, 2**18, 2**20, 2**22),
    ops=("all_reduce",),
    iters: int = 3,
    warmup: int = 2,
    repeats: int = 5,
) -> list[dict]:
    """Rank function: time each op over message sizes (fp32), nccl-tests style.

    Per (op, size): ``warmup`` untimed calls, then ``repeats`` timed repeats of ``iters`` calls
    each; a repeat's time is the max over ranks of its mean per-call time (the slowest rank
    sets the pace). Returns rows {op, bytes, world_size, time_s (median of the repeats),
    time_lo_s / time_hi_s (min / max: the spread), times_s, algbw_GBps, busbw_GBps}.
    ``algbw = bytes / time`` and ``busbw = algbw · ring_factor`` — busbw is comparable across
    ops and world sizes. Ops: all_reduce, reduce_scatter, all_gather, broadcast and
    send_recv (point-to-point, not a collective: every rank sends its tensor to rank+1 and
    receives rank−1's — one step of a ring).
    """
    if repeats < 1 or iters < 1:
        raise ValueError(f"bandwidth_benchmark: repeats={repeats} and iters={iters} must be ≥ 1")
    dev = device()
    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for op in ops:
        for size in sizes_bytes:
            numel = max(n, size // 4 // n * n)
            full = torch.ones(numel, device=dev)
            part = torch.ones(numel // n, device=dev)
            inbox = torch.empty(numel, device=dev)

            def send_recv():
                req = dist.isend(full, (rank + 1) % n)
                dist.recv(inbox, (rank - 1) % n)
                req.wait()

            calls = {
                "all_reduce": lambda: dist.all_reduce(full),
                "reduce_scatter": lambda: dist.reduce_scatter_single(part, full),
                "all_gather": lambda: dist.all_gather_single(full, part),
                "broadcast": lambda: dist.broadcast(full, src=0),
                "send_recv": send_recv,
            }
            if op not in calls:
                raise ValueError(
                    f"bandwidth_benchmark: unsupported op {op!r}; choose from {sorted(calls)}"
                )
            for _ in range(warmup):
                calls[op]()
            times = []
            for _ in range(repeats):
                _sync(dev)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    calls[op]()
                _sync(dev)
                times.append((time.perf_counter() - t0) / iters)
            worst = torch.tensor(times, dtype=torch.float64, device=dev)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            times = worst.tolist()
            nbytes = numel * 4
            t = statistics.median(times)
            algbw = nbytes / t / 1e9
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "world_size": n,
                    "time_s": t,
                    "time_lo_s": min(times),
                    "time_hi_s": max(times),
                    "times_s": times,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * _factor(op, n),
                }
            )
    return rows


def busbw_table(rows: list[dict]) -> str:
    """Format :func:`bandwidth_benchmark` rows as a fixed-width table (time = median, with min–max)."""
    lines = [
        f"{'op':<15}{'bytes':>10}{'median (us)':>13}{'min–max (us)':>18}{'algbw GB/s':>12}{'busbw GB/s':>12}"
    ]
    for r in rows:
        lo, hi = r.get("time_lo_s", r["time_s"]), r.get("time_hi_s", r["time_s"])
        lines.append(
            f"{r['op']:<15}{r['bytes']:>10}{r['time_s'] * 1e6:>13.1f}"
            f"{f'{lo * 1e6:.0f}–{hi * 1e6:.0f}':>18}{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- the α–β cost model


@dataclass
class AlphaBeta:
    """The α–β cost model, one (α, β) per op: ``time = α + ring_factor(op, N) · bytes / β``.

    ``alpha_s[op]`` is the fixed cost of one call (seconds: latency, launch, synchronisation);
    ``beta_bytes_per_s[op]`` the bus bandwidth (bytes one rank sends per second, ring model).
    ``bytes`` is the tensor size as nccl-tests and ``CommLog.tensor_bytes`` count it (the
    all-reduce buffer, the reduce-scatter input, the all-gather output, the sent tensor).
    """

    alpha_s: dict[str, float]
    beta_bytes_per_s: dict[str, float]
    world_size: int
    min_bytes: int
    points: dict[str, int] = field(default_factory=dict)

    def predict(self, op: str, nbytes: float, world_size: int | None = None) -> float:
        """Predicted seconds for one ``op`` call on a ``nbytes`` tensor over ``world_size`` ranks."""
        if op not in self.alpha_s:
            raise ValueError(
                f"AlphaBeta.predict: no fit for op {op!r}; fitted ops: {sorted(self.alpha_s)}"
            )
        n = self.world_size if world_size is None else world_size
        if n < 1 or nbytes < 0:
            raise ValueError(
                f"AlphaBeta.predict: need world_size ≥ 1 and nbytes ≥ 0, got {n}, {nbytes}"
            )
        if n == 1:
            return 0.0
        return self.alpha_s[op] + _factor(op, n) * nbytes / self.beta_bytes_per_s[op]

    def table(self) -> str:
        """α (µs) and β (GB/s) per op, as a fixed-width table."""
        lines = [f"{'op':<15}{'α (us)':>10}{'β (GB/s)':>11}{'points in β fit':>17}"]
        for op in self.alpha_s:
            lines.append(
                f"{op:<15}{self.alpha_s[op] * 1e6:>10.1f}{self.beta_bytes_per_s[op] / 1e9:>11.3f}"
                f"{self.points.get(op, 0):>17}"
            )
        return "\n".join(lines)


def fit_alpha_beta(
    rows: list[dict], min_bytes: int = 2**20, latency_bytes: int = 2**12
) -> AlphaBeta:
    """Fit the α–β model per op to measured rows, as :func:`bandwidth_benchmark` returns them.

    Input: rows with at least ``op``, ``bytes`` and ``time_s`` (seconds per call, the median of
    repeats) and ``world_size``. Output: an :class:`AlphaBeta` with ``alpha_s`` and
    ``beta_bytes_per_s`` per op and ``predict(op, nbytes, world_size)``.

    α is the smallest time of the latency regime (rows with ``bytes ≤ latency_bytes``, each
    already a median of repeats; the smallest size if none) — a busy machine only ever adds
    time, so the minimum is the robust estimate of the fixed cost; β is fitted on the
    **bandwidth regime** only (``bytes ≥ min_bytes``): the slope of ``time − α`` against
    ``ring_factor · bytes``, least squares in relative error.
    Why two regimes: gloo switches algorithm with the message size, so one straight line
    through all sizes fits neither end. Needs ≥ 1 bandwidth-regime row per op; all rows of
    one fit must share one world size.
    """
    if not rows:
        raise ValueError("fit_alpha_beta: no rows; pass bandwidth_benchmark's rows")
    worlds = {r["world_size"] for r in rows}
    if len(worlds) != 1:
        raise ValueError(
            f"fit_alpha_beta: rows from several world sizes {sorted(worlds)}; fit one at a time"
        )
    n = worlds.pop()
    if n < 2:
        raise ValueError("fit_alpha_beta: world_size 1 has no communication to fit")
    alpha, beta, points = {}, {}, {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
        small = [r["time_s"] for r in mine if r["bytes"] <= latency_bytes] or [mine[0]["time_s"]]
        big = [r for r in mine if r["bytes"] >= min_bytes]
        if not big:
            raise ValueError(
                f"fit_alpha_beta: op {op!r} has no row with bytes ≥ min_bytes={min_bytes}; "
                f"sweep larger messages (largest measured: {mine[-1]['bytes']})"
            )
        a = min(small)
        xs = [_factor(op, n) * r["bytes"] for r in big]
        ys = [max(r["time_s"] - a, 1e-12) for r in big]
        ts = [r["time_s"] for r in big]
        inv_beta = sum(x * y / t**2 for x, y, t in zip(xs, ys, ts)) / sum(
            x * x / t**2 for x, t in zip(xs, ts)
        )
        alpha[op], beta[op], points[op] = a, 1.0 / inv_beta, len(big)
    return AlphaBeta(alpha, beta, n, min_bytes, points)


def measure_alpha_beta(
    world_size: int = 2,
    ops: Iterable[str] = OPS,
    sizes_bytes: Iterable[int] = FIT_SIZES,
    repeats: int = 5,
    iters: int = 2,
    warmup: int = 1,
    min_bytes: int = 2**20,
) -> tuple[AlphaBeta, list[dict]]:
    """Spawn a short sweep on ``world_size`` ranks and fit it: ``(fit, rows)``. A few seconds on 2 cores.

    >>> fit, rows = measure_alpha_beta()          # doctest: +SKIP
    >>> fit.predict("all_reduce", 12.6e6, 2)      # seconds for one 12.6 MB gradient all-reduce
    """
    rows = spawn(
        bandwidth_benchmark,
        world_size,
        kwargs=dict(
            sizes_bytes=tuple(sizes_bytes),
            ops=tuple(ops),
            iters=iters,
            warmup=warmup,
            repeats=repeats,
        ),
    )[0]
    return fit_alpha_beta(rows, min_bytes=min_bytes), rows


# --------------------------------------------------------------------------- "is distributed always faster?"


def toy_data_parallel_step(
    d_model: int = 512, global_batch: int = 64, steps: int = 10, warmup: int = 2
) -> dict:
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
    return {
        "world_size": n,
        "compute_s": comp,
        "comm_s": comm_t,
        "step_s": comp + comm_t,
        "grad_bytes": 4 * d_model * d_model,
        "rows_per_rank": global_batch // n,
    }


def scaling_race(
    cases: dict[str, tuple[int, int]], rounds: int = 5, steps: int = 3, warmup: int = 1
) -> dict:
    """Rank function: 1 rank vs all N ranks on the same linear-layer step, interleaved in rounds.

    ``cases[name] = (d_model, global_batch)``. Each round runs, per case, the 1-rank step (rank 0
    alone on the whole batch, no communication; the other ranks wait in a barrier) and then the
    N-rank data-parallel step (``global_batch / N`` rows each + the gradient all-reduce), so a
    background load hits both alike. Returns ``{name: {"1": {...}, "N": {...}, "ratio": [...]}}``
    with per-variant median step / compute / all-reduce seconds (max over ranks) and the per-round
    ratio N-rank / 1-rank step time.
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    out = {}
    for name, (d_model, global_batch) in cases.items():
        if global_batch % n:
            raise ValueError(
                f"scaling_race: case {name!r}: global_batch={global_batch} not divisible by {n}"
            )
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(d_model, d_model, generator=gen).to(dev).requires_grad_()
        x = torch.randn(global_batch, d_model, generator=gen).to(dev)
        local = x.chunk(n)[rank]

        def step(rows, communicate):
            t0 = time.perf_counter()
            (rows @ w).square().mean().backward()
            _sync(dev)
            t1 = time.perf_counter()
            if communicate:
                dist.all_reduce(w.grad)
                _sync(dev)
            t2 = time.perf_counter()
            w.grad = None
            return t1 - t0, t2 - t1

        samples = {"1": [], "N": []}
        for r in range(warmup + rounds):
            for variant in ("1", "N"):
                dist.barrier()
                comp = comm_t = 0.0
                if variant == "N" or rank == 0:
                    for _ in range(steps):
                        c, m = step(local if variant == "N" else x, variant == "N" and n > 1)
                        comp, comm_t = comp + c / steps, comm_t + m / steps
                t = torch.tensor([comp, comm_t, comp + comm_t], dtype=torch.float64, device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if r >= warmup:
                    samples[variant].append(t.tolist())
        med = {
            v: {
                k: statistics.median(s[i] for s in samples[v])
                for i, k in enumerate(("compute_s", "comm_s", "step_s"))
            }
            for v in samples
        }
        out[name] = {
            **med,
            "ratio": [b[2] / a[2] for a, b in zip(samples["1"], samples["N"])],
            "world_size": n,
            "grad_bytes": 4 * d_model * d_model,
        }
    return out


__all__ += ["scaling_race"]
