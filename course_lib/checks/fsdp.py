"""Chapter 04 checkers: FSDP2 units (``wrap_blocks``) and the DCP ``ShardedCheckpoint``."""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from . import layered_hint
from ..experiments.common import shard_batch, state_diff, step_batch, train_step, zero_config
from ..fsdp import fsdp2_wrap, full_state_dict, full_training_state
from ..fsdp_meters import counted_step
from ..launch import device
from ..models import GPT
from ..results import EXACT, SGD

__all__ = ["HINTS", "hint", "check_fsdp2_wrap_blocks", "check_sharded_checkpoint"]

HINTS: dict[str, tuple[str, str]] = {
    "fsdp2_wrap_blocks": (
        "Each fully_shard call makes one unit: gathered in one all-gather before it runs, "
        "reduce-scattered in one after its backward. A call takes every parameter of the module "
        "that no unit below it owns yet, so wrap the blocks first and the whole model last: the "
        "root then holds only the embeddings, ln_f and the tied head. Wrap only the root and the "
        "whole model is one unit, gathered at once.",
        "from torch.distributed.fsdp import fully_shard; fully_shard(module, mesh=mesh, "
        "reshard_after_forward=...) wraps in place (it also returns the module). model.blocks is "
        "an nn.ModuleList; the root call must get the same reshard_after_forward, or its default "
        "(None: the root keeps its parameters) changes the backward all-gather count.",
    ),
    "sharded_checkpoint": (
        "Nobody gathers the model: every rank writes its own shards and a metadata file says "
        "which slice of which tensor is where. Loading is in place: build the same sharded model "
        "and optimizer, ask for their (empty) state layout, fill it from disk, hand it back. The "
        "optimizer's state must be saved too, keyed by parameter name, or the resume drifts.",
        "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) returns "
        "(model_sd, optim_sd) and creates the optimizer's state; dcp.save(state, checkpoint_id=path) "
        "and dcp.load(state, checkpoint_id=path) take the same dict, e.g. {'model': ..., 'optim': "
        "...}; set_state_dict(model, optimizer, model_state_dict=..., optim_state_dict=...) "
        "puts the loaded values in place.",
    ),
}


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` (1: the idea, 2: the API) for exercise ``name``; never the code."""
    return layered_hint(HINTS, name, level)


def check_fsdp2_wrap_blocks(fn) -> list[str]:
    """One FSDP2 unit per block plus the root: L+1 all-gathers per pass, and one SGD step == one device."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    config = zero_config(n_layer=3)
    units = config.n_layer + 1
    problems = []
    for reshard in (True, False):
        where = f"rank {rank}, reshard_after_forward={reshard}"
        model = GPT(config, seed=0).to(dev)
        out = fn(model, init_device_mesh(dev.type, (world,)), reshard_after_forward=reshard)
        model = out if out is not None else model
        if not isinstance(model, FSDPModule):
            return problems + [
                f"{where}: the root is not wrapped — call fully_shard(model, mesh=mesh, ...) "
                f"after the blocks"
            ]
        unwrapped = [i for i, b in enumerate(model.blocks) if not isinstance(b, FSDPModule)]
        if unwrapped:
            return problems + [
                f"{where}: block(s) {unwrapped} are not wrapped — call fully_shard on every "
                f"block of model.blocks before the root"
            ]
        reference = GPT(config, seed=0).to(dev)
        opt = torch.optim.SGD(
            model.parameters(), lr=0.1
        )  # plain SGD (no momentum): one step, exactly
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        x, y = step_batch(0, config, 2 * world, dev)
        cc, _ = counted_step(model, opt, *shard_batch(x, y))
        train_step(reference, ref_opt, x, y)
        fwd, bwd = (
            cc.count(op="all_gather", tag="forward"),
            cc.count(op="all_gather", tag="backward"),
        )
        scatters = cc.count(op="reduce_scatter")
        want_bwd = units if reshard else 0
        if fwd != units:
            problems.append(
                f"{where}: {fwd} all-gather(s) in forward, expected {units} (one per block and one "
                f"for the root)"
                + (
                    " — one unit gathers the whole model at once: wrap each block before the root"
                    if fwd == 1
                    else ""
                )
            )
        if bwd != want_bwd:
            why = "the forward freed the gathered weights" if reshard else "the forward kept them"
            problems.append(
                f"{where}: {bwd} all-gather(s) in backward, expected {want_bwd} ({why}; pass "
                f"reshard_after_forward to every fully_shard call, the root's too)"
            )
        if scatters != units:
            problems.append(
                f"{where}: {scatters} reduce-scatter(s), expected {units} (one per unit)"
            )
        full = full_state_dict(model)
        if not SGD.ok(full, reference.state_dict()):
            problems.append(
                f"{where}: after one SGD step the weights differ from one device's (full batch) by "
                f"max |error| {state_diff(full, reference):.3g} (tolerance {SGD})"
            )
        if problems:
            return problems
    return problems


def check_sharded_checkpoint(cls) -> list[str]:
    """DCP save writes one file per rank; load into a fresh model restores everything; resume is bit-exact."""
    world, rank, dev = dist.get_world_size(), dist.get_rank(), device()
    config = zero_config()
    box = [tempfile.mkdtemp(prefix="course_ckpt_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")

    def build(seed):
        model = fsdp2_wrap(GPT(config, seed=seed).to(dev))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def train(model, opt, steps):
        for step in steps:
            train_step(model, opt, *shard_batch(*step_batch(step, config, 2 * world, dev)))

    problems = []
    try:
        model, opt = build(0)
        train(model, opt, range(2))
        saved = full_training_state(model, opt)
        cls.save(model, opt, path)
        dist.barrier()
        files = sorted(os.listdir(path)) if os.path.isdir(path) else []
        want = [".metadata"] + [f"__{r}_0.distcp" for r in range(world)]
        if files != want:
            problems.append(
                f"rank {rank}: the checkpoint at path holds {files}, expected {want} — dcp.save(..., "
                f"checkpoint_id=path) on every rank writes one file per rank and .metadata"
            )
        fresh, fresh_opt = build(123)  # other weights, no optimizer state
        cls.load(fresh, fresh_opt, path)
        restored = full_training_state(fresh, fresh_opt)
        wrong = [k for k in saved if k not in restored or not torch.equal(restored[k], saved[k])]
        if wrong:
            problems.append(
                f"rank {rank}: after load, {len(wrong)} of {len(saved)} tensors differ from the saved "
                f"ones, e.g. {wrong[0]} (load the optimizer state too, with set_state_dict)"
            )
        train(model, opt, range(2, 4))
        train(fresh, fresh_opt, range(2, 4))
        a, b = full_state_dict(model), full_state_dict(fresh)
        err = max((a[k] - b[k]).abs().max().item() for k in a)
        if not EXACT.ok(b, a):
            problems.append(
                f"rank {rank}: two steps after resuming, the weights differ from the uninterrupted "
                f"run by max |error| {err:.3g} (expected bit-for-bit equal)"
            )
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)
    return problems
