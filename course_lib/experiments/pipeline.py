"""Chapter 05's measurements: pipelines equal to one device, bubbles, live activations, torch's pipelining.

Rank functions (run them with ``launch.spawn``), each returning a
:class:`~course_lib.results.Result`:

* :func:`pipeline_training` — our GPipe / 1F1B / interleaved 1F1B trained for some steps: this
  rank's stage weights (:class:`StageResult`), checked against one device trained on this rank;
* :func:`measure_bubbles` — each stage a tiny real layer whose forward and backward the shared
  clock costs (:mod:`course_lib.clock`: known stage times): the bubble measured against
  ``(p−1)/(m+p−1)`` (:class:`BubbleResult`; :func:`sleep_bubbles` is its ``as_dict()``);
* :func:`unbalanced_timing` — the same clocked stages, one of them ``factor``× slower: the
  measured step against :func:`~course_lib.step_time.slowest_stage_step` (:class:`UnbalancedTiming`);
* :func:`gpt_timelines` — the real GPT: timelines, bubbles, live micro-batches and live activation
  bytes, p2p bytes (:class:`TimelineResult`);
* :func:`gpt_clocked` — the same GPT pipeline under the modelled clock at a calibrated rate: the
  measured step against :func:`~course_lib.step_time.pipeline_step` of each stage's FLOPs / rate,
  each rank's bubble against the simulation's idle share (:class:`ClockedPipelineResult`);
* :func:`pp_dp_training` — 2 stages × 2 replicas (:class:`PPDPResult`);
* :func:`torch_pipelining_grads` — ``torch.distributed.pipelining`` on the same stages: gradients
  equal to ours (:class:`TorchPipeliningResult`);
* :func:`zero_bubble_order` — torch's zero-bubble action order (:class:`ZeroBubbleResult`);
* :func:`zero_bubble_timing` — our 1F1B and ZB-H1 zero bubble on clocked tiny stages: idle time
  per rank against ``(p−1)(F+B+W)`` and ``(p−1)(F+B−W)`` (:class:`ZeroBubbleTiming`, displayed).

Parent-side: :func:`merge_states`, :func:`gpt_stage_flops`, :func:`idle_split`. Timelines and
memory are measured by the runner's observers (:func:`~course_lib.pipeline.measured_step`), p2p
bytes by :class:`~course_lib.comm.CommLog`.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..clock import BACKWARD_FACTOR, AcceleratorClock, calibrate, count_flops, format_rate
from ..formulas import pipeline_bubble, pipeline_p2p_bytes
from ..launch import device
from ..models import GPT, GPTConfig
from ..pipeline import (
    PipelineRunner,
    bubble_fractions,
    gpt_loss,
    make_schedules,
    measured_step,
    peak_live_microbatches,
    split_gpt,
    split_layers,
    split_microbatches,
)
from ..results import EXACT, Result, Row, for_optimizer, max_abs_diff
from ..step_time import part_flops, pipeline_step, slowest_stage_step
from ..timing import AGREEMENT_BAND
from .common import (
    make_optimizer,
    min_over_ranks,
    parallel_config,
    reference_run,
    shard_batch,
    step_batch,
)

__all__ = [
    "parallel_config",
    "StageResult",
    "pipeline_training",
    "merge_states",
    "tiny_layer",
    "stage_clock",
    "BubbleResult",
    "measure_bubbles",
    "sleep_bubbles",
    "UnbalancedTiming",
    "unbalanced_timing",
    "TimelineResult",
    "gpt_timelines",
    "IdleSplit",
    "idle_split",
    "gpt_stage_flops",
    "ClockedPipelineResult",
    "gpt_clocked",
    "PPDPResult",
    "pp_dp_training",
    "TorchPipeliningResult",
    "torch_pipelining_grads",
    "ZeroBubbleResult",
    "zero_bubble_order",
    "ZeroBubbleTiming",
    "zero_bubble_timing",
]


def _stage_chunks(config: GPTConfig, p: int, v: int, rank: int, dev) -> list[nn.Module]:
    """This rank's chunks of the GPT (seed 0 on every rank: the same full model, then cut)."""
    stages = split_gpt(GPT(config, seed=0), p, v)
    return [stages[c * p + rank].to(dev) for c in range(v)]


def _runner(config, schedule, p, m, v, stage, micro, chunks, ranks=None):
    kwargs = {"num_chunks": v} if schedule == "interleaved" else {}
    scheds = make_schedules(schedule, p, m, **kwargs)
    return PipelineRunner(
        chunks,
        stage,
        scheds,
        m,
        activation_shape=(micro, config.block_size, config.d_model),
        ranks=ranks,
        device=device(),
    )


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _tiny_chunks(p: int, v: int, rank: int, width: int, dev) -> list[nn.Module]:
    """This rank's ``v`` chunks of ``p·v`` :func:`tiny_layer` stages (chunk c is stage c·p + rank)."""
    layers = split_layers([tiny_layer(width, seed=k) for k in range(p * v)], p * v)
    return [layers[c * p + rank].to(dev) for c in range(v)]


def _tiny_runner(chunks, rank, schedule, p, m, micro_batch, width, dev, weight_cost=None):
    """A :class:`PipelineRunner` over tiny stages, an MSE loss on ``(micro_batch, width)`` rows."""
    kwargs = {"num_chunks": len(chunks)} if len(chunks) > 1 else {}
    return PipelineRunner(
        chunks,
        rank,
        make_schedules(schedule, p, m, **kwargs),
        m,
        activation_shape=(micro_batch, width),
        loss_fn=_mse,
        device=dev,
        weight_cost=weight_cost,
    )


def _state(chunks) -> dict:
    return {k: t.detach().cpu() for c in chunks for k, t in c.state_dict().items()}


def _one_device(config, steps, global_batch, optimizer, keys) -> dict:
    """One device trained on the full batches, on this rank: its state dict's entries ``keys``."""
    ref = reference_run(config, steps, global_batch, optimizer)[0].state_dict()
    return {k: ref[k] for k in keys}


# =========================================================================== equality with one device


@dataclass
class StageResult(Result):
    """One rank's stage weights after pipeline training (``state``: its part of the state dict)."""

    rank: int
    state: dict = field(repr=False)
    losses: list  # per step, the mean over micro-batches (last stage only; else None)


def pipeline_training(
    schedule: str = "1f1b",
    optimizer: str = "sgd",
    steps: int = 10,
    num_microbatches: int = 4,
    global_batch: int = 16,
    config: GPTConfig | None = None,
    num_chunks: int = 1,
) -> StageResult:
    """Rank function: train the GPT as a pipeline of ``world`` stages; return this rank's stage weights.

    Every rank builds the same full model (seed 0), keeps its stage(s), and runs ``steps``
    optimizer steps on ``step_batch(k)`` split into ``num_microbatches``. The row compares this
    rank's weights with one device trained on the full batches (``reference_run``, here on the
    rank); the parent can merge the stages' state dicts (:func:`merge_states`) into the whole model.
    """
    config = config or parallel_config()
    p, rank, dev, v = dist.get_world_size(), dist.get_rank(), device(), num_chunks
    chunks = _stage_chunks(config, p, v, rank, dev)
    micro = global_batch // num_microbatches
    split_microbatches(
        torch.empty(global_batch), num_microbatches
    )  # a clear error before any rank waits
    runner = _runner(config, schedule, p, num_microbatches, v, rank, micro, chunks)
    opt = make_optimizer(optimizer, runner.params)
    losses = []
    for step in range(steps):
        x, y = step_batch(step, config, global_batch, dev)
        opt.zero_grad(set_to_none=True)
        mb_losses = runner.step(x, y)
        opt.step()
        losses.append(sum(mb_losses) / num_microbatches if mb_losses else None)
    state = _state(chunks)
    res = StageResult(
        rank, state, losses, title=f"{schedule}, p={p}, m={num_microbatches}, stage {rank}"
    )
    res.equal(
        f"stage {rank}'s weights after {steps} {optimizer} steps",
        state,
        _one_device(config, steps, global_batch, optimizer, state),
        for_optimizer(optimizer),
    )
    return res


def merge_states(results: list) -> dict:
    """The full model's state dict from every rank's :class:`StageResult` (keys are disjoint)."""
    merged = {}
    for r in results:
        overlap = set(merged) & set(r.state)
        if overlap:
            raise ValueError(f"two stages hold the same parameter(s): {sorted(overlap)[:3]}")
        merged.update(r.state)
    return merged


# =========================================================================== bubbles with fixed stage costs


def tiny_layer(width: int, seed: int = 0) -> nn.Linear:
    """A tiny real ``Linear`` (no bias, seeded): each stage of the bubble experiment; the clock costs it."""
    layer = nn.Linear(width, width, bias=False)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        layer.weight.copy_(torch.randn(width, width, generator=gen) * 0.1)
    return layer


def stage_clock(chunks, t_f: float, micro_batch: int, width: int, dev) -> AcceleratorClock:
    """The shared clock on ``chunks``, at the rate where a chunk's forward of one micro-batch costs
    ``t_f`` seconds (its backward 2×): FLOPs / rate, so the stage times are known and set the schedule.

    Forced on any device (a GPU's own clock would time the tiny layer, not the stage costs)."""
    x = torch.zeros(micro_batch, width, device=dev)
    with torch.no_grad():
        _, flops = count_flops(chunks[0], x)  # every chunk is the same layer shape
    clock = AcceleratorClock(flops / t_f, device=dev, force=True)
    for chunk in chunks:
        clock.apply(chunk)
    return clock


@dataclass
class BubbleResult(Result):
    """Measured bubble per (schedule, m): per-rank fractions (median over steps) and the formula.

    One row per (schedule, m): the rank whose bubble is farthest from the formula, within ``margin``
    (absolute) of it. ``clock`` names the clock that costed the stages (the title too), ``slept``
    is this rank's modelled seconds under it.
    """

    p: int
    t_f: float
    t_b: float
    clock: str = "real clock"
    slept: float = 0.0
    rows: list = field(
        default_factory=list
    )  # {"schedule", "m", "per_rank", "formula", "step", "peak_live"}
    timelines: dict = field(
        default_factory=dict
    )  # "schedule/m" -> per-rank events, seconds from step start
    margin: float = 0.05

    def checks(self) -> list[Row]:
        out = list(self.checked)
        for r in self.rows:
            formula = "(p−1)/(v·m+p−1)" if r["schedule"] == "interleaved" else "(p−1)/(m+p−1)"
            worst = max(r["per_rank"], key=lambda b: abs(b - r["formula"]))
            out.append(
                Row(
                    f"{r['schedule']}, p={self.p}, m={r['m']}: every rank's bubble within {self.margin} of "
                    f"{formula} = {r['formula']:.3f}",
                    worst,
                    r["formula"],
                    f"formula {formula}",
                    f"±{self.margin} (absolute)",
                    abs(worst - r["formula"]) <= self.margin,
                )
            )
        return out


def _timed_step(runner, chunks, x, y):
    """One pipeline step after a barrier, its p2p counted: ``(stats, CommLog, every rank's timeline events)``."""
    for c in chunks:
        c.zero_grad(set_to_none=True)
    dist.barrier()
    with comm.CommLog() as log:
        stats = measured_step(runner, x, y)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats.events)
    return stats, log, gathered


def _timed_steps(runner, chunks, x, steps: int, warmup: int):
    """``warmup`` + ``steps`` timed steps on input and target ``x``: per measured step the bubbles
    (:func:`~course_lib.pipeline.bubble_fractions`) and the step (earliest start to latest end, all
    ranks); with the last step's ``(stats, CommLog, gathered events)``."""
    bubbles, spans = [], []
    for i in range(warmup + steps):
        stats, log, gathered = _timed_step(runner, chunks, x, x)
        if i >= warmup:
            bubbles.append(bubble_fractions(gathered))
            work = [e for tl in gathered for e in tl if e.kind in ("F", "B", "W")]
            spans.append(max(e.end for e in work) - min(e.start for e in work))
    return bubbles, spans, (stats, log, gathered)


def _from_start(gathered) -> list:
    """Every rank's events as tuples, in seconds from the step's earliest start."""
    t0 = min(e.start for tl in gathered for e in tl)
    return [
        [(e.kind, e.microbatch, e.chunk, e.start - t0, e.end - t0) for e in tl] for tl in gathered
    ]


def measure_bubbles(
    schedules=("gpipe", "1f1b"),
    microbatches=(1, 2, 4, 8),
    t_f: float = 0.02,
    t_b: float | None = None,
    steps: int = 3,
    warmup: int = 1,
    width: int = 8,
    micro_batch: int = 2,
    num_chunks: int = 2,
) -> BubbleResult:
    """Rank function: every stage a :func:`tiny_layer` costed by the shared clock
    (:func:`stage_clock`: forward ``t_f``, backward ``t_b`` = 2·``t_f`` modelled seconds); measure bubbles.

    For each schedule and ``m``: ``warmup`` + ``steps`` pipeline steps, each after a barrier; per step
    and rank, bubble = 1 − busy / (latest end − earliest start over all ranks) from ``perf_counter``
    (one clock for all processes on a machine), gathered on every rank; the median over ``steps``
    (and of the step itself, ``"step"``). ``microbatches``: the m's, or a dict schedule → m's
    (interleaved needs m divisible by p). Every rank returns the same bubbles (read rank 0's) and
    the last step's timelines.
    """
    t_b = BACKWARD_FACTOR * t_f if t_b is None else t_b
    if not math.isclose(t_b, BACKWARD_FACTOR * t_f):
        raise ValueError(
            f"t_b={t_b} must be {BACKWARD_FACTOR}·t_f = {BACKWARD_FACTOR * t_f}: "
            "the clock costs a backward at twice its forward"
        )
    p, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    res = BubbleResult(p=p, t_f=t_f, t_b=t_b)
    names = []
    for name in schedules:
        v = num_chunks if name == "interleaved" else 1
        chunks = _tiny_chunks(p, v, rank, width, dev)
        # a rank's v chunks share its t_F, t_B: each costs 1/v
        clock = stage_clock(chunks, t_f / v, micro_batch, width, dev)
        names.append(clock.name)
        for m in microbatches[name] if isinstance(microbatches, dict) else microbatches:
            runner = _tiny_runner(chunks, rank, name, p, m, micro_batch, width, dev)
            gen = torch.Generator().manual_seed(m)
            x = torch.randn(m * micro_batch, width, generator=gen).to(dev)
            per_step, spans, (stats, log, gathered) = _timed_steps(runner, chunks, x, steps, warmup)
            per_rank = [statistics.median(s[r] for s in per_step) for r in range(p)]
            res.rows.append(
                {
                    "schedule": name,
                    "m": m,
                    "per_rank": per_rank,
                    "formula": pipeline_bubble(p, m, v),
                    "step": statistics.median(spans),
                    "peak_live": stats.peak_live_microbatches,
                    "messages_sent": log.count(op="send"),
                    "clock": clock.name,
                }
            )
            res.timelines[f"{name}/{m}"] = _from_start(gathered)
        res.slept += sum(clock.slept.values())
        clock.remove()
    res.clock = "; ".join(dict.fromkeys(names))  # one name unless interleaved sets another rate
    res.title = f"pipeline bubbles, p={p}: stages costed by the {res.clock}"
    return res


def sleep_bubbles(*args, **kwargs) -> dict:
    """:func:`measure_bubbles` as a plain dict (``BubbleResult(**d)`` rebuilds it; chapter 10's)."""
    return measure_bubbles(*args, **kwargs).as_dict()


@dataclass
class UnbalancedTiming(Result):
    """GPipe / 1F1B on clocked tiny stages, stage ``slow_stage`` ``factor``× slower (timing).

    ``rows``: per schedule ``step`` (measured, median over steps), ``predicted``
    (:func:`~course_lib.step_time.slowest_stage_step` of the modelled stage costs) and ``per_rank``
    bubbles (median). Rows are displayed, not asserted: the step within ``band`` of the prediction.
    """

    p: int
    m: int
    t_f: float
    slow_stage: int
    factor: float
    clock: str = "real clock"
    rows: list = field(default_factory=list)
    timelines: dict = field(default_factory=dict)  # schedule -> every rank's events (from start)
    band: float = AGREEMENT_BAND

    def checks(self) -> list[Row]:
        out = list(self.checked)
        for r in self.rows:
            out.append(
                Row(
                    f"{r['schedule']}, p={self.p}, m={self.m}, stage {self.slow_stage} "
                    f"{self.factor:g}× slower: step (s)",
                    r["step"],
                    r["predicted"],
                    "m·(F+B)_slowest + Σ others' (F+B)",
                    f"±{self.band:.0%}",
                    abs(r["step"] - r["predicted"]) <= self.band * r["predicted"],
                )
            )
        return out


def unbalanced_timing(
    schedules=("gpipe", "1f1b"),
    num_microbatches: int = 4,
    t_f: float = 0.04,
    factor: float = 2.0,
    slow_stage: int | None = None,
    steps: int = 3,
    warmup: int = 1,
    width: int = 8,
    micro_batch: int = 2,
) -> UnbalancedTiming:
    """Rank function: :func:`measure_bubbles`' stages with stage ``slow_stage`` (default: the last)
    ``factor``× slower; the measured step against :func:`~course_lib.step_time.slowest_stage_step`.

    Every stage a :func:`tiny_layer` under the shared clock (:func:`stage_clock`): F sleeps ``t_f``
    (``factor``·``t_f`` on the slow stage), B twice that. Per schedule ``warmup`` + ``steps`` steps
    after a barrier each; the step (earliest start to latest end over all ranks) and the bubbles,
    medians over ``steps``. The last stage by default: there 1F1B's step is exactly the formula
    (earlier, 1F1B hides a little of the others' pass, see ``slowest_stage_step``). Every rank
    returns the same rows.
    """
    p, rank, dev, m = dist.get_world_size(), dist.get_rank(), device(), num_microbatches
    slow = p - 1 if slow_stage is None else slow_stage
    if not 0 <= slow < p or factor <= 0:
        raise ValueError(
            f"slow_stage={slow_stage} must be a stage in 0..{p - 1} and factor={factor} > 0"
        )
    stage_f = [t_f * (factor if s == slow else 1.0) for s in range(p)]
    chunks = _tiny_chunks(p, 1, rank, width, dev)
    clock = stage_clock(chunks, stage_f[rank], micro_batch, width, dev)
    res = UnbalancedTiming(p=p, m=m, t_f=t_f, slow_stage=slow, factor=factor, clock=clock.name)
    res.title = (
        f"step time, p={p}, m={m}, stage {slow} {factor:g}× slower: stages costed by the "
        "modelled accelerator clock"
    )
    x = torch.randn(m * micro_batch, width, generator=torch.Generator().manual_seed(m)).to(dev)
    for name in schedules:
        runner = _tiny_runner(chunks, rank, name, p, m, micro_batch, width, dev)
        bubbles, spans, (_, _, gathered) = _timed_steps(runner, chunks, x, steps, warmup)
        res.rows.append(
            {
                "schedule": name,
                "step": statistics.median(spans),
                "predicted": slowest_stage_step(stage_f, m),
                "per_rank": [statistics.median(b[r] for b in bubbles) for r in range(p)],
            }
        )
        res.timelines[name] = _from_start(gathered)
    clock.remove()
    return res


# =========================================================================== the real GPT: timelines and memory


@dataclass
class TimelineResult(Result):
    """The GPT pipeline on one rank, per schedule: timelines, bubbles, live activations, p2p bytes.

    ``schedules[name]`` holds ``events`` (every rank's, seconds from the step's start), ``bubble``
    (per rank), ``peak_live`` and ``predicted_peak_live`` (this stage), ``peak_live_bytes``,
    ``sent_bytes``, ``sends`` and ``recv_bytes`` (this rank, per step). Rows: live micro-batches as
    the schedule predicts, bytes sent as :func:`~course_lib.formulas.pipeline_p2p_bytes`, and
    GPipe's live bytes over 1F1B's following their live micro-batches. Bubbles are reported, not
    checked (the stages are unequal).
    """

    p: int
    m: int
    rank: int
    activation_bytes: int  # one micro-batch's boundary activation
    schedules: dict = field(default_factory=dict)

    def checks(self) -> list[Row]:
        rows = Result()
        for name, s in self.schedules.items():
            rows.exact(
                f"{name}: peak live micro-batches on stage {self.rank}",
                s["peak_live"],
                s["predicted_peak_live"],
                "the schedule's order",
            )
            rows.exact(
                f"{name}: bytes stage {self.rank} sends per step",
                s["sent_bytes"],
                pipeline_p2p_bytes(self.p, self.m, self.activation_bytes, stage=self.rank),
                "formula pipeline_p2p_bytes",
            )
        if "gpipe" in self.schedules and "1f1b" in self.schedules:
            g, o = self.schedules["gpipe"], self.schedules["1f1b"]
            ratio, live = (
                g["peak_live_bytes"] / o["peak_live_bytes"],
                g["peak_live"] / o["peak_live"],
            )
            rows.condition(
                "peak live activation bytes GPipe / 1F1B",
                ratio,
                ratio >= 0.8 * live,
                "≥ 0.8 × the live micro-batches' ratio",
                reference=live,
                against="live micro-batches",
            )
        return [*self.checked, *rows.checked]


def gpt_timelines(
    schedules=("gpipe", "1f1b"),
    num_microbatches: int = 8,
    global_batch: int = 32,
    steps: int = 3,
    config: GPTConfig | None = None,
) -> TimelineResult:
    """Rank function: the GPT pipeline's real timelines, bubbles, live micro-batches / bytes and p2p bytes.

    For each schedule: ``steps`` steps (the first a warm-up), after a barrier each. Per schedule:
    every rank's events of the last step (seconds from its start), the bubble per rank (median over
    the measured steps), this rank's peak live micro-batches and peak live activation bytes, the
    predicted peak (:func:`~course_lib.pipeline.peak_live_microbatches` of the schedule) and the
    bytes this rank sent per step (``CommLog``).
    """
    config = config or parallel_config()
    p, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    m = num_microbatches
    micro = global_batch // m
    chunks = _stage_chunks(config, p, 1, rank, dev)
    res = TimelineResult(p, m, rank, micro * config.block_size * config.d_model * 4)
    for name in schedules:
        runner = _runner(config, name, p, m, 1, rank, micro, chunks)
        bubbles = []
        for i in range(steps):
            x, y = step_batch(i, config, global_batch, dev)
            stats, log, gathered = _timed_step(runner, chunks, x, y)
            if i > 0:
                bubbles.append(bubble_fractions(gathered))
        res.schedules[name] = {
            "events": _from_start(gathered),
            "bubble": [statistics.median(b[r] for b in bubbles) for r in range(p)],
            "peak_live": stats.peak_live_microbatches,
            "peak_live_bytes": stats.peak_live_bytes,
            "predicted_peak_live": peak_live_microbatches(runner.schedules[rank]),
            "sent_bytes": log.total("tensor_bytes", op="send"),
            "sends": log.count(op="send"),
            "recv_bytes": log.total("tensor_bytes", op="recv"),
        }
    return res


# =========================================================================== the real GPT under the clock


class IdleSplit(NamedTuple):
    """One rank's step in seconds: ``compute + fill_drain + waiting + overhead == step``."""

    step: float  # earliest F/B/W start to latest end, over all ranks
    compute: float  # Σ of this rank's F, B and W
    fill_drain: float  # before this rank's first action and after its last
    waiting: float  # blocked in a receive between its first and last action
    overhead: float  # the rest: Python between actions, posting messages, the loss's .item()


def idle_split(events) -> list[IdleSplit]:
    """Per rank, the step split into compute, fill/drain, waiting for a peer and runtime overhead.

    ``events``: every rank's events as :func:`_from_start` tuples ``(kind, microbatch, chunk,
    start, end)``. Fill/drain and waiting are the schedule's idle time (what ``(p−1)/(m+p−1)`` and
    :func:`~course_lib.step_time.pipeline_step` model); overhead is what neither models.
    ``1 − compute / step`` is :func:`~course_lib.pipeline.bubble_fractions`' bubble.
    """
    work = [[e for e in tl if e[0] in ("F", "B", "W")] for tl in events]
    t0 = min(e[3] for tl in work for e in tl)
    t1 = max(e[4] for tl in work for e in tl)
    out = []
    for tl, mine in zip(events, work, strict=True):
        first, last = min(e[3] for e in mine), max(e[4] for e in mine)
        busy = sum(e[4] - e[3] for e in mine)
        edges = (first - t0) + (t1 - last)
        waits = [e for e in tl if e[0] == "wait"]
        wait = sum(max(0.0, min(e[4], last) - max(e[3], first)) for e in waits)
        out.append(IdleSplit(t1 - t0, busy, edges, wait, t1 - t0 - busy - edges - wait))
    return out


def gpt_stage_flops(config: GPTConfig, p: int, micro_batch: int) -> list[int]:
    """Each of the ``p`` stages' forward FLOPs for one micro-batch, as the clock counts them.

    :func:`~course_lib.step_time.part_flops` on each stage of ``split_gpt`` in turn, fed the
    previous stage's output: its blocks, plus the embeddings on the first stage, plus the head and
    the loss (3 per logit) on the last. Shapes alone decide the count (any batch, any device).
    """
    dev = device()
    x, _ = step_batch(0, config, micro_batch, dev)
    out = []
    for stage in split_gpt(GPT(config, seed=0).to(dev), p):
        out.append(sum(f for _, _, f in part_flops(stage, x)))
        with torch.no_grad():
            x = stage(x)
    return out


def _median_seconds(steps_events: list, kind: str) -> list[float]:
    """Per rank, the median duration of its ``kind`` events over steps of :func:`_from_start` events."""
    ranks = range(len(steps_events[0]))
    return [
        statistics.median(e[4] - e[3] for ev in steps_events for e in ev[r] if e[0] == kind)
        for r in ranks
    ]


@dataclass
class ClockedPipelineResult(Result):
    """The GPT pipeline under the modelled clock, per schedule: measured beside ``pipeline_step``.

    ``stage_flops[s]``: stage s's forward FLOPs of one micro-batch (:func:`gpt_stage_flops`);
    :attr:`stage_forward_s` = those / ``rate``, the F each stage sleeps (its B: 2×). ``rows``, per
    schedule, from the measured step whose span is the median: ``step`` (s), ``predicted``
    (:func:`~course_lib.step_time.pipeline_step`'s total), per rank ``bubble`` (1 − busy/step),
    ``simulated`` (the simulation's idle share, 1 − m·(F_s+B_s)/predicted), ``split`` (shares of
    the step, :func:`idle_split`), ``F`` and ``B`` (median measured seconds). ``timelines``: that
    step's events, every rank. Timing rows: displayed, not asserted.

    Tolerances. The step: ``band`` (:data:`~course_lib.timing.AGREEMENT_BAND`). A rank's bubble:
    ``margin`` absolute (0.05, as :class:`BubbleResult`'s). ±20 % of an idle share near 1/9 would
    be ±0.02, less than the runtime the simulation leaves out and 1 − busy/step counts as idle
    (Python between actions, posting messages, the loss's ``.item()``: the ``overhead`` share of
    the split, a few % of the step at the calibrated rate). 0.05 still catches a simulation
    that gets the fill or drain wrong: one stage's F + B is 1/(m+p−1) of the step (0.11 at
    p = 2, m = 8).
    """

    p: int
    m: int
    rate: float
    stage_flops: list
    clock: str = "real clock"
    calibration: str = ""
    rows: list = field(default_factory=list)
    timelines: dict = field(default_factory=dict)  # schedule -> every rank's events (from start)
    band: float = AGREEMENT_BAND
    margin: float = 0.05

    @property
    def stage_forward_s(self) -> list[float]:
        """Each stage's modelled forward of one micro-batch (s): its FLOPs / ``rate``."""
        return [f / self.rate for f in self.stage_flops]

    def checks(self) -> list[Row]:
        out = list(self.checked)
        for r in self.rows:
            name = f"{r['schedule']}, p={self.p}, m={self.m}"
            out.append(
                Row(
                    f"{name}: step (s)",
                    r["step"],
                    r["predicted"],
                    "pipeline_step, F_s = FLOPs_s / rate",
                    f"±{self.band:.0%}",
                    abs(r["step"] - r["predicted"]) <= self.band * r["predicted"],
                )
            )
            for rank, (got, want) in enumerate(zip(r["bubble"], r["simulated"], strict=True)):
                out.append(
                    Row(
                        f"{name}: rank {rank} bubble 1 − busy/step",
                        got,
                        want,
                        "pipeline_step's idle share",
                        f"±{self.margin} (absolute)",
                        abs(got - want) <= self.margin,
                    )
                )
        return out


def gpt_clocked(
    schedules=("gpipe", "1f1b"),
    num_microbatches: int = 8,
    global_batch: int = 32,
    steps: int = 3,
    warmup: int = 0,
    ratio: float = 20.0,
    config: GPTConfig | None = None,
) -> ClockedPipelineResult:
    """Rank function: :func:`gpt_timelines`' GPT pipeline under the modelled clock, predicted.

    The rate: ``clock.calibrate`` on the full GPT at one micro-batch (every block sleeps ≥
    ``ratio`` × its real forward + backward; calibrate aims at twice that, its margin for noise),
    the minimum over ranks, so every rank runs one rate. The clock costs this rank's stage (its
    blocks, the embeddings on the first, the head and the loss on the last).

    The prediction: :func:`~course_lib.step_time.pipeline_step` of the schedules with each
    stage's own F = FLOPs / rate (:func:`gpt_stage_flops`: the last stage also has the head and
    the loss, so the stages are unequal); the sends (one micro-batch's boundary activation each)
    are left out.

    Per schedule ``warmup`` + ``steps`` steps after a barrier each; the step whose span is the
    median is reported (of 3, a slow first step is outvoted: no warm-up by default, each step is
    m + p − 1 slots of modelled compute). Every rank returns the same rows.
    """
    unknown = [s for s in schedules if s not in ("gpipe", "1f1b")]
    if unknown:
        raise ValueError(f"schedules {unknown}: gpt_clocked runs one stage per rank (gpipe, 1f1b)")
    config = config or parallel_config()
    p, rank, dev, m = dist.get_world_size(), dist.get_rank(), device(), num_microbatches
    micro = global_batch // m
    split_microbatches(torch.empty(global_batch), m)  # a clear error before any rank waits
    x, y = step_batch(0, config, micro, dev)
    cal = calibrate(GPT(config, seed=0).to(dev), x, y, ratio=ratio)
    rate = min_over_ranks(cal.rate)  # one rate on every rank
    worst = min_over_ranks(cal.ratio * cal.rate / rate)  # a lower rate sleeps longer
    clock = AcceleratorClock(rate)
    chunks = _stage_chunks(config, p, 1, rank, dev)
    clock.apply(chunks[0])
    res = ClockedPipelineResult(p, m, rate, gpt_stage_flops(config, p, micro), clock=clock.name)
    res.calibration = f"{format_rate(rate)}: every block sleeps ≥ {worst:.0f}× its real compute"
    res.title = f"the GPT pipeline, p={p}, m={m}, under the {clock.name}: measured vs pipeline_step"
    fwd = res.stage_forward_s
    for name in schedules:
        runner = _runner(config, name, p, m, 1, rank, micro, chunks)
        measured = []
        for i in range(warmup + steps):
            x, y = step_batch(i, config, global_batch, dev)
            _, _, gathered = _timed_step(runner, chunks, x, y)
            if i >= warmup:
                measured.append(_from_start(gathered))
        spans = [idle_split(ev)[0].step for ev in measured]
        ev = measured[spans.index(statistics.median_low(spans))]
        split = idle_split(ev)
        pred = pipeline_step(runner.schedules, fwd, m, backward_factor=clock.backward_factor)
        busy = [m * (1 + clock.backward_factor) * f for f in fwd]  # per rank, v = 1
        res.rows.append(
            {
                "schedule": name,
                "step": split[0].step,
                "predicted": pred.total,
                "bubble": [1 - s.compute / s.step for s in split],
                "simulated": [1 - b / pred.total for b in busy],
                "split": [
                    {k: v / s.step for k, v in s._asdict().items() if k != "step"} for s in split
                ],
                "F": _median_seconds(measured, "F"),
                "B": _median_seconds(measured, "B"),
            }
        )
        res.timelines[name] = ev
    clock.remove()
    return res


# =========================================================================== PP × DP


@dataclass
class PPDPResult(StageResult):
    """One rank of PP × DP: stage weights, coordinates, gradient all-reduces and their groups."""

    replica: int
    stage: int
    grad_allreduces: int
    groups: list  # the process groups its all-reduces ran in


def pp_dp_training(
    num_stages: int = 2,
    schedule: str = "1f1b",
    optimizer: str = "sgd",
    steps: int = 5,
    num_microbatches: int = 2,
    global_batch: int = 16,
    config: GPTConfig | None = None,
) -> PPDPResult:
    """Rank function: ``world / num_stages`` pipeline replicas × ``num_stages`` stages (rank = replica·p + stage).

    Replica ``d`` trains on its ``1/dp`` of each global batch; after the pipeline step each stage's
    gradients are all-reduced (and averaged) within that stage's data-parallel group — the ranks
    holding the same stage in every replica. Rows: this rank's stage against one device on the full
    batches, one all-reduce per parameter and step, all of them in one group.
    """
    config = config or parallel_config()
    world, rank, dev, p = dist.get_world_size(), dist.get_rank(), device(), num_stages
    if world % p:
        raise ValueError(
            f"world_size={world} is not divisible by num_stages={p} (ranks = replicas × stages)"
        )
    dp = world // p
    replica, stage = divmod(rank, p)
    dp_groups = [
        dist.new_group([d * p + s for d in range(dp)]) for s in range(p)
    ]  # every rank creates every group
    chunks = _stage_chunks(config, p, 1, stage, dev)
    micro = global_batch // dp // num_microbatches
    runner = _runner(
        config,
        schedule,
        p,
        num_microbatches,
        1,
        stage,
        micro,
        chunks,
        ranks=[replica * p + s for s in range(p)],
    )
    opt = make_optimizer(optimizer, runner.params)
    losses = []
    with comm.CommLog() as log:
        for step in range(steps):
            x, y = shard_batch(
                *step_batch(step, config, global_batch, dev), rank=replica, world_size=dp
            )
            opt.zero_grad(set_to_none=True)
            mb_losses = runner.step(x, y)
            for q in runner.params:
                comm.all_reduce(q.grad, group=dp_groups[stage], tag="grad")
                q.grad.div_(dp)
            opt.step()
            losses.append(sum(mb_losses) / num_microbatches if mb_losses else None)
    state = _state(chunks)
    res = PPDPResult(
        rank,
        state,
        losses,
        replica,
        stage,
        log.count(op="all_reduce", tag="grad"),
        sorted({r.group for r in log.records if r.op == "all_reduce"}),
        title=f"PP × DP: replica {replica}, stage {stage}",
    )
    res.equal(
        f"replica {replica}, stage {stage}: weights after {steps} {optimizer} steps",
        state,
        _one_device(config, steps, global_batch, optimizer, state),
        for_optimizer(optimizer),
    )
    res.exact(
        "gradient all-reduces",
        res.grad_allreduces,
        steps * len(runner.params),
        "one per parameter and step",
    )
    res.condition(
        "process groups of those all-reduces",
        len(res.groups),
        len(res.groups) == 1,
        "exactly 1: this stage's data-parallel group",
    )
    return res


# =========================================================================== torch.distributed.pipelining


@dataclass
class TorchPipeliningResult(Result):
    """One step of torch's schedule and of ours on identical stages, on this rank."""

    rank: int
    schedule: str  # torch's class name
    max_grad_diff: float
    torch_loss: float | None  # mean over micro-batches (last stage only)


def _grads(chunks) -> dict:
    return {f"{k}.{n}": q.grad for k, c in enumerate(chunks) for n, q in c.named_parameters()}


def torch_pipelining_grads(
    schedule: str = "1f1b",
    num_microbatches: int = 4,
    global_batch: int = 16,
    config: GPTConfig | None = None,
    num_chunks: int = 2,
) -> TorchPipeliningResult:
    """Rank function: one step of torch's schedule and of ours on identical stages; compare gradients.

    ``schedule`` "gpipe" → ``ScheduleGPipe``, "1f1b" → ``Schedule1F1B``, "interleaved" →
    ``ScheduleInterleaved1F1B`` (``num_chunks`` stages per rank), all with ``scale_grads=True``.
    The row: torch's gradients on this rank against our runner's (the same operations in the same
    order: bit for bit).
    """
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    config = config or parallel_config()
    p, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    v = num_chunks if schedule == "interleaved" else 1
    m, micro = num_microbatches, global_batch // num_microbatches
    x, y = step_batch(0, config, global_batch, dev)
    ours = _stage_chunks(config, p, v, rank, dev)
    _runner(config, schedule, p, m, v, rank, micro, ours).step(x, y)
    theirs = _stage_chunks(config, p, v, rank, dev)
    stages = [
        PipelineStage(c, stage_index=k * p + rank, num_stages=p * v, device=dev)
        for k, c in enumerate(theirs)
    ]
    if schedule == "interleaved":
        sched = ScheduleInterleaved1F1B(
            stages, n_microbatches=m, loss_fn=gpt_loss, scale_grads=True
        )
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], n_microbatches=m, loss_fn=gpt_loss, scale_grads=True)
    losses: list = []
    has_first, has_last = rank == 0, (p * v - 1) % p == rank
    kwargs = {}
    if has_last:
        kwargs = dict(target=y, losses=losses)
    if has_first:
        sched.step(x, **kwargs)
    else:
        sched.step(**kwargs)
    got, want = _grads(theirs), _grads(ours)
    loss = statistics.fmean(t.item() for t in losses) if losses else None
    res = TorchPipeliningResult(
        rank,
        type(sched).__name__,
        max_abs_diff(got, want),
        loss,
        title=f"{type(sched).__name__} vs ours, rank {rank}",
    )
    res.equal(
        f"rank {rank}: {type(sched).__name__}'s gradients",
        got,
        want,
        EXACT,
        against="our PipelineRunner",
    )
    return res


@dataclass
class ZeroBubbleResult(Result):
    """Torch's ``ScheduleInterleavedZeroBubble``: its static action order and the step's loss."""

    rank: int
    order: dict  # rank -> action strings ("2I0": stage 2, input-grad of micro-batch 0); None = idle
    loss: float | None  # mean over micro-batches (last stage only)


_ACTION = re.compile(r"^(\d+)([A-Z]+)(\d+)$")


def _ran_once(actions: list, stages, m: int) -> bool:
    """Each (stage, micro-batch) ran F once, and B once or I and W once each."""
    seen: dict = {}
    for a in actions:
        stage, op, mb = _ACTION.match(a).groups()
        seen[(int(stage), op, int(mb))] = seen.get((int(stage), op, int(mb)), 0) + 1
    for s in stages:
        for mb in range(m):
            ops = {op: seen.get((s, op, mb), 0) for op in "FBIW"}
            if ops["F"] != 1 or not (ops["B"] == 1 or ops["I"] == ops["W"] == 1):
                return False
    return True


def zero_bubble_order(
    num_microbatches: int = 4, config: GPTConfig | None = None
) -> ZeroBubbleResult:
    """Rank function: torch's ``ScheduleInterleavedZeroBubble`` (2 stages per rank), one real step, its action order.

    Backward is split into ``I`` (gradient of the input, sent upstream at once) and ``W`` (gradient
    of the weights, deferred into what would be bubble). ``order`` is ``pipeline_order`` (rank →
    action strings; ``None`` = idle slot) — torch records no times, so this is the static order.
    The row: every micro-batch's F, I and W appear once on each of this rank's stages.
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

    config = config or parallel_config()
    p, rank, dev, v = dist.get_world_size(), dist.get_rank(), device(), 2
    x, y = step_batch(0, config, 4 * num_microbatches, dev)
    chunks = _stage_chunks(config, p, v, rank, dev)
    stages = [
        PipelineStage(c, stage_index=k * p + rank, num_stages=p * v, device=dev)
        for k, c in enumerate(chunks)
    ]
    sched = ScheduleInterleavedZeroBubble(stages, n_microbatches=num_microbatches, loss_fn=gpt_loss)
    losses: list = []
    kwargs = dict(target=y, losses=losses) if (p * v - 1) % p == rank else {}
    if rank == 0:
        sched.step(x, **kwargs)
    else:
        sched.step(**kwargs)
    order = {
        r: [None if a is None else str(a) for a in acts] for r, acts in sched.pipeline_order.items()
    }
    loss = statistics.fmean(t.item() for t in losses) if losses else None
    res = ZeroBubbleResult(rank, order, loss, title=f"ScheduleInterleavedZeroBubble, rank {rank}")
    mine = [a for a in order[rank] if a is not None]
    res.condition(
        f"rank {rank}: every micro-batch's F, I and W once per stage",
        len(mine),
        _ran_once(mine, [k * p + rank for k in range(v)], num_microbatches),
        f"{v} stages × {num_microbatches} micro-batches × (F + I + W)",
    )
    return res


# =========================================================================== our zero bubble, timed


@dataclass
class ZeroBubbleTiming(Result):
    """1F1B and ZB-H1 on clocked tiny stages: idle seconds per rank against the formulas (timing).

    ``rows``: per schedule ``idle`` (per rank, median over steps), ``F``, ``B``, ``W`` (median
    measured seconds of each kind; 1F1B's B is the whole backward, W 0) and ``formula``. Rows are
    displayed, not asserted (timing): within ``band`` (relative) of the formula.
    """

    p: int
    m: int
    t_f: float
    clock: str = "real clock"
    rows: list = field(default_factory=list)
    timelines: dict = field(default_factory=dict)  # schedule -> every rank's events (from start)
    band: float = 0.2

    def checks(self) -> list[Row]:
        out = list(self.checked)
        for r in self.rows:
            ms = {k: f"{r[k] * 1e3:.0f}" for k in "FBW"}
            if r["schedule"] == "1f1b":  # its B is the whole backward: B+W
                text = f"(p−1)(F+B+W), F={ms['F']} B+W={ms['B']} ms"
            else:
                text = f"(p−1)(F+B−W), F={ms['F']} B={ms['B']} W={ms['W']} ms"
            for rank, idle in enumerate(r["idle"]):
                out.append(
                    Row(
                        f"{r['schedule']}, p={self.p}, m={self.m}: rank {rank} idle (s)",
                        idle,
                        r["formula"],
                        f"formula {text}",
                        f"±{self.band:.0%}",
                        abs(idle - r["formula"]) <= self.band * r["formula"],
                    )
                )
        return out


def _idle(gathered) -> list[float]:
    """Per rank: the step (earliest start to latest end, all ranks) less its F, B and W time."""
    work = [[e for e in tl if e.kind in ("F", "B", "W")] for tl in gathered]
    t0 = min(e.start for tl in work for e in tl)
    t1 = max(e.end for tl in work for e in tl)
    return [t1 - t0 - sum(e.end - e.start for e in tl) for tl in work]


def zero_bubble_timing(
    num_microbatches: int = 4,
    t_f: float = 0.04,
    steps: int = 3,
    warmup: int = 1,
    width: int = 8,
    micro_batch: int = 2,
) -> ZeroBubbleTiming:
    """Rank function: 1F1B then ZB-H1 zero bubble on ``world`` tiny clocked stages; idle per rank.

    Each stage a :func:`tiny_layer` under the shared clock (:func:`stage_clock`): F sleeps ``t_f``;
    1F1B's backward 2·``t_f``; zero bubble's B (input gradient, ``clock.backward_factor = 1``)
    ``t_f`` and its W (the weight walk runs no costed module) ``clock.spend`` of the forward's
    FLOPs: ``t_f``. Per step (after a barrier) every rank's idle seconds; the median over ``steps``.
    Needs ``m ≥ p`` (the formulas' steady state). Every rank returns the same rows.
    """
    p, rank, dev, m = dist.get_world_size(), dist.get_rank(), device(), num_microbatches
    if m < p:
        raise ValueError(f"num_microbatches={m} must be >= world size p={p} (the formulas' regime)")
    chunks = _tiny_chunks(p, 1, rank, width, dev)
    clock = stage_clock(chunks, t_f, micro_batch, width, dev)
    flops = t_f * clock.rate  # the forward's FLOPs
    res = ZeroBubbleTiming(p=p, m=m, t_f=t_f, clock=clock.name)
    res.title = f"idle time per rank, p={p}, m={m}: stages costed by the {clock.name}"
    x = torch.randn(m * micro_batch, width, generator=torch.Generator().manual_seed(m)).to(dev)
    for name in ("1f1b", "zero_bubble"):
        clock.backward_factor = 1 if name == "zero_bubble" else BACKWARD_FACTOR
        spend_w = lambda mb, chunk: clock.spend(flops, "W")  # noqa: E731
        runner = _tiny_runner(chunks, rank, name, p, m, micro_batch, width, dev, spend_w)
        idles, events = [], []
        for i in range(warmup + steps):
            _, _, gathered = _timed_step(runner, chunks, x, x)
            if i >= warmup:
                idles.append(_idle(gathered))
                events += [e for tl in gathered for e in tl]
        per = {
            k: statistics.median([e.end - e.start for e in events if e.kind == k] or [0.0])
            for k in "FBW"
        }
        sign = 1 if name == "1f1b" else -1  # 1F1B: (F + B+W); ZB-H1: (F + B − W)
        res.rows.append(
            {
                "schedule": name,
                "idle": [statistics.median(s[r] for s in idles) for r in range(p)],
                **per,
                "formula": (p - 1) * (per["F"] + per["B"] + sign * per["W"]),
            }
        )
        res.timelines[name] = _from_start(gathered)
    clock.backward_factor = BACKWARD_FACTOR
    clock.remove()
    return res
