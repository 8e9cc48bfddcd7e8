"""Chapter 00's measurements: collective timings, the α–β cost model, and when data parallelism pays.

Rank functions (run them with ``launch.spawn``): :func:`bandwidth_benchmark` (nccl-tests style
algbw / busbw per op and size, timed with ``timing.time_steps``: median of rounds with their
spread) and :func:`scaling_race` (1 rank vs N on a linear layer, or an embedding table and the
layer, under the modelled clock: compute shrinks with N, the gradient all-reduce does not).
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
import torch.nn as nn

from .. import comm
from ..clock import BACKWARD_FACTOR, AcceleratorClock, Calibration, calibrate, count_flops
from ..launch import device, spawn
from ..results import Measured, Result, Row
from ..timing import Timings, format_seconds, time_steps
from ..step_time import AlphaBeta, fit_alpha_beta
from ..step_time import op_factor as _factor

__all__ = [
    "AlphaBeta",
    "BandwidthSweep",
    "bandwidth_benchmark",
    "busbw_table",
    "fit_alpha_beta",
    "measure_alpha_beta",
    "OPS",
    "FIT_SIZES",
]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
# 1 KiB … 16 MiB: ≤ 4 KiB is the latency regime, from 1 MiB on the bandwidth regime.
FIT_SIZES = (2**10, 2**12, 2**16, 2**20, 2**22, 2**24)


def _op_call(op: str, full: torch.Tensor, part: torch.Tensor, inbox: torch.Tensor):
    """The one call :func:`bandwidth_benchmark` times for ``op``, on these buffers."""
    n, rank = dist.get_world_size(), dist.get_rank()

    def send_recv():
        req = dist.isend(full, (rank + 1) % n)
        dist.recv(inbox, (rank - 1) % n)
        req.wait()

    calls = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: comm.reduce_scatter_single(part, full),
        "all_gather": lambda: comm.all_gather_single(full, part),
        "broadcast": lambda: dist.broadcast(full, src=0),
        "send_recv": send_recv,
    }
    if op not in calls:
        raise ValueError(f"bandwidth_benchmark: unsupported op {op!r}; choose from {sorted(calls)}")
    return calls[op]


@dataclass
class BandwidthSweep(Measured):
    """:func:`bandwidth_benchmark`'s result: reads as its list of rows (``sweep[0]["busbw_GBps"]``).

    ``header`` is what the timings stood on (:meth:`~course_lib.timing.Timings.header`);
    ``print(sweep)`` shows it above :func:`busbw_table`.
    """

    header: str = ""

    def table(self) -> str:
        lines = [self.title] if self.title else []
        return "\n".join(lines + [self.header, busbw_table(self.values)])


def bandwidth_benchmark(
    sizes_bytes: Iterable[int] = (2**10, 2**14, 2**18, 2**20, 2**22),
    ops=("all_reduce",),
    iters: int = 3,
    warmup: int = 2,
    repeats: int = 5,
) -> BandwidthSweep:
    """Rank function: time each op over message sizes (fp32), nccl-tests style.

    Per (op, size), :func:`course_lib.timing.time_steps`: ``warmup`` untimed calls, then
    ``repeats`` rounds of ``iters`` calls each; a round's time is the max over ranks of its mean
    per-call time (the slowest rank sets the pace). Returns a :class:`BandwidthSweep` reading as
    rows {op, bytes, world_size, time_s (median of the rounds), time_lo_s / time_hi_s (min / max:
    the spread), times_s, timing (the :class:`~course_lib.timing.Timing`), algbw_GBps,
    busbw_GBps}. ``algbw = bytes / time`` and ``busbw = algbw · ring_factor`` — busbw is
    comparable across ops and world sizes. Ops: all_reduce, reduce_scatter, all_gather,
    broadcast and send_recv (point-to-point, not a collective: every rank sends its tensor to
    rank+1 and receives rank−1's — one step of a ring).
    """
    if repeats < 1 or iters < 1:
        raise ValueError(f"bandwidth_benchmark: repeats={repeats} and iters={iters} must be ≥ 1")
    dev = device()
    n = dist.get_world_size()
    rows, header = [], ""
    for op in ops:
        for size in sizes_bytes:
            numel = max(n, size // 4 // n * n)
            full = torch.ones(numel, device=dev)
            part = torch.ones(numel // n, device=dev)
            inbox = torch.empty(numel, device=dev)
            call = _op_call(op, full, part, inbox)
            timed = time_steps(
                {op: call}, rounds=repeats, steps_per_round=iters, warmup=warmup, device=dev
            )
            timing, header = timed[op], timed.header()
            nbytes = numel * 4
            algbw = nbytes / timing.median / 1e9
            rows.append(
                {
                    "op": op,
                    "bytes": nbytes,
                    "world_size": n,
                    "time_s": timing.median,
                    "time_lo_s": timing.lo,
                    "time_hi_s": timing.hi,
                    "times_s": list(timing.samples),
                    "timing": timing,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * _factor(op, n),
                }
            )
    return BandwidthSweep(title=f"bandwidth sweep on {n} ranks", values=rows, header=header)


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
# AlphaBeta and fit_alpha_beta live in course_lib.step_time (the course's cost model); re-exported.


def measure_alpha_beta(
    world_size: int = 2,
    ops: Iterable[str] = OPS,
    sizes_bytes: Iterable[int] = FIT_SIZES,
    repeats: int = 5,
    iters: int = 2,
    warmup: int = 1,
    min_bytes: int = 2**20,
) -> tuple[AlphaBeta, BandwidthSweep]:
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


@dataclass
class ScalingRace(Result):
    """1 rank vs N ranks per case, under the modelled clock and once on the real clock.

    ``clocked`` / ``real`` are :class:`~course_lib.timing.Timings` of the variants
    ``"<case> · 1 rank"`` and ``"<case> · N ranks"`` (``real`` also ``"<case> · compute of
    1/N"``: every rank on its share at once, as in the N-rank step, but no all-reduce). Per
    case, ``compute_s`` / ``real_s`` / ``comm_s`` are the model's parts (FLOPs / rate; the real
    compute; the all-reduces, timed alone) and ``ratio`` the modelled compute over the real
    compute of the same rows (the smaller of the two batches).
    Rows: each clocked variant within ±20 % of its prediction, the 1-vs-N verdict the
    prediction expects (ranges separate), and ``modelled ≥ 10× real compute`` for the cases in
    ``require_ratio``.
    """

    # name -> (d_model, global_batch) for a linear layer, (d_model, global_batch, vocab) for a table
    cases: dict = field(default_factory=dict)
    world_size: int = 1
    rate: float = 0.0
    clock: str = "real clock"
    clocked: Timings | None = None
    real: Timings | None = None
    compute_s: dict = field(default_factory=dict)  # case -> {"1": s, "N": s} modelled compute
    # case -> the step's all-reduces (N ranks), timed alone after idling as long as the step computes
    comm_s: dict = field(default_factory=dict)
    comm_model_s: dict = field(default_factory=dict)  # case -> the same, by section 4's α–β fit
    real_s: dict = field(default_factory=dict)  # case -> {"1": s, "N": s} real compute alone
    ratio: dict = field(default_factory=dict)  # case -> modelled / real compute
    grad_bytes: dict = field(default_factory=dict)  # case -> [bytes of each parameter's gradient]
    beta: float = 0.0  # the fitted all-reduce β (bytes/s)
    require_ratio: tuple = ()

    def name(self, case: str, variant: str) -> str:
        """The variant's name in the timings: ``variant`` is ``"1"``, ``"N"`` or ``"share"``."""
        n = self.world_size
        return {
            "1": f"{case} · 1 rank",
            "N": f"{case} · {n} ranks",
            "share": f"{case} · compute of 1/{n}",
        }[variant]

    def predicted(self, case: str) -> dict[str, float]:
        """``{"1": s, "N": s}``: modelled + real compute (+ the all-reduces on N ranks).

        The clock sleeps *after* the real computation, so a step lasts both: the real part is
        timed before the clocked run (``real_s``: the compute alone, no all-reduce, under the
        clock, less the seconds it slept). So are the all-reduces (``comm_s``: the step's
        gradients, each round after idling as long as the step computes, as under the clock)."""
        c, r = self.compute_s[case], self.real_s[case]
        comm = self.comm_s.get(case, 0.0)
        return {"1": c["1"] + r["1"], "N": c["N"] + r["N"] + comm}

    def expect(self, case: str) -> str:
        """What the model predicts N ranks are against 1: ``"faster"`` or ``"slower"``."""
        p = self.predicted(case)
        return "faster" if p["N"] < p["1"] else "slower"

    def crossover_batch(self, case: str) -> float:
        """The global batch at which one rank's compute equals the all-reduce (N ≡ 1 rank)."""
        batch = self.cases[case][1]
        per_row = self.compute_s[case]["1"] / batch
        return self.world_size * self.comm_s[case] / per_row

    @property
    def flop_per_byte(self) -> float:
        """rate / β: the FLOPs the modelled accelerator does while the link moves one byte."""
        return self.rate / self.beta

    def verdict(self, case: str, timings: Timings | None = None) -> str:
        """``Comparison.verdict`` of N ranks against 1 (under the clock unless ``timings``)."""
        t = self.clocked if timings is None else timings
        return t.compare(self.name(case, "N"), self.name(case, "1")).verdict

    def checks(self):
        rows = []
        if self.clocked is not None:
            rows += self.clocked.checks()
        if self.clocked is not None and self.comm_s:
            for case in self.cases:
                a, b = self.name(case, "N"), self.name(case, "1")
                c = self.clocked.compare(a, b)
                want = -1 if self.expect(case) == "faster" else 1
                rows.append(
                    Row(
                        f"{case}: {self.world_size} ranks {self.expect(case)} than 1",
                        f"{c.timing_a} vs {c.timing_b}",
                        None,
                        "the prediction",
                        "min–max ranges separate",
                        c.sign == want,
                    )
                )
        for case in self.require_ratio:
            rows.append(
                Row(
                    f"{case}: modelled / real compute",
                    self.ratio[case],
                    10.0,
                    "",
                    "≥ 10×",
                    self.ratio[case] >= 10,
                )
            )
        return rows + list(self.checked)

    def table(self) -> str:
        """Per clock, each variant's median [min–max] (and the prediction); then the rows."""
        lines = [self.title] if self.title else []
        for t in (self.clocked, self.real):
            if t is None:
                continue
            lines.append(t.header())
            width = max(len(n) for n in t.timings)
            for name, timing in t.timings.items():
                pred = t.predicted.get(name)
                tail = f"   predicted {format_seconds(pred)}" if pred is not None else ""
                lines.append(f"  {name:<{width}}  {str(timing):<24}{tail}")
        rows = self.checks()
        if rows:
            lines.append(Result(checked=rows).table())
        return "\n".join(lines)


def linear_model(d_model: int) -> nn.Sequential:
    """The race's model: one ``d_model × d_model`` linear layer (bias-free), the same on every rank.

    A Sequential, so :class:`~course_lib.clock.AcceleratorClock` costs its layer as a block."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(d_model, d_model, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(d_model, d_model, generator=gen) / d_model**0.5)
    return model.to(device())


def embedding_model(vocab: int, d_model: int) -> nn.Sequential:
    """An embedding table of ``vocab`` rows, then :func:`linear_model`'s layer; the same on every rank.

    The lookup costs almost no FLOPs (the clock counts one per output element), but its gradient
    is dense: all ``vocab × d_model`` entries (the rows not looked up are zero) are all-reduced."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, d_model), nn.Linear(d_model, d_model, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(vocab, d_model, generator=gen))
        model[1].weight.copy_(torch.randn(d_model, d_model, generator=gen) / d_model**0.5)
    return model.to(device())


def calibrate_rate(d_model: int, batch: int, ratio: float = 10.0) -> Calibration:
    """:func:`course_lib.clock.calibrate` on :func:`linear_model` at ``batch`` rows, one thread.

    The ranks compute on one thread each (``launch.spawn``), so the real compute is measured on
    one thread too; the rate makes that block sleep ≥ ``ratio`` (× 2 margin) × its real compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = linear_model(d_model)
        x = torch.randn(batch, d_model, generator=torch.Generator().manual_seed(1))
        return calibrate(model, x.to(device()), ratio=ratio)
    finally:
        torch.set_num_threads(threads)


def idle_alpha(
    ops=("all_reduce", "all_gather", "reduce_scatter"), gap_s: float = 0.005, calls: int = 12
) -> dict[str, float]:
    """Rank function piece: the fixed cost of one small call issued after ``gap_s`` of idling.

    The sweep's α (:func:`~course_lib.experiments.collectives.bandwidth_benchmark`) times calls
    back to back, while gloo's threads are awake. Under the clock a collective mostly comes after
    a sleep: the worker thread, and the peer, must be woken and scheduled first — on 2 busy
    cores that costs milliseconds (0.4–0.8 ms back to back, 2–4 ms after a 5 ms sleep, measured
    at a load of 2). Median of ``calls`` 1 KiB calls per op, averaged over the ranks.
    """
    world = dist.get_world_size()
    x = torch.zeros(256, device=device())
    out = torch.zeros(256 * world, device=device())
    run = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: comm.all_gather_single(out, x),
        "reduce_scatter": lambda: comm.reduce_scatter_single(x, out),
    }
    medians = []
    for op in ops:
        times = []
        for _ in range(calls):
            time.sleep(gap_s)
            t0 = time.perf_counter()
            run[op]()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    t = torch.tensor(medians, dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return dict(zip(ops, (t / world).tolist(), strict=True))


def _all_reduces_alone(model: nn.Module, idle_s: float, rounds: int) -> float:
    """Median over ``rounds`` of all-reducing ``model``'s gradients, each round after ``idle_s``.

    As in a step under the clock, the all-reduces follow a stretch of compute with no
    collective: gloo's threads must wake first. The max over ranks (the slowest sets the pace)."""
    grads = [torch.ones_like(p) for p in model.parameters()]
    dist.barrier()
    times = []
    for _ in range(rounds):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        for g in grads:
            dist.all_reduce(g)
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def scaling_race(
    cases: dict[str, tuple[int, int]],
    rounds: int = 5,
    steps: int = 2,
    warmup: int = 1,
    rate: float | None = None,
    fit: AlphaBeta | None = None,
    require_ratio: Iterable[str] = (),
) -> ScalingRace:
    """Rank function: 1 rank vs all N ranks on one layer, timed with ``time_steps``.

    ``cases[name] = (d_model, global_batch)``: a linear layer (:func:`linear_model`) on
    ``global_batch`` rows; ``(d_model, global_batch, vocab)``: an embedding table then that
    layer (:func:`embedding_model`) on ``global_batch`` token ids. Per case, the 1-rank step
    (rank 0 alone on the whole batch, no communication; the other ranks wait in the next
    barrier) and the N-rank data-parallel step (``global_batch / N`` rows each, then one
    all-reduce per gradient), all variants interleaved in rounds. First on the real clock
    (``real``; each case's 1/N share of the compute is also timed, every rank at once, without
    the all-reduce). Then, with ``rate``, under ``AcceleratorClock(rate)``: the compute alone,
    less the seconds the clock slept (``real_s``: the real compute, after sleeps as in a step);
    with ``fit``, the step's all-reduces alone, each round after idling as long as the step
    computes (``comm_s``; ``comm_model_s`` is the fit's α–β for the same bytes); then the
    ``clocked`` timings, predicted from FLOPs / rate + ``real_s`` (+ ``comm_s`` on N ranks).
    ``require_ratio``: the cases whose modelled compute must be ≥ 10× their real compute.
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    out = ScalingRace(cases=dict(cases), world_size=n, require_ratio=tuple(require_ratio))
    models, batches = {}, {}
    for name, case in cases.items():
        if len(case) not in (2, 3):
            raise ValueError(
                f"scaling_race: case {name!r}: {case!r} is not (d_model, global_batch[, vocab])"
            )
        d_model, global_batch = case[:2]
        if global_batch % n:
            raise ValueError(
                f"scaling_race: case {name!r}: global_batch={global_batch} not divisible by {n}"
            )
        gen = torch.Generator().manual_seed(1)
        if len(case) == 3:  # an embedding table: token ids in, a vocab × d_model gradient out
            models[name] = embedding_model(case[2], d_model)
            x = torch.randint(case[2], (global_batch,), generator=gen)
        else:
            models[name] = linear_model(d_model)
            x = torch.randn(global_batch, d_model, generator=gen)
        batches[name] = x.to(dev)
        out.grad_bytes[name] = [4 * p.numel() for p in models[name].parameters()]

    def step(model, rows, communicate):
        model(rows).square().mean().backward()
        for p in model.parameters():
            if communicate:
                dist.all_reduce(p.grad)
            p.grad = None

    def variants(share: bool) -> dict:
        steps_ = {}
        for name, x in batches.items():
            m, local = models[name], x.chunk(n)[rank]
            steps_[out.name(name, "1")] = lambda m=m, x=x: rank == 0 and step(m, x, False)
            steps_[out.name(name, "N")] = lambda m=m, x=local: step(m, x, n > 1)
            if share:
                steps_[out.name(name, "share")] = lambda m=m, x=local: step(m, x, False)
        return steps_

    kw = dict(rounds=rounds, steps_per_round=steps, warmup=warmup)
    out.real = time_steps(variants(True), **kw)
    for name in batches:
        one, share = out.real[out.name(name, "1")], out.real[out.name(name, "share")]
        out.real_s[name] = {"1": one.median, "N": share.median}
    if rate is None:
        return out
    clock = AcceleratorClock(rate)
    for m in models.values():
        clock.apply(m)
    out.rate, out.clock = clock.rate, clock.name
    # the real compute the sleeps follow, in the step's conditions: the compute alone (no
    # all-reduce) under the clock, less what the clock slept
    alone = {k: f for k, f in variants(True).items() if not k.endswith(f"· {n} ranks")}
    real = time_steps(alone, **kw)
    for name, x in batches.items():
        _, flops = count_flops(models[name], x)
        full = (1 + BACKWARD_FACTOR) * flops / clock.rate
        out.compute_s[name] = {"1": full, "N": full / n}
        r = {
            "1": max(real[out.name(name, "1")].median - full, 0.0),
            "N": max(real[out.name(name, "share")].median - full / n, 0.0),
        }
        out.real_s[name] = r
        out.ratio[name] = min(full / r["1"], full / n / r["N"])  # the smaller batch: the worst
        if fit is not None:  # one all-reduce per parameter
            idle = out.compute_s[name]["N"] + r["N"]
            out.comm_s[name] = _all_reduces_alone(models[name], idle, rounds)
            calls = [fit.predict("all_reduce", b, n) for b in out.grad_bytes[name]]
            out.comm_model_s[name] = sum(calls)
            out.beta = fit.beta_bytes_per_s["all_reduce"]
    predicted = {out.name(c, v): s for c in out.comm_s for v, s in out.predicted(c).items()}
    out.clocked = time_steps(variants(False), clock=clock, predicted=predicted, **kw)
    clock.remove()
    return out


__all__ += [
    "ScalingRace",
    "calibrate_rate",
    "embedding_model",
    "idle_alpha",
    "linear_model",
    "scaling_race",
]
