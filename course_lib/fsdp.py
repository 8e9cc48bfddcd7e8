"""Chapter 04 — FSDP2: torch's ZeRO-3, next to the one we wrote in chapter 03.

``torch.distributed.fsdp.fully_shard`` ("FSDP2") does what :class:`course_lib.zero3.Zero3` does —
every rank keeps 1/N of every parameter, gradient and optimizer state; full weights exist only
while a layer runs — with three engineering differences worth measuring:

==========================  =====================================  ==========================================
                            our ``Zero3``                          FSDP2 ``fully_shard``
==========================  =====================================  ==========================================
unit of communication       one parameter (one collective each,    one *wrapped module* (all its parameters
                            and one per use of a tied weight)      in one flat all-gather / reduce-scatter)
sharding                    flatten, pad to a multiple of N,       dim 0 like ``torch.chunk``, each shard
                            1-D shard                              padded to ⌈dim0/N⌉ rows; a ``DTensor``
                                                                   with placement ``Shard(0)``
what the optimizer sees     plain fp32 shard Parameters            the model's own parameters, now DTensors
mixed precision             ``compute_dtype``                      ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``
checkpoint                  full weights + one optim file / rank   ``torch.distributed.checkpoint``: every rank
                                                                   writes its own shards, reshardable on load
==========================  =====================================  ==========================================

The wrapping unit decides the communication pattern. ``fsdp2_wrap`` calls ``fully_shard`` on
every transformer block, then on the root (embeddings, final LayerNorm, tied output layer):
L + 1 units. Per training step and per unit FSDP2 then issues

* forward: **one all-gather** (the whole unit's parameters) before the unit runs;
* backward: **one all-gather** again (``reshard_after_forward=True``: the forward freed the
  gathered weights) and **one reduce-scatter** of the unit's gradients.

That is 3Ψ per step, like ZeRO-3 — in (L + 1) × 3 large messages instead of one small message
per parameter and per use. ``reshard_after_forward=False`` keeps each unit's gathered weights
from its forward until its backward: no backward all-gather (2Ψ, like ZeRO-2's traffic), but the
whole model is gathered at the end of the forward — ZeRO-2-like memory for parameters during the
step, while the optimizer state and the gradients stay sharded.

Rank functions for the notebook (run them with ``launch.spawn``; each returns plain numbers):

* :func:`fsdp2_vs_single_device` — FSDP2 trains like one device on the whole batch;
* :func:`fsdp2_vs_zero3` — memory, step time and collectives of FSDP2 and our ``Zero3``;
* :func:`fsdp2_mixed_precision` — bf16 compute, fp32 shards and reductions;
* :func:`fsdp2_checkpoint_roundtrip` — sharded checkpoint with DCP; resume is bit-exact;
* :func:`fsdp2_load_checkpoint` — load that checkpoint at another world size (DCP reshards).

Helpers: :func:`fsdp2_wrap`, :func:`padded_numel`, :func:`fsdp2_model_state_accounting`,
:class:`CollectiveCounter` (``CommDebugMode`` that also records bytes), :func:`full_state_dict`.
"""
from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode

from . import comm
from .data import make_batch
from .launch import device
from .formulas import zero_model_state_breakdown
from .memory import model_state_bytes
from .models import GPT, GPTConfig, equality_config

__all__ = ["fsdp_config", "fsdp2_wrap", "padded_numel", "full_state_dict", "fsdp2_model_state_accounting",
           "CollectiveCounter", "OPTIMIZERS", "fsdp2_vs_single_device", "fsdp2_vs_zero3", "fsdp2_mixed_precision",
           "fsdp2_checkpoint_roundtrip", "fsdp2_load_checkpoint"]

# Same optimizers as the ZeRO chapter's equality tests. AdamW's eps = 1e-6 instead of 1e-8: its
# first update is lr·g/(|g| + eps), and a gradient that is ~1e-8 by cancellation (one of the
# embedding's) turns fp32 rounding noise — which differs between a full-batch mean on one device
# and an average of per-rank means — into a 1e-5 weight difference. eps = 1e-6 leaves every
# ordinary update unchanged (median |g| ~ 5e-4) and keeps the comparison about FSDP, not about Adam.
OPTIMIZERS = {"sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1, eps=1e-6))}


def fsdp_config(**overrides) -> GPTConfig:
    """The ZeRO chapter's model, so numbers compare: bias-free, tied, Ψ = 128,835, odd tensor sizes.

    ``d_model = 63`` makes many dim-0 sizes odd, so FSDP2's per-row padding and ``Zero3``'s
    per-element padding both happen at N = 2 and 4.
    """
    return equality_config(**{"vocab_size": 512, "d_model": 63, "n_layer": 2, "n_head": 3, "block_size": 16,
                              **overrides})


# =========================================================================== wrapping


def fsdp2_wrap(model: nn.Module, mesh=None, reshard_after_forward: bool = True, mp_policy=None) -> nn.Module:
    """Shard ``model`` with FSDP2: ``fully_shard`` every block of ``model.blocks``, then the root.

    Why per block: ``fully_shard(m)`` makes *one* communication group of ``m``'s parameters
    that are not already in a group of a submodule — all-gathered in one collective before
    ``m`` runs and reduce-scattered in one after its backward. Wrapping bottom-up (blocks first)
    makes each block a unit and leaves the root with what is left (embeddings, ``ln_f``, the
    tied ``lm_head``). Only the root would mean one all-gather of the whole model: no memory
    saved while it runs. The unit is the trade-off knob — bigger units, fewer and larger
    messages, more memory gathered at once.

    ``reshard_after_forward`` applies to every unit, the root included. ``True`` (ZeRO-3): free a
    unit's gathered weights after its forward and all-gather them again in backward.
    ``False``: keep them until the unit's backward (no second all-gather; ZeRO-2-like traffic
    and parameter memory). torch's own default (``None``) is ``True`` for blocks and ``False``
    for the root, whose weights (``lm_head``) are needed first in backward anyway; we pass the
    same value to every unit so that the counts are exactly "one all-gather per unit per pass".

    ``mesh``: a 1-D ``DeviceMesh`` over all ranks of the launcher's process group; by default
    ``init_device_mesh(launch.device().type, (world_size,))`` — "cpu" (gloo) or "cuda" (nccl).
    ``mp_policy``: a ``MixedPrecisionPolicy`` or None (fp32). The model is modified in place
    (its classes become ``FSDP<Class>``, its parameters DTensors ``Shard(0)``) and returned.
    Build the optimizer *after* wrapping: it must see the sharded parameters.
    """
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if not isinstance(model, nn.Module):
        raise TypeError(f"fsdp2_wrap wraps an nn.Module, got {type(model).__name__}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) or len(blocks) == 0:
        found = "no .blocks" if blocks is None else f".blocks of type {type(blocks).__name__}" + \
            (f" and length {len(blocks)}" if hasattr(blocks, "__len__") else "")
        raise TypeError(f"fsdp2_wrap needs a model whose transformer blocks are in a non-empty `model.blocks` "
                        f"(nn.ModuleList): each block becomes one FSDP unit; {type(model).__name__} has {found}. "
                        f"For another model call torch.distributed.fsdp.fully_shard on its layers, then on the root")
    if isinstance(model, FSDPModule) or any(isinstance(b, FSDPModule) for b in blocks):
        raise ValueError("fsdp2_wrap: this model is already sharded with fully_shard; wrap a fresh model")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True (ZeRO-3: re-gather in backward) or False (keep "
                        f"gathered weights until backward), got {reshard_after_forward!r}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                        f"got {type(mp_policy).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("fsdp2_wrap needs an initialised process group: run it on ranks started by "
                           "course_lib.launch.spawn (or torchrun)")
    world = dist.get_world_size()
    if mesh is None:
        mesh = init_device_mesh(device().type, (world,))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != 1 or mesh.size() != world:
        raise ValueError(f"fsdp2_wrap shards over every rank of the process group: mesh must be 1-D of size "
                         f"world_size={world}, got shape {tuple(mesh.shape)} "
                         f"(use init_device_mesh('{device().type}', ({world},)), or mesh=None)")
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy())
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def padded_numel(model: nn.Module, world_size: int | None = None) -> int:
    """Ψ_pad as FSDP2 stores it: every parameter's dim 0 rounded up to a multiple of N.

    FSDP2 cuts dim 0 like ``torch.chunk`` (rank r gets rows ``[r·⌈d/N⌉, (r+1)·⌈d/N⌉)``, the last
    ranks fewer or none) and pads every rank's shard to ⌈d/N⌉ rows, so all-gathers are even.
    A ``(189, 63)`` weight at N = 2: shards of 95 and 94 rows, each stored as 95 rows —
    63 padding elements, where ``Zero3`` (flatten, pad to a multiple of N) pads 1.
    Works on the plain or the wrapped model (a DTensor's ``.shape`` is the full shape).
    """
    n = world_size if world_size is not None else dist.get_world_size()
    total = 0
    for p in model.parameters():
        shape = tuple(p.shape) or (1,)
        total += math.ceil(shape[0] / n) * n * math.prod(shape[1:])
    return total


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors under the plain model's ``state_dict()`` keys, on every rank.

    ``get_model_state_dict(..., full_state_dict=True)`` all-gathers every DTensor: a collective,
    call it on every rank. (With ``cpu_offload=True`` only rank 0 gets the tensors — the form for
    saving one file for single-device use; see :func:`fsdp2_checkpoint_roundtrip`.)
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


# =========================================================================== measuring


def fsdp2_model_state_accounting(model: nn.Module, optimizer) -> dict:
    """Per-rank model-state bytes of an FSDP2 model, measured, against 16Ψ_pad/N (fp32 AdamW).

    Same fields as :func:`course_lib.experiments.ch03_zero.model_state_accounting`. Measured from real tensors
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
    return dict(stage=3, world_size=n, psi=psi, psi_pad=psi_pad, measured=measured, formula=breakdown["total"],
                formula_breakdown=breakdown, ratio=measured["total"] / breakdown["total"])


# c10d operators (what torch.distributed's Python API dispatches to) and functional collectives,
# by the names course_lib.comm uses
_C10D, _FUNCOL = torch.ops.c10d, torch.ops._c10d_functional
_OP_NAMES = {
    _C10D._allgather_base_: "all_gather", _C10D.allgather_: "all_gather",
    _C10D.allgather_into_tensor_coalesced_: "all_gather", _C10D.allgather_coalesced_: "all_gather",
    _C10D._reduce_scatter_base_: "reduce_scatter", _C10D.reduce_scatter_: "reduce_scatter",
    _C10D.reduce_scatter_tensor_coalesced_: "reduce_scatter",
    _C10D.allreduce_: "all_reduce", _C10D.allreduce_coalesced_: "all_reduce", _C10D.broadcast_: "broadcast",
    _FUNCOL.all_gather_into_tensor: "all_gather", _FUNCOL.all_gather_into_tensor_coalesced: "all_gather",
    _FUNCOL.reduce_scatter_tensor: "reduce_scatter", _FUNCOL.reduce_scatter_tensor_coalesced: "reduce_scatter",
    _FUNCOL.all_reduce: "all_reduce", _FUNCOL.all_reduce_coalesced: "all_reduce", _FUNCOL.broadcast: "broadcast",
}


def _tensor_groups(args) -> list[list[torch.Tensor]]:
    groups = []
    for a in args:
        if isinstance(a, torch.Tensor):
            groups.append([a])
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            groups.append(list(a))
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, (list, tuple)) for t in a):
            groups.append([t for sub in a for t in sub if isinstance(t, torch.Tensor)])
    return groups


class CollectiveCounter(CommDebugMode):
    """``torch.distributed.tensor.debug.CommDebugMode`` that also records each collective's size.

    ``CommDebugMode`` is a ``TorchDispatchMode``: it sees every operator call made while it is
    active, including the c10d collectives FSDP2 issues through ``torch.distributed``
    (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``), in forward *and* in backward
    (autograd runs backward with the caller's dispatch modes active). It counts them per op
    (``get_comm_counts()``), but records no sizes; this subclass adds one
    :class:`course_lib.comm.CommRecord`-like dict per call, with the course's conventions:
    ``tensor_bytes`` = the largest tensor argument (all_gather output, reduce_scatter input,
    all_reduce buffer — the full tensor), ``ring_bytes`` = ``tensor_bytes · comm.ring_factor``.
    Nothing is patched; the mode runs the operator unchanged and only looks at its arguments.
    The ring factor uses the default group's size (all collectives here run on it).

    ``phase``: a label you set (``counter.phase = "backward"``) that each record carries.
    """

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        packet = getattr(func, "_overloadpacket", None)
        if out is not NotImplemented and packet in _OP_NAMES:
            groups = _tensor_groups(list(args) + list((kwargs or {}).values()))
            biggest = max(groups, key=lambda g: sum(t.numel() * t.element_size() for t in g))
            tb = sum(t.numel() * t.element_size() for t in biggest)
            n = dist.get_world_size()
            op = _OP_NAMES[packet]
            self.records.append(dict(op=op, phase=self.phase, dtype=str(biggest[0].dtype).replace("torch.", ""),
                                     tensor_bytes=tb, ring_bytes=tb * comm.ring_factor(op, n), world_size=n))
        return out

    def count(self, op: str | None = None, phase: str | None = None) -> int:
        return len(self.select(op, phase))

    def total(self, field: str = "tensor_bytes", op: str | None = None, phase: str | None = None) -> float:
        return sum(r[field] for r in self.select(op, phase))

    def select(self, op: str | None = None, phase: str | None = None) -> list[dict]:
        return [r for r in self.records if (op is None or r["op"] == op) and (phase is None or r["phase"] == phase)]


def _gathered_bytes(model: nn.Module) -> int:
    """Bytes of full (gathered) parameters alive right now: registered, non-DTensor, holding memory.

    While a unit is unsharded, FSDP2 registers plain ``nn.Parameter`` s (the gathered weights)
    on its modules; when it reshards, it puts the sharded DTensors back and frees the gathered
    storage. Unique storages are counted once (a tied weight is one).
    """
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for m in model.modules():
        for p in m._parameters.values():
            if p is None or isinstance(p, DTensor):
                continue
            s = p.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


class _PeakGathered:
    """Largest :func:`_gathered_bytes` seen at any leaf module's forward (hooks on every leaf)."""

    def __init__(self, model: nn.Module):
        self.model, self.peak = model, 0
        self.handles = [m.register_forward_pre_hook(self._hook) for m in model.modules()
                        if not list(m.children())]

    def _hook(self, module, args):
        self.peak = max(self.peak, _gathered_bytes(self.model))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# =========================================================================== rank functions: helpers


def _check_batch(global_batch: int, world: int) -> None:
    if global_batch % world:
        raise ValueError(f"global_batch={global_batch} is not divisible by world_size={world}")


def _optimizer(name: str, params):
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not one of {sorted(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **kwargs)


def _batch(step: int, config: GPTConfig, global_batch: int, dev, rank: int | None = None, world: int = 1):
    """Step ``step``'s global batch (the same on every rank), or rank ``rank``'s slice of it."""
    x, y = make_batch(global_batch, config.block_size, config.vocab_size, seed=step)
    if rank is not None:
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    return x.to(dev), y.to(dev)


def _train_step(model, opt, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    return loss.item()


def _mean_over_ranks(value: float) -> float:
    """The average of a per-rank number (a local loss) over all ranks: the global-batch loss."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _digest(state: dict) -> dict[str, str]:
    """A short SHA-256 per tensor (exact bytes, any dtype) — compare checkpoints across spawns by value."""
    import hashlib

    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            raw = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            out[k] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]
    return out


def full_training_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Model and optimizer state as full tensors, flat keys (``model.<fqn>``, ``optim.state.<fqn>.<name>``).

    ``get_state_dict(..., full_state_dict=True)`` gathers every DTensor (a collective); optimizer
    state is keyed by parameter *name*, not by position, so it compares across world sizes.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            flat[f"optim.state.{fqn}.{name}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return flat


def _max_abs_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


# =========================================================================== rank functions


def fsdp2_vs_single_device(steps: int = 10, optimizer: str = "adamw", reshard_after_forward: bool = True,
                           config: GPTConfig | None = None, global_batch: int = 8) -> dict:
    """Rank function: FSDP2 on N ranks vs one device on the full batch, same init, same data.

    Each step rank r trains on its ``global_batch / N`` slice; the reference (built on this
    rank) sees the whole batch. FSDP2 averages the gradients over ranks in its reduce-scatter,
    so the update is the full-batch update up to float rounding. Compared after ``steps``
    steps on full tensors (:func:`full_state_dict`). Expected: SGD max|Δ| ≤ 1e-6; AdamW
    ``assert_close(rtol=1e-5, atol=1e-5)`` (see ``OPTIMIZERS`` for its eps).
    """
    from torch.distributed.tensor import DTensor

    config = config or fsdp_config()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    _check_batch(global_batch, world)
    model = fsdp2_wrap(GPT(config, seed=0).to(dev), reshard_after_forward=reshard_after_forward)
    reference = GPT(config, seed=0).to(dev)
    opt, ref_opt = _optimizer(optimizer, model.parameters()), _optimizer(optimizer, reference.parameters())
    losses, ref_losses = [], []
    for step in range(steps):
        local = _train_step(model, opt, *_batch(step, config, global_batch, dev, rank, world))
        losses.append(_mean_over_ranks(local))  # mean of equal-sized slices' means = full-batch loss
        ref_losses.append(_train_step(reference, ref_opt, *_batch(step, config, global_batch, dev)))
    full, ref = full_state_dict(model), reference.state_dict()
    per_tensor = {k: (full[k] - ref[k]).abs().max().item() for k in ref}
    close = all(torch.allclose(full[k], ref[k], rtol=1e-5, atol=1e-5) for k in ref)
    params = list(model.named_parameters())
    return {"world_size": world, "optimizer": optimizer, "reshard_after_forward": reshard_after_forward,
            "steps": steps, "psi": sum(p.numel() for _, p in params),
            "max_abs_diff": max(per_tensor.values()), "max_abs_diff_per_tensor": per_tensor,
            "allclose_1e-5": close, "keys_match": sorted(full) == sorted(ref),
            "losses": losses, "reference_losses": ref_losses,
            "all_dtensor": all(isinstance(p, DTensor) for _, p in params),
            "placements": sorted({str(p.placements) for _, p in params}),
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in params}}


def _zero3_step(model, opt, x, y, log_f=None, log_b=None) -> float:
    """One Zero3 step; with CommLogs, forward and backward(+step) are recorded separately."""
    opt.zero_grad(set_to_none=True)
    if log_f is None:
        _, loss = model(x, y)
        loss.backward()
    else:
        with log_f:
            _, loss = model(x, y)
        with log_b:
            loss.backward()
    opt.step()
    return loss.item()


def fsdp2_vs_zero3(steps: int = 3, config: GPTConfig | None = None, global_batch: int = 8,
                   reshard_after_forward: bool = True) -> dict:
    """Rank function: FSDP2 and our ``Zero3`` on the same model and data — memory, time, collectives.

    1. One warm-up step each (FSDP2 initialises lazily on its first forward).
    2. ``steps`` timed rounds; each round times one step of each, in alternating order, after a
       barrier, as the max over ranks (the slowest rank sets the pace). Reported: the median.
    3. One counted step each: ``Zero3``'s collectives from :class:`course_lib.comm.CommLog`,
       FSDP2's from :class:`CollectiveCounter` (``CommDebugMode``). Counted apart from the timing:
       a dispatch mode sees every operator and slows the step down.
    4. Model-state bytes after that step (before ``zero_grad``), against 16Ψ_pad/N — each with
       its own Ψ_pad (FSDP2 pads rows, ``Zero3`` elements).

    Bytes sent (ring, per rank) are compared with ``(N−1)/N · c · Ψ_pad · 4``, c = 3 (c = 2 for
    FSDP2 with ``reshard_after_forward=False``). ``Zero3`` gathers the tied embedding once per
    *use* (twice per pass), so it sends more than 3Ψ; FSDP2 gathers its root unit once per pass.
    """
    from .experiments.ch03_zero import model_state_accounting
    from .zero3 import Zero3

    config = config or fsdp_config()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    _check_batch(global_batch, world)
    fsdp = fsdp2_wrap(GPT(config, seed=0).to(dev), reshard_after_forward=reshard_after_forward)
    zero3 = Zero3(GPT(config, seed=0).to(dev))
    opts = {"fsdp2": _optimizer("adamw", fsdp.parameters()), "zero3": _optimizer("adamw", zero3.parameters())}
    models = {"fsdp2": fsdp, "zero3": zero3}
    counter = [0]

    def step(name, **logs):
        x, y = _batch(counter[0] % 8, config, global_batch, dev, rank, world)
        counter[0] += 1
        if name == "zero3":
            return _zero3_step(zero3, opts["zero3"], x, y, **logs)
        return _train_step(fsdp, opts["fsdp2"], x, y)

    for name in models:  # warm-up
        step(name)
    times = {name: [] for name in models}
    names = list(models)
    for r in range(steps):
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            step(name)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())

    # counted step, FSDP2: forward and backward under one CommDebugMode, phase labelled by us
    x, y = _batch(99, config, global_batch, dev, rank, world)
    opts["fsdp2"].zero_grad(set_to_none=True)
    with CollectiveCounter() as cc:
        _, loss = fsdp(x, y)
        cc.phase = "backward"
        loss.backward()
        cc.phase = "step"
        opts["fsdp2"].step()
    fsdp_mem = fsdp2_model_state_accounting(fsdp, opts["fsdp2"])
    # counted step, Zero3
    log_f, log_b = comm.CommLog(), comm.CommLog()
    _zero3_step(zero3, opts["zero3"], x, y, log_f=log_f, log_b=log_b)
    zero_mem = model_state_accounting(zero3, opts["zero3"])

    n, units = world, len(fsdp.blocks) + 1
    ring = (n - 1) / n
    c_fsdp = 3 if reshard_after_forward else 2
    fsdp_sent = cc.total("ring_bytes", "all_gather") + cc.total("ring_bytes", "reduce_scatter")
    zero_sent = sum(log.total("ring_bytes", tag=t) for log in (log_f, log_b) for t in ("param", "grad"))
    debug_counts = {str(k): v for k, v in cc.get_comm_counts().items()}

    def side(mem, sent, c, colls, step_s):
        formula = ring * c * mem["psi_pad"] * 4
        return {"psi_pad": mem["psi_pad"], "memory": mem["measured"], "memory_formula": mem["formula"],
                "memory_ratio": mem["ratio"], "step_s": statistics.median(step_s), "step_s_rounds": step_s,
                "collectives": colls, "sent_per_step": sent, "comm_formula": formula,
                "comm_ratio": sent / formula if formula else float("nan")}

    fsdp_colls = {op: {"forward": cc.count(op, "forward"), "backward": cc.count(op, "backward"),
                       "tensor_bytes": cc.total("tensor_bytes", op)} for op in ("all_gather", "reduce_scatter")}
    zero_colls = {op: {"forward": log_f.count(op=op), "backward": log_b.count(op=op),
                       "tensor_bytes": log_f.total(op=op) + log_b.total(op=op)}
                  for op in ("all_gather", "reduce_scatter")}
    out = {"world_size": n, "psi": zero_mem["psi"], "units": units, "reshard_after_forward": reshard_after_forward,
           "formula_16psi_over_n": 16 * zero_mem["psi"] / n,
           "fsdp2": side(fsdp_mem, fsdp_sent, c_fsdp, fsdp_colls, times["fsdp2"]),
           "zero3": side(zero_mem, zero_sent, 3, zero_colls, times["zero3"]),
           "fsdp2_comm_debug_counts": debug_counts,
           "fsdp2_other_collectives": [r for r in cc.records if r["op"] not in ("all_gather", "reduce_scatter")]}
    out["memory_ratio_fsdp2_over_zero3"] = fsdp_mem["measured"]["total"] / zero_mem["measured"]["total"]
    out["step_time_ratio_fsdp2_over_zero3"] = out["fsdp2"]["step_s"] / out["zero3"]["step_s"]
    return out


def fsdp2_mixed_precision(steps: int = 5, config: GPTConfig | None = None, global_batch: int = 8) -> dict:
    """Rank function: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` vs fp32.

    Three runs on the same data, AdamW: FSDP2 in bf16, FSDP2 in fp32, one device in fp32 (the
    reference). What the policy does, measured:

    * the sharded parameters (what the optimizer steps) stay fp32 DTensors; so do their
      gradients and the optimizer state — the shards *are* the fp32 master weights;
    * before a unit runs, its shards are cast to bf16 and all-gathered in bf16: the module sees
      plain bf16 Parameters, computes in bf16, and the all-gathers move half the bytes;
    * the bf16 gradients are cast to fp32 before the reduce-scatter (``reduce_dtype``): the
      average over ranks is taken in fp32.

    Returns dtypes, all-gather / reduce-scatter bytes per step, the peak bytes of gathered
    parameters during forward (fp32 vs bf16: half), and the per-tensor relative error
    ‖p − p_ref‖ / ‖p_ref‖ of both FSDP2 runs against the fp32 reference.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    config = config or fsdp_config()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    _check_batch(global_batch, world)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {"bf16": fsdp2_wrap(GPT(config, seed=0).to(dev), mp_policy=policy),
            "fp32": fsdp2_wrap(GPT(config, seed=0).to(dev))}
    reference = GPT(config, seed=0).to(dev)
    opts = {k: _optimizer("adamw", m.parameters()) for k, m in runs.items()}
    ref_opt = _optimizer("adamw", reference.parameters())

    seen = {}  # what a Linear inside block 0 sees while it runs (bf16 run)
    probe = runs["bf16"].blocks[0].attn.c_attn
    handle = probe.register_forward_pre_hook(lambda m, args: seen.update(
        weight_type=type(m.weight).__name__, weight_dtype=str(m.weight.dtype), input_dtype=str(args[0].dtype)))

    out = {"world_size": world, "steps": steps, "losses": {}, "comm": {}, "peak_gathered_bytes": {}}
    for name, model in runs.items():
        losses = []
        for step in range(steps):
            x, y = _batch(step, config, global_batch, dev, rank, world)
            opts[name].zero_grad(set_to_none=True)
            if step == steps - 1:  # last step: count collectives and gathered bytes
                peak = _PeakGathered(model)
                with CollectiveCounter() as cc:
                    logits, loss = model(x, y)
                    cc.phase = "backward"
                    loss.backward()
                peak.remove()
                out["peak_gathered_bytes"][name] = peak.peak
                out["comm"][name] = {op: {"calls": cc.count(op), "tensor_bytes": cc.total("tensor_bytes", op),
                                          "dtypes": sorted({r["dtype"] for r in cc.select(op)})}
                                     for op in ("all_gather", "reduce_scatter")}
                out.setdefault("logits_dtype", {})[name] = str(logits.dtype)
                out.setdefault("grad_dtypes", {})[name] = sorted({str(p.grad.dtype) for p in model.parameters()})
            else:
                _, loss = model(x, y)
                loss.backward()
            opts[name].step()
            losses.append(_mean_over_ranks(loss.item()))
        out["losses"][name] = losses
    handle.remove()
    ref_losses = []
    for step in range(steps):
        ref_losses.append(_train_step(reference, ref_opt, *_batch(step, config, global_batch, dev)))
    out["losses"]["reference"] = ref_losses

    bf16 = runs["bf16"]
    out["sharded_param_types"] = sorted({type(p).__name__ for p in bf16.parameters()})
    out["sharded_param_dtypes"] = sorted({str(p.dtype) for p in bf16.parameters()})
    out["local_shard_dtypes"] = sorted({str(p.to_local().dtype) for p in bf16.parameters()})
    out["optimizer_state_dtypes"] = sorted({str(t.dtype) for s in opts["bf16"].state.values() for t in s.values()
                                            if isinstance(t, torch.Tensor) and t.dim() > 0})
    out["compute"] = seen
    out["all_dtensor"] = all(isinstance(p, DTensor) for p in bf16.parameters())
    ref = reference.state_dict()
    for name, model in runs.items():
        full = full_state_dict(model)
        rel = {k: ((full[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref}
        out.setdefault("rel_err", {})[name] = rel
        out.setdefault("max_rel_err", {})[name] = max(rel.values())
        out.setdefault("median_rel_err", {})[name] = statistics.median(rel.values())
    g = out["comm"]
    out["gather_bytes_ratio_bf16_over_fp32"] = g["bf16"]["all_gather"]["tensor_bytes"] / \
        g["fp32"]["all_gather"]["tensor_bytes"]
    out["reduce_bytes_ratio_bf16_over_fp32"] = g["bf16"]["reduce_scatter"]["tensor_bytes"] / \
        g["fp32"]["reduce_scatter"]["tensor_bytes"]
    out["peak_gathered_ratio_bf16_over_fp32"] = out["peak_gathered_bytes"]["bf16"] / \
        out["peak_gathered_bytes"]["fp32"]
    return out


def _build_trained(config, seed: int, dev):
    model = fsdp2_wrap(GPT(config, seed=seed).to(dev))
    return model, _optimizer("adamw", model.parameters())


def _dcp_save(model, optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensor shards under canonical names: no copy
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _dcp_load(model, optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # the layout to fill (creates optimizer state)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)  # in place: each rank reads the slices its shards cover
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def fsdp2_checkpoint_roundtrip(tmp_dir: str, steps: int = 4, resume_at: int = 2, config: GPTConfig | None = None,
                               global_batch: int = 8) -> dict:
    """Rank function: sharded checkpoint with ``torch.distributed.checkpoint`` (DCP), resume, compare.

    Save at step ``resume_at``::

        model_sd, optim_sd = get_state_dict(model, optimizer)     # DTensor shards, canonical keys
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    Every rank writes *its own* shards (``__<rank>_0.distcp``) — nobody gathers the model —
    and the coordinator (rank 0) writes ``.metadata``: for every tensor, its global shape and
    which chunk (offsets, sizes) lies in which file. Loading is the mirror image, into a *fresh*
    model (another init) and optimizer::

        model_sd, optim_sd = get_state_dict(model, optimizer)     # the layout to fill
        dcp.load(state := {"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

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

    config = config or fsdp_config()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    _check_batch(global_batch, world)
    if not 0 < resume_at < steps:
        raise ValueError(f"resume_at={resume_at} must be between 1 and steps-1={steps - 1}")
    path = os.path.join(os.fspath(tmp_dir), f"fsdp2_ckpt_w{world}_step{resume_at}")
    os.makedirs(path, exist_ok=True)

    def train(model, opt, first, last):
        for step in range(first, last):
            _train_step(model, opt, *_batch(step, config, global_batch, dev, rank, world))

    straight, straight_opt = _build_trained(config, 0, dev)
    train(straight, straight_opt, 0, steps)
    straight_sd = full_state_dict(straight)

    model, opt = _build_trained(config, 0, dev)
    train(model, opt, 0, resume_at)
    saved = full_training_state(model, opt)
    _dcp_save(model, opt, path)
    dist.barrier()  # every rank's file is complete before anyone reads the directory

    model, opt = _build_trained(config, 123, dev)  # other weights, no optimizer state: all from the checkpoint
    fresh_differs = any(not torch.equal(v, saved["model." + k]) for k, v in full_state_dict(model).items())
    _dcp_load(model, opt, path)
    restored = full_training_state(model, opt)
    restored_equal = sorted(restored) == sorted(saved) and all(torch.equal(restored[k], saved[k]) for k in saved)
    train(model, opt, resume_at, steps)
    resumed_sd = full_state_dict(model)

    # a full state dict for one device, way 1: gathered to rank 0 (collective)
    rank0_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    x, y = _batch(0, config, global_batch, dev)
    with torch.no_grad():
        _, fsdp_loss = model(x, y)  # all-gathers inside: every rank runs it
    out = {"world_size": world, "steps": steps, "resume_at": resume_at, "path": path,
           "fresh_model_differed": fresh_differs, "restored_equals_saved": restored_equal,
           "resumed_equals_uninterrupted": all(torch.equal(resumed_sd[k], straight_sd[k]) for k in straight_sd),
           "max_abs_diff": _max_abs_diff(resumed_sd, straight_sd), "saved_digest": _digest(saved),
           "rank0_full_state_dict_keys": len(rank0_sd), "fsdp_loss": fsdp_loss.item(),
           "psi": sum(p.numel() for p in model.parameters())}
    if rank == 0:
        files = sorted(os.listdir(path))
        out["files"] = files
        out["file_bytes"] = {f: os.path.getsize(os.path.join(path, f)) for f in files}
        meta = FileSystemReader(path).read_metadata()
        keys = sorted(meta.state_dict_metadata)
        out["checkpoint_key_counts"] = {prefix: sum(k.startswith(prefix + ".") for k in keys)
                                        for prefix in ("model", "optim.state", "optim.param_groups")}
        # a tied weight is one parameter but two state_dict keys: DCP stores it under both
        out["tied_weight_keys"] = [k for k in keys if k in ("model.wte.weight", "model.lm_head.weight")]
        entry = meta.state_dict_metadata["model.blocks.0.attn.c_attn.weight"]
        out["example_chunks"] = {"key": "model.blocks.0.attn.c_attn.weight", "global_shape": tuple(entry.size),
                                 "chunks": [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]}
        plain = GPT(config, seed=7).to(dev)
        result = plain.load_state_dict(rank0_sd, strict=True)
        out["load_state_dict_ok"] = not result.missing_keys and not result.unexpected_keys
        with torch.no_grad():
            out["single_device_loss"] = plain(x, y)[1].item()
        out["rank0_full_equals_fsdp"] = all(torch.equal(rank0_sd[k].to(dev), resumed_sd[k]) for k in resumed_sd)
        # way 2: offline conversion of the DCP directory into one torch.save file (no process group)
        converted = os.path.join(os.fspath(tmp_dir), f"fsdp2_ckpt_w{world}_step{resume_at}.pt")
        dcp_to_torch_save(path, converted)
        offline = torch.load(converted, weights_only=True)
        out["torch_save_keys"] = sorted(offline)
        plain.load_state_dict(offline["model"], strict=True)
        out["torch_save_model_equals_saved"] = all(torch.equal(v.to(dev), saved["model." + k])
                                                   for k, v in plain.state_dict().items())
    dist.barrier()
    return out


def fsdp2_load_checkpoint(path: str, config: GPTConfig | None = None) -> dict:
    """Rank function: load a DCP checkpoint saved at *any* world size into a fresh FSDP2 model here.

    DCP reshards on load: each rank asks for the global slice its new shard covers, and the
    planner reads it from whichever files hold it. Returns the digest of the full loaded
    state (model and AdamW state) — equal to the saver's ``saved_digest`` when nothing was lost.
    """
    config = config or fsdp_config()
    model, opt = _build_trained(config, 123, device())
    _dcp_load(model, opt, path)
    state = full_training_state(model, opt)
    return {"world_size": dist.get_world_size(), "digest": _digest(state),
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}}
