"""Chapter 02's measurements: DDP equal to one device, throughput races, bucket sizes, scaling, timelines.

Rank functions (run them with ``launch.spawn``): :func:`equality_with_single_device`,
:func:`accumulation_with_no_sync`, :func:`ddp_throughput`, :func:`bucket_size_sweep`,
:func:`ddp_step_time`, :func:`ddp_timelines`. Parent-side helpers: :func:`ddp_benchmark`,
:func:`scaling`, :func:`format_throughput`. Every race uses :func:`common.race` (interleaved
rounds, max over ranks, median over rounds); every variant trains its own copy of the same model
with the same data and optimizer, one :func:`common.train_step` at a time.

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
from .common import (
    Result,
    bench_config,
    check_global_batch,
    make_optimizer,
    race,
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
    "ddp_step_time",
    "ddp_timelines",
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
    """``{name: one_step()}`` for :func:`common.race`: each variant its own SGD, rank-local batches."""
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
) -> dict:
    """Rank function: tokens/s of each variant of :data:`RACE_VARIANTS` (or the ones named).

    ``batch_size`` is per rank; tokens per step = world · batch_size · block_size. Both bucketed
    variants use the same ``bucket_cap_mb`` (torch additionally caps its first bucket at 1 MiB).
    Returns ``{variant: {"step_s", "tokens_per_s", "step_s_rounds"}, "world_size", "params", ...}``.
    """
    config = config or bench_config()
    world, dev = dist.get_world_size(), device()
    entries = {v: _wrap(v, GPT(config, seed=0).to(dev), bucket_cap_mb) for v in variants}
    times = race(_race_steps(entries, config, batch_size), rounds, steps_per_round, warmup)
    tokens = world * batch_size * config.block_size
    out = {
        "world_size": world,
        "batch_size_per_rank": batch_size,
        "tokens_per_step": tokens,
        "bucket_cap_mb": bucket_cap_mb,
        "params": GPT(config).num_params(),
    }
    for v, ts in times.items():
        med = statistics.median(ts)
        out[v] = {"step_s": med, "tokens_per_s": tokens / med, "step_s_rounds": ts}
    return out


def bucket_size_sweep(
    bucket_sizes_mb=(None, 0.25, 1.0, 4.0, 16.0, 64.0),
    config: GPTConfig | None = None,
    batch_size: int = 8,
    rounds: int = 3,
    steps_per_round: int = 3,
    warmup: int = 1,
) -> list[dict]:
    """Rank function: own DDP step time for each ``bucket_cap_mb`` (None = one all-reduce per parameter).

    Returns rows ``{"bucket_cap_mb", "n_buckets", "step_s", "tokens_per_s"}`` (max over ranks,
    median over interleaved rounds). Small buckets pay the per-message latency many times; one
    huge bucket cannot start until backward ends (no overlap).
    """
    config = config or bench_config()
    world, dev = dist.get_world_size(), device()
    entries, n_buckets = {}, {}
    for cap in bucket_sizes_mb:
        ddp = DDP(GPT(config, seed=0).to(dev), bucket_cap_mb=cap)
        entries[str(cap)] = (ddp, None)
        n_buckets[str(cap)] = len(ddp.buckets)
    times = race(_race_steps(entries, config, batch_size), rounds, steps_per_round, warmup)
    tokens = world * batch_size * config.block_size
    return [
        {
            "bucket_cap_mb": cap,
            "n_buckets": n_buckets[str(cap)],
            "step_s": statistics.median(times[str(cap)]),
            "tokens_per_s": tokens / statistics.median(times[str(cap)]),
        }
        for cap in bucket_sizes_mb
    ]


def ddp_step_time(
    config: GPTConfig | None = None,
    global_batch: int = 8,
    bucket_cap_mb: float | None = 4.0,
    steps: int = 6,
    warmup: int = 2,
) -> dict:
    """Rank function: seconds per training step of own DDP with a *fixed global batch* (strong scaling).

    Each of N ranks gets ``global_batch / N`` sequences: more ranks → less compute each, but the
    same gradient bytes to all-reduce (and 2(N−1)/N of them on the wire per rank). Also reports
    the step time with the all-reduce left out (``compute_s``: forward, backward, optimizer only).
    """
    config = config or bench_config()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    check_global_batch(global_batch, world)
    local = global_batch // world
    ddp = DDP(GPT(config, seed=0).to(dev), bucket_cap_mb=bucket_cap_mb)
    plain = GPT(config, seed=0).to(dev)
    result = {
        "world_size": world,
        "global_batch": global_batch,
        "tokens_per_step": global_batch * config.block_size,
    }
    for key, model in (("step_s", ddp), ("compute_s", plain)):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for i in range(warmup + steps):
            if i == warmup:
                dist.barrier()
                t0 = time.perf_counter()
            x, y = make_batch(local, config.block_size, config.vocab_size, seed=100 * rank + i)
            train_step(model, opt, x.to(dev), y.to(dev))
        elapsed = torch.tensor(
            [(time.perf_counter() - t0) / steps], dtype=torch.float64, device=dev
        )
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        result[key] = elapsed.item()
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_s"]
    return result


def _blocking_bucketed(model, bucket_cap_mb: float, events: list) -> None:
    """After backward: one *blocking* all-reduce per bucket (flatten, reduce, copy back): bucketing, no overlap."""
    world = dist.get_world_size()
    for i, bucket in enumerate(
        make_buckets([p for _, p in trainable_parameters(model)], bucket_cap_mb * 2**20)
    ):
        t0 = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in bucket]).div_(world)
        comm.all_reduce(flat, tag="grad")
        for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
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


def ddp_timelines(
    config: GPTConfig | None = None, batch_size: int = 8, bucket_cap_mb: float = 2.0, steps: int = 3
) -> TimelineResult:
    """Rank function: one step's compute/communication timeline for the four ways to average gradients.

    Overlap and bucketing, each alone and together: ``"naive"`` (per parameter, blocking, after
    backward), ``"blocking_bucketed"`` (buckets, blocking, after backward), ``"per_param"`` (our DDP
    per parameter: async during backward), ``"overlapped"`` (our DDP with buckets: async during
    backward). Events are ``(kind, name, t_start, t_end)`` in seconds from the start of that
    step's forward (the last of ``steps`` SGD steps, after warm-up). Kinds: ``compute`` (forward,
    backward), ``comm`` (one collective, launch to completion), ``wait`` (training thread blocked).
    Returns a :class:`TimelineResult` (``res[variant]`` the events; its rows: who overlaps).
    """
    config = config or bench_config()
    rank, dev = dist.get_rank(), device()
    x, y = make_batch(batch_size, config.block_size, config.vocab_size, seed=rank)
    x, y = x.to(dev), y.to(dev)
    out = {}
    for key in (
        "naive",
        "blocking_bucketed",
    ):  # backward first, then communicate, one blocking call at a time
        model = GPT(config, seed=0).to(dev)
        opt, clock = torch.optim.SGD(model.parameters(), lr=1e-3), _Clock(model)
        for _ in range(steps):
            events = []

            def communicate(model=model, key=key, events=events):
                t_backward_end = time.perf_counter()
                if key == "naive":
                    naive_allreduce_gradients(model, timeline=events)
                else:
                    _blocking_bucketed(model, bucket_cap_mb, events)
                t = clock.t
                events[:0] = [
                    ("compute", "forward", t["forward"], t["backward"]),
                    ("compute", "backward", t["backward"], t_backward_end),
                ]

            dist.barrier()
            train_step(model, opt, x, y, after_backward=communicate)
        t0 = events[0][2]
        out[key] = [(k, n, a - t0, b - t0) for k, n, a, b in events]

    for key, cap in (("per_param", None), ("overlapped", bucket_cap_mb)):
        timeline = DDPTimeline()
        ddp = DDP(GPT(config, seed=0).to(dev), bucket_cap_mb=cap, observer=timeline)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        for _ in range(steps):
            timeline.events.clear()
            dist.barrier()
            train_step(ddp, opt, x, y)
        t0 = min(e[2] for e in timeline.events)
        out[key] = [(k, n, a - t0, b - t0) for k, n, a, b in timeline.events]
    result = TimelineResult(values=out)
    result.check_overlap()
    return result


# --------------------------------------------------------------------------- parent side


def ddp_benchmark(world_size: int = 2, timeout: float = 600, **kwargs) -> dict:
    """Run :func:`ddp_throughput` on ``world_size`` ranks; add ``ratios_vs_torch`` (tokens/s ÷ torch DDP's)."""
    from ..launch import spawn

    res = spawn(ddp_throughput, world_size, kwargs=kwargs, timeout=timeout)[0]
    variants = [v for v in RACE_VARIANTS if v in res]
    if "torch_ddp" in res:
        res["ratios_vs_torch"] = {
            v: res[v]["tokens_per_s"] / res["torch_ddp"]["tokens_per_s"] for v in variants
        }
    return res


def scaling(world_sizes=None, timeout: float = 600, **kwargs) -> list[dict]:
    """Strong scaling of own DDP: :func:`ddp_step_time` at each world size (default 1 … min(4, CPUs)).

    Beyond the number of cores, ranks share cores and the measurement says more about the
    machine than about DDP, so the default stops at ``os.cpu_count()``.
    """
    from ..launch import spawn

    if world_sizes is None:
        world_sizes = list(range(1, min(4, os.cpu_count() or 1) + 1))
    return [spawn(ddp_step_time, w, kwargs=kwargs, timeout=timeout)[0] for w in world_sizes]


def format_throughput(res: dict) -> str:
    lines = [
        f"world {res['world_size']}, {res['params'] / 1e6:.2f}M params, {res['tokens_per_step']} tokens/step, "
        f"bucket_cap_mb={res['bucket_cap_mb']}",
        f"{'variant':<16}{'step (ms)':>11}{'tokens/s':>11}{'vs torch':>10}",
    ]
    for v in RACE_VARIANTS:
        if v in res:
            ratio = res.get("ratios_vs_torch", {}).get(v, float("nan"))
            lines.append(
                f"{v:<16}{res[v]['step_s'] * 1e3:>11.1f}{res[v]['tokens_per_s']:>11.0f}{ratio:>10.2f}"
            )
    return "\n".join(lines)
