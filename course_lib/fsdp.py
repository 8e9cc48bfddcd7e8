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

This module is the technique only: :func:`fsdp2_wrap` (which modules become units),
:func:`padded_numel` (Ψ_pad as FSDP2 stores it) and :func:`full_state_dict` (full tensors from the
shards). What the notebook measures with them — equality with one device, FSDP2 vs our ``Zero3``,
mixed precision, sharded checkpoints — is in :mod:`course_lib.experiments.ch04_fsdp`; FSDP2's
collectives are counted with :class:`course_lib.comm.CollectiveCounter` and its gathered weights
with :class:`course_lib.memory.GatheredParamMeter`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from .launch import device

__all__ = ["fsdp2_wrap", "padded_numel", "full_state_dict", "full_training_state"]


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
    saving one file for single-device use; see ``experiments.ch04_fsdp.fsdp2_checkpoint_roundtrip``.)
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
            flat[f"optim.state.{fqn}.{name}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return flat
