"""Chapter 04's measurements: FSDP2 trains like one device, next to our Zero3, in bf16, through a checkpoint.

Rank functions for the notebook (run them with ``launch.spawn``). Each returns an
:class:`FSDPResult`: the checked rows (``print(result)``, ``result.passed``) and, under
``result["key"]``, the numbers the notebook prints and the tests recompute:

* :func:`fsdp2_vs_single_device` — FSDP2 trains like one device on the whole batch;
* :func:`fsdp2_vs_zero3` — memory, step time and collectives of FSDP2 and our ``Zero3``;
* :func:`fsdp2_mixed_precision` — bf16 compute, fp32 shards and reductions;
* :func:`fsdp2_checkpoint_roundtrip` — sharded checkpoint with DCP; resume is bit-exact;
* :func:`fsdp2_load_checkpoint` — load that checkpoint at another world size (DCP reshards).

Pieces, usable in any rank function: :func:`fsdp2_train` (an FSDP2 model trained on each rank's
slice), :func:`fsdp2_model_state_accounting` (bytes held vs 16Ψ_pad/N), ``fsdp.full_training_state``
(model and optimizer state as full tensors, flat keys). The model is :func:`common.zero_config`'s
(Ψ = 128,835, odd sizes), so FSDP2's row padding and ``Zero3``'s element padding both happen.
"""

from __future__ import annotations

import hashlib
import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import CommLog
from ..formulas import zero_model_state_breakdown
from ..fsdp import (
    fsdp2_wrap,
    full_state_dict,
    full_training_state,
    load_sharded_checkpoint,
    padded_numel,
    save_sharded_checkpoint,
)
from ..fsdp_meters import GatheredParamMeter, counted_step
from ..launch import device
from ..memory import model_state_bytes
from ..models import GPT, GPTConfig
from ..results import ADAMW, BF16, EXACT, Measured, for_optimizer
from .common import (
    check_global_batch,
    make_optimizer,
    max_abs_diff,
    mean_over_ranks,
    median_times,
    race,
    reference_run,
    shard_batch,
    step_batch,
    train_step,
    zero_config,
)

__all__ = [
    "FSDPResult",
    "digest",
    "fsdp2_train",
    "fsdp2_model_state_accounting",
    "fsdp2_vs_single_device",
    "fsdp2_vs_zero3",
    "fsdp2_mixed_precision",
    "fsdp2_checkpoint_roundtrip",
    "fsdp2_load_checkpoint",
]


@dataclass
class FSDPResult(Measured):
    """Checked rows plus the measured numbers, read as ``result["key"]`` (what the notebook prints)."""


# =========================================================================== pieces


def fsdp2_train(
    steps: int = 10,
    optimizer: str = "adamw",
    reshard_after_forward: bool = True,
    config: GPTConfig | None = None,
    global_batch: int = 8,
    shard=shard_batch,
):
    """An FSDP2 model (``GPT(seed=0)``) trained ``steps`` steps; rank r sees ``shard(x, y)`` of step k's batch.

    Returns ``(model, local_losses)``: each step's loss on this rank's slice. ``shard`` is
    :func:`common.shard_batch` (rank r's ``1/N``); a test passes another to show what goes wrong.
    """
    config = config or zero_config()
    check_global_batch(global_batch, dist.get_world_size())
    dev = device()
    model = fsdp2_wrap(GPT(config, seed=0).to(dev), reshard_after_forward=reshard_after_forward)
    opt = make_optimizer(optimizer, model.parameters())
    losses = [
        train_step(model, opt, *shard(*step_batch(step, config, global_batch, dev)))
        for step in range(steps)
    ]
    return model, losses


def fsdp2_model_state_accounting(model, optimizer) -> dict:
    """Per-rank model-state bytes of an FSDP2 model, measured, against 16Ψ_pad/N (fp32 AdamW).

    Same fields as :func:`course_lib.experiments.zero.model_state_accounting`. Measured from real tensors
    (``memory.model_state_bytes``: each DTensor counts its local shard's storage). Call after
    ``step()`` and before ``zero_grad()``. What FSDP2 keeps on a rank:

    * params: each parameter's padded shard, ⌈d/N⌉ rows (4Ψ_pad/N);
    * grads: one reduce-scatter output per unit, each gradient a view into it (4Ψ_pad/N);
    * optimizer: ``zeros_like`` of the *unpadded* local shard (exp_avg, exp_avg_sq: ≤ 8Ψ_pad/N —
      the last rank's short shards hold less) and a 0-d ``step`` per parameter.
    """
    n = dist.get_world_size()
    psi = sum(p.numel() for p in model.parameters())
    psi_pad = padded_numel(model, n)
    measured = model_state_bytes(list(model.parameters()), optimizer)
    breakdown = zero_model_state_breakdown(psi_pad, n, 3, precision="fp32")
    return dict(
        stage=3,
        world_size=n,
        psi=psi,
        psi_pad=psi_pad,
        measured=measured,
        formula=breakdown["total"],
        formula_breakdown=breakdown,
        ratio=measured["total"] / breakdown["total"],
    )


def digest(state: dict) -> dict[str, str]:
    """A short SHA-256 per tensor (exact bytes, any dtype) — compare checkpoints across spawns by value."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            raw = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            out[k] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]
    return out


# =========================================================================== FSDP2 == one device


def fsdp2_vs_single_device(
    steps: int = 10,
    optimizer: str = "adamw",
    reshard_after_forward: bool = True,
    config: GPTConfig | None = None,
    global_batch: int = 8,
) -> FSDPResult:
    """Rank function: FSDP2 on N ranks vs one device on the full batch, same init, same data.

    Each step rank r trains on its ``global_batch / N`` slice; the reference
    (:func:`common.reference_run`, on this rank) sees the whole batch. FSDP2 averages the
    gradients over ranks in its reduce-scatter, so the update is the full-batch update up to
    float rounding. Compared after ``steps`` steps on full tensors (``fsdp.full_state_dict``),
    within the optimizer's named tolerance (``results.SGD`` / ``results.ADAMW``). Also returns the
    trained weights (``full_state``, on CPU) and each step's loss on this rank's slice
    (``local_losses``), for a check elsewhere. (``allclose_1e-5``: the older, fixed bound.)
    """
    from torch.distributed.tensor import DTensor

    config = config or zero_config()
    world, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, world)
    model, local = fsdp2_train(steps, optimizer, reshard_after_forward, config, global_batch)
    losses = [
        mean_over_ranks(v) for v in local
    ]  # mean of equal-sized slices' means = full-batch loss
    reference, ref_losses, _ = reference_run(config, steps, global_batch, optimizer, dev=dev)
    full, ref = full_state_dict(model), reference.state_dict()
    per_tensor = {k: (full[k] - ref[k]).abs().max().item() for k in ref}
    close = all(torch.allclose(full[k], ref[k], rtol=1e-5, atol=1e-5) for k in ref)
    params = list(model.named_parameters())
    tol = for_optimizer(optimizer)
    res = FSDPResult(
        title=f"FSDP2 vs one device, {optimizer}, reshard_after_forward={reshard_after_forward}"
    )
    res.equal(f"weights after {steps} steps", full, ref, tol, against="one device (full batch)")
    res.equal(
        "mean of the ranks' slice losses", losses, ref_losses, tol, against="one device's loss"
    )
    res.condition(
        "every parameter is a Shard(0) DTensor",
        sorted({str(p.placements) for _, p in params}),
        all(isinstance(p, DTensor) and str(p.placements) == "(Shard(dim=0),)" for _, p in params),
        "all parameters",
    )
    res.values = {
        "world_size": world,
        "optimizer": optimizer,
        "reshard_after_forward": reshard_after_forward,
        "steps": steps,
        "psi": sum(p.numel() for _, p in params),
        "max_abs_diff": max(per_tensor.values()),
        "max_abs_diff_per_tensor": per_tensor,
        "allclose_1e-5": close,
        "keys_match": sorted(full) == sorted(ref),
        "losses": losses,
        "reference_losses": ref_losses,
        "local_losses": local,
        "full_state": {k: v.cpu() for k, v in full.items()},
        "all_dtensor": all(isinstance(p, DTensor) for _, p in params),
        "placements": sorted({str(p.placements) for _, p in params}),
        "local_shapes": {n: tuple(p.to_local().shape) for n, p in params},
    }
    return res


# =========================================================================== FSDP2 vs our Zero3


def _logged_step(model, opt, x, y) -> tuple[CommLog, CommLog]:
    """One ``train_step`` under a ``CommLog``, split at the end of ``model``'s forward: (forward, backward+step)."""
    split = []
    handle = model.register_forward_hook(lambda m, a, o: split.append(len(log.records)))
    try:
        with CommLog() as log:
            train_step(model, opt, x, y)
    finally:
        handle.remove()
    forward, backward = CommLog(), CommLog()
    forward.records, backward.records = log.records[: split[0]], log.records[split[0] :]
    return forward, backward


def fsdp2_vs_zero3(
    steps: int = 3,
    config: GPTConfig | None = None,
    global_batch: int = 8,
    reshard_after_forward: bool = True,
) -> FSDPResult:
    """Rank function: FSDP2 and our ``Zero3`` on the same model and data — memory, time, collectives.

    1. One warm-up step each (FSDP2 initialises lazily on its first forward).
    2. ``steps`` timed rounds (:func:`common.race`): each round times one step of each, in
       alternating order, after a barrier, as the max over ranks. Reported: the median.
    3. One counted step each: ``Zero3``'s collectives from :class:`course_lib.comm.CommLog`,
       FSDP2's from :class:`course_lib.comm.CollectiveCounter` (``CommDebugMode``). Counted apart
       from the timing: a dispatch mode sees every operator and slows the step down.
    4. Model-state bytes after that step (before ``zero_grad``), against 16Ψ_pad/N — each with
       its own Ψ_pad (FSDP2 pads rows, ``Zero3`` elements).

    Bytes sent (ring, per rank) are compared with ``(N−1)/N · c · Ψ_pad · 4``, c = 3 (c = 2 for
    FSDP2 with ``reshard_after_forward=False``). Both gather by unit (each block, and the root with
    the tied embedding once per pass), so both send 3Ψ.
    """
    from dataclasses import asdict

    from ..zero3 import Zero3
    from .zero import model_state_accounting

    config = config or zero_config()
    world, dev = dist.get_world_size(), device()
    check_global_batch(global_batch, world)
    fsdp = fsdp2_wrap(GPT(config, seed=0).to(dev), reshard_after_forward=reshard_after_forward)
    zero3 = Zero3(GPT(config, seed=0).to(dev))
    opts = {
        "fsdp2": make_optimizer("adamw", fsdp.parameters()),
        "zero3": make_optimizer("adamw", zero3.parameters()),
    }
    counter = [0]

    def step(name):
        x, y = shard_batch(*step_batch(counter[0] % 8, config, global_batch, dev))
        counter[0] += 1
        return train_step(zero3 if name == "zero3" else fsdp, opts[name], x, y)

    times = race({"fsdp2": lambda: step("fsdp2"), "zero3": lambda: step("zero3")}, rounds=steps)
    step_s = median_times(times)

    # counted step, FSDP2: one CommDebugMode over the step, tagged forward / backward / step
    x, y = shard_batch(*step_batch(99, config, global_batch, dev))
    cc, _ = counted_step(fsdp, opts["fsdp2"], x, y)
    fsdp_mem = fsdp2_model_state_accounting(fsdp, opts["fsdp2"])
    # counted step, Zero3: our CommLog, split at the end of the forward
    log_f, log_b = _logged_step(zero3, opts["zero3"], x, y)
    zero_mem = model_state_accounting(zero3, opts["zero3"])

    n, units = world, len(fsdp.blocks) + 1
    ring = (n - 1) / n
    c_fsdp = 3 if reshard_after_forward else 2
    fsdp_sent = cc.total("ring_bytes", op="all_gather") + cc.total(
        "ring_bytes", op="reduce_scatter"
    )
    zero_sent = sum(
        log.total("ring_bytes", tag=t) for log in (log_f, log_b) for t in ("param", "grad")
    )
    debug_counts = {str(k): v for k, v in cc.get_comm_counts().items()}

    def side(mem, sent, c, colls, name):
        formula = ring * c * mem["psi_pad"] * 4
        return {
            "psi_pad": mem["psi_pad"],
            "memory": mem["measured"],
            "memory_formula": mem["formula"],
            "memory_ratio": mem["ratio"],
            "step_s": step_s[name],
            "step_s_rounds": times[name],
            "collectives": colls,
            "sent_per_step": sent,
            "comm_formula": formula,
            "comm_ratio": sent / formula if formula else float("nan"),
        }

    fsdp_colls = {
        op: {
            "forward": cc.count(op=op, tag="forward"),
            "backward": cc.count(op=op, tag="backward"),
            "tensor_bytes": cc.total("tensor_bytes", op=op),
        }
        for op in ("all_gather", "reduce_scatter")
    }
    zero_colls = {
        op: {
            "forward": log_f.count(op=op),
            "backward": log_b.count(op=op),
            "tensor_bytes": log_f.total(op=op) + log_b.total(op=op),
        }
        for op in ("all_gather", "reduce_scatter")
    }
    res = FSDPResult(title=f"FSDP2 vs our Zero3, reshard_after_forward={reshard_after_forward}")
    for name, colls, mem, sent, c in (
        ("FSDP2", fsdp_colls, fsdp_mem, fsdp_sent, c_fsdp),
        ("Zero3", zero_colls, zero_mem, zero_sent, 3),
    ):
        ag, rs = colls["all_gather"], colls["reduce_scatter"]
        backward_gathers = units if name == "Zero3" or reshard_after_forward else 0
        res.exact(f"{name} all-gathers in forward", ag["forward"], units, against="one per unit")
        res.exact(
            f"{name} all-gathers in backward",
            ag["backward"],
            backward_gathers,
            against="one per unit",
        )
        res.exact(f"{name} reduce-scatters", rs["backward"], units, against="one per unit")
        res.exact(
            f"{name} bytes sent per step",
            sent,
            ring * c * mem["psi_pad"] * 4,
            against=f"formula {c}·(N−1)/N·4Ψ_pad",
        )
        # within 3 %: AdamW's state covers the unpadded shard only (the last ranks hold less)
        res.within(
            f"{name} model states per rank",
            mem["measured"]["total"],
            mem["formula"],
            0.03,
            against="formula 16Ψ_pad/N",
        )
    out = {
        "world_size": n,
        "psi": zero_mem["psi"],
        "units": units,
        "reshard_after_forward": reshard_after_forward,
        "formula_16psi_over_n": 16 * zero_mem["psi"] / n,
        "fsdp2": side(fsdp_mem, fsdp_sent, c_fsdp, fsdp_colls, "fsdp2"),
        "zero3": side(zero_mem, zero_sent, 3, zero_colls, "zero3"),
        "fsdp2_comm_debug_counts": debug_counts,
        "fsdp2_collective_groups": sorted({(r.group, r.world_size) for r in cc.records}),
        "fsdp2_other_collectives": [
            asdict(r) for r in cc.records if r.op not in ("all_gather", "reduce_scatter")
        ],
    }
    out["memory_ratio_fsdp2_over_zero3"] = (
        fsdp_mem["measured"]["total"] / zero_mem["measured"]["total"]
    )
    out["step_time_ratio_fsdp2_over_zero3"] = out["fsdp2"]["step_s"] / out["zero3"]["step_s"]
    res.values = out
    return res


# =========================================================================== mixed precision


def fsdp2_mixed_precision(
    steps: int = 5, config: GPTConfig | None = None, global_batch: int = 8
) -> FSDPResult:
    """Rank function: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` vs fp32.

    Three runs on the same data, AdamW: FSDP2 in bf16, FSDP2 in fp32, one device in fp32 (the
    reference, :func:`common.reference_run`). What the policy does, measured:

    * the sharded parameters (what the optimizer steps) stay fp32 DTensors; so do their
      gradients and the optimizer state — the shards *are* the fp32 master weights;
    * before a unit runs, its shards are cast to bf16 and all-gathered in bf16: the module sees
      plain bf16 Parameters, computes in bf16, and the all-gathers move half the bytes;
    * the bf16 gradients are cast to fp32 before the reduce-scatter (``reduce_dtype``): the
      average over ranks is taken in fp32.

    Returns dtypes, all-gather / reduce-scatter bytes per step, the peak bytes of gathered
    parameters during forward (``fsdp_meters.GatheredParamMeter``; fp32 vs bf16: half), and the
    per-tensor relative error ‖p − p_ref‖ / ‖p_ref‖ of both FSDP2 runs against the fp32 reference.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    config = config or zero_config()
    world, dev = dist.get_world_size(), device()
    if world < 2:  # one rank gathers and reduces nothing: the byte ratios below would be 0 / 0
        raise ValueError(
            f"fsdp2_mixed_precision compares collective bytes: it needs world_size >= 2, got {world}"
        )
    check_global_batch(global_batch, world)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {
        "bf16": fsdp2_wrap(GPT(config, seed=0).to(dev), mp_policy=policy),
        "fp32": fsdp2_wrap(GPT(config, seed=0).to(dev)),
    }
    opts = {k: make_optimizer("adamw", m.parameters()) for k, m in runs.items()}

    seen = {}  # what a Linear inside block 0 sees while it runs (bf16 run)
    probe = runs["bf16"].blocks[0].attn.c_attn
    handle = probe.register_forward_pre_hook(
        lambda m, args: seen.update(
            weight_type=type(m.weight).__name__,
            weight_dtype=str(m.weight.dtype),
            input_dtype=str(args[0].dtype),
        )
    )

    out = {"world_size": world, "steps": steps, "losses": {}, "comm": {}, "peak_gathered_bytes": {}}
    logits_dtype, grad_dtypes = {}, {}
    for name, model in runs.items():
        batches = [
            shard_batch(*step_batch(step, config, global_batch, dev)) for step in range(steps)
        ]
        losses = [mean_over_ranks(train_step(model, opts[name], x, y)) for x, y in batches[:-1]]
        # the last step: collectives, gathered bytes, and the dtypes of the logits and the gradients
        hook = model.register_forward_hook(
            lambda m, a, o, name=name: logits_dtype.update({name: str(o[0].dtype)})
        )
        dtypes = lambda name=name, model=model: grad_dtypes.update(  # noqa: E731
            {name: sorted({str(p.grad.dtype) for p in model.parameters()})}
        )
        with GatheredParamMeter(model) as peak:
            cc, loss = counted_step(model, opts[name], *batches[-1], after_backward=dtypes)
        hook.remove()
        losses.append(mean_over_ranks(loss))
        out["peak_gathered_bytes"][name] = peak.peak
        out["comm"][name] = {
            op: {
                "calls": cc.count(op=op),
                "tensor_bytes": cc.total("tensor_bytes", op=op),
                "dtypes": sorted({r.dtype for r in cc.select(op=op)}),
            }
            for op in ("all_gather", "reduce_scatter")
        }
        out["losses"][name] = losses
    out["logits_dtype"], out["grad_dtypes"] = logits_dtype, grad_dtypes
    handle.remove()
    reference, out["losses"]["reference"], _ = reference_run(
        config, steps, global_batch, "adamw", dev=dev
    )

    bf16 = runs["bf16"]
    out["sharded_param_types"] = sorted({type(p).__name__ for p in bf16.parameters()})
    out["sharded_param_dtypes"] = sorted({str(p.dtype) for p in bf16.parameters()})
    out["local_shard_dtypes"] = sorted({str(p.to_local().dtype) for p in bf16.parameters()})
    out["optimizer_state_dtypes"] = sorted(
        {
            str(t.dtype)
            for s in opts["bf16"].state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        }
    )
    out["compute"] = seen
    out["all_dtensor"] = all(isinstance(p, DTensor) for p in bf16.parameters())
    ref = reference.state_dict()
    for name, model in runs.items():
        full = full_state_dict(model)
        rel = {k: ((full[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref}
        out.setdefault("rel_err", {})[name] = rel
        out.setdefault("max_rel_err", {})[name] = max(rel.values())
        out.setdefault("median_rel_err", {})[name] = statistics.median(rel.values())
    g, peak = out["comm"], out["peak_gathered_bytes"]
    for op, key in (("all_gather", "gather"), ("reduce_scatter", "reduce")):
        out[f"{key}_bytes_ratio_bf16_over_fp32"] = (
            g["bf16"][op]["tensor_bytes"] / g["fp32"][op]["tensor_bytes"]
        )
    out["peak_gathered_ratio_bf16_over_fp32"] = peak["bf16"] / peak["fp32"]
    res = FSDPResult(
        title="FSDP2 mixed precision: bf16 compute, fp32 shards and reductions", values=out
    )
    res.exact(
        "all-gather bytes bf16 / fp32",
        out["gather_bytes_ratio_bf16_over_fp32"],
        0.5,
        against="formula 2 / 4 bytes",
    )
    res.exact(
        "reduce-scatter bytes bf16 / fp32",
        out["reduce_bytes_ratio_bf16_over_fp32"],
        1.0,
        against="formula: reduce_dtype fp32",
    )
    res.exact(
        "peak gathered parameters bf16 / fp32",
        out["peak_gathered_ratio_bf16_over_fp32"],
        0.5,
        against="formula 2 / 4 bytes",
    )
    res.condition(
        "sharded parameters, gradients, optimizer state",
        out["optimizer_state_dtypes"],
        out["sharded_param_dtypes"] == out["optimizer_state_dtypes"] == ["torch.float32"]
        and grad_dtypes["bf16"] == ["torch.float32"],
        "all fp32",
    )
    res.equal(
        "fp32 FSDP2 weights", full_state_dict(runs["fp32"]), ref, ADAMW, against="one device (fp32)"
    )
    res.condition(
        "bf16 FSDP2 weights: max per-tensor ‖Δ‖/‖ref‖",
        out["max_rel_err"]["bf16"],
        out["max_rel_err"]["bf16"] < BF16.rtol,
        f"< {BF16}'s rtol",
        against="one device (fp32)",
    )
    return res


# =========================================================================== sharded checkpoints


def _build(config, seed: int, dev):
    model = fsdp2_wrap(GPT(config, seed=seed).to(dev))
    return model, make_optimizer("adamw", model.parameters())


def fsdp2_checkpoint_roundtrip(
    tmp_dir: str,
    steps: int = 4,
    resume_at: int = 2,
    config: GPTConfig | None = None,
    global_batch: int = 8,
) -> FSDPResult:
    """Rank function: sharded checkpoint with ``torch.distributed.checkpoint`` (DCP), resume, compare.

    Save at step ``resume_at`` (``fsdp.save_sharded_checkpoint``: ``get_state_dict`` → the DTensor shards under
    canonical keys → ``dcp.save``). Every rank writes *its own* shards (``__<rank>_0.distcp``) —
    nobody gathers the model — and the coordinator (rank 0) writes ``.metadata``: for every tensor,
    its global shape and which chunk (offsets, sizes) lies in which file. Loading
    (``fsdp.load_sharded_checkpoint``, keys and shapes checked first) is the mirror image, into a
    *fresh* model (another init) and optimizer:
    ``get_state_dict`` gives the layout to fill, ``dcp.load`` fills it in place, ``set_state_dict``
    puts it into the model and the optimizer.

    Because the metadata speaks of global chunks, the checkpoint loads at another world size too
    (:func:`fsdp2_load_checkpoint`) — unlike ``Zero3``'s per-rank optimizer files.

    Returns whether the resumed run equals the uninterrupted one bit for bit, the files and their
    sizes, where the shards of one weight went, a digest of the full saved state (to compare
    with a load at another world size), and two ways to a full state dict for single-device use:
    ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (collective; rank 0 gets the
    tensors) and ``dcp_to_torch_save`` (offline, no process group: one ``torch.save`` file).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    config = config or zero_config()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    check_global_batch(global_batch, world)
    if not 0 < resume_at < steps:
        raise ValueError(f"resume_at={resume_at} must be between 1 and steps-1={steps - 1}")
    path = os.path.join(os.fspath(tmp_dir), f"fsdp2_ckpt_w{world}_step{resume_at}")
    os.makedirs(path, exist_ok=True)

    def train(model, opt, first, last):
        for step in range(first, last):
            train_step(model, opt, *shard_batch(*step_batch(step, config, global_batch, dev)))

    straight, straight_opt = _build(config, 0, dev)
    train(straight, straight_opt, 0, steps)
    straight_sd = full_state_dict(straight)

    model, opt = _build(config, 0, dev)
    train(model, opt, 0, resume_at)
    saved = full_training_state(model, opt)
    save_sharded_checkpoint(model, opt, path)
    dist.barrier()  # every rank's file is complete before anyone reads the directory

    model, opt = _build(
        config, 123, dev
    )  # other weights, no optimizer state: all from the checkpoint
    fresh_differs = any(
        not torch.equal(v, saved["model." + k]) for k, v in full_state_dict(model).items()
    )
    load_sharded_checkpoint(model, opt, path)
    restored = full_training_state(model, opt)
    restored_equal = sorted(restored) == sorted(saved) and all(
        torch.equal(restored[k], saved[k]) for k in saved
    )
    train(model, opt, resume_at, steps)
    resumed_sd = full_state_dict(model)

    # a full state dict for one device, way 1: gathered to rank 0 (collective)
    rank0_sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    x, y = step_batch(0, config, global_batch, dev)
    with torch.no_grad():
        _, fsdp_loss = model(x, y)  # all-gathers inside: every rank runs it
    out = {
        "world_size": world,
        "steps": steps,
        "resume_at": resume_at,
        "path": path,
        "fresh_model_differed": fresh_differs,
        "restored_equals_saved": restored_equal,
        "resumed_equals_uninterrupted": all(
            torch.equal(resumed_sd[k], straight_sd[k]) for k in straight_sd
        ),
        "max_abs_diff": max_abs_diff(resumed_sd, straight_sd),
        "saved_digest": digest(saved),
        "rank0_full_state_dict_keys": len(rank0_sd),
        "fsdp_loss": fsdp_loss.item(),
        "psi": sum(p.numel() for p in model.parameters()),
    }
    if rank == 0:
        files = sorted(os.listdir(path))
        out["files"] = files
        out["file_bytes"] = {f: os.path.getsize(os.path.join(path, f)) for f in files}
        meta = FileSystemReader(path).read_metadata()
        keys = sorted(meta.state_dict_metadata)
        out["checkpoint_key_counts"] = {
            prefix: sum(k.startswith(prefix + ".") for k in keys)
            for prefix in ("model", "optim.state", "optim.param_groups")
        }
        # a tied weight is one parameter but two state_dict keys: DCP stores it under both
        out["tied_weight_keys"] = [
            k for k in keys if k in ("model.wte.weight", "model.lm_head.weight")
        ]
        entry = meta.state_dict_metadata["model.blocks.0.attn.c_attn.weight"]
        out["example_chunks"] = {
            "key": "model.blocks.0.attn.c_attn.weight",
            "global_shape": tuple(entry.size),
            "chunks": [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks],
        }
        plain = GPT(config, seed=7).to(dev)
        result = plain.load_state_dict(rank0_sd, strict=True)
        out["load_state_dict_ok"] = not result.missing_keys and not result.unexpected_keys
        with torch.no_grad():
            out["single_device_loss"] = plain(x, y)[1].item()
        out["rank0_full_equals_fsdp"] = all(
            torch.equal(rank0_sd[k].to(dev), resumed_sd[k]) for k in resumed_sd
        )
        # way 2: offline conversion of the DCP directory into one torch.save file (no process group)
        converted = os.path.join(os.fspath(tmp_dir), f"fsdp2_ckpt_w{world}_step{resume_at}.pt")
        dcp_to_torch_save(path, converted)
        offline = torch.load(converted, weights_only=True)
        out["torch_save_keys"] = sorted(offline)
        plain.load_state_dict(offline["model"], strict=True)
        out["torch_save_model_equals_saved"] = all(
            torch.equal(v.to(dev), saved["model." + k]) for k, v in plain.state_dict().items()
        )
    dist.barrier()
    res = FSDPResult(
        title=f"FSDP2 sharded checkpoint at world {world}, resumed at step {resume_at}", values=out
    )
    res.condition(
        "a fresh model (other init) differs before loading", fresh_differs, fresh_differs, "True"
    )
    res.condition(
        "model and AdamW state restored bit for bit",
        restored_equal,
        restored_equal,
        "True",
        against="the saved state",
    )
    res.equal(
        f"weights after resuming, at step {steps}",
        resumed_sd,
        straight_sd,
        EXACT,
        against="the uninterrupted run",
    )
    return res


def fsdp2_load_checkpoint(
    path: str, config: GPTConfig | None = None, saved_digest: dict | None = None
) -> FSDPResult:
    """Rank function: load a DCP checkpoint saved at *any* world size into a fresh FSDP2 model here.

    DCP reshards on load: each rank asks for the global slice its new shard covers, and the
    planner reads it from whichever files hold it. Returns the digest of the full loaded
    state (model and AdamW state) — equal to the saver's ``saved_digest`` when nothing was lost
    (pass it to check it here too).
    """
    config = config or zero_config()
    model, opt = _build(config, 123, device())
    load_sharded_checkpoint(model, opt, path)
    got = digest(full_training_state(model, opt))
    res = FSDPResult(
        title=f"DCP checkpoint loaded at world {dist.get_world_size()}",
        values={
            "world_size": dist.get_world_size(),
            "digest": got,
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
        },
    )
    if saved_digest is not None:
        same = sum(got.get(k) == v for k, v in saved_digest.items())
        res.condition(
            "SHA-256 of every loaded tensor",
            f"{same} of {len(saved_digest)} equal",
            got == saved_digest,
            "all equal",
            against="the saver's digest",
        )
    return res
