"""Chapter 03's measurements: each ZeRO stage's bytes held and sent against the formulas, clipping and resume.

Rank functions (run them with ``launch.spawn``), each returning a
:class:`~course_lib.results.Result` whose rows are the chapter's claims:

* :func:`zero_stage_report` — one stage: model-state bytes vs the ZeRO formula, bytes sent vs
  2Ψ/3Ψ, weights vs one device (:class:`StageReport`);
* :func:`zero_clip_and_resume` — global-norm clipping vs one device, checkpoint/resume vs the
  uninterrupted run (:class:`ClipResumeReport`);
* :func:`zero_stage_profile` — every stage's step time, peak bytes per phase and which collectives
  each phase issues (:class:`StageProfile`);
* :func:`zero_step_times` — every stage's step under the modelled clock against the step-time
  model, then on the real clock (:class:`StepTimes`).

The results also read like the dicts they replace (``report["ratio"]``, :class:`results.FieldAccess`).
Accounting helpers, usable in any rank function: :func:`model_state_accounting` (bytes held) and
:func:`comm_accounting` (bytes sent).
"""

from __future__ import annotations

import io
import math
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import comm
from ..ddp import DDP
from ..formulas import zero_model_state_breakdown
from ..launch import device
from ..memory import SavedTensorMeter, model_state_bytes, tensors_in, unique_storage_bytes
from ..models import GPT, GPTConfig
from ..results import ADAMW, EXACT, FieldAccess, Result
from ..zero import ZeroOptimizer
from ..zero3 import Zero3
from .common import (
    OPTIMIZERS,
    check_global_batch,
    make_optimizer,
    median_times,
    race,
    reference_run,
    shard_batch,
    state_diff,
    step_batch,
    train_step,
    zero_config,
)

__all__ = [
    "zero_config",
    "model_state_accounting",
    "comm_accounting",
    "zero_stage_report",
    "zero_clip_and_resume",
    "zero_stage_profile",
    "StageReport",
    "ClipResumeReport",
    "StageProfile",
    "zero_step_times",
    "StepTimes",
    "MEMORY_FORMULA",
]

# per-rank model-state bytes of each stage, fp32 AdamW (0 = DDP)
MEMORY_FORMULA = {0: "16Ψ", 1: "8Ψ + 8Ψ/N", 2: "4Ψ + 12Ψ/N", 3: "16Ψ/N"}


# --------------------------------------------------------------------------- accounting


def model_state_accounting(model, optimizer, extra=()) -> dict:
    """Per-rank model-state bytes, measured from real tensors and predicted by the ZeRO formula.

    Call after ``step()`` (k ≥ 1) and before ``zero_grad()``, when everything exists.
    ``measured`` sums ``untyped_storage().nbytes()`` over unique storages reachable from the
    parameters, their ``.grad``, the optimizer state and every tensor the wrapper holds
    (``memory.model_state_bytes``). ``formula`` is fp32 AdamW on the padded count Ψ:

    * ``model`` plain (or DDP), ``optimizer`` a torch optimizer → DDP, 16Ψ
    * ``optimizer`` a :class:`ZeroOptimizer` → stage 1: 8Ψ + 8Ψ/N; stage 2: 4Ψ + 12Ψ/N
    * ``model`` a :class:`Zero3`, ``optimizer`` a torch optimizer over its shards → 16Ψ/N

    Returns ``{"stage", "world_size", "psi", "psi_pad", "measured", "formula", "formula_breakdown",
    "ratio"}``; ``measured`` and ``formula_breakdown`` split the bytes into params / grads / optimizer
    (ZeRO-2's partition gradient and the flat buffers are charged as ``grads`` / ``params``).
    """
    if isinstance(optimizer, ZeroOptimizer):
        stage, n, psi, psi_pad = (
            optimizer.stage,
            optimizer.world_size,
            optimizer.numel,
            optimizer.padded_numel,
        )
        # the segments' .grad are this rank's gradient slices: count them as "grads"
        measured = model_state_bytes(
            optimizer.params + [s.param for s in optimizer.segments],
            optimizer.optimizer,
            extra=list(optimizer.held_tensors()) + list(extra),
        )
    elif isinstance(model, Zero3):
        stage, n, psi, psi_pad = 3, model.world_size, model.numel, model.padded_numel
        measured = model_state_bytes(
            list(model.parameters()), optimizer, extra=list(model.held_tensors()) + list(extra)
        )
    else:
        params = list(model.parameters())
        stage, psi = 0, sum(p.numel() for p in params)
        psi_pad = psi
        n = dist.get_world_size() if dist.is_initialized() else 1
        measured = model_state_bytes(params, optimizer, extra=list(extra))
    breakdown = zero_model_state_breakdown(psi_pad, n, stage, precision="fp32")
    return dict(
        stage=stage,
        world_size=n,
        psi=psi,
        psi_pad=psi_pad,
        measured=measured,
        formula=breakdown["total"],
        formula_breakdown=breakdown,
        ratio=measured["total"] / breakdown["total"],
    )


def comm_accounting(log: comm.CommLog, wrapper, steps: int = 1) -> dict:
    """Bytes one rank sent per step (ring model), against ``(N−1)/N · c · Ψ · 4`` bytes.

    ``log`` recorded ``steps`` full training steps; only tags ``"param"`` and ``"grad"``
    count (not the one-time ``"init"`` broadcast or the tiny ``"used"``/``"norm"`` all-reduces).
    c = 2 for DDP and ZeRO-1/2 (an all-reduce, or reduce-scatter + all-gather: the same bytes) and
    3 for ZeRO-3 (an extra all-gather in backward). ``wrapper`` is the course's :class:`DDP`, a
    :class:`ZeroOptimizer` or a :class:`Zero3`. The formula assumes fp32 traffic; with
    ``compute_dtype`` 16-bit the gathers are half.
    """
    if isinstance(wrapper, ZeroOptimizer):
        stage, c, n, psi_pad = wrapper.stage, 2, wrapper.world_size, wrapper.padded_numel
    elif isinstance(wrapper, Zero3):
        stage, c, n, psi_pad = 3, 3, wrapper.world_size, wrapper.padded_numel
    elif isinstance(wrapper, DDP):
        stage, c, n = 0, 2, dist.get_world_size()
        psi_pad = sum(p.numel() for p in wrapper.parameters())
    else:
        raise TypeError(
            f"wrapper must be a DDP, ZeroOptimizer or Zero3, got {type(wrapper).__name__}"
        )
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    sent = (log.total("ring_bytes", tag="param") + log.total("ring_bytes", tag="grad")) / steps
    formula = (n - 1) / n * c * psi_pad * 4
    return dict(
        stage=stage,
        world_size=n,
        psi_pad=psi_pad,
        sent_per_step=sent,
        formula=formula,
        ratio=sent / formula if formula else float("nan"),
    )


# --------------------------------------------------------------------------- one stage, measured


@dataclass
class StageReport(FieldAccess, Result):
    """One ZeRO stage (0 = DDP) on one rank: bytes held and sent, weights vs one device."""

    stage: int
    world_size: int
    psi: int
    psi_pad: int
    measured: dict  # model-state bytes after the last step: params, grads, optimizer, total
    formula: float
    formula_breakdown: dict
    ratio: float  # measured / formula
    comm_ratio: float  # bytes sent in the last step / (N−1)/N · c · Ψ_pad · 4
    comm: list  # the last step's CommLog.summary()
    activation_bytes: int  # saved for backward and held at the end of the last forward
    losses: list  # this rank's loss per step
    max_abs_diff: float  # max |Δparam| against one device on the full batches


def _build(stage: int, model, dev, bucket_cap_mb, zero3_unit: str = "block"):
    """(wrapped model, optimizer) for ZeRO ``stage``; 0 = bucketed DDP, the baseline ZeRO improves on.

    DDP uses the same ``bucket_cap_mb`` as ZeRO-1/2 and ``gradient_as_bucket_view=True`` (as torch
    DDP offers): each ``.grad`` is a view into its bucket, so the buckets *are* the 4Ψ of gradients.
    """
    if stage == 0:
        wrapped = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
        return wrapped, make_optimizer("adamw", wrapped.parameters())
    if stage in (1, 2):
        adamw, options = OPTIMIZERS["adamw"]
        return model, ZeroOptimizer(
            model.parameters(), adamw, stage=stage, bucket_cap_mb=bucket_cap_mb, **options
        )
    if stage == 3:
        wrapped = Zero3(model, unit=zero3_unit)
        return wrapped, make_optimizer("adamw", wrapped.parameters())
    raise ValueError(f"stage={stage} is not one of 0 (DDP), 1, 2, 3")


def _traffic_formula(stage: int, config: GPTConfig, world: int, traffic: dict, zero3_unit: str):
    """(bytes one rank sends per step, what that number is): c·Ψ_pad·4·(N−1)/N, plus the tied
    weight's second use when ``Zero3`` gathers per parameter and use."""
    c = 3 if stage == 3 else 2
    formula, against = traffic["formula"], f"formula {c}Ψ_pad · 4 B · (N−1)/N"
    if stage == 3 and zero3_unit == "param" and config.tie_weights:
        tied_pad = math.ceil(config.vocab_size * config.d_model / world) * world
        # gathered once more in forward and once more in backward
        formula += (world - 1) / world * 2 * tied_pad * 4
        against += " + 2 gathers of the tied weight"
    return formula, against


def zero_stage_report(
    stage: int,
    steps: int = 3,
    global_batch: int = 8,
    config: GPTConfig | None = None,
    zero3_unit: str = "block",
) -> StageReport:
    """Rank function: train ``steps`` AdamW steps at ZeRO ``stage`` (0 = DDP) and measure everything.

    Rows: model-state bytes after the last step (before ``zero_grad``) within 1 % of the fp32
    formula (the excess: AdamW's 4-byte step counter per tensor; the shortfall: no state for
    padding); the last step's bytes sent (Σ ring bytes of tags "grad" and "param") equal to
    (N−1)/N · c · Ψ_pad · 4, c = 2 for stages 0–2 and 3 for stage 3; the weights equal to
    one device trained on the full batches (``ADAMW``). Fields: those numbers, the activation bytes
    autograd saved in the last forward (ZeRO does not shard them) and the loss curve.
    ``zero3_unit``: ``Zero3``'s ``unit`` at stage 3 ("block": one all-gather per block + root, the
    default; "param": one per parameter and use, so the tied weight is gathered twice per pass).
    """
    config = config or zero_config()
    world, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, world)
    model = GPT(config, seed=0).to(dev)
    wrapped, opt = _build(stage, model, dev, 25.0, zero3_unit)
    activations = []

    weights = list(wrapped.parameters()) + list(model.parameters())

    def forward(x, y):  # the wrapped model, counting what autograd saves for backward
        with SavedTensorMeter(exclude=weights) as meter:
            out = wrapped(x, y)
            activations.append(meter.live_bytes())  # held at the end of forward
        return out

    losses = []
    for step in range(steps):
        x, y = step_batch(step, config, global_batch, dev)
        with comm.CommLog() as log:
            losses.append(train_step(forward, opt, *shard_batch(x, y)))
    acct = model_state_accounting(wrapped if stage in (0, 3) else model, opt)
    traffic = comm_accounting(log, opt if stage in (1, 2) else wrapped)
    full = wrapped.full_state_dict() if stage == 3 else dict(model.state_dict())
    reference, _, _ = reference_run(config, steps, global_batch, "adamw", dev=dev)
    report = StageReport(
        stage=stage,
        world_size=world,
        psi=acct["psi"],
        psi_pad=acct["psi_pad"],
        measured=acct["measured"],
        formula=acct["formula"],
        formula_breakdown=acct["formula_breakdown"],
        ratio=acct["ratio"],
        comm_ratio=traffic["ratio"],
        comm=log.summary(),
        activation_bytes=activations[-1],
        losses=losses,
        max_abs_diff=state_diff(full, reference),
        title=f"ZeRO stage {stage} (0 = DDP), N = {world}, rank {dist.get_rank()}",
    )
    report.within(
        "model-state bytes per rank",
        acct["measured"]["total"],
        acct["formula"],
        0.01,
        against=f"formula {MEMORY_FORMULA[stage]} (fp32 AdamW, Ψ padded)",
    )
    sent_formula, against = _traffic_formula(stage, config, world, traffic, zero3_unit)
    sent = traffic["sent_per_step"]
    report.condition(
        "bytes sent per step (ring, grad + param)",
        sent,
        math.isclose(sent, sent_formula, rel_tol=1e-9),
        "= formula (float ring factor)",
        reference=sent_formula,
        against=against,
    )
    report.equal(f"weights after {steps} AdamW steps", full, reference.state_dict(), ADAMW)
    return report


# --------------------------------------------------------------------------- clipping and resume


@dataclass
class ClipResumeReport(FieldAccess, Result):
    """ZeRO-1/2 with global-norm clipping, uninterrupted and resumed from a checkpoint."""

    stage: int
    norms: list  # the global gradient norm ZeRO computed, per step (before clipping)
    reference_norms: list  # torch.nn.utils.clip_grad_norm_ on one device
    max_abs_diff_uninterrupted: float
    max_abs_diff_resumed: float
    resumed_equals_uninterrupted: bool


def zero_clip_and_resume(
    stage: int = 2,
    steps: int = 6,
    resume_at: int = 3,
    max_norm: float = 0.5,
    global_batch: int = 8,
    config: GPTConfig | None = None,
) -> ClipResumeReport:
    """Rank function: ZeRO-``stage`` (1, 2 or 3) with gradient clipping, checkpointed and resumed mid-run.

    Three runs on the same data: one device with ``torch.nn.utils.clip_grad_norm_`` (the
    reference), ZeRO uninterrupted, and ZeRO saved at ``resume_at`` (weights + every
    partition's optimizer state through ``torch.save``), rebuilt from a *different* init, loaded
    and continued. Stage 3 clips with ``Zero3.clip_grad_norm_`` and checkpoints the full weights
    (``full_state_dict``) with each rank's own AdamW state (over its shards).

    Rows: clipping happened at every step; ZeRO's norms (the true global norm, from an
    all-reduce of squared partial norms) and weights equal one device's (``ADAMW``); the
    resumed weights equal the uninterrupted ones bit for bit (``EXACT``).
    """
    config = config or zero_config()
    dev = device()
    check_global_batch(global_batch, dist.get_world_size())
    reference, _, ref_norms = reference_run(
        config, steps, global_batch, "adamw", max_norm=max_norm, dev=dev
    )
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r} is not one of 1, 2, 3")
    adamw, options = OPTIMIZERS["adamw"]

    def build(seed: int):  # (model to call, optimizer, what clips)
        model = GPT(config, seed=seed).to(dev)
        if stage == 3:
            z3 = Zero3(model)
            opt = make_optimizer("adamw", z3.parameters())
            return z3, opt, z3
        opt = ZeroOptimizer(model.parameters(), adamw, stage=stage, **options)
        return model, opt, opt

    def weights(model) -> dict:  # full tensors (collective at stage 3)
        return model.full_state_dict() if stage == 3 else dict(model.state_dict())

    def run(resume: bool):
        model, opt, clipper = build(seed=0)
        norms = []

        def clip():  # after backward: the global norm, assembled from every rank's partition
            norms.append(clipper.clip_grad_norm_(max_norm).item())

        for step in range(steps):
            if resume and step == resume_at:
                blob = io.BytesIO()
                torch.save({"model": weights(model), "optim": opt.state_dict()}, blob)
                blob.seek(0)
                saved = torch.load(blob, weights_only=True)
                # different weights: the checkpoint must restore everything
                model, opt, clipper = build(seed=123)
                if stage == 3:
                    model.load_full_state_dict(saved["model"])
                else:
                    model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optim"])
            x, y = shard_batch(*step_batch(step, config, global_batch, dev))
            train_step(model, opt, x, y, after_backward=clip)
        return weights(model), norms

    straight, norms = run(resume=False)
    resumed, _ = run(resume=True)
    same = all(torch.equal(v, straight[k]) for k, v in resumed.items())
    report = ClipResumeReport(
        stage=stage,
        norms=norms,
        reference_norms=ref_norms,
        max_abs_diff_uninterrupted=state_diff(straight, reference),
        max_abs_diff_resumed=state_diff(resumed, reference),
        resumed_equals_uninterrupted=same,
        title=f"ZeRO-{stage}: clipping at max_norm {max_norm}, resumed at step {resume_at}",
    )
    report.condition(
        "clipping scaled every step",
        min(ref_norms),
        min(ref_norms) > max_norm,
        f"> max_norm = {max_norm}",
        against="smallest norm on one device",
    )
    report.equal(
        "global gradient norm per step",
        norms,
        ref_norms,
        ADAMW,
        against="clip_grad_norm_ on one device",
    )
    report.equal(f"weights after {steps} clipped steps", straight, reference.state_dict(), ADAMW)
    report.equal(
        "weights, resumed from the checkpoint",
        resumed,
        straight,
        EXACT,
        against="the uninterrupted run",
    )
    return report


# --------------------------------------------------------------------------- time and peak memory per stage


class _Sampler:
    """Bytes held, by category, sampled from hooks: model states, transient comm buffers, live activations.

    * model states — parameters, their ``.grad``, optimizer state and the wrapper's persistent buffers;
    * transient — ZeRO-2's gradient staging buckets (filling, or in flight in a reduce-scatter:
      ``ZeroOptimizer.transient_tensors``) and ZeRO-3's gathered full weights
      (``Zero3.held_tensors``);
    * activations — tensors saved for backward and not yet freed (weak references, so counting
      does not keep them alive).
    Samples are taken after every module's forward, as every gradient is accumulated, and at the
    phase boundaries; ``peak[phase]`` keeps the largest total per phase with its breakdown.
    """

    def __init__(self, stage, model, wrapped, opt):
        self.stage, self.model, self.wrapped, self.opt = stage, model, wrapped, opt
        self.phase, self.peak, self._saved = "forward", {}, []
        leaves = list(wrapped.parameters()) if stage in (0, 3) else list(model.parameters())
        self._hooks = [m.register_forward_hook(lambda *_: self.sample()) for m in model.modules()]
        self._hooks += [
            p.register_post_accumulate_grad_hook(lambda _p: self.sample())
            for p in leaves
            if p.requires_grad
        ]
        self.leaves = leaves

    def pack(self, t):
        """``saved_tensors_hooks`` pack: a weak reference to every tensor saved for backward."""
        self._saved.append(weakref.ref(t))
        return t

    def _groups(self) -> dict:
        opt, stage = self.opt, self.stage
        params = self.leaves
        states = params + [p.grad for p in params if p.grad is not None]
        transient = []
        if stage in (1, 2):
            transient = opt.transient_tensors()
            states += [t for t in opt.held_tensors() if not any(t is s for s in transient)]
            states += [s.param for s in opt.segments] + [
                s.param.grad for s in opt.segments if s.param.grad is not None
            ]
            states += list(tensors_in(opt.optimizer.state))
        else:
            states += list(tensors_in(opt.state))
            if stage == 0:  # DDP's flat buckets exist from wrap time on: its 4Ψ of gradients
                states += [f for f in self.wrapped._flat if f is not None]
            if stage == 3:
                transient = self.wrapped.held_tensors()
        acts = [t for t in (r() for r in self._saved) if t is not None]
        return {"model states": states, "transient": transient, "activations": acts}

    def sample(self) -> None:
        snap = self.last = unique_storage_bytes(self._groups())
        snap["total"] = sum(snap.values())
        if snap["total"] > self.peak.get(self.phase, {"total": -1})["total"]:
            self.peak[self.phase] = snap

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@dataclass
class StageProfile(FieldAccess, Result):
    """Every stage's step time, peak bytes per phase and the collectives each phase issues."""

    world_size: int
    micro_batch: int
    step_s: dict  # stage → median seconds per step (max over ranks); {} without timing
    peak: dict  # stage → phase → {"model states", "transient", "activations", "total"} at its peak
    calls: dict  # stage → phase → {collective: calls} (tags "grad" and "param")
    activation_bytes: dict  # stage → bytes saved for backward, held at the end of forward
    psi: int
    units: list | None = None  # Zero3.unit_table() (stage 3)
    buckets_stage1: int | None = None
    buckets_stage2: int | None = None
    formula: dict | None = None  # stage → model-state bytes by the fp32 formula (Ψ padded)

    def peak_of(self, stage: int) -> dict:
        """The stage's peak over forward, backward and step: {"model states", "transient", ...}."""
        phases = ("forward", "backward", "step")
        return max((self.peak[stage][ph] for ph in phases), key=lambda d: d["total"])

    def stage2_gap(self) -> dict:
        """DDP's peak − ZeRO-2's peak, measured and predicted from the formulas.

        Predicted = (formula DDP − formula ZeRO-2) − ZeRO-2's transient (staging buckets) at its
        peak + (activations at DDP's peak − at ZeRO-2's): the model states ZeRO-2 does not keep,
        less the communication memory it adds, at the moments the two peaks happen."""
        d, z = self.peak_of(0), self.peak_of(2)
        saved = self.formula[0] - self.formula[2]
        acts = d["activations"] - z["activations"]
        return dict(
            measured=d["total"] - z["total"],
            predicted=saved - z["transient"] + acts,
            formula_saving=saved,
            staging=z["transient"],
            activations=acts,
        )


def _profile_rows(p: StageProfile) -> None:
    """The profile's claims: when each stage communicates, what is transient, activations alike."""
    calls = p.calls
    if 1 in calls:
        p.exact(
            "stage 1: reduce-scatters during backward",
            calls[1]["backward"].get("reduce_scatter", 0),
            0,
            against="stage 1 reduces in step()",
        )
        p.exact(
            "stage 1: reduce-scatters in step()",
            calls[1]["step"].get("reduce_scatter", 0),
            p.buckets_stage1,
            against="one per bucket",
        )
    if 2 in calls:
        p.exact(
            "stage 2: reduce-scatters during backward",
            calls[2]["backward"].get("reduce_scatter", 0),
            p.buckets_stage2,
            against="one per bucket",
        )
        staged, after = p.peak[2]["backward"]["transient"], p.peak[2]["after step"]["transient"]
        p.condition(
            "stage 2: staging bytes in backward, after the step",
            (staged, after),
            staged > 0 and after == 0,
            "> 0, then 0",
        )
        if 0 in calls and p.formula:
            gap = p.stage2_gap()
            p.within(
                "stage 2: DDP's peak − its peak (B)",
                gap["measured"],
                gap["predicted"],
                0.01,
                against="= formula saving − staging at its peak (± activations)",
            )
    if 3 in calls:
        for phase in ("forward", "backward"):
            p.exact(
                f"stage 3: all-gathers in {phase}",
                calls[3][phase].get("all_gather", 0),
                len(p.units),
                against="one per unit",
            )
        units = {u["name"]: u["gathered_bytes"] for u in p.units}
        g3 = max(p.peak[3][ph]["transient"] for ph in ("forward", "backward"))
        root, block = units["(root)"], units["blocks.0"]
        blocks, rest = divmod(g3 - root, block)
        n_blocks = len(units) - 1
        if n_blocks > 2:  # with 2 blocks, "at most 2 gathered" cannot fail: no row
            p.condition(
                f"stage 3: gathered weights at the peak ({n_blocks} blocks), B",
                g3,
                rest == 0 and 1 <= blocks <= 2 < n_blocks,
                "≤, whole blocks (≥ root + 1)",
                reference=root + 2 * block,
                against="root + 2 blocks gathered",
            )
    acts = list(p.activation_bytes.values())
    if len(acts) < 2:  # one stage profiled: "the same at every stage" would compare it with itself
        return
    p.condition(
        "activation bytes at every stage",
        acts[0],
        len(set(acts)) == 1 and acts[0] > 0,
        "the same at every stage",
        against="ZeRO shards model states only",
    )


def _formula_bytes(stage: int, built, world: int) -> float:
    """Model-state bytes of ``stage`` by the fp32 formula, on the count the stage really pads to."""
    model, wrapped, opt = built
    psi = {0: model.num_params(), 3: getattr(wrapped, "padded_numel", 0)}.get(stage)
    if psi is None:
        psi = opt.padded_numel
    return zero_model_state_breakdown(psi, world, stage, precision="fp32")["total"]


def zero_stage_profile(
    stages=(0, 1, 2, 3),
    micro_batch: int = 4,
    rounds: int = 5,
    bucket_cap_mb: float = 0.05,
    config: GPTConfig | None = None,
) -> StageProfile:
    """Rank function: every stage's step time, peak memory per phase and when it communicates.

    Each rank trains every stage on a per-rank micro-batch of ``micro_batch`` sequences (global
    batch ``micro_batch · N``). ``bucket_cap_mb`` is small so that ZeRO-1/2 cut the flat buffer
    into several buckets: stage 2 then reduce-scatters bucket by bucket *during* backward.

    * ``step_s[stage]``: median over ``rounds`` interleaved rounds (``common.race``: every stage
      once per round, max over ranks); 0 rounds skips timing;
    * ``peak[stage][phase]``: the largest bytes held during forward / backward / step, split into
      model states, transient (stage-2 staging, stage-3 gathered weights) and live activations
      (:class:`_Sampler`); ``after_backward`` / ``after_step``: the same split at those moments;
    * ``calls[stage][phase]``: collectives issued per phase, e.g. ``{"reduce_scatter": 4}``;
    * ``activation_bytes[stage]``: bytes saved for backward, held at the end of forward (weights
      excluded: they are model states, or stage 3's transient gathered units).

    The measured step is written out phase by phase (not through ``train_step``): the sampler
    and the collective counts switch phase between forward, backward and step.
    """
    config = config or zero_config()
    world, dev = dist.get_world_size(), device()
    built = {}
    for s in stages:
        model = GPT(config, seed=0).to(dev)
        built[s] = (model, *_build(s, model, dev, bucket_cap_mb))
    x, y = step_batch(0, config, micro_batch * world, dev)
    xl, yl = (
        t.clone() for t in shard_batch(x, y)
    )  # the rank's own micro-batch, as a data loader delivers it

    def one_step(s):
        _model, wrapped, opt = built[s]
        train_step(wrapped, opt, xl, yl)

    for s in stages:  # AdamW's state exists after the first step
        one_step(s)
    step_s = (
        median_times(race({s: (lambda s=s: one_step(s)) for s in stages}, rounds)) if rounds else {}
    )
    peak, calls, acts = {}, {}, {}
    for s in stages:
        model, wrapped, opt = built[s]
        sampler = _Sampler(s, model, wrapped, opt)
        calls[s] = {}
        opt.zero_grad(set_to_none=True)
        with (
            comm.CommLog() as log_f,
            torch.autograd.graph.saved_tensors_hooks(sampler.pack, lambda t: t),
        ):
            _, loss = wrapped(xl, yl)
        sampler.sample()
        acts[s] = sampler.last[
            "activations"
        ]  # saved for backward, still held at the end of forward
        sampler.phase = "backward"
        with comm.CommLog() as log_b:
            loss.backward()
        sampler.sample()
        sampler.phase = "after backward"
        sampler.sample()
        sampler.phase = "step"
        with comm.CommLog() as log_s:
            opt.step()
        sampler.sample()
        sampler.phase = "after step"
        sampler.sample()
        sampler.remove()
        for phase, log in (("forward", log_f), ("backward", log_b), ("step", log_s)):
            calls[s][phase] = {}
            for rec in log.records:
                if rec.tag in ("grad", "param"):
                    calls[s][phase][rec.op] = calls[s][phase].get(rec.op, 0) + 1
        peak[s] = sampler.peak
    profile = StageProfile(
        world_size=world,
        micro_batch=micro_batch,
        step_s=step_s,
        peak=peak,
        calls=calls,
        activation_bytes=acts,
        psi=built[stages[0]][0].num_params(),
        units=built[3][1].unit_table() if 3 in built else None,
        buckets_stage1=len(built[1][2].buckets) if 1 in built else None,
        buckets_stage2=len(built[2][2].buckets) if 2 in built else None,
        formula={s: _formula_bytes(s, built[s], world) for s in stages},
        title=f"ZeRO stages {', '.join(map(str, stages))}: one step at N = {world}, "
        f"micro-batch {micro_batch}",
    )
    _profile_rows(profile)
    return profile


# --------------------------------------------------------------------------- step time under the clock

TIMED_STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


class StepTimes(NamedTuple):
    """:func:`zero_step_times`' result: the stages timed on both clocks, and the α–β it priced with."""

    clocked: object  # timing.Timings under the modelled clock, a row per prediction
    predicted: dict  # {stage: step_time.Prediction}
    links: object  # step_time.AlphaBeta the predictions used: α after idling, β the sweep's
    alpha_back_to_back: dict  # {op: s} the sweep's α: calls back to back (chapter 00's kind)
    alpha_after_idle: dict  # {op: s} collectives.idle_alpha: each call after a sleep
    real: object  # timing.Timings of the same steps on the real clock (None: real_rounds=0)


def zero_step_times(
    rounds: int = 3,
    batch: int = 2,
    ratio: float = 20.0,
    config: GPTConfig | None = None,
    bucket_cap_mb: float = 0.2,
    real_rounds: int = 5,
    real_steps: int = 2,
) -> StepTimes:
    """Rank function: each stage's step under the modelled accelerator clock, against the model.

    The chapter's model with 4 blocks (``zero_config(n_layer=4)``; ``bucket_cap_mb`` 0.2: about
    one block per bucket), ``batch`` sequences per rank. α–β fitted on the spot: β from a short
    sweep; α per op the larger of the sweep's (1 KiB calls back to back, the smallest median:
    ``step_time.fit_alpha_beta``, as chapter 00 fits it) and ``collectives.idle_alpha``'s (the
    median 1 KiB call issued after a 5 ms sleep, averaged over the ranks: gloo's worker thread
    and the peer are woken first, as a collective after a clock sleep is); a clock rate at which
    every block sleeps ≥ ``ratio`` × 2 its real compute; then bucketed DDP, ZeRO-1, ZeRO-2
    (``ZeroOptimizer``) and ZeRO-3 with prefetch (``Zero3``), each predicted by
    :func:`course_lib.step_time.ddp_step` / ``zero_step`` / ``zero3_step`` from what the object
    really holds (its buckets, its units) and timed in interleaved rounds
    (:func:`course_lib.timing.time_steps`); the Timings' rows: each median within
    ``AGREEMENT_BAND`` of its prediction. Then the same step objects once more with the clock
    paused (the real clock: ``real_rounds`` rounds of ``real_steps`` steps), beside one rank's
    model stepping alone ("no communication"). Returns :class:`StepTimes`.
    """
    from .. import step_time as st
    from ..clock import AcceleratorClock, calibrate, costed_parts
    from ..timing import time_steps
    from .collectives import bandwidth_benchmark, idle_alpha

    rank, world = dist.get_rank(), dist.get_world_size()
    config = config or zero_config(n_layer=4)
    dev = device()
    ops = ("all_reduce", "all_gather", "reduce_scatter")
    # β from three sizes ≥ 1 MiB (one point let a noisy 1 MiB call fit β ≈ ∞), α from 1 KiB
    sizes = (2**10, 2**16, 2**20, 2**21, 2**22)
    rows = bandwidth_benchmark(sizes, ops=ops, iters=3, warmup=1, repeats=3)
    fit = st.fit_alpha_beta(rows)
    idle = idle_alpha()
    alpha = {op: max(a, idle.get(op, a)) for op, a in fit.alpha_s.items()}
    ab = st.AlphaBeta(alpha, fit.beta_bytes_per_s, fit.world_size, fit.min_bytes, fit.points)

    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g).to(dev)
    y = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g).to(dev)
    rate = torch.tensor([calibrate(GPT(config).to(dev), x, y, ratio=ratio).rate], device=dev)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)  # one rate for every rank
    clock = AcceleratorClock(float(rate.item()))
    steps, predicted = {}, {}

    def clocked():
        model = GPT(config).to(dev)
        clock.apply(model)
        fwd = st.part_seconds(st.part_flops(model, x, y), clock.rate)
        owner, order = st.param_parts(model), [n for n, _, _ in costed_parts(model)]
        return model, fwd, lambda ps: min((owner[p] for p in ps), key=order.index)

    model, fwd, ready = clocked()
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    steps["DDP"] = lambda m=ddp, o=opt: train_step(m, o, x, y)
    by_name = dict(model.named_parameters())
    buckets = [[by_name[n] for n in names] for names in ddp.buckets]
    buckets = [(sum(p.numel() * 4 for p in ps), ready(ps)) for ps in buckets]
    predicted["DDP"] = st.ddp_step(fwd, buckets, ab, world)
    for stage in (1, 2):
        model, fwd, ready = clocked()
        opt = ZeroOptimizer(
            model.parameters(), torch.optim.SGD, stage, bucket_cap_mb=bucket_cap_mb, lr=1e-3
        )
        steps[f"ZeRO-{stage}"] = lambda m=model, o=opt: train_step(m, o, x, y)
        buckets = [(b.numel * 4, ready(b.params)) for b in opt.buckets]
        predicted[f"ZeRO-{stage}"] = st.zero_step(
            stage, fwd, buckets, ab, world, used_flags=len(opt.params)
        )
    model, fwd, _ = clocked()
    z3 = Zero3(model, prefetch=True)
    opt = torch.optim.SGD(z3.parameters(), lr=1e-3)
    steps["ZeRO-3"] = lambda m=z3, o=opt: train_step(m, o, x, y)
    names = [n for n, _ in fwd]
    units = []
    for row in z3.unit_table():
        if row["root"]:
            units.insert(
                0,
                (
                    row["name"],
                    row["gathered_bytes"],
                    [n for n in names if not n.startswith("blocks.")],
                ),
            )
        else:
            mine = [n for n in names if any(p.startswith(n + ".") for p in row["params"])]
            units.append((row["name"], row["gathered_bytes"], mine))
    units[1:] = sorted(units[1:], key=lambda u: names.index(u[2][0]))
    predicted["ZeRO-3"] = st.zero3_step(fwd, units, ab, world, prefetch=True)
    timings = time_steps(
        steps,
        rounds=rounds,
        clock=clock,
        predicted={n: p.total for n, p in predicted.items()},
        title=f"one step per stage, N = {world}: measured under the clock vs the step-time model",
    )
    real = None
    if real_rounds:
        alone = GPT(config).to(dev)
        clock.apply(alone)
        sgd = torch.optim.SGD(alone.parameters(), lr=1e-3)
        steps["no communication"] = lambda m=alone, o=sgd: train_step(m, o, x, y)
        with clock.paused():  # nothing sleeps: the same steps in real time
            real = time_steps(
                steps,
                rounds=real_rounds,
                steps_per_round=real_steps,
                clock=clock,
                title=f"one step per stage, N = {world}: the same steps on the real clock",
            )
    return StepTimes(timings, predicted, ab, dict(fit.alpha_s), idle, real)
