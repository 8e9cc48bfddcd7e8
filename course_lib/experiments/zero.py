"""Chapter 03's measurements: each ZeRO stage's bytes held and sent against the formulas, clipping and resume.

Rank functions (run them with ``launch.spawn``): :func:`zero_stage_report` (one stage: memory vs
formula, communication vs 2Ψ/3Ψ, activations, equality with one device) and
:func:`zero_clip_and_resume`. Accounting helpers, usable in any rank function:
:func:`model_state_accounting` (bytes held) and :func:`comm_accounting` (bytes sent).
"""
from __future__ import annotations

import io

import torch
import torch.distributed as dist

from .. import comm
from ..ddp import DDP
from ..formulas import zero_model_state_breakdown
from ..launch import device
from ..memory import SavedTensorMeter, model_state_bytes
from ..models import GPT, GPTConfig
from ..zero import ZeroOptimizer
from ..zero3 import Zero3
from .common import OPTIMIZERS, check_global_batch, make_optimizer, shard_batch, state_diff, step_batch, zero_config

__all__ = ["zero_config", "model_state_accounting", "comm_accounting", "zero_stage_report", "zero_clip_and_resume"]


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
        stage, n, psi, psi_pad = optimizer.stage, optimizer.world_size, optimizer.numel, optimizer.padded_numel
        # the segments' .grad are this rank's gradient slices: count them as "grads"
        measured = model_state_bytes(optimizer.params + [s.param for s in optimizer.segments], optimizer.optimizer,
                                     extra=list(optimizer.held_tensors()) + list(extra))
    elif isinstance(model, Zero3):
        stage, n, psi, psi_pad = 3, model.world_size, model.numel, model.padded_numel
        measured = model_state_bytes(list(model.parameters()), optimizer,
                                     extra=list(model.held_tensors()) + list(extra))
    else:
        params = list(model.parameters())
        stage, psi = 0, sum(p.numel() for p in params)
        psi_pad = psi
        n = dist.get_world_size() if dist.is_initialized() else 1
        measured = model_state_bytes(params, optimizer, extra=list(extra))
    breakdown = zero_model_state_breakdown(psi_pad, n, stage, precision="fp32")
    return dict(stage=stage, world_size=n, psi=psi, psi_pad=psi_pad, measured=measured, formula=breakdown["total"],
                formula_breakdown=breakdown, ratio=measured["total"] / breakdown["total"])


def comm_accounting(log: comm.CommLog, wrapper, steps: int = 1) -> dict:
    """Bytes one rank sent per step (ring model), against ``(N−1)/N · c · Ψ · 4`` bytes.

    ``log`` recorded ``steps`` full training steps; only tags ``"param"`` and ``"grad"``
    count (not the one-time ``"init"`` broadcast or the tiny ``"used"``/``"norm"`` all-reduces).
    c = 2 for ZeRO-1/2 (reduce-scatter + all-gather = one all-reduce, as DDP) and 3 for ZeRO-3
    (an extra all-gather in backward). ``wrapper`` is the :class:`ZeroOptimizer` or :class:`Zero3`.
    The formula assumes fp32 traffic; with ``compute_dtype`` 16-bit the gathers are half.
    """
    if isinstance(wrapper, ZeroOptimizer):
        stage, c = wrapper.stage, 2
    elif isinstance(wrapper, Zero3):
        stage, c = 3, 3
    else:
        raise TypeError(f"wrapper must be a ZeroOptimizer or Zero3, got {type(wrapper).__name__}")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    n, psi_pad = wrapper.world_size, wrapper.padded_numel
    sent = (log.total("ring_bytes", tag="param") + log.total("ring_bytes", tag="grad")) / steps
    formula = (n - 1) / n * c * psi_pad * 4
    return dict(stage=stage, world_size=n, psi_pad=psi_pad, sent_per_step=sent, formula=formula,
                ratio=sent / formula if formula else float("nan"))



def _adamw_kwargs() -> dict:
    return dict(OPTIMIZERS["adamw"][1])


def zero_stage_report(stage: int, steps: int = 3, global_batch: int = 8, config: GPTConfig | None = None,
                      zero3_unit: str = "block") -> dict:
    """Rank function: train ``steps`` AdamW steps at ZeRO ``stage`` (0 = DDP) and measure everything.

    Returns, for this rank: model-state bytes measured vs the fp32 formula (after the last step,
    before ``zero_grad``), the last step's communication (Σ ring bytes of tags "grad" and "param"
    ÷ ((N−1)/N · c · Ψ_pad · 4), c = 2 for stages 0–2 and 3 for stage 3), the activation bytes
    autograd saved in the last forward (ZeRO does not shard them), the loss curve and max|Δparam|
    against one device trained on the full batches. ``zero3_unit``: ``Zero3``'s ``unit`` at stage 3
    ("block": one all-gather per block + root, the default; "param": one per parameter and use).
    """
    config = config or zero_config()
    world, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, world)
    model = GPT(config, seed=0).to(dev)
    if stage == 0:
        wrapped = DDP(model, bucket_cap_mb=None)  # per-parameter all-reduce in place: no bucket copies
        opt = make_optimizer("adamw", wrapped.parameters())
    elif stage in (1, 2):
        wrapped = model
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **_adamw_kwargs())
    elif stage == 3:
        wrapped = Zero3(model, unit=zero3_unit)
        opt = make_optimizer("adamw", wrapped.parameters())
    else:
        raise ValueError(f"stage={stage} is not one of 0 (DDP), 1, 2, 3")
    reference = GPT(config, seed=0).to(dev)
    ref_opt = make_optimizer("adamw", reference.parameters())
    losses = []
    for step in range(steps):
        x, y = step_batch(step, config, global_batch, dev)
        opt.zero_grad(set_to_none=True)
        with comm.CommLog() as log:
            with SavedTensorMeter(exclude=list(wrapped.parameters()) + list(model.parameters())) as meter:
                _, loss = wrapped(*shard_batch(x, y))
                activation_bytes = meter.live_bytes()  # held at the end of forward
            loss.backward()
            opt.step()
        losses.append(loss.item())
        ref_opt.zero_grad(set_to_none=True)
        reference(x, y)[1].backward()
        ref_opt.step()
    acct = model_state_accounting(wrapped if stage in (0, 3) else model, opt)
    if stage == 0:
        c = 2
        psi = acct["psi_pad"]
        sent = log.total("ring_bytes", tag="grad") + log.total("ring_bytes", tag="param")
        comm_ratio = sent / ((world - 1) / world * c * psi * 4) if world > 1 else float("nan")
    else:
        comm_ratio = comm_accounting(log, opt if stage in (1, 2) else wrapped)["ratio"]
    full = wrapped.full_state_dict() if stage == 3 else dict(model.state_dict())
    return {"stage": stage, "world_size": world, "psi": acct["psi"], "psi_pad": acct["psi_pad"],
            "measured": acct["measured"], "formula": acct["formula"], "formula_breakdown": acct["formula_breakdown"],
            "ratio": acct["ratio"], "comm_ratio": comm_ratio, "comm": log.summary(),
            "activation_bytes": activation_bytes, "losses": losses, "max_abs_diff": state_diff(full, reference)}


def zero_clip_and_resume(stage: int = 2, steps: int = 6, resume_at: int = 3, max_norm: float = 0.5,
                         global_batch: int = 8, config: GPTConfig | None = None) -> dict:
    """Rank function: ZeRO-``stage`` (1 or 2) with gradient clipping, checkpointed and resumed mid-run.

    Three runs on the same data: one device with ``torch.nn.utils.clip_grad_norm_`` (the
    reference), ZeRO uninterrupted, and ZeRO saved at ``resume_at`` (weights + every
    partition's optimizer state through ``torch.save``), rebuilt from a *different* init, loaded
    and continued. Returns the gradient norms ZeRO computed (the true global norm, from an
    all-reduce of squared partial norms) next to the reference's, and max|Δparam| of both runs.
    """
    from .common import reference_run

    config = config or zero_config()
    dev = device()
    check_global_batch(global_batch, dist.get_world_size())
    reference, _, ref_norms = reference_run(config, steps, global_batch, "adamw", max_norm=max_norm, dev=dev)

    def run(resume: bool):
        model = GPT(config, seed=0).to(dev)
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **_adamw_kwargs())
        norms = []
        for step in range(steps):
            if resume and step == resume_at:
                blob = io.BytesIO()
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, blob)
                blob.seek(0)
                saved = torch.load(blob, weights_only=True)
                model = GPT(config, seed=123).to(dev)  # different weights: the checkpoint must restore everything
                model.load_state_dict(saved["model"])
                opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **_adamw_kwargs())
                opt.load_state_dict(saved["optim"])
            x, y = step_batch(step, config, global_batch, dev)
            opt.zero_grad(set_to_none=True)
            model(*shard_batch(x, y))[1].backward()
            norms.append(opt.clip_grad_norm_(max_norm).item())
            opt.step()
        return model, norms

    straight, norms = run(resume=False)
    resumed, _ = run(resume=True)
    return {"stage": stage, "norms": norms, "reference_norms": ref_norms,
            "max_abs_diff_uninterrupted": state_diff(straight, reference),
            "max_abs_diff_resumed": state_diff(resumed, reference),
            "resumed_equals_uninterrupted": all(torch.equal(v, straight.state_dict()[k])
                                                for k, v in resumed.state_dict().items())}


# --------------------------------------------------------------------------- time and peak memory per stage


def _build_stage(stage: int, config: GPTConfig, dev, bucket_cap_mb: float):
    """(model, wrapped, optimizer) for ZeRO ``stage`` (0 = DDP), as in :func:`zero_stage_report`."""
    model = GPT(config, seed=0).to(dev)
    if stage == 0:
        wrapped = DDP(model, bucket_cap_mb=None)
        return model, wrapped, make_optimizer("adamw", wrapped.parameters())
    if stage in (1, 2):
        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, bucket_cap_mb=bucket_cap_mb,
                            **_adamw_kwargs())
        return model, model, opt
    wrapped = Zero3(model)
    return model, wrapped, make_optimizer("adamw", wrapped.parameters())


class _Sampler:
    """Bytes held, by category, sampled from hooks: model states, transient comm buffers, live activations.

    * model states — parameters, their ``.grad``, optimizer state and the wrapper's persistent buffers;
    * transient — ZeRO-2's gradient staging buckets (filling, or in flight in a reduce-scatter) and
      ZeRO-3's gathered full weights (``Zero3.held_tensors``);
    * activations — tensors saved for backward and not yet freed (weak references, so counting
      does not keep them alive).
    Samples are taken after every module's forward, as every gradient is accumulated, and at the
    phase boundaries; ``peak[phase]`` keeps the largest total per phase with its breakdown.
    """

    def __init__(self, stage, model, wrapped, opt):
        import weakref

        self.stage, self.model, self.wrapped, self.opt = stage, model, wrapped, opt
        self.phase, self.peak, self._saved, self._weakref = "forward", {}, [], weakref.ref
        leaves = list(wrapped.parameters()) if stage in (0, 3) else list(model.parameters())
        self._hooks = [m.register_forward_hook(lambda *_: self.sample()) for m in model.modules()]
        self._hooks += [p.register_post_accumulate_grad_hook(lambda _p: self.sample()) for p in leaves
                        if p.requires_grad]
        self.leaves = leaves

    def _pack(self, t):
        self._saved.append(self._weakref(t))
        return t

    def _groups(self) -> dict:
        opt, stage = self.opt, self.stage
        params = self.leaves
        states = params + [p.grad for p in params if p.grad is not None]
        transient = []
        if stage in (1, 2):
            staging = list(opt._staging.values()) + [t for _b, _w, out, st in opt._inflight for t in (out, st)]
            states += [t for t in opt.held_tensors() if not any(t is s for s in staging)]
            states += [s.param for s in opt.segments] + [s.param.grad for s in opt.segments if s.param.grad is not None]
            states += list(_tensors(opt.optimizer.state))
            transient = staging
        else:
            states += list(_tensors(opt.state))
            if stage == 3:
                transient = self.wrapped.held_tensors()
        acts = [t for t in (r() for r in self._saved) if t is not None]
        return {"model states": states, "transient": transient, "activations": acts}

    def sample(self) -> None:
        from ..memory import unique_storage_bytes

        snap = self.last = unique_storage_bytes(self._groups())
        snap["total"] = sum(snap.values())
        if snap["total"] > self.peak.get(self.phase, {"total": -1})["total"]:
            self.peak[self.phase] = snap

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _tensors(obj):
    from ..memory import tensors_in

    return tensors_in(obj)


def zero_stage_profile(stages=(0, 1, 2, 3), micro_batch: int = 4, rounds: int = 5, bucket_cap_mb: float = 0.05,
                       config: GPTConfig | None = None) -> dict:
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
    """
    from .common import median_times, race

    config = config or zero_config()
    world, dev = dist.get_world_size(), device()
    built = {s: _build_stage(s, config, dev, bucket_cap_mb) for s in stages}
    x, y = step_batch(0, config, micro_batch * world, dev)
    xl, yl = (t.clone() for t in shard_batch(x, y))  # the rank's own micro-batch, as a data loader delivers it

    def one_step(s):
        _model, wrapped, opt = built[s]
        opt.zero_grad(set_to_none=True)
        wrapped(xl, yl)[1].backward()
        opt.step()

    for s in stages:  # AdamW's state exists after the first step
        one_step(s)
    step_s = median_times(race({s: (lambda s=s: one_step(s)) for s in stages}, rounds)) if rounds else {}
    peak, calls, acts = {}, {}, {}
    for s in stages:
        model, wrapped, opt = built[s]
        sampler = _Sampler(s, model, wrapped, opt)
        calls[s] = {}
        opt.zero_grad(set_to_none=True)
        with comm.CommLog() as log_f, torch.autograd.graph.saved_tensors_hooks(sampler._pack, lambda t: t):
            _, loss = wrapped(xl, yl)
        sampler.sample()
        acts[s] = sampler.last["activations"]  # saved for backward, still held at the end of forward
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
    out = {"world_size": world, "micro_batch": micro_batch, "step_s": step_s, "peak": peak, "calls": calls,
           "activation_bytes": acts, "psi": built[stages[0]][0].num_params()}
    if 3 in built:
        out["units"] = built[3][1].unit_table()
    for s in (1, 2):
        if s in built:
            out[f"buckets_stage{s}"] = len(built[s][2].buckets)
    return out


__all__ += ["zero_stage_profile"]
