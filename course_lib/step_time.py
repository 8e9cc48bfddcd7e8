"""The course's step-time model: predict a step's seconds, then measure them under the clock.

A step is compute plus the communication that compute does not hide. The model has three parts:

* **Communication: the α–β fit** (chapter 00). One call costs
  ``α + ring_factor(op, N) · bytes / β`` (:class:`AlphaBeta`, :func:`fit_alpha_beta`); ``bytes``
  is the tensor as nccl-tests count it (the all-reduce buffer, the reduce-scatter input, the
  all-gather output). The collectives of one process group run **one after another, in the
  order they were issued** (one FIFO link, :class:`Link`): an all-gather issued behind a
  reduce-scatter waits for it. Point-to-point sends are ``"send_recv"`` on their own link.
* **Compute: FLOPs / rate, counted as the modelled clock counts them** (:mod:`course_lib.clock`).
  :func:`part_flops` runs the model once and counts each costed part's forward FLOPs with
  ``clock.count_flops`` on the shapes this rank really computes with (a TP shard 1/t of the
  columns, a pipeline stage only its blocks, the head + the loss's 3 per logit). A part's
  backward is ``BACKWARD_FACTOR`` (2) × its forward. So the prediction and the clock agree on
  compute by construction; what the model has to get right is the *timeline*: which
  communication runs while the clock sleeps and which runs while nothing else does.
* **An exposure rule per technique** — each a small event simulation over the parts, in the
  order our implementations run them (the docstrings say which code each rule reads):

  ==================  ==============================================================
  :func:`ddp_step`     buckets all-reduce during backward, launched in bucket order as
                       their last gradient is ready; exposed = what the link still has
                       to do when backward ends (at least the last bucket)
  :func:`zero_step`    ZeRO-1: reduce-scatter + all-gather after backward, all exposed;
                       ZeRO-2: the reduce-scatters overlap backward as DDP's all-reduces
  :func:`zero3_step`   an all-gather per unit before it runs (forward and backward) and
                       a reduce-scatter after its backward; ``prefetch`` issues unit
                       i+1's all-gather before unit i computes, hiding it; the
                       first all-gather (before any compute) and the last
                       reduce-scatter (after all of it) stay exposed
  :func:`pipeline_step`  each stage's schedule, F and B costs per micro-batch, p2p sends;
                       the bubble (p−1)/(m+p−1) (:func:`bubble_fraction`) comes out of it
  :func:`slowest_stage_step`  unequal stages: m·(F+B) of the slowest + one (F+B) of
                       each other stage (GPipe exact; 1F1B an upper bound unless last)
  :func:`tp_step`      2 all-reduces per block forward, 2 backward, all on the critical
                       path (the next matmul needs the sum)
  ``recompute=``       a checkpointed part runs its forward once more, just before its
                       backward (``torch.utils.checkpoint``; the clock sleeps it again)
  ==================  ==============================================================

Which α. A collective on the critical path is mostly issued after a sleep (a block's modelled
compute): gloo's worker thread and the peer must be woken before it moves a byte, which on a
busy 2-core laptop costs more than the back-to-back calls of chapter 00's sweep (2–4 ms against
0.4–0.8 ms). The first measurements here came out 15–26 % slow for the techniques with many small
calls on the path (TP's 21 all-reduces, ZeRO-3's gathers) until the α they were predicted with
was measured that way too (``experiments.step_time.idle_alpha``); β stays the sweep's.

What it leaves out: Python dispatch, the optimizer step, copies into buckets, the real (small)
compute that runs *besides* the clock's sleeps. At the calibrated rate (every block sleeps ≥ 10×
its real compute) those stay under about a tenth of a step, which is why the course's one
agreement band, :data:`course_lib.timing.AGREEMENT_BAND` (measured within ±20 % of predicted),
is wide enough for them and narrow enough to catch a missing mechanism.

The chapter-09 planner uses the same rules with a named GPU node (:class:`NodeProfile`,
:data:`H100_NODE`: published FLOP/s and link bandwidths, not the laptop's α–β):
:func:`layout_step` predicts one layout's step, :func:`rank_layouts` orders layouts by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from .clock import BACKWARD_FACTOR, LOSS_FLOPS_PER_LOGIT, costed_parts, count_flops
from .comm import ring_factor
from .formulas import pipeline_bubble, training_flops_per_token
from .timing import AGREEMENT_BAND

__all__ = [
    "AGREEMENT_BAND",
    "AlphaBeta",
    "fit_alpha_beta",
    "op_factor",
    "Prediction",
    "Link",
    "part_flops",
    "part_seconds",
    "param_parts",
    "ddp_step",
    "zero_step",
    "zero3_step",
    "pipeline_step",
    "slowest_stage_step",
    "tp_step",
    "tp_allreduces",
    "bubble_fraction",
    "NodeProfile",
    "H100_NODE",
    "layout_step",
    "rank_layouts",
    "cp_ring_bytes",
    "ep_all_to_all_bytes",
]


# --------------------------------------------------------------------------- the α–β cost model


def op_factor(op: str, n: int) -> float:
    """Ring factor of ``op``; ``send_recv`` (one ring step: send right, receive left) moves its tensor once."""
    return 1.0 if op == "send_recv" else ring_factor(op, n)


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
        return self.alpha_s[op] + op_factor(op, n) * nbytes / self.beta_bytes_per_s[op]

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
    time, so the minimum is the robust estimate of the fixed cost — and never more than the
    quickest call of any size (a larger message cannot take less than α); β is fitted on the
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
        # time only grows with size, so no call is quicker than α: a latency row slower than a
        # bandwidth-regime call was slowed by something else (a wake-up, the load), and taking it
        # as α would leave nothing for β to explain (β → ∞)
        a = min(min(small), min(r["time_s"] for r in mine))
        xs = [op_factor(op, n) * r["bytes"] for r in big]
        ys = [max(r["time_s"] - a, 1e-12) for r in big]
        ts = [r["time_s"] for r in big]
        inv_beta = sum(x * y / t**2 for x, y, t in zip(xs, ys, ts, strict=True)) / sum(
            x * x / t**2 for x, t in zip(xs, ts, strict=True)
        )
        alpha[op], beta[op], points[op] = a, 1.0 / inv_beta, len(big)
    return AlphaBeta(alpha, beta, n, min_bytes, points)


# --------------------------------------------------------------------------- a prediction


@dataclass
class Prediction:
    """A predicted step: ``total`` seconds, the named ``parts`` it adds up from, and ``why``.

    ``parts`` are seconds on the critical path: ``"compute"`` (forward + backward sleeps),
    ``"recompute"`` (the extra forwards), ``"exposed all_reduce"`` and the like (communication
    nothing overlapped), ``"bubble"`` (a pipeline stage waiting). ``hidden`` is communication
    that ran while compute did (seconds, not in ``total``). ``bytes``: what one rank sends in the
    step, by kind (:func:`layout_step` fills it for context- and expert-parallel traffic).
    """

    name: str
    parts: dict[str, float]
    why: str
    hidden: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, float] = field(default_factory=dict)  # sent per rank per step, by kind

    def __post_init__(self):
        # hidden = busy − exposed, a difference of sums: a float round-off may make it −1e-18
        self.hidden = {k: max(0.0, v) for k, v in self.hidden.items()}

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def table(self) -> str:
        """The parts (ms and share of the step), the hidden communication, and why."""
        lines = [f"{self.name}: {self.total * 1e3:.2f} ms predicted — {self.why}"]
        for part, s in self.parts.items():
            share = s / self.total if self.total else 0.0
            lines.append(f"  {part:<28}{s * 1e3:>10.2f} ms{share:>7.0%}")
        for part, s in self.hidden.items():
            lines.append(f"  {part + ' (hidden)':<28}{s * 1e3:>10.2f} ms")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class Link:
    """One process group's collectives: one at a time, in the order they were issued.

    ``run(t, seconds, op)`` issues a call at time ``t``; it starts when the link is free and
    returns its end. ``busy[op]`` adds up each op's seconds (the communication, hidden or not).
    """

    def __init__(self):
        self.free = 0.0
        self.busy: dict[str, float] = {}

    def run(self, t: float, seconds: float, op: str) -> float:
        self.free = max(t, self.free) + seconds
        self.busy[op] = self.busy.get(op, 0.0) + seconds
        return self.free


# --------------------------------------------------------------------------- compute, as the clock counts it


def part_flops(model: nn.Module, *inputs, **kwargs) -> list[tuple[str, str, int]]:
    """``(name, kind, forward FLOPs)`` of each costed part of ``model`` at ``model(*inputs)``.

    Counted the way :class:`~course_lib.clock.AcceleratorClock` counts them: one forward (no
    gradients) with each part's input kept, then ``count_flops`` on each part alone; the head
    adds the loss's ``LOSS_FLOPS_PER_LOGIT`` per logit. A clock already on the model is paused.
    Collectives inside the forward (a TP model) run, so every rank must call it together.
    """
    parts = costed_parts(model)
    clocks = {getattr(m, "_accelerator_clock", None) for _, m, _ in parts} - {None}
    seen: dict[str, tuple] = {}

    def keep(name):
        return lambda module, args: seen.setdefault(name, args)

    handles = [m.register_forward_pre_hook(keep(n)) for n, m, _ in parts]
    was = [(c, c.enabled) for c in clocks]
    try:
        for c, _ in was:
            c.enabled = False
        with torch.no_grad():
            model(*inputs, **kwargs)
            out = []
            for name, module, kind in parts:
                if name not in seen:  # not run in this forward (another stage's part)
                    continue
                y, flops = count_flops(module, *seen[name])
                if kind == "head":
                    logits = y if isinstance(y, torch.Tensor) else y[0]
                    local = logits.to_local() if hasattr(logits, "to_local") else logits
                    flops += LOSS_FLOPS_PER_LOGIT * local.numel()
                out.append((name, kind, flops))
    finally:
        for h in handles:
            h.remove()
        for c, enabled in was:
            c.enabled = enabled
    return out


def part_seconds(flops: Sequence[tuple[str, str, int]], rate: float) -> list[tuple[str, float]]:
    """``(name, forward seconds)`` at ``rate`` FLOP/s, from :func:`part_flops`."""
    return [(name, f / rate) for name, _, f in flops]


def param_parts(model: nn.Module) -> dict[nn.Parameter, str]:
    """The costed part whose backward makes each parameter's gradient ready.

    A parameter of a costed part: that part (the clock sleeps the part's backward *before* its
    backward ops, so its gradients land at the end of that sleep); a weight shared by two parts
    (the tied ``wte`` / ``lm_head``): the first, whose backward comes last and completes the
    accumulated gradient. A parameter outside every part (``ln_f`` between the blocks and the
    head): the next costed part in **module** order — the one whose backward runs just before
    it (``lm_head`` for ``ln_f``); none after it: the first part (whose backward ends the
    backward pass).

    Why module order, not parameter order: a head whose only weight is tied to the embedding
    owns no parameter of its own, so in parameter order nothing comes after ``ln_f`` and it
    would be assigned to ``wte`` — ready only when backward ends, which held every DDP / ZeRO-2
    bucket holding ``ln_f`` (the first to be reduced) until then, and predicted no overlap.
    """
    parts = costed_parts(model)
    owner = {}
    for name, module, _ in parts:
        for p in module.parameters():
            owner.setdefault(p, name)
    position = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    starts = sorted((position[id(m)], name) for name, m, _ in parts)
    out = {}
    for i, module in enumerate(m for _, m in model.named_modules()):
        for p in module.parameters(recurse=False):
            if p in out:
                continue
            if p in owner:
                out[p] = owner[p]
            else:
                later = [n for j, n in starts if j > i]
                out[p] = later[0] if later else starts[0][1]
    return out


def _backward(
    forward_s: Sequence[tuple[str, float]], t: float, recompute: Sequence[str]
) -> tuple[float, dict[str, float], float]:
    """Backward from time ``t``: parts in reverse; returns (end, ready time per part, recompute s)."""
    ready, extra = {}, 0.0
    for name, f in reversed(forward_s):
        if name in recompute:  # checkpoint's recompute runs right before the part's backward
            t += f
            extra += f
        t += BACKWARD_FACTOR * f
        ready[name] = t
    return t, ready, extra


def _check_recompute(forward_s, recompute) -> tuple[str, ...]:
    names = [n for n, _ in forward_s]
    unknown = sorted(set(recompute) - set(names))
    if unknown:
        raise ValueError(f"recompute={unknown}: no such costed part; parts are {names}")
    return tuple(recompute)


# --------------------------------------------------------------------------- data parallel: DDP, ZeRO-1/2


def _overlapped(
    op: str,
    forward_s: Sequence[tuple[str, float]],
    buckets: Sequence[tuple[float, str]],
    ab: AlphaBeta,
    world_size: int,
    recompute: Sequence[str],
) -> tuple[float, float, float, Link, float]:
    """Forward, then backward with one ``op`` per bucket launched as its gradients are ready.

    Returns (end of the last collective or backward, compute s, recompute s, link, backward end).
    Buckets launch strictly in bucket order (``grad_buckets.py``): bucket k at the later of its
    ready time and bucket k−1's launch, then waits for the link.
    """
    recompute = _check_recompute(forward_s, recompute)
    forward = sum(f for _, f in forward_s)
    end_b, ready, extra = _backward(forward_s, forward, recompute)
    link, launched, done = Link(), 0.0, end_b
    for nbytes, part in buckets:
        if part not in ready:
            raise ValueError(f"bucket ready after part {part!r}: not a costed part")
        launched = max(launched, ready[part])
        done = link.run(launched, ab.predict(op, nbytes, world_size), op)
    compute = forward + (end_b - forward - extra)
    return max(done, end_b), compute, extra, link, end_b


def ddp_step(
    forward_s: Sequence[tuple[str, float]],
    buckets: Sequence[tuple[float, str]],
    ab: AlphaBeta,
    world_size: int,
    *,
    recompute: Sequence[str] = (),
) -> Prediction:
    """DDP (``course_lib.ddp.DDP``): bucket all-reduces overlapping the rest of backward.

    ``forward_s``: ``(part, forward seconds)`` in forward order (:func:`part_seconds`);
    ``buckets``: ``(bytes, part)`` in bucket order, ``part`` the one whose backward completes
    the bucket (:func:`param_parts` of its parameters, the latest in backward order).

    Why: backward produces the last layers' gradients first; each bucket's all-reduce starts
    when its last gradient is ready (and every earlier bucket has been launched) and runs
    while backward computes earlier layers. The link runs them one at a time, so a bucket whose
    all-reduce is longer than the compute after it delays the next. What is exposed is what the
    link still has to do when backward ends — at least the last bucket, whose gradients come
    from the first layers and are ready only at the very end.
    """
    end, compute, extra, link, end_b = _overlapped(
        "all_reduce", forward_s, buckets, ab, world_size, recompute
    )
    exposed = end - end_b
    comm = link.busy.get("all_reduce", 0.0)
    parts = {"compute": compute, "recompute": extra, "exposed all_reduce": exposed}
    return Prediction(
        "DDP + recompute" if recompute else "DDP",
        {k: v for k, v in parts.items() if v or k == "compute"},
        f"{len(buckets)} bucket all-reduces overlap backward; what is left after backward shows",
        {"all_reduce": comm - exposed},
    )


def zero_step(
    stage: int,
    forward_s: Sequence[tuple[str, float]],
    buckets: Sequence[tuple[float, str]],
    ab: AlphaBeta,
    world_size: int,
    *,
    recompute: Sequence[str] = (),
    used_flags: int = 0,
) -> Prediction:
    """ZeRO-1 / ZeRO-2 (``course_lib.zero.ZeroOptimizer``): reduce-scatter, step a slice, all-gather.

    ``buckets``: ``(padded bytes, part)`` per bucket, as for :func:`ddp_step`; ``used_flags``:
    the parameter count (one byte each) of the "used" all-reduce both stages issue.

    Why: stage 1 reduces nothing during backward — ``step()`` issues every bucket's
    reduce-scatter and the used-flag all-reduce, waits, steps, then all-gathers each bucket, one
    blocking call after another: all of it is exposed, the same bytes as DDP's all-reduce but
    none overlapped. Stage 2 reduce-scatters each bucket during backward as DDP all-reduces
    (exposed: what is left when backward ends), then the flags and the all-gathers, exposed.
    """
    if stage not in (1, 2):
        raise ValueError(f"zero_step: stage={stage!r} is 1 or 2 (stage 3: zero3_step)")
    if stage == 2:
        end, compute, extra, link, end_b = _overlapped(
            "reduce_scatter", forward_s, buckets, ab, world_size, recompute
        )
    else:
        recompute = _check_recompute(forward_s, recompute)
        forward = sum(f for _, f in forward_s)
        end_b, _, extra = _backward(forward_s, forward, recompute)
        compute, link, end = end_b - extra, Link(), end_b
        for nbytes, _ in buckets:
            end = link.run(
                end_b, ab.predict("reduce_scatter", nbytes, world_size), "reduce_scatter"
            )
    rs_exposed = end - end_b
    t = (
        link.run(end, ab.predict("all_reduce", used_flags, world_size), "used")
        if used_flags
        else end
    )
    flags = t - end
    gathered = t
    for nbytes, _ in buckets:
        gathered = link.run(gathered, ab.predict("all_gather", nbytes, world_size), "all_gather")
    parts = {
        "compute": compute,
        "recompute": extra,
        "exposed reduce_scatter": rs_exposed,
        "exposed used flags": flags,
        "exposed all_gather": gathered - t,
    }
    rs = link.busy.get("reduce_scatter", 0.0)
    how = "during backward" if stage == 2 else "after backward"
    return Prediction(
        f"ZeRO-{stage}",
        {k: v for k, v in parts.items() if v or k == "compute"},
        f"reduce-scatter {how}, then the all-gathers after the step (exposed)",
        {"reduce_scatter": rs - rs_exposed} if stage == 2 else {},
    )


# --------------------------------------------------------------------------- ZeRO-3


def zero3_step(
    forward_s: Sequence[tuple[str, float]],
    units: Sequence[tuple[str, float, Sequence[str]]],
    ab: AlphaBeta,
    world_size: int,
    *,
    prefetch: bool = True,
    recompute: Sequence[str] = (),
) -> Prediction:
    """ZeRO-3 (``course_lib.zero3.Zero3``, ``unit="block"``), with or without ``prefetch``.

    ``units``: ``(name, gathered bytes, parts)`` — the **root** first (the parts outside the
    blocks: embeddings, head), then one unit per block in forward order (``parts`` its costed
    part). A unit's all-gather output and its reduce-scatter input are both ``gathered bytes``.

    Why, reading ``zero3.py``: the root is gathered when the wrapper is called (blocking) and
    kept through the forward; each block's all-gather lands before the block runs. Without
    prefetch it is issued there, so compute waits for it every time. With prefetch the next
    unit's all-gather is issued right after this one lands, before this unit computes, and runs
    while it does: only what is longer than a unit's compute shows. Backward: the root is
    re-gathered first (blocking), then the blocks in reverse, each re-gathered before its
    backward (prefetched the same way) and reduce-scattered right after it — asynchronously, one
    in flight: a unit waits for the previous reduce-scatter before launching its own; the root's
    reduce-scatter goes last, after the embeddings' backward, and backward waits for it. All on
    one link: a prefetch issued behind a reduce-scatter waits for it.
    """
    recompute = _check_recompute(forward_s, recompute)
    f = dict(forward_s)
    root, blocks = units[0], list(units[1:])
    first = [n for n, _ in forward_s]
    block_parts = {p for _, _, ps in blocks for p in ps}
    start = min(first.index(p) for _, _, ps in blocks for p in ps) if blocks else len(first)
    before = [n for n in first[:start] if n not in block_parts]  # embeddings
    after = [n for n in first[start:] if n not in block_parts]  # head

    def ag(u):
        return ab.predict("all_gather", u[1], world_size)

    def rs(u):
        return ab.predict("reduce_scatter", u[1], world_size)

    link, t, compute, extra = Link(), 0.0, 0.0, 0.0
    # forward
    t = link.run(t, ag(root), "all_gather")
    pending = {}
    if prefetch and blocks:
        pending[0] = link.run(t, ag(blocks[0]), "all_gather")
    for n in before:
        t += f[n]
        compute += f[n]
    for i, u in enumerate(blocks):
        t = max(t, pending.pop(i)) if prefetch else link.run(t, ag(u), "all_gather")
        if prefetch and i + 1 < len(blocks):
            pending[i + 1] = link.run(t, ag(blocks[i + 1]), "all_gather")
        for n in u[2]:
            t += f[n]
            compute += f[n]
    for n in after:
        t += f[n]
        compute += f[n]
    # backward
    t = link.run(t, ag(root), "all_gather")
    last = len(blocks) - 1
    if prefetch and blocks:
        pending[last] = link.run(t, ag(blocks[last]), "all_gather")
    for n in reversed(after):
        t += BACKWARD_FACTOR * f[n]
        compute += BACKWARD_FACTOR * f[n]
    rs_end = 0.0
    for i in range(last, -1, -1):
        u = blocks[i]
        t = max(t, pending.pop(i)) if prefetch else link.run(t, ag(u), "all_gather")
        if prefetch and i > 0:
            pending[i - 1] = link.run(t, ag(blocks[i - 1]), "all_gather")
        for n in reversed(u[2]):
            if n in recompute:
                t += f[n]
                extra += f[n]
            t += BACKWARD_FACTOR * f[n]
            compute += BACKWARD_FACTOR * f[n]
        t = max(t, rs_end)  # one reduce-scatter in flight: wait for the previous
        rs_end = link.run(t, rs(u), "reduce_scatter")
    for n in reversed(before):
        t += BACKWARD_FACTOR * f[n]
        compute += BACKWARD_FACTOR * f[n]
    t = max(t, rs_end)
    t = link.run(t, rs(root), "reduce_scatter")
    comm = sum(link.busy.values())
    exposed = t - compute - extra
    parts = {"compute": compute, "recompute": extra, "exposed all_gather + reduce_scatter": exposed}
    why = (
        "prefetch: unit i+1's all-gather runs behind unit i's compute"
        if prefetch
        else "no prefetch: each all-gather waits before its unit"
    )
    return Prediction(
        f"ZeRO-3{' + prefetch' if prefetch else ''}",
        {k: v for k, v in parts.items() if v or k == "compute"},
        why,
        {"all_gather + reduce_scatter": comm - exposed},
    )


# --------------------------------------------------------------------------- pipeline


def bubble_fraction(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """GPipe / 1F1B idle share of a step with equal stages: (p−1)/(v·m+p−1) (``formulas``)."""
    return pipeline_bubble(num_stages, num_microbatches, num_chunks)


def pipeline_step(
    schedules: Sequence[Sequence[tuple]],
    stage_forward_s: Sequence[float],
    num_microbatches: int,
    p2p_s: float = 0.0,
    *,
    backward_factor: float = BACKWARD_FACTOR,
    name: str = "pipeline",
) -> Prediction:
    """A pipeline step (``course_lib.pipeline.PipelineRunner``): every stage's schedule, simulated.

    ``schedules``: one action list per rank, ``(op, microbatch, chunk)`` with op ``"F"``/``"B"``
    (``pipeline_schedules.make_schedules``); ``stage_forward_s[s]``: one micro-batch's forward
    seconds on virtual stage ``s`` (its blocks, plus the embeddings on the first, the head and
    loss on the last); ``p2p_s``: one activation (or gradient) send, ``ab.predict("send_recv",
    bytes)``.

    Why: a stage's F of micro-batch j can start when the previous stage's F of j has arrived
    (its end + one send) and its own previous action is done; a B when the next stage's B has
    arrived. Sends are asynchronous (``isend``): the sender does not wait. The step lasts until
    the last stage is done; the rest of a rank's time is the **bubble** — (p−1)/(m+p−1) of the
    step for equal stages (:func:`bubble_fraction`), more when the first or last stage (the
    embeddings, the head) is heavier, plus the sends on the critical path.
    """
    p = len(schedules)
    v = max(a[2] for acts in schedules for a in acts) + 1
    if len(stage_forward_s) != p * v:
        raise ValueError(f"stage_forward_s has {len(stage_forward_s)} entries for {p * v} stages")
    last = p * v - 1
    done: dict[tuple, float] = {}
    free, pos = [0.0] * p, [0] * p
    busy = [0.0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(schedules[r]):
                op, mb, chunk = schedules[r][pos[r]][:3]
                s = chunk * p + r
                dep = ("F", mb, s - 1) if op == "F" and s > 0 else None
                if op == "B" and s < last:
                    dep = ("B", mb, s + 1)
                if dep is not None and dep not in done:
                    break
                arrive = done[dep] + p2p_s if dep else 0.0
                cost = stage_forward_s[s] * (1 if op == "F" else backward_factor)
                start = max(free[r], arrive)
                done[(op, mb, s)] = free[r] = start + cost
                busy[r] += cost
                pos[r] += 1
                progress = True
    if any(pos[r] < len(schedules[r]) for r in range(p)):
        raise ValueError("pipeline_step: the schedules deadlock (see pipeline_schedules.simulate)")
    total = max(free)
    compute = max(busy)
    m = num_microbatches
    return Prediction(
        name,
        {"compute": compute, "bubble + p2p": total - compute},
        f"{p} stages × {m} micro-batches: bubble ≈ (p−1)/(v·m+p−1) = "
        f"{bubble_fraction(p, m, v):.0%} for equal stages",
    )


def slowest_stage_step(
    stage_forward_s: Sequence[float],
    num_microbatches: int,
    *,
    backward_factor: float = BACKWARD_FACTOR,
) -> float:
    """A GPipe or 1F1B step when the stages differ: the slowest stage sets the pace.

    With F_s one micro-batch's forward on stage s, B_s = ``backward_factor``·F_s, and s* the
    slowest stage::

        step = m·(F + B)_s*  +  Σ_{s ≠ s*} (F_s + B_s)

    Why. Stage s* never waits once it has started, except for what the other stages must do
    around it: every input (from the stages above) and every gradient (from the stages below)
    comes from stages faster than it, so they are ready before s* is. So s* works its m
    forwards and m backwards back to back: m·(F + B)_s*, the steady state, paced by the
    slowest stage alone. What s* cannot overlap is one pass of the others: micro-batch 0's
    forward through the stages above it before s* can start (Σ_{s<s*} F_s), the first
    gradient's trip down and back through the stages below it (Σ_{s>s*} (F_s + B_s): in GPipe
    between its last forward and first backward; in 1F1B none when s* is the last stage), and
    the last gradient's way up to stage 0 after s* is done (Σ_{s<s*} B_s). Those add up to
    Σ_{s ≠ s*} (F_s + B_s). With p equal stages it is (m + p − 1)(F + B), the balanced step;
    one stage k× slower gives k·m·(F + B) + (p − 1)(F + B): the bound (m + p − 1)·k(F + B)
    over-counts the fill and drain, which the faster stages run at their own pace.

    Exact for GPipe wherever s* is, and for 1F1B when s* is the last stage (checked against
    :func:`pipeline_step`'s simulation). For 1F1B with s* earlier it is an upper bound: 1F1B's
    early backwards let the stages below s* work while s* still runs, hiding part of their pass.
    """
    f = list(stage_forward_s)
    m = num_microbatches
    if not f or m < 1 or min(f) < 0:
        raise ValueError(
            f"slowest_stage_step needs >= 1 stage, num_microbatches >= 1 and costs >= 0: "
            f"got {len(f)} stages, m={m}, min cost {min(f, default=None)}"
        )
    pair = [t * (1 + backward_factor) for t in f]  # F_s + B_s
    slowest = max(pair)
    return m * slowest + sum(pair) - slowest


# --------------------------------------------------------------------------- tensor parallel


def tp_step(
    forward_s: Sequence[tuple[str, float]],
    forward_allreduces: Sequence[float],
    backward_allreduces: Sequence[float],
    ab: AlphaBeta,
    tp_size: int,
    *,
    recompute: Sequence[str] = (),
) -> Prediction:
    """Tensor parallelism (``course_lib.tensor_parallel``): every all-reduce on the critical path.

    ``forward_s``: this rank's parts at its local (1/t) shapes; ``forward_allreduces`` /
    ``backward_allreduces``: the bytes of each all-reduce (:func:`tp_allreduces` lists the
    course GPT's).

    Why: a row-parallel layer's output is a partial sum; the next op (the residual add, the
    LayerNorm) needs the whole sum, so ``g``'s all-reduce blocks the forward, and ``f``'s the
    backward, for every block: 2 forward + 2 backward. Nothing overlaps them — hence TP stays
    inside a node, on NVLink.
    """
    recompute = _check_recompute(forward_s, recompute)
    forward = sum(f for _, f in forward_s)
    extra = sum(f for n, f in forward_s if n in recompute)
    fwd = sum(ab.predict("all_reduce", b, tp_size) for b in forward_allreduces)
    bwd = sum(ab.predict("all_reduce", b, tp_size) for b in backward_allreduces)
    # a recomputed block's forward all-reduces run again; the caller lists them in backward
    parts = {
        "compute": (1 + BACKWARD_FACTOR) * forward,
        "recompute": extra,
        "exposed all_reduce (forward)": fwd,
        "exposed all_reduce (backward)": bwd,
    }
    n = len(forward_allreduces) + len(backward_allreduces)
    return Prediction(
        f"TP {tp_size}",
        {k: v for k, v in parts.items() if v or k == "compute"},
        f"{n} all-reduces, each on the critical path",
    )


def tp_allreduces(
    n_layer: int, tokens: int, d_model: int, dtype_bytes: int = 4
) -> tuple[list[float], list[float]]:
    """The course TP GPT's all-reduces per step, ``(forward bytes, backward bytes)``.

    Forward: the vocabulary-parallel embedding's sum (tokens·h), 2 per block (tokens·h each),
    the vocabulary-parallel cross-entropy's max, Σexp and target logit (tokens each).
    Backward: 2 per block, and the head's ``f`` (the input gradient of the column-parallel head).
    """
    act = tokens * d_model * dtype_bytes
    forward = [act] + [act] * 2 * n_layer + [tokens * dtype_bytes] * 3
    backward = [act] * 2 * n_layer + [act]
    return forward, backward


# --------------------------------------------------------------------------- a GPU node, for the planner


@dataclass(frozen=True)
class NodeProfile:
    """A GPU node for the planner: published FLOP/s and link bandwidths, an assumed MFU and α.

    ``flops``: dense 16-bit peak per GPU (FLOP/s); ``mfu``: the share of it a tuned training
    step achieves (model FLOPs utilisation); ``intra_bw`` / ``inter_bw``: bytes per second one
    GPU sends in one direction inside the node / to other nodes; ``alpha_intra`` /
    ``alpha_inter``: the fixed cost of one collective (s).
    """

    name: str
    flops: float
    mfu: float
    intra_bw: float
    inter_bw: float
    gpus_per_node: int
    alpha_intra: float
    alpha_inter: float

    @property
    def rate(self) -> float:
        """Achieved FLOP/s per GPU: ``flops · mfu``."""
        return self.flops * self.mfu

    def alpha_beta(self, world_size: int, across_nodes: bool) -> AlphaBeta:
        """The α–β model of one group of ``world_size`` GPUs, inside a node or across nodes."""
        a = self.alpha_inter if across_nodes else self.alpha_intra
        b = self.inter_bw if across_nodes else self.intra_bw
        ops = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
        return AlphaBeta(dict.fromkeys(ops, a), dict.fromkeys(ops, b), world_size, 0)


H100_NODE = NodeProfile(
    "8× H100 SXM (NVLink 4, 8× 400 Gb/s InfiniBand NDR)",
    flops=989e12,
    mfu=0.40,
    intra_bw=450e9,
    inter_bw=50e9,
    gpus_per_node=8,
    alpha_intra=10e-6,
    alpha_inter=20e-6,
)
"""A DGX/HGX H100 node. Published (NVIDIA H100 datasheet; DGX H100 user guide): 989 TFLOP/s
dense BF16 per H100 SXM; NVLink 4, 900 GB/s per GPU bidirectional, so 450 GB/s each way (the
β of a ring step); one 400 Gb/s ConnectX-7 NDR port per GPU, 50 GB/s each way. Assumed: 40 %
MFU (what well-tuned large-model training reports, e.g. Megatron-LM's 41–52 % on A100s,
Narayanan et al. 2021) and α = 10 µs inside a node, 20 µs across nodes (NCCL's small-message
latency, order of magnitude)."""


def cp_ring_bytes(
    batch: int, heads: int, seq_len: int, head_dim: int, cp_size: int, element_size: int = 2
) -> dict[str, int]:
    """Bytes one rank sends per attention layer in ring attention: ``{"forward", "backward"}``.

    The course's ring (``context_parallel.ring_attention``, formula
    ``context_parallel.ring_attention_traffic``): a rank's K/V block is 2·B·H·(S/c)·D elements;
    forward sends it c−1 times round the ring; backward sends K/V c−1 times again and the dK/dV
    accumulators c−1 times (twice the forward's bytes). ``heads``: this rank's (a/t under TP).
    """
    block = 2 * batch * heads * (seq_len // cp_size) * head_dim * element_size
    kv = (cp_size - 1) * block
    return {"forward": kv, "backward": 2 * kv}


def ep_all_to_all_bytes(
    tokens: int, d_model: int, top_k: int, ep_size: int, element_size: int = 2
) -> int:
    """Bytes one rank sends to other ranks in one all-to-all of an MoE layer, routing balanced.

    ``expert_parallel.all_to_all_bytes`` of a kept matrix where every expert receives the same
    share of every rank's ``tokens`` · k assignments and none is dropped: (e−1)/e of them go to
    other ranks' experts, d_model · ``element_size`` bytes each. Dispatch and combine send the
    same (the combine returns what other ranks' tokens sent here); backward sends them again.
    """
    assignments = tokens * top_k
    return (ep_size - 1) * assignments // ep_size * d_model * element_size


def layout_step(
    model,
    layout,
    profile: NodeProfile,
    *,
    global_batch: int,
    micro_batch: int = 1,
    element_size: int = 2,
) -> Prediction:
    """One step of ``layout`` for ``model`` on nodes of ``profile``, by the same exposure rules.

    ``model``: ``params``, ``layers``, ``hidden``, ``heads``, ``seq_len``, and for an MoE model
    ``experts``, ``top_k``, ``expert_params``, ``active_params`` (``plan.Model``); ``layout``:
    ``dp``, ``tp``, ``pp``, ``cp``, ``ep``, ``zero``, ``recompute`` (``plan.Layout``). Every layout
    trains the same ``global_batch`` sequences per step, each replica (dp of them; the cp ranks of
    a replica share its sequences) in ``m = global_batch / (dp · micro_batch)`` micro-batches;
    16-bit gradients, activations of ``element_size`` bytes (2). Ranks are placed TP fastest,
    then CP, then DP, then PP (Megatron's order): a group crosses nodes when its span exceeds
    ``gpus_per_node``; an EP group sits next to the TP ranks (span tp·ep).

    * compute: ``training_flops_per_token`` (of the parameters a token meets, ``active_params``)
      · tokens / (tp · pp · cp) at ``profile.rate``; full recompute adds one forward (2 of the 6
      FLOPs per parameter and token);
    * CP (ring attention, :func:`cp_ring_bytes`): per attention layer and micro-batch c−1 K/V
      sends forward, each behind one block's attention (its share of the layer's forward), and
      c−1 K/V + c−1 dK/dV sends behind the backward blocks; exposed where a send takes longer
      than its block; ``bytes["CP K/V (forward)"]`` and ``["CP K/V (backward)"]`` per step;
    * EP (:func:`ep_all_to_all_bytes`, routing balanced, nothing dropped): per MoE layer and
      micro-batch two all-to-alls forward (dispatch, combine) and two backward, all on the
      critical path (the experts need the tokens, the next layer their outputs);
      ``bytes["EP all-to-all (forward)"]``, ``["EP all-to-all (backward)"]`` per step;
    * pipeline: the 1F1B bubble, compute · (p−1)/m, and 2(p−1) activation sends on the path;
    * TP: 4 all-reduces of b·s·h per layer and micro-batch (2 more with full recompute), exposed;
    * data parallel (ZeRO stage z) over the dp·cp ranks holding the dense weights (and, for an
      MoE model, over the dp·cp/e ranks holding the same experts, on their own link), each rule
      the mechanism of :func:`ddp_step`, :func:`zero_step`, :func:`zero3_step` at one bucket /
      unit per layer:

      - DDP / ZeRO-2 reduce during the last micro-batch's backward (the others accumulate
        locally); exposed: what the link needs beyond that backward, and at least the last
        bucket (the first layers' gradients, ready only when backward ends);
      - ZeRO-1 reduces after backward, all exposed;
      - ZeRO-1/2 all-gather the updated parameters after the optimizer step, exposed (as
        DeepSpeed and ``course_lib.zero`` do; FSDP2 with ``reshard_after_forward=False`` would
        instead gather in the next forward, prefetched — not modelled here);
      - ZeRO-3 all-gathers every layer in forward and again in backward and reduce-scatters it,
        every micro-batch. The **first** layer's all-gather (nothing to compute before it) and
        the **last** layer's reduce-scatter (nothing left to compute after it) are exposed each
        micro-batch; the others are prefetched and show only where one layer's transfer takes
        longer than one layer's compute. So ZeRO-3 pays an exposed head and tail where DDP pays
        one tail, and 3Ψ of traffic against 2Ψ: it is never predicted faster than DDP.
    """
    dp, tp, pp, z = layout.dp, layout.tp, layout.pp, layout.zero
    cp, ep = getattr(layout, "cp", 1), getattr(layout, "ep", 1)
    s, h, n, eb = model.seq_len, model.hidden, profile.gpus_per_node, element_size
    m = global_batch / (dp * micro_batch)
    if m < 1:
        raise ValueError(f"global_batch={global_batch} < dp · micro_batch = {dp * micro_batch}")
    tokens = global_batch / dp * s
    experts = getattr(model, "experts", 0)
    psi = model.active_params if experts else model.params
    per_token = training_flops_per_token(psi, model.layers, s, h)
    full = layout.recompute == "full"
    flops = per_token * tokens / (tp * pp * cp) * ((6 + 2) / 6 if full else 1.0)
    compute = flops / profile.rate
    micro_fwd = compute / m / (4 if full else 3)  # one micro-batch's forward (no recompute)
    parts, sent = {"compute": compute}, {}
    layers = model.layers / pp  # this rank's layers
    if pp > 1:
        act = micro_batch * s * h * eb / cp
        p2p = profile.alpha_beta(2, tp * cp * dp * pp > n).predict("send_recv", act)
        parts["bubble"] = compute * (pp - 1) / m
        parts["exposed p2p"] = 2 * (pp - 1) * p2p
    if tp > 1:
        ab = profile.alpha_beta(tp, tp > n)
        one = ab.predict("all_reduce", micro_batch * s * h * eb / cp)
        parts["exposed TP all_reduce"] = (6 if full else 4) * model.layers / pp * m * one
    if cp > 1:
        ring = cp_ring_bytes(micro_batch, model.heads // tp, s, h // model.heads, cp, eb)
        ab = profile.alpha_beta(2, tp * cp > n)
        send = ab.predict("send_recv", ring["forward"] / (cp - 1))  # one K/V block
        # one ring step's attention: 4·b·(s/c)²·h/t FLOPs forward (QKᵀ and PV), c of them per layer
        block_f = 4 * micro_batch * (s / cp) ** 2 * h / tp / profile.rate
        fwd = (cp - 1) * max(0.0, send - block_f)
        bwd = (cp - 1) * max(0.0, 2 * send - BACKWARD_FACTOR * block_f)  # K/V and dK/dV
        forwards = 2 if full else 1  # full recompute runs the ring's forward again
        parts["exposed CP ring K/V"] = layers * m * (forwards * fwd + bwd)
        sent["CP K/V (forward)"] = layers * m * forwards * ring["forward"]
        sent["CP K/V (backward)"] = layers * m * ring["backward"]
    if experts and ep > 1:
        local = micro_batch * s / cp / (tp if getattr(layout, "sp", False) else 1)
        one = ep_all_to_all_bytes(local, h, model.top_k, ep, eb)
        ab = profile.alpha_beta(ep, tp * ep > n)
        a2a = ab.predict("send_recv", one)  # the bytes leave the rank once
        forwards = 2 if full else 1
        parts["exposed EP all_to_all"] = layers * m * 2 * (forwards + 1) * a2a
        sent["EP all-to-all (forward)"] = layers * m * forwards * 2 * one
        sent["EP all-to-all (backward)"] = layers * m * 2 * one
    dense = model.params - (model.expert_params if experts else 0.0)
    groups = [("", dense / (tp * pp), dp * cp)]
    if experts:
        groups.append((" (experts)", model.expert_params / (tp * pp * ep), dp * cp // ep))
    for label, psi_rank, size in groups:
        if size > 1:
            span = tp * cp * dp
            parts.update(_dp_parts(profile, label, psi_rank, size, span, layers, micro_fwd, m, z))
    return Prediction(
        layout.name() if hasattr(layout, "name") else repr(layout),
        parts,
        f"{profile.name}: {profile.rate / 1e12:.0f} TFLOP/s achieved per GPU",
        bytes={k: int(v) if float(v).is_integer() else v for k, v in sent.items()},
    )


def _dp_parts(
    profile: NodeProfile,
    label: str,
    psi_rank: float,
    size: int,
    span: int,
    per_layer: float,
    micro_fwd: float,
    m: float,
    z: int,
) -> dict[str, float]:
    """Exposed data-parallel communication of ``psi_rank`` parameters over ``size`` ranks (see above).

    ``span``: how many consecutive ranks the group's members lie across (it crosses nodes when
    that exceeds ``gpus_per_node``): tp·cp·dp for the dense weights' group, and the same for the
    experts' (e of every tp·e·… ranks hold other experts).
    """
    ab = profile.alpha_beta(size, span > profile.gpus_per_node)
    shard = psi_rank * 2  # 16-bit gradients / parameters of one rank
    micro_bwd = 2 * micro_fwd
    parts = {}
    if z == 3:
        # one unit per layer: its all-gather before it runs (forward and backward), its
        # reduce-scatter after its backward, all on one link (see zero3_step)
        g = ab.predict("all_gather", shard / per_layer)
        r = ab.predict("reduce_scatter", shard / per_layer)
        f, b = micro_fwd / per_layer, micro_bwd / per_layer
        # the first unit's all-gather: forward cannot start before it; the last unit's
        # reduce-scatter: after backward ends (the next micro-batch's first all-gather
        # queues behind it, the optimizer step waits for it) — both exposed every micro-batch
        edges = g + r
        # the others, prefetched: unit i+1's all-gather runs behind unit i's forward; in
        # backward unit i−1's all-gather and unit i's reduce-scatter behind unit i's
        # backward — exposed only where the link needs longer than the compute
        inner = (per_layer - 1) * (max(0.0, g - f) + max(0.0, g + r - b))
        parts["exposed all_gather + reduce_scatter" + label] = m * (edges + inner)
    else:
        if z == 0:
            reduce = ab.predict("all_reduce", shard)
        else:
            reduce = ab.predict("reduce_scatter", shard)
        hidden = 0.0 if z == 1 else micro_bwd
        last = reduce / per_layer  # the first layers' bucket is ready only at the end
        parts["exposed gradient reduction" + label] = max(reduce - hidden, last)
        if z in (1, 2):
            parts["exposed all_gather" + label] = ab.predict("all_gather", shard)
    return parts


def rank_layouts(
    model, layouts, profile: NodeProfile = H100_NODE, *, global_batch: int, micro_batch: int = 1
) -> list[tuple[object, Prediction]]:
    """``(layout, prediction)`` for each layout, fastest predicted step first (:func:`layout_step`)."""
    ranked = [
        (lay, layout_step(model, lay, profile, global_batch=global_batch, micro_batch=micro_batch))
        for lay in layouts
    ]
    return sorted(ranked, key=lambda pair: pair[1].total)
