"""Chapter 02's measurements: DDP equal to one device, throughput races, bucket sizes, scaling, timelines.

Rank functions (run them with ``launch.spawn``): :func:`equality_with_single_device`,
:func:`accumulation_with_no_sync`, :func:`ddp_throughput`, :func:`bucket_size_sweep`,
:func:`bucket_sweep_under_clock`, :func:`ddp_step_time`, :func:`ddp_timelines`,
:func:`exposed_communication`. Parent-side helpers: :func:`ddp_benchmark`,
:func:`scaling`, :func:`format_throughput`. Every step time is measured by
:func:`course_lib.timing.time_steps` (warm-up, interleaved rounds, max over ranks, median with the
min–max range; the results keep its :class:`~course_lib.timing.Timings` under ``"timings"``);
every variant trains its own copy of the same model with the same data and optimizer, one
:func:`common.train_step` at a time.

:class:`DDPTimeline` is the instrument the timelines are drawn from: a :class:`ddp.DDPObserver`
attached to our DDP from outside (``DDP(..., observer=DDPTimeline())``).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..data import make_batch
from ..ddp import (
    DDP,
    DDPObserver,
    make_buckets,
    naive_allreduce_gradients,
    torch_ddp,
    trainable_parameters,
)
from ..launch import device
from ..models import GPT, GPTConfig
from ..results import SGD, Measured, for_optimizer
from ..timing import time_steps
from .common import (
    Result,
    bench_config,
    check_global_batch,
    make_optimizer,
    shard_batch,
    small_config,
    step_batch,
    train_step,
)

__all__ = [
    "bench_config",
    "VARIANTS",
    "RACE_VARIANTS",
    "EQUALITY_OPTIMIZERS",
    "EqualityResult",
    "AccumulationResult",
    "TimelineResult",
    "DDPTimeline",
    "equality_with_single_device",
    "accumulation_with_no_sync",
    "ddp_throughput",
    "bucket_size_sweep",
    "SWEEP_BUCKETS_MB",
    "cap_label",
    "bucket_sweep_under_clock",
    "ddp_step_time",
    "ddp_timelines",
    "EXPOSURE_VARIANTS",
    "ExposureResult",
    "exposed_communication",
    "one_device_replay",
    "ddp_benchmark",
    "scaling",
    "format_throughput",
]

VARIANTS = ("naive", "own_per_param", "own_bucketed", "torch_ddp")
# The race: what each of our DDP's options costs or saves, and gradient compression on both sides.
# own_bucketed = our defaults, like torch's (copy in/out, no unused-parameter search).
RACE_VARIANTS = (
    "naive",
    "own_per_param",
    "own_find_unused",
    "own_bucketed",
    "own_bucket_view",
    "torch_ddp",
    "torch_bucket_view",
    "own_fp16",
    "torch_fp16",
    "own_bf16",
)

# Chapter 02's equality runs: plain SGD with a big step (differences would show) and AdamW with
# torch's default eps (this chapter's small model has no ~0 gradients that eps=1e-8 would amplify).
EQUALITY_OPTIMIZERS = {
    "sgd": ("sgd", dict(lr=0.5, momentum=0.0)),
    "adamw": ("adamw", dict(lr=3e-3, eps=1e-8)),
}


# --------------------------------------------------------------------------- equality with one device


@dataclass
class EqualityResult(Result):
    """One rank's weights against one device on the full batch, after ``steps`` steps.

    One row: the parameters equal the single-device run's within ``for_optimizer(optimizer)``.
    ``max_abs_diff`` is that row's max |Δparam|.
    """

    variant: str
    optimizer: str
    steps: int
    max_abs_diff: float

    @property
    def tol(self):
        """The named tolerance the row is checked with (:func:`results.for_optimizer`)."""
        return for_optimizer(self.optimizer)

    @property
    def tolerance(self) -> float:
        """The absolute part of :attr:`tol` (for older callers: max|Δ| ≤ it implies the row passes)."""
        return self.tol.atol


@dataclass
class AccumulationResult(Result):
    """Gradient accumulation with ``no_sync``: collectives per optimizer step, and equality with one device."""

    micro_batches: int
    grad_allreduces: int
    buckets: int
    max_abs_diff: float


@dataclass
class TimelineResult(Measured):
    """:func:`ddp_timelines`: ``res[variant]`` is its events; rows: who overlaps, who buckets."""

    def check_overlap(self) -> None:
        """Rows: the async variants launch during backward, the blocking ones after; buckets are fewer."""
        for key, overlaps in (
            ("overlapped", True),
            ("per_param", True),
            ("naive", False),
            ("blocking_bucketed", False),
        ):
            lead = _comm_lead(
                self.values[key]
            )  # > 0: the first all-reduce began before backward ended
            rule = "> 0 (launched during backward)" if overlaps else "≤ 0 (after backward)"
            self.condition(
                f"{key}: backward end − first all-reduce launch (s)",
                lead,
                lead > 0 if overlaps else lead <= 0,
                rule,
            )
        n = {k: sum(e[0] == "comm" for e in self.values[k]) for k in ("overlapped", "per_param")}
        self.condition(
            "all-reduces per step, bucketed vs per parameter",
            f"{n['overlapped']} vs {n['per_param']}",
            n["overlapped"] < n["per_param"],
            "fewer with buckets",
        )


def _comm_lead(events) -> float:
    backward_end = max(b for kind, _, _, b in events if kind == "compute")
    return backward_end - min(a for kind, _, a, _ in events if kind == "comm")


def _params(model) -> dict:
    return {name: p.detach() for name, p in model.named_parameters()}


def _wrap(variant: str, model, bucket_cap_mb: float | None):
    """(model to call, function run after backward) for one way of averaging gradients."""
    if variant == "naive":
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        return model, lambda: naive_allreduce_gradients(model)
    if variant == "own_per_param":
        return DDP(model, bucket_cap_mb=None), None
    own = {
        "own_bucketed": {},
        "own_find_unused": dict(find_unused_parameters=True),
        "own_bucket_view": dict(gradient_as_bucket_view=True),
        "own_fp16": dict(comm_hook="fp16"),
        "own_bf16": dict(comm_hook="bf16"),
    }
    if variant in own:
        return DDP(model, bucket_cap_mb=bucket_cap_mb, **own[variant]), None
    if variant in ("torch_ddp", "torch_bucket_view", "torch_fp16"):
        wrapped = torch_ddp(
            model,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=variant == "torch_bucket_view",
        )
        if variant == "torch_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

            wrapped.register_comm_hook(None, fp16_compress_hook)
        return wrapped, None
    raise ValueError(f"unknown variant {variant!r}; choose from {RACE_VARIANTS}")


def equality_with_single_device(
    variant: str = "own_bucketed",
    optimizer: str = "sgd",
    steps: int = 5,
    global_batch: int = 16,
    bucket_cap_mb: float = 0.03,
    config: GPTConfig | None = None,
) -> EqualityResult:
    """Rank function: train data-parallel and, on the same rank, one device on the full batch; compare.

    Rank r starts from a *different* init (seed r) to show that wrapping broadcasts rank 0's
    weights. Each step rank r trains on its ``global_batch / N`` slice of the same batch the
    single-device model sees whole. Returns the max |Δparam| after ``steps`` steps.
    """
    config = config or small_config()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    check_global_batch(global_batch, world)
    model = GPT(config, seed=rank).to(dev)
    wrapped, after = _wrap(variant, model, bucket_cap_mb)
    reference = GPT(config, seed=0).to(dev)
    name, overrides = EQUALITY_OPTIMIZERS[optimizer]
    opt = make_optimizer(name, model.parameters(), **overrides)
    ref_opt = make_optimizer(name, reference.parameters(), **overrides)
    for step in range(steps):
        x, y = step_batch(step, config, global_batch, dev)
        train_step(wrapped, opt, *shard_batch(x, y), after_backward=after)
        train_step(reference, ref_opt, x, y)
    result = EqualityResult(variant, optimizer, steps, 0.0)
    row = result.equal(
        "params vs one device on the full batch",
        _params(model),
        _params(reference),
        for_optimizer(optimizer),
    )
    result.max_abs_diff = row.measured
    return result


def accumulation_with_no_sync(
    micro_batches: int = 4,
    global_batch: int = 16,
    bucket_cap_mb: float = 0.03,
    config: GPTConfig | None = None,
) -> AccumulationResult:
    """Rank function: gradient accumulation with ``no_sync`` vs one device on the whole batch.

    Each rank splits its share into ``micro_batches`` pieces; all but the last backward run
    inside ``no_sync()`` (local accumulation, no communication), the last one syncs. Loss is
    scaled by 1/micro_batches so the accumulated gradient is the mean. Returns the number of
    gradient all-reduces per optimizer step and max |Δparam| after one step.
    """
    config = config or small_config()
    world, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, world, micro_batches)
    ddp = DDP(GPT(config, seed=0).to(dev), bucket_cap_mb=bucket_cap_mb)
    reference = GPT(config, seed=0).to(dev)
    opt, ref_opt = (
        torch.optim.SGD(ddp.parameters(), lr=0.5),
        torch.optim.SGD(reference.parameters(), lr=0.5),
    )
    x, y = step_batch(0, config, global_batch, dev)
    xl, yl = shard_batch(x, y)
    xs, ys = xl.chunk(micro_batches), yl.chunk(micro_batches)
    with comm.CommLog() as log:
        for i in range(micro_batches):
            if i < micro_batches - 1:
                with ddp.no_sync():
                    (ddp(xs[i], ys[i])[1] / micro_batches).backward()
            else:
                (ddp(xs[i], ys[i])[1] / micro_batches).backward()
    opt.step()
    train_step(reference, ref_opt, x, y)
    result = AccumulationResult(micro_batches, log.count(tag="grad"), len(ddp.buckets), 0.0)
    result.exact(
        "one gradient all-reduce per bucket per step (not per micro-batch)",
        result.grad_allreduces,
        result.buckets,
        against="buckets",
    )
    row = result.equal(
        "accumulated step vs one device on the whole batch",
        _params(ddp.module),
        _params(reference),
        SGD,
    )
    result.max_abs_diff = row.measured
    return result


# --------------------------------------------------------------------------- races


def _race_steps(
    entries: dict, config: GPTConfig, batch_size: int, optimizer_lr: float = 1e-3
) -> dict:
    """``{name: one_step()}`` for :func:`time_steps`: each variant its own SGD, rank-local batches."""
    rank, dev = dist.get_rank(), device()
    counter = [0]

    def one_step(model, after_backward, opt):
        x, y = make_batch(
            batch_size, config.block_size, config.vocab_size, seed=1000 * rank + counter[0] % 16
        )
        counter[0] += 1
        train_step(model, opt, x.to(dev), y.to(dev), after_backward=after_backward)

    steps = {}
    for name, (model, after_backward) in entries.items():
        opt = torch.optim.SGD(model.parameters(), lr=optimizer_lr)
        steps[name] = lambda m=model, a=after_backward, o=opt: one_step(m, a, o)
    return steps


def ddp_throughput(
    config: GPTConfig | None = None,
    batch_size: int = 8,
    bucket_cap_mb: float = 4.0,
    variants=RACE_VARIANTS,
    rounds: int = 7,
    steps_per_round: int = 3,
    warmup: int = 2,
) -> Measured:
    """Rank function: tokens/s of each variant of :data:`RACE_VARIANTS` (or the ones named).

    ``batch_size`` is per rank; tokens per step = world · batch_size · block_size. Both bucketed
    variants use the same ``bucket_cap_mb``; given explicitly, torch caps every bucket, the first
    included, at it (its 1 MiB first bucket applies only when ``bucket_cap_mb`` is left unset).
    Returns :class:`Measured` reading as ``{variant: {"step_s", "tokens_per_s", "step_s_rounds"},
    "world_size", "params", ..., "timings"}`` (``"timings"``: the :class:`Timings`, for ranges
    and verdicts).
    """
    config = config or bench_config()
    world, dev = dist.get_world_size(), device()
    entries = {v: _wrap(v, GPT(config, seed=0).to(dev), bucket_cap_mb) for v in variants}
    timings = time_steps(_race_steps(entries, config, batch_size), rounds, steps_per_round, warmup)
    tokens = world * batch_size * config.block_size
    out = {
        "world_size": world,
        "batch_size_per_rank": batch_size,
        "tokens_per_step": tokens,
        "bucket_cap_mb": bucket_cap_mb,
        "params": GPT(config).num_params(),
        "timings": timings,
    }
    for v, t in timings.items():
        out[v] = {
            "step_s": t.median,
            "tokens_per_s": tokens / t.median,
            "step_s_rounds": list(t.samples),
        }
    return Measured(title=f"DDP variants at world {world}: {timings.header()}", values=out)


def bucket_size_sweep(
    bucket_sizes_mb=(None, 0.25, 1.0, 4.0, 16.0, 64.0),
    config: GPTConfig | None = None,
    batch_size: int = 8,
    rounds: int = 3,
    steps_per_round: int = 3,
    warmup: int = 1,
) -> Measured:
    """Rank function: own DDP step time for each ``bucket_cap_mb`` (None = one all-reduce per parameter).

    Returns :class:`Measured` reading as a list of rows ``{"bucket_cap_mb", "n_buckets", "step_s",
    "tokens_per_s", "timing"}`` (max over ranks, median over interleaved rounds; ``"timing"`` the
    :class:`~course_lib.timing.Timing` with its range). Small buckets pay the per-message latency
    many times; one huge bucket cannot start until backward ends (no overlap).
    """
    config = config or bench_config()
    world, dev = dist.get_world_size(), device()
    entries, n_buckets = {}, {}
    for cap in bucket_sizes_mb:
        ddp = DDP(GPT(config, seed=0).to(dev), bucket_cap_mb=cap)
        entries[str(cap)] = (ddp, None)
        n_buckets[str(cap)] = len(ddp.buckets)
    timings = time_steps(_race_steps(entries, config, batch_size), rounds, steps_per_round, warmup)
    tokens = world * batch_size * config.block_size
    rows = [
        {
            "bucket_cap_mb": cap,
            "n_buckets": n_buckets[str(cap)],
            "step_s": timings[str(cap)].median,
            "tokens_per_s": tokens / timings[str(cap)].median,
            "timing": timings[str(cap)],
        }
        for cap in bucket_sizes_mb
    ]
    return Measured(title=f"bucket sizes at world {world}: {timings.header()}", values=rows)


def ddp_step_time(
    config: GPTConfig | None = None,
    global_batch: int = 8,
    bucket_cap_mb: float | None = 4.0,
    steps: int = 6,
    warmup: int = 2,
) -> Measured:
    """Rank function: seconds per training step of own DDP with a *fixed global batch* (strong scaling).

    Each of N ranks gets ``global_batch / N`` sequences: more ranks → less compute each, but the
    same gradient bytes to all-reduce (and 2(N−1)/N of them on the wire per rank). Also reports
    the step time with the all-reduce left out (``compute_s``: forward, backward, optimizer only).
    The two are timed in ``steps`` interleaved rounds of one step (:func:`time_steps`); returns
    :class:`Measured` reading as ``{"world_size", "global_batch", "tokens_per_step", "step_s",
    "compute_s", "tokens_per_s", "timings"}`` (medians over rounds).
    """
    config = config or bench_config()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    check_global_batch(global_batch, world)
    local = global_batch // world
    models = {
        "ddp": DDP(GPT(config, seed=0).to(dev), bucket_cap_mb=bucket_cap_mb),
        "compute only": GPT(config, seed=0).to(dev),
    }

    def stepper(model):
        opt, counter = torch.optim.SGD(model.parameters(), lr=1e-3), [0]

        def one_step():
            x, y = make_batch(
                local, config.block_size, config.vocab_size, seed=100 * rank + counter[0]
            )
            counter[0] += 1
            train_step(model, opt, x.to(dev), y.to(dev))

        return one_step

    timings = time_steps(
        {name: stepper(m) for name, m in models.items()}, rounds=steps, warmup=warmup
    )
    tokens = global_batch * config.block_size
    values = {
        "world_size": world,
        "global_batch": global_batch,
        "tokens_per_step": tokens,
        "step_s": timings["ddp"].median,
        "compute_s": timings["compute only"].median,
        "tokens_per_s": tokens / timings["ddp"].median,
        "timings": timings,
    }
    return Measured(title=f"own DDP at world {world}: {timings.header()}", values=values)


def _blocking_bucketed(model, bucket_cap_mb: float, events: list) -> None:
    """After backward: one *blocking* all-reduce per bucket (flatten, reduce, copy back): bucketing, no overlap."""
    world = dist.get_world_size()
    for i, bucket in enumerate(
        make_buckets([p for _, p in trainable_parameters(model)], bucket_cap_mb * 2**20)
    ):
        t0 = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in bucket]).div_(world)
        comm.all_reduce(flat, tag="grad")
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket]), strict=True):
            p.grad.copy_(g.view_as(p))
        events.append(("comm", f"bucket {i}", t0, time.perf_counter()))


class DDPTimeline(DDPObserver):
    """Our DDP's steps as ``(kind, name, t_start, t_end)`` events in ``.events`` (``perf_counter`` s).

    ``"compute"`` forward / backward; ``"comm"`` one per bucket, from launch until the collective
    completed (on gloo it runs in a background thread: the end is taken from the Work's future);
    ``"wait"`` the time the training thread sat blocked at the end of backward (waiting, then
    writing the averages into ``.grad``). Attach with ``DDP(..., observer=DDPTimeline())``.
    """

    def __init__(self):
        self.events: list[tuple[str, str, float, float]] = []
        self._comm: dict[int, list] = {}

    def on_forward_start(self) -> None:
        self._t_forward = time.perf_counter()

    def on_forward_end(self, output) -> None:
        self.events.append(("compute", "forward", self._t_forward, time.perf_counter()))
        self._backward_start, self._comm = None, {}
        for t in output if isinstance(output, (tuple, list)) else [output]:
            if isinstance(t, torch.Tensor) and t.requires_grad:  # fires when backward reaches it
                t.register_hook(self._note_backward_start)

    def _note_backward_start(self, grad) -> None:
        if self._backward_start is None:
            self._backward_start = time.perf_counter()

    def on_bucket_launch(self, i: int, work) -> None:
        event = self._comm[i] = ["comm", f"bucket {i}", time.perf_counter(), None]
        work.get_future().add_done_callback(lambda _fut: event.__setitem__(3, time.perf_counter()))

    def on_wait_start(self, t_end_compute: float) -> None:
        self._t_end_compute, self._t_wait = t_end_compute, time.perf_counter()

    def on_bucket_done(self, i: int) -> None:
        if self._comm[i][3] is None:
            self._comm[i][3] = time.perf_counter()

    def on_step_done(self) -> None:
        now = time.perf_counter()
        start = self._t_end_compute if self._backward_start is None else self._backward_start
        self.events.append(("compute", "backward", start, self._t_end_compute))
        self.events.extend(tuple(ev) for ev in self._comm.values())
        self.events.append(("wait", "wait + copy back", self._t_wait, now))


class _Clock:
    """Forward start and end of a plain model (forward hooks), for the blocking variants' timelines."""

    def __init__(self, model):
        self.t: dict[str, float] = {}
        model.register_forward_pre_hook(
            lambda *_: self.t.__setitem__("forward", time.perf_counter())
        )
        model.register_forward_hook(lambda *_: self.t.__setitem__("backward", time.perf_counter()))


def _median_events(steps: list[list]) -> list[tuple[str, str, float, float]]:
    """Per event position, the median start and end over steps (every step has the same events)."""
    if len({len(s) for s in steps}) != 1:
        raise RuntimeError(f"steps recorded different numbers of events: {[len(s) for s in steps]}")
    out = []
    for evs in zip(*steps, strict=True):
        kind, name = evs[0][0], evs[0][1]
        out.append(
            (
                kind,
                name,
                statistics.median(e[2] for e in evs),
                statistics.median(e[3] for e in evs),
            )
        )
    return out


def ddp_timelines(
    config: GPTConfig | None = None,
    batch_size: int = 8,
    bucket_cap_mb: float = 2.0,
    steps: int = 3,
    clock=None,
) -> TimelineResult:
    """Rank function: a step's compute/communication timeline for the four ways to average gradients.

    Overlap and bucketing, each alone and together: ``"naive"`` (per parameter, blocking, after
    backward), ``"blocking_bucketed"`` (buckets, blocking, after backward), ``"per_param"`` (our DDP
    per parameter: async during backward), ``"overlapped"`` (our DDP with buckets: async during
    backward). Events are ``(kind, name, t_start, t_end)`` in seconds from the start of the
    step's forward: the **median over** ``steps`` SGD steps after one warm-up step (with
    ``steps=1``, that one step). Kinds: ``compute`` (forward, backward), ``comm`` (one collective,
    launch to completion), ``wait`` (training thread blocked). ``clock`` (an
    :class:`~course_lib.clock.AcceleratorClock`, optional) is applied to every model first.
    Returns a :class:`TimelineResult` (``res[variant]`` the events; its rows: who overlaps).
    """
    config = config or bench_config()
    rank, dev = dist.get_rank(), device()
    x, y = make_batch(batch_size, config.block_size, config.vocab_size, seed=rank)
    x, y = x.to(dev), y.to(dev)
    warmup = 1 if steps > 1 else 0

    def new_model():
        model = GPT(config, seed=0).to(dev)
        if clock is not None:
            clock.apply(model)
        return model

    out = {}
    for key in ("naive", "blocking_bucketed"):  # backward, then communicate, one call at a time
        model = new_model()
        opt, marks = torch.optim.SGD(model.parameters(), lr=1e-3), _Clock(model)
        recorded = []
        for step in range(warmup + steps):
            events = []

            def communicate(model=model, key=key, events=events, marks=marks):
                t_backward_end = time.perf_counter()
                if key == "naive":
                    naive_allreduce_gradients(model, timeline=events)
                else:
                    _blocking_bucketed(model, bucket_cap_mb, events)
                t = marks.t
                events[:0] = [
                    ("compute", "forward", t["forward"], t["backward"]),
                    ("compute", "backward", t["backward"], t_backward_end),
                ]

            dist.barrier()
            train_step(model, opt, x, y, after_backward=communicate)
            if step >= warmup:
                t0 = events[0][2]
                recorded.append([(k, n, a - t0, b - t0) for k, n, a, b in events])
        out[key] = _median_events(recorded)

    for key, cap in (("per_param", None), ("overlapped", bucket_cap_mb)):
        timeline = DDPTimeline()
        ddp = DDP(new_model(), bucket_cap_mb=cap, observer=timeline)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        recorded = []
        for step in range(warmup + steps):
            timeline.events.clear()
            dist.barrier()
            train_step(ddp, opt, x, y)
            if step >= warmup:
                t0 = min(e[2] for e in timeline.events)
                recorded.append([(k, n, a - t0, b - t0) for k, n, a, b in timeline.events])
        out[key] = _median_events(recorded)
    result = TimelineResult(values=out)
    result.check_overlap()
    return result


# --------------------------------------------------------------------------- exposed communication


EXPOSURE_VARIANTS = {
    "blocking per-param": "naive",
    "blocking bucketed": "blocking_bucketed",
    "overlapped per-param": "per_param",
    "overlapped bucketed": "overlapped",
}
"""The four ways to average gradients of :func:`exposed_communication` → their timeline keys."""


@dataclass
class ExposureResult(Measured):
    """:func:`exposed_communication`: step times under the clock against the step-time model.

    ``values``: ``"timings"`` (the :class:`~course_lib.timing.Timings`, with a row per variant:
    measured within ``AGREEMENT_BAND`` of predicted), ``"predicted"`` ``{name: Prediction}``,
    ``"exposed"`` ``{name: (predicted s, measured s)}`` (measured = the variant's median step
    minus the compute-only median), ``"all_reduces"`` ``{name: calls per step}``, ``"timelines"``
    (the :class:`TimelineResult`, under the same clock), ``"rate"``, ``"clock"``, ``"alpha_beta"``
    (its table) and ``"fit"`` (the :class:`~course_lib.step_time.AlphaBeta`, α after idling).
    """

    def exposure_table(self) -> str:
        """Exposed communication per step, predicted beside measured, and the step totals."""
        t, pred = self.values["timings"], self.values["predicted"]
        lines = [
            t.header(),
            f"{'variant':<22}{'all-reduces':>12}{'exposed: predicted':>20}{'measured':>10}"
            f"{'step: predicted':>17}{'measured':>10}",
        ]
        for name in ("compute only", *EXPOSURE_VARIANTS):
            p_exp, m_exp = self.values["exposed"][name]
            calls = self.values["all_reduces"][name]
            lines.append(
                f"{name:<22}{calls:>12}{p_exp * 1e3:>17.1f} ms{m_exp * 1e3:>7.1f} ms"
                f"{pred[name].total * 1e3:>14.1f} ms{t[name].median * 1e3:>7.1f} ms"
            )
        return "\n".join(lines)


def exposed_communication(
    config: GPTConfig | None = None,
    batch_size: int = 2,
    bucket_cap_mb: float = 4.0,
    rounds: int = 3,
    timeline_steps: int = 3,
    ratio: float = 8.0,
) -> ExposureResult:
    """Rank function: exposed communication per step of the four ways to average gradients.

    Under the modelled accelerator clock (:mod:`course_lib.clock`; rate calibrated so every
    block sleeps ≥ ``ratio`` × 2 its real compute) and with α–β fitted on the spot, each of
    :data:`EXPOSURE_VARIANTS` and a compute-only step are predicted with
    :mod:`course_lib.step_time` from the buckets the objects really hold, then timed in
    interleaved rounds (:func:`time_steps`). Blocking variants expose every all-reduce
    (compute + Σ α + 2(N−1)/N·b/β, with the back-to-back α of the sweep); overlapped ones what
    :func:`step_time.ddp_step` leaves after backward (α measured after idling, as the calls come
    after a sleep). ``timelines``: :func:`ddp_timelines` under the same clock, medians over
    ``timeline_steps`` steps. ``ratio`` 8 (sleeps ≥ 16× the real compute) keeps the step short
    enough for the all-reduces to matter; the real compute beside the sleeps then adds 5–15 %
    to every variant alike, so it cancels in the measured exposure (variant − compute only).
    """
    from .. import step_time as st
    from ..clock import AcceleratorClock
    from .step_time import step_time_config

    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    config = config or step_time_config()
    fit, after_sleep = _fit_alpha_beta_twice()
    x, y = make_batch(batch_size, config.block_size, config.vocab_size, seed=rank)
    x, y = x.to(dev), y.to(dev)
    probe = GPT(config, seed=0).to(dev)
    rate = _one_rate(probe, x, y, ratio)
    clock = AcceleratorClock(rate)

    def clocked():
        model = GPT(config, seed=0).to(dev)
        clock.apply(model)
        return model

    params = dict(probe.named_parameters())
    fwd = st.part_seconds(st.part_flops(probe, x, y), rate)

    def nbytes(names_in_bucket) -> int:
        return sum(params[n].numel() * params[n].element_size() for n in names_in_bucket)

    steps, predicted, calls = {}, {}, {}
    compute = st.ddp_step(fwd, [], after_sleep, world)  # no bucket: compute alone
    plain = clocked()
    opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    steps["compute only"] = lambda m=plain, o=opt: train_step(m, o, x, y)
    predicted["compute only"] = compute
    calls["compute only"] = 0
    for name, key in EXPOSURE_VARIANTS.items():
        if key in ("naive", "blocking_bucketed"):
            model = clocked()
            named = [n for n, _ in trainable_parameters(model)]
            groups = (
                [[n] for n in named]
                if key == "naive"
                else [
                    [n for n, _ in b]
                    for b in make_buckets(trainable_parameters(model), bucket_cap_mb * 2**20)
                ]
            )
            after = (
                (lambda m=model: naive_allreduce_gradients(m))
                if key == "naive"
                else (lambda m=model: _blocking_bucketed(m, bucket_cap_mb, []))
            )
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            steps[name] = lambda m=model, o=opt, a=after: train_step(m, o, x, y, after_backward=a)
            exposed = sum(fit.predict("all_reduce", nbytes(g), world) for g in groups)
            predicted[name] = st.Prediction(
                name,
                {"compute": compute.parts["compute"], "exposed all_reduce": exposed},
                f"{len(groups)} blocking all-reduces after backward: all exposed",
            )
        else:
            ddp = DDP(clocked(), bucket_cap_mb=None if key == "per_param" else bucket_cap_mb)
            groups = [list(b) for b in ddp.buckets]
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            steps[name] = lambda m=ddp, o=opt: train_step(m, o, x, y)
            predicted[name] = st.ddp_step(fwd, _bucket_parts(probe, groups), after_sleep, world)
            predicted[name].name = name
        calls[name] = len(groups)
    timings = time_steps(
        steps,
        rounds=rounds,
        clock=clock,
        predicted={n: p.total for n, p in predicted.items()},
        title="DDP step time under the clock vs the step-time model",
    )
    base = timings["compute only"].median
    exposed = {
        n: (p.parts.get("exposed all_reduce", 0.0), timings[n].median - base)
        for n, p in predicted.items()
    }
    timelines = ddp_timelines(config, batch_size, bucket_cap_mb, steps=timeline_steps, clock=clock)
    result = ExposureResult(
        title=f"exposed communication per step, {world} ranks, {clock.name}",
        values={
            "timings": timings,
            "predicted": predicted,
            "exposed": exposed,
            "all_reduces": calls,
            "timelines": timelines,
            "rate": rate,
            "clock": clock.name,
            "alpha_beta": after_sleep.table(),
            "fit": after_sleep,
        },
    )
    result.checked += timings.checks()
    result.checked += timelines.checks()
    return result


def _fit_alpha_beta_twice():
    """(the sweep's α–β fit, the same with α measured after idling): DDP's calls follow sleeps.

    β is fitted on 1–16 MiB messages: the gradient all-reduces it predicts reach 12 MiB (one
    bucket), and a fit on 1–4 MiB alone gave a β 2–3× too high for those on 2 shared cores.
    """
    from .. import step_time as st
    from .collectives import bandwidth_benchmark, idle_alpha

    sizes = (2**10, 2**16, 2**20, 2**22, 2**24)
    rows = bandwidth_benchmark(sizes, iters=2, warmup=1, repeats=3)
    fit = st.fit_alpha_beta(rows)
    idle = idle_alpha(ops=("all_reduce",))
    after_sleep = st.AlphaBeta(
        {op: max(a, idle.get(op, a)) for op, a in fit.alpha_s.items()},
        fit.beta_bytes_per_s,
        fit.world_size,
        fit.min_bytes,
        fit.points,
    )
    return fit, after_sleep


def _one_rate(probe, x, y, ratio: float) -> float:
    """The clock's rate calibrated on ``probe`` (every block sleeps ≥ 2·ratio × its real
    compute), the smallest over ranks so that every rank sleeps the same."""
    from ..clock import calibrate

    rate = calibrate(probe, x, y, ratio=ratio).rate
    rate = torch.tensor([rate], dtype=torch.float64, device=device())
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    return float(rate.item())


def _bucket_parts(model, groups) -> list[tuple[int, str]]:
    """``(bytes, part)`` per bucket of parameter names, for :func:`step_time.ddp_step`: ``part``
    is the costed part whose backward completes the bucket (the latest in backward order)."""
    from .. import step_time as st
    from ..clock import costed_parts

    owner, params = st.param_parts(model), dict(model.named_parameters())
    order = [n for n, _, _ in costed_parts(model)]
    out = []
    for names in groups:
        nbytes = sum(params[n].numel() * params[n].element_size() for n in names)
        out.append((nbytes, min((owner[params[n]] for n in names), key=order.index)))
    return out


# --------------------------------------------------------------------------- bucket size, predicted


SWEEP_BUCKETS_MB = (None, 1.0, 4.0, 16.0)
""":func:`bucket_sweep_under_clock`'s caps: one all-reduce per parameter, about a quarter of a
block, about one block, and every gradient in one bucket (``step_time_config``: 12 MiB)."""


def cap_label(cap_mb: float | None) -> str:
    """``None`` → ``"per param"``, ``4.0`` → ``"4 MiB"``."""
    return "per param" if cap_mb is None else f"{cap_mb:g} MiB"


def bucket_sweep_under_clock(
    bucket_sizes_mb=SWEEP_BUCKETS_MB,
    rate: float | None = None,
    fit=None,
    config: GPTConfig | None = None,
    batch_size: int = 2,
    rounds: int = 5,
    ratio: float = 8.0,
) -> Measured:
    """Rank function: our DDP's step time per ``bucket_cap_mb``, predicted, then measured.

    Under the modelled accelerator clock at ``rate`` (calibrated here at ``ratio`` when None,
    as :func:`exposed_communication` does) each cap's step is predicted by
    :func:`step_time.ddp_step` from the buckets our DDP really holds and ``fit`` (an
    :class:`~course_lib.step_time.AlphaBeta`; when None, fitted here with α after idling), then
    every cap is timed in ``rounds`` interleaved rounds (:func:`time_steps`). Returns
    :class:`Measured` reading as ``{"rows": [{"cap_mb", "label", "n_buckets", "predicted"
    (a Prediction), "timing"}], "timings", "clock", "rate"}``; its rows: each measured median
    within ``AGREEMENT_BAND`` of its prediction.
    """
    from .. import step_time as st
    from ..clock import AcceleratorClock
    from .step_time import step_time_config

    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    config = config or step_time_config()
    x, y = make_batch(batch_size, config.block_size, config.vocab_size, seed=rank)
    x, y = x.to(dev), y.to(dev)
    probe = GPT(config, seed=0).to(dev)
    fit = _fit_alpha_beta_twice()[1] if fit is None else fit
    rate = _one_rate(probe, x, y, ratio) if rate is None else rate
    clock = AcceleratorClock(rate)
    fwd = st.part_seconds(st.part_flops(probe, x, y), rate)
    steps, rows = {}, []
    for cap in bucket_sizes_mb:
        model = GPT(config, seed=0).to(dev)
        clock.apply(model)
        ddp = DDP(model, bucket_cap_mb=cap)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        label = cap_label(cap)
        steps[label] = lambda m=ddp, o=opt: train_step(m, o, x, y)
        predicted = st.ddp_step(fwd, _bucket_parts(probe, ddp.buckets), fit, world)
        predicted.name = label
        rows.append({"cap_mb": cap, "label": label, "n_buckets": len(ddp.buckets)})
        rows[-1]["predicted"] = predicted
    timings = time_steps(
        steps,
        rounds=rounds,
        clock=clock,
        predicted={r["label"]: r["predicted"].total for r in rows},
        title="our DDP's step per bucket_cap_mb under the clock vs step_time.ddp_step",
    )
    for r in rows:
        r["timing"] = timings[r["label"]]
    result = Measured(
        title=f"step time vs bucket size, {world} ranks, {clock.name}",
        values={"rows": rows, "timings": timings, "clock": clock.name, "rate": rate},
    )
    result.checked += timings.checks()
    return result


# --------------------------------------------------------------------------- a script's run, replayed


def one_device_replay(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset,
    seen: list[list[list[int]]],
    batch_size: int,
    accumulation: int,
) -> torch.nn.Module:
    """Train ``model`` on one device on the global batches a DDP run's ranks saw; return it.

    ``seen[r][e]`` is rank r's sample order in epoch e (``list(sampler)`` after
    ``set_epoch(e)``). Rank r's micro-batch i is ``seen[r][e][i·b:(i+1)·b]``; optimizer step s
    averaged micro-batches ``s·k … s·k+k−1`` of every rank (k = ``accumulation``), so one device
    takes all of them as one global batch of N·k·b samples — the mean loss over it is the mean
    of the ranks' accumulated means, as every micro-batch has ``batch_size`` samples.
    """
    world, epochs = len(seen), len(seen[0])
    dev = next(model.parameters()).device
    for e in range(epochs):
        micro = len(seen[0][e]) // batch_size
        if micro % accumulation or any(len(s[e]) != len(seen[0][e]) for s in seen):
            raise ValueError(
                f"epoch {e}: every rank needs the same number of micro-batches, a multiple of "
                f"accumulation={accumulation} (got {[len(s[e]) for s in seen]} samples, "
                f"batch_size={batch_size})"
            )
        for step in range(micro // accumulation):
            rows = [
                i
                for r in range(world)
                for m in range(step * accumulation, (step + 1) * accumulation)
                for i in seen[r][e][m * batch_size : (m + 1) * batch_size]
            ]
            x = torch.stack([dataset[i][0] for i in rows]).to(dev)
            y = torch.stack([dataset[i][1] for i in rows]).to(dev)
            train_step(model, optimizer, x, y)
    return model


# --------------------------------------------------------------------------- parent side


def ddp_benchmark(world_size: int = 2, timeout: float = 600, **kwargs) -> Measured:
    """Run :func:`ddp_throughput` on ``world_size`` ranks; add ``ratios_vs_torch`` (tokens/s ÷ torch DDP's)."""
    from ..launch import spawn

    res = spawn(ddp_throughput, world_size, kwargs=kwargs, timeout=timeout)[0]
    variants = [v for v in RACE_VARIANTS if v in res]
    if "torch_ddp" in res:
        res.values["ratios_vs_torch"] = {
            v: res[v]["tokens_per_s"] / res["torch_ddp"]["tokens_per_s"] for v in variants
        }
    return res


def scaling(world_sizes=None, timeout: float = 600, **kwargs) -> Measured:
    """Strong scaling of own DDP: :func:`ddp_step_time` at each world size (default 1 … min(4, CPUs)).

    Beyond the number of cores, ranks share cores and the measurement says more about the
    machine than about DDP, so the default stops at ``os.cpu_count()``. Returns :class:`Measured`
    reading as the list of :func:`ddp_step_time`'s results, one per world size.
    """
    from ..launch import spawn

    if world_sizes is None:
        world_sizes = list(range(1, min(4, os.cpu_count() or 1) + 1))
    runs = [spawn(ddp_step_time, w, kwargs=kwargs, timeout=timeout)[0] for w in world_sizes]
    return Measured(title="strong scaling of own DDP (fixed global batch)", values=runs)


def format_throughput(res) -> str:
    """:func:`ddp_benchmark`'s result as text: each variant's step time (median [min–max]), tokens/s,
    ratio to torch DDP, and whether our bucketed DDP and torch's can be told apart here."""
    timings = res.get("timings")
    lines = [
        f"world {res['world_size']}, {res['params'] / 1e6:.2f}M params, {res['tokens_per_step']} tokens/step, "
        f"bucket_cap_mb={res['bucket_cap_mb']}",
        *([timings.header()] if timings is not None else []),
        f"{'variant':<16}{'step time [min–max]':>24}{'tokens/s':>11}{'vs torch':>10}",
    ]
    for v in RACE_VARIANTS:
        if v in res:
            ratio = res.get("ratios_vs_torch", {}).get(v, float("nan"))
            step = str(timings[v]) if timings is not None else f"{res[v]['step_s'] * 1e3:.1f} ms"
            lines.append(f"{v:<16}{step:>24}{res[v]['tokens_per_s']:>11.0f}{ratio:>10.2f}")
    if timings is not None and "own_bucketed" in timings and "torch_ddp" in timings:
        lines.append(timings.compare("own_bucketed", "torch_ddp").verdict)
    return "\n".join(lines)
