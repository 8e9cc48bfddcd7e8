"""Chapter 06's measurements: tensor parallelism equal to one device, its collectives counted, DTensor, DP×TP.

Rank functions (run them with ``launch.spawn``): :func:`linear_layers` (Column/RowParallelLinear with
biases vs ``nn.Linear``), :func:`tp_step` (one forward + backward of the TP GPT: logits, loss, gradient
shards, the collectives of each phase, per-rank weight bytes, saved activation bytes),
:func:`tp_training` (AdamW steps; this rank's weight shards), :func:`dtensor_step` (the same plan with
``parallelize_module`` and ``loss_parallel``; the two traps), :func:`dp_tp_training` (a 2-D mesh: DP
over one dimension, our TP over the other, collectives counted per mesh dimension), :func:`fsdp_tp_step`
(FSDP2 on the "dp" sub-mesh of a DTensor-TP model) and :func:`notebook_suite` (several in one spawn).
Parent-side: :func:`merge_shards` (the full tensors from every TP rank's shards).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .. import comm
from ..launch import device
from ..memory import SavedTensorMeter
from ..models import GPT, GPTConfig
from ..tensor_parallel import (ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads,
                               check_mesh, tensor_parallel_gpt, tp_shard_dim)
from .common import make_optimizer, parallel_config, shard_batch, step_batch

__all__ = ["parallel_config", "linear_layers", "tp_step", "tp_training", "merge_shards", "dtensor_plan",
           "parallelize_gpt", "dtensor_step", "dtensor_sequence_parallel_blocks",
           "dp_tp_training", "fsdp_tp_step", "notebook_suite", "mesh_suite"]


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone()


def merge_shards(results: list[dict], key: str = "grads") -> dict[str, torch.Tensor]:
    """Parent-side: the full tensors from the TP ranks' ``results[r][key]`` (in TP-rank order)."""
    merged = {}
    for name, t in results[0][key].items():
        d = tp_shard_dim(name)
        merged[name] = t if d is None else torch.cat([r[key][name] for r in results], d)
    return merged


# =========================================================================== single layers


def linear_layers(in_features: int = 16, out_features: int = 24, batch: int = 4, bias: bool = True,
                  seed: int = 0) -> dict:
    """Rank function: ``nn.Linear(seed)`` split column-wise (gathered output) and row-wise (full input).

    Returns each layer's output, input gradient and parameter-gradient shards for the loss
    ``Σ (y · w)`` with a fixed ``w``; the parent compares them with the unsplit ``nn.Linear``.
    """
    dev = device()
    gen = torch.Generator().manual_seed(seed)
    full = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    full = full.to(dev)
    x = torch.randn(batch, in_features, generator=gen).to(dev)
    w = torch.randn(batch, out_features, generator=gen).to(dev)
    out = {}
    for kind, layer in (("column", ColumnParallelLinear.from_linear(full, gather_output=True)),
                        ("row", RowParallelLinear.from_linear(full, input_is_parallel=False))):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        (y * w).sum().backward()
        out[kind] = {"y": _cpu(y), "x_grad": _cpu(xi.grad), "weight_grad": _cpu(layer.weight.grad),
                     "bias_grad": None if layer.bias is None else _cpu(layer.bias.grad)}
    return out


# =========================================================================== the TP GPT


def _phase_counts(log: comm.CommLog) -> dict:
    return {f"{r['op']}:{r['tag']}": r["calls"] for r in log.summary()}


def tp_step(config: GPTConfig | None = None, batch_size: int = 8, sequence_parallel: bool = False) -> dict:
    """Rank function: one forward + backward of the TP GPT on ``step_batch(0)``.

    Returns this rank's logits (V/t columns), loss, gradient shards, the collectives of forward and of
    backward (``{"op:tag": calls}``, ``tag`` "tp" = inside the blocks, "embed", "head", "loss",
    "sp_grad"), the ring bytes of each, this rank's weight bytes (block Linears vs the rest) and the
    activation bytes saved for backward.
    """
    config = config or parallel_config()
    dev = device()
    model = tensor_parallel_gpt(GPT(config, seed=0).to(dev), sequence_parallel=sequence_parallel)
    x, y = step_batch(0, config, batch_size, dev)
    with comm.CommLog() as fwd, SavedTensorMeter(exclude=model) as meter:
        logits, loss = model(x, y)
    with comm.CommLog() as bwd:
        loss.backward()
        allreduce_sequence_parallel_grads(model)
    block_linear = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if n.startswith("blocks.") and ".ln_" not in n)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"rank": dist.get_rank(), "logits": _cpu(logits), "loss": loss.item(),
            "grads": {n: _cpu(p.grad) for n, p in model.named_parameters()},
            "forward": _phase_counts(fwd), "backward": _phase_counts(bwd),
            "forward_ring_bytes": fwd.total("ring_bytes"), "backward_ring_bytes": bwd.total("ring_bytes"),
            "block_tp_ring_bytes": fwd.total("ring_bytes", tag="tp") + bwd.total("ring_bytes", tag="tp"),
            "block_linear_bytes": block_linear, "other_param_bytes": total - block_linear,
            "activation_bytes": meter.bytes, "tokens": x.numel()}


def tp_training(steps: int = 10, optimizer: str = "adamw", batch_size: int = 8, config: GPTConfig | None = None,
                sequence_parallel: bool = False) -> dict:
    """Rank function: ``steps`` optimizer steps of the TP GPT on ``step_batch(0 … steps−1)``; this rank's shards."""
    config = config or parallel_config()
    dev = device()
    model = tensor_parallel_gpt(GPT(config, seed=0).to(dev), sequence_parallel=sequence_parallel)
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        _, loss = model(*step_batch(step, config, batch_size, dev))
        loss.backward()
        allreduce_sequence_parallel_grads(model)
        opt.step()
        losses.append(loss.item())
    return {"rank": dist.get_rank(), "losses": losses, "state": {n: _cpu(p) for n, p in model.named_parameters()}}


# =========================================================================== DTensor


def dtensor_plan(n_layer: int, loss_parallel: bool = True) -> dict:
    """A ``parallelize_module`` plan for the tiny GPT (untied), as torchtitan writes one for Llama.

    ``c_attn`` is ColwiseParallel: ``Shard(0)`` of its weight is a contiguous row block, which is
    whole heads because the GPT lays q, k, v out head by head. ``loss_parallel=True`` keeps the head's
    logits a DTensor sharded on V (``use_local_output=False``), which ``loss_parallel()`` needs.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=not loss_parallel)}
    for i in range(n_layer):
        plan.update({f"blocks.{i}.attn.c_attn": ColwiseParallel(), f"blocks.{i}.attn.c_proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.c_fc": ColwiseParallel(), f"blocks.{i}.mlp.c_proj": RowwiseParallel()})
    return plan


def parallelize_gpt(gpt: GPT, tp_mesh, loss_parallel: bool = True) -> GPT:
    """``parallelize_module(gpt, tp_mesh, dtensor_plan(...))``; refuses a tied GPT (it would silently untie)."""
    from torch.distributed.tensor.parallel import parallelize_module

    if gpt.lm_head.weight is gpt.wte.weight:
        raise ValueError("tied embedding and head: parallelize_module re-wraps the second module's parameter and "
                         "silently unties them; use an untied config (parallel_config) or re-tie after it")
    return parallelize_module(gpt, tp_mesh, dtensor_plan(gpt.config.n_layer, loss_parallel))


def _full(t):
    return _cpu(t.full_tensor() if hasattr(t, "full_tensor") else t)


def dtensor_step(config: GPTConfig | None = None, batch_size: int = 8, traps: bool = True) -> dict:
    """Rank function: the DTensor TP GPT, one forward + backward under ``loss_parallel()``; full grads.

    With ``traps``: (1) ``parallelize_module`` on a *tied* GPT — is the tie still there afterwards?
    (2) the default ``ColwiseParallel()`` head (local logits) under the GPT's own cross-entropy:
    the error it raises (the local V/t logits meet targets in [0, V)).
    """
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from ..comm import CollectiveCounter

    config = config or parallel_config()
    dev, t = device(), dist.get_world_size()
    mesh = init_device_mesh(dev.type, (t,), mesh_dim_names=("tp",))
    model = parallelize_gpt(GPT(config, seed=0).to(dev), mesh)
    x, y = step_batch(0, config, batch_size, dev)
    with CollectiveCounter(tag="forward") as cc, loss_parallel():
        logits, loss = model(x, y)
        cc.tag = "backward"
        loss.backward()
    out = {"loss": _full(loss).item(), "logits": _full(logits),
           "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
           "collectives": {f"{r['op']}:{r['tag']}": r["calls"] for r in cc.summary()}}
    if traps:
        tied = GPT(parallel_config(tie_weights=True), seed=0).to(dev)
        plan = dtensor_plan(config.n_layer, loss_parallel=False)
        plan["lm_head"] = type(plan["lm_head"])()  # the trap is about the tie, not the loss
        tied = parallelize_module(tied, mesh, plan)
        out["tied_after_parallelize"] = tied.lm_head.weight is tied.wte.weight
        naive = parallelize_module(GPT(config, seed=0).to(dev), mesh, {**dtensor_plan(config.n_layer),
                                                                       "lm_head": plan["lm_head"]})
        try:
            naive(x, y)
            out["local_logits_error"] = None
        except Exception as exc:  # noqa: BLE001 — the error itself is what we report
            out["local_logits_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        dist.barrier()
    return out


def dtensor_sequence_parallel_blocks(config: GPTConfig | None = None, batch_size: int = 2, seed: int = 1) -> dict:
    """Rank function: the GPT's blocks with DTensor sequence parallelism (torchtitan's plan), loss Σ out².

    The input ``x`` (``randn(b, s, h)`` from ``seed``) arrives as this rank's s/t positions; LayerNorms
    are ``SequenceParallel()``, attention and MLP gather the sequence (``PrepareModuleInput``) and the
    row-parallel outputs are ``Shard(1)``. Returns the full gradients, the LayerNorm weight gradients'
    placements (``Partial``: DTensor defers their all-reduce over TP), their local (partial) values,
    and ``x``'s gradient block.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    config = config or parallel_config()
    dev, t, r = device(), dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(dev.type, (t,), mesh_dim_names=("tp",))
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {}
    for i in range(config.n_layer):
        plan.update({f"{i}.ln_1": SequenceParallel(), f"{i}.ln_2": SequenceParallel(), f"{i}.attn": gather,
                     f"{i}.mlp": gather, f"{i}.attn.c_attn": ColwiseParallel(), f"{i}.mlp.c_fc": ColwiseParallel(),
                     f"{i}.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                     f"{i}.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))})
    blocks = parallelize_module(GPT(config, seed=0).blocks.to(dev), mesh, plan)
    x = torch.randn(batch_size, config.block_size, config.d_model, generator=torch.Generator().manual_seed(seed))
    h = x.to(dev).chunk(t, 1)[r].contiguous().requires_grad_(True)
    xs = h
    for block in blocks:
        h = block(h)
    h.pow(2).sum().backward()
    ln = {n: p.grad for n, p in blocks.named_parameters() if ".ln_" in f".{n}"}
    return {"grads": {n: _full(p.grad) for n, p in blocks.named_parameters()}, "x_grad": _cpu(xs.grad),
            "ln_placements": {n: type(g.placements[0]).__name__ for n, g in ln.items()},
            "ln_local": {n: _cpu(g.to_local()) for n, g in ln.items()}}


# =========================================================================== 2-D: DP × TP


def _auto_mesh() -> tuple[int, int]:
    """(world/2, 2) on an even world, else (world, 1): what ``mesh_shape=None`` means."""
    w = dist.get_world_size()
    return (w // 2, 2) if w % 2 == 0 else (w, 1)


def dp_tp_training(steps: int = 5, optimizer: str = "adamw", global_batch: int = 8, config: GPTConfig | None = None,
                   mesh_shape: tuple[int, int] | None = (2, 2)) -> dict:
    """Rank function: ranks on a (dp, tp) mesh; our TP inside each "tp" group, gradients averaged over "dp".

    Each TP group gets ``global_batch / dp`` sequences (its dp rank's shard); after backward every
    gradient shard is averaged over the "dp" group (one flat all-reduce, like a DDP bucket). Returns
    this rank's coordinates, weight shards, losses and the step-0 collectives per (op, group).
    """
    config = config or parallel_config()
    dev = device()
    mesh_shape = mesh_shape or _auto_mesh()
    check_mesh(mesh_shape, dist.get_world_size())
    dp, tp = mesh_shape
    mesh = init_device_mesh(dev.type, mesh_shape, mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    dp_rank = mesh.get_local_rank("dp")
    model = tensor_parallel_gpt(GPT(config, seed=0).to(dev), process_group=tp_group)
    opt = make_optimizer(optimizer, model.parameters())
    losses, per_group, ring = [], {}, {}
    for step in range(steps):
        x, y = shard_batch(*step_batch(step, config, global_batch, dev), dp_rank, dp)
        with comm.CommLog() as log:
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, group=dp_group, tag="grad")
            flat /= dp
            for g, v in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(v.view_as(g))
            opt.step()
        if step == 0:
            for r in log.records:
                key = f"{r.op}@{r.group}"
                per_group[key] = per_group.get(key, 0) + 1
                ring[r.group] = ring.get(r.group, 0.0) + r.ring_bytes
        losses.append(loss.item())
    return {"rank": dist.get_rank(), "dp_rank": dp_rank, "tp_rank": mesh.get_local_rank("tp"), "losses": losses,
            "state": {n: _cpu(p) for n, p in model.named_parameters()}, "collectives_step0": per_group,
            "ring_bytes_step0": ring, "tokens_per_rank": x.numel()}


def fsdp_tp_step(config: GPTConfig | None = None, global_batch: int = 8,
                 mesh_shape: tuple[int, int] | None = (2, 2)) -> dict:
    """Rank function: DTensor TP over "tp", then FSDP2 ``fully_shard`` over the "dp" sub-mesh (torchtitan's order).

    One forward + backward; returns the full gradients (``full_tensor()`` over both dimensions) and
    the collectives per (op, mesh dimension).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    from ..comm import CollectiveCounter

    config = config or parallel_config()
    dev = device()
    mesh_shape = mesh_shape or _auto_mesh()
    check_mesh(mesh_shape, dist.get_world_size())
    mesh = init_device_mesh(dev.type, mesh_shape, mesh_dim_names=("dp", "tp"))
    model = parallelize_gpt(GPT(config, seed=0).to(dev), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    x, y = shard_batch(*step_batch(0, config, global_batch, dev), mesh.get_local_rank("dp"), mesh_shape[0])
    with CollectiveCounter() as cc, loss_parallel():
        _, loss = model(x, y)
        loss.backward()
    per_group = {}
    for r in cc.records:
        per_group[f"{r.op}@{r.group}"] = per_group.get(f"{r.op}@{r.group}", 0) + 1
    return {"grads": {n: _full(p.grad) for n, p in model.named_parameters()}, "collectives": per_group}


# =========================================================================== one spawn for the notebook


def notebook_suite(config: GPTConfig | None = None, batch_size: int = 8, steps: int = 10,
                   alpha_beta_sizes: tuple = (2**10, 2**12, 2**20, 2**22)) -> dict:
    """Rank function: what notebook 06 runs on the TP group, in one spawn (each spawn costs seconds).

    Also sweeps all-reduce sizes with chapter 00's benchmark (fit α and β in the parent).
    """
    from .collectives import bandwidth_benchmark

    config = config or parallel_config()
    return {"layers": linear_layers(), "tp": tp_step(config, batch_size),
            "sp": tp_step(config, batch_size, sequence_parallel=True),
            "train": tp_training(steps, "adamw", batch_size, config), "dtensor": dtensor_step(config, batch_size),
            "dtensor_sp": dtensor_sequence_parallel_blocks(config),
            "alpha_beta_rows": bandwidth_benchmark(sizes_bytes=alpha_beta_sizes, ops=("all_reduce",), iters=2,
                                                   warmup=1, repeats=3)}


def mesh_suite(config: GPTConfig | None = None, global_batch: int = 8, steps: int = 5) -> dict:
    """Rank function: the 2-D mesh cases of notebook 06 in one spawn (4 ranks): DP×TP (ours), FSDP2×TP."""
    config = config or parallel_config()
    return {"dp_tp": dp_tp_training(steps, "adamw", global_batch, config),
            "fsdp_tp": fsdp_tp_step(config, global_batch)}
