"""Chapter 04 — FSDP2: torch's ZeRO-3, next to the one we wrote in chapter 03.

``torch.distributed.fsdp.fully_shard`` ("FSDP2") does what :class:`course_lib.zero3.Zero3` does —
every rank keeps 1/N of every parameter, gradient and optimizer state; full weights exist only
while a unit runs — with engineering differences worth measuring:

==========================  =====================================  ==========================================
                            our ``Zero3``                          FSDP2 ``fully_shard``
==========================  =====================================  ==========================================
unit of communication       one unit per block + the root          one *wrapped module* (all its parameters
                            (``unit="block"``, the default; a      in one flat all-gather / reduce-scatter)
                            ModuleList's / Sequential's children,
                            else the whole model), or one per
                            parameter and use (``unit="param"``)
sharding                    flatten, pad to a multiple of N,       dim 0 like ``torch.chunk``, each shard
                            1-D shard                              padded to ⌈dim0/N⌉ rows; a ``DTensor``
                                                                   with placement ``Shard(0)``
what the optimizer sees     plain fp32 shard Parameters            the model's own parameters, now DTensors
mixed precision             ``compute_dtype``                      ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``
prefetch                    next unit, on by default (per unit)    implicit one ahead; :func:`set_prefetch`
checkpoint                  full weights + one optim file / rank   ``torch.distributed.checkpoint``: every rank
                                                                   writes its own shards, reshardable on load
==========================  =====================================  ==========================================

The wrapping unit decides the communication pattern. ``fsdp2_wrap`` calls ``fully_shard`` on
every transformer block, then on the root (embeddings, final LayerNorm, tied output layer):
L + 1 units. Per training step and per unit FSDP2 then issues

* forward: **one all-gather** (the whole unit's parameters) before the unit runs;
* backward: **one all-gather** again (``reshard_after_forward=True``: the forward freed the
  gathered weights) and **one reduce-scatter** of the unit's gradients.

That is 3Ψ per step, like ZeRO-3 — in (L + 1) × 3 large messages (our ``Zero3`` per unit does
the same; ``unit="param"`` sends one small message per parameter and per use).
``reshard_after_forward=False`` keeps each unit's gathered weights from its forward until its
backward: no backward all-gather (2Ψ, like ZeRO-2's traffic), but the whole model is gathered at
the end of the forward — ZeRO-2-like memory for parameters during the
step, while the optimizer state and the gradients stay sharded.

This module is the technique only: :func:`fsdp2_wrap` (which modules become units),
:func:`padded_numel` (Ψ_pad as FSDP2 stores it), :func:`full_state_dict` (full tensors from the
shards), :func:`set_prefetch` (an explicit prefetch plan, checked) and
:func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint` (DCP, keys and shapes checked
before loading). FSDP2's features — HSDP, accumulation, checkpointing, meta-device init — are
measured in :mod:`course_lib.experiments.fsdp_features` and :mod:`course_lib.experiments.fsdp_practice`.
What the notebook measures with them — equality with one device, FSDP2 vs our ``Zero3``,
mixed precision, sharded checkpoints — is in :mod:`course_lib.experiments.fsdp`; FSDP2's
collectives are counted with :class:`course_lib.comm.CollectiveCounter` and its gathered weights
with :class:`course_lib.fsdp_meters.GatheredParamMeter`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from .launch import device

__all__ = [
    "fsdp2_wrap",
    "padded_numel",
    "full_state_dict",
    "full_training_state",
    "set_prefetch",
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
]


# =========================================================================== wrapping


def fsdp2_wrap(
    model: nn.Module, mesh=None, reshard_after_forward: bool = True, mp_policy=None
) -> nn.Module:
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
        found = (
            "no .blocks"
            if blocks is None
            else f".blocks of type {type(blocks).__name__}"
            + (f" and length {len(blocks)}" if hasattr(blocks, "__len__") else "")
        )
        raise TypeError(
            f"fsdp2_wrap needs a model whose transformer blocks are in a non-empty `model.blocks` "
            f"(nn.ModuleList): each block becomes one FSDP unit; {type(model).__name__} has {found}. "
            f"For another model call torch.distributed.fsdp.fully_shard on its layers, then on the root"
        )
    wrapped = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if wrapped:  # fully_shard itself would fail later with a bare AssertionError, or shard twice
        raise ValueError(
            f"fsdp2_wrap: this model is already sharded with fully_shard (FSDP modules: "
            f"{', '.join(wrapped[:4])}{' …' if len(wrapped) > 4 else ''}); wrap a fresh model"
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"reshard_after_forward must be True (ZeRO-3: re-gather in backward) or False (keep "
            f"gathered weights until backward), got {reshard_after_forward!r}"
        )
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
            f"got {type(mp_policy).__name__}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fsdp2_wrap needs an initialised process group: run it on ranks started by "
            "course_lib.launch.spawn (or torchrun)"
        )
    world = dist.get_world_size()
    if mesh is None:
        mesh = init_device_mesh(device().type, (world,))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {type(mesh).__name__}"
        )
    if mesh.ndim != 1 or mesh.size() != world:
        raise ValueError(
            f"fsdp2_wrap shards over every rank of the process group: mesh must be 1-D of size "
            f"world_size={world}, got shape {tuple(mesh.shape)} "
            f"(use init_device_mesh('{device().type}', ({world},)), or mesh=None)"
        )
    kwargs = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
    )
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
    saving one file for single-device use; see ``experiments.fsdp.fsdp2_checkpoint_roundtrip``.)
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


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
            flat[f"optim.state.{fqn}.{name}"] = (
                v if isinstance(v, torch.Tensor) else torch.tensor(v)
            )
    return flat


# =========================================================================== prefetch plans


def set_prefetch(
    model: nn.Module, forward: dict | None = None, backward: dict | None = None
) -> None:
    """Explicit prefetch: ``{unit: [units to all-gather before it runs]}``, for forward and/or backward.

    FSDP2 already overlaps one unit ahead where the device runs ahead of Python (CUDA streams);
    ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` make the all-gather of
    the listed units *issue* as soon as the key unit starts — more in flight, more memory. Every
    key and value must be a ``fully_shard`` ed module inside ``model`` (checked here: FSDP2 itself
    would accept a module of another model and hang or gather the wrong weights).
    """
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): name or "<root>" for name, m in model.named_modules()}

    def check(m, role: str) -> None:
        if id(m) not in names:
            raise ValueError(
                f"set_prefetch: the {role} {type(m).__name__} (id {id(m):#x}) is not a module of this "
                f"model; name units of the model you prefetch for, e.g. model.blocks[i]"
            )
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"set_prefetch: the {role} {names[id(m)]!r} ({type(m).__name__}) is not a fully_shard "
                f"unit; only units have an all-gather to prefetch"
            )

    for plan, setter in (
        (forward, "set_modules_to_forward_prefetch"),
        (backward, "set_modules_to_backward_prefetch"),
    ):
        if plan is None:
            continue
        if not isinstance(plan, dict):
            raise TypeError(
                f"a prefetch plan is a dict {{unit: [units]}}, got {type(plan).__name__}"
            )
        for unit, targets in plan.items():
            check(unit, "unit")
            targets = list(targets)
            for t in targets:
                check(t, f"prefetch target of {names[id(unit)]!r}")
            getattr(unit, setter)(targets)


# =========================================================================== sharded checkpoints (DCP)


def save_sharded_checkpoint(model: nn.Module, optimizer, path: str) -> None:
    """Every rank writes its own shards (``torch.distributed.checkpoint``); rank 0 writes ``.metadata``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_sharded_checkpoint(model: nn.Module, optimizer, path: str) -> None:
    """Load a DCP checkpoint saved at any world size into ``model`` (and ``optimizer``), in place.

    Checked first against the checkpoint's metadata, so that another model's checkpoint fails with
    the key at fault (DCP alone reports a planner error, or loads a mismatched shape silently
    partly): every model key must be in the checkpoint with the same global shape, and the
    checkpoint must hold no model key this model lacks.
    """
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if not os.path.isfile(os.path.join(os.fspath(path), ".metadata")):
        raise FileNotFoundError(f"{path} is not a DCP checkpoint (no .metadata file)")
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(
            model, optimizer
        )  # the layout to fill (creates optimizer state)
    else:
        model_sd, optim_sd = get_model_state_dict(model), None
    saved = {k[len("model.") :]: v for k, v in meta.items() if k.startswith("model.")}
    missing = [k for k in model_sd if k not in saved]
    if missing:
        raise KeyError(
            f"checkpoint {path} has no entry for model key {missing[0]!r} ({len(missing)} missing); "
            f"it was saved from another model"
        )
    unexpected = sorted(set(saved) - set(model_sd))
    if unexpected:
        raise KeyError(
            f"checkpoint {path} holds model key {unexpected[0]!r} that this model does not have "
            f"({len(unexpected)} unexpected); it was saved from another model"
        )
    for k, v in model_sd.items():
        want, got = tuple(v.shape), tuple(getattr(saved[k], "size", ()))
        if want != got:
            raise ValueError(
                f"checkpoint {path}: model key {k!r} has shape {got} there, {want} in this model"
            )
    state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)  # in place: each rank reads the slices its shards cover
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
