"""Chapter 06's measurements: tensor parallelism equal to one device, its collectives counted, DTensor, DP×TP.

Rank functions (run them with ``launch.spawn``), most returning a :class:`~course_lib.results.Result`:

* :func:`linear_layers` — Column/RowParallelLinear with biases vs ``nn.Linear``
  (:class:`LinearLayersResult`);
* :func:`tp_step` — one forward + backward of the TP GPT: logits, loss, gradient shards, the
  collectives of each phase, per-rank weight bytes, saved activation bytes (a dict: chapter 10
  reads its keys);
* :func:`tp_training` — AdamW steps; this rank's weight shards (:class:`ShardsResult`);
* :func:`dtensor_step` — the same plan with ``parallelize_module`` and ``loss_parallel``; the two
  traps (:class:`DTensorResult`); :func:`dtensor_sequence_parallel_blocks` (:class:`DTensorSPResult`);
* :func:`dp_tp_training` — a 2-D mesh: DP over one dimension, our TP over the other, collectives
  counted per mesh dimension (:class:`DPTPResult`);
* :func:`fsdp_tp_step` — FSDP2 on the "dp" sub-mesh of a DTensor-TP model (:class:`FSDPTPResult`);
* :func:`notebook_suite` / :func:`mesh_suite` — several in one spawn.

Parent-side: :func:`merge_shards` (the full tensors from every TP rank's shards, by
:func:`tp_shard_dim`); :func:`check_mesh`. The DTensor plans are technique:
:func:`~course_lib.tensor_parallel.dtensor_plan`, :func:`~course_lib.tensor_parallel.parallelize_gpt`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from .. import comm
from ..launch import device
from ..memory import SavedTensorMeter
from ..models import GPT, GPTConfig
from ..results import ADAMW, SGD, Result, for_optimizer
from ..tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    dtensor_plan,
    dtensor_sequence_parallel_plan,
    parallelize_gpt,
    tensor_parallel_gpt,
)
from .common import (
    make_optimizer,
    parallel_config,
    reference_run,
    shard_batch,
    step_batch,
    train_step,
)

__all__ = [
    "parallel_config",
    "tp_shard_dim",
    "check_mesh",
    "merge_shards",
    "LinearLayersResult",
    "linear_layers",
    "tp_step",
    "ShardsResult",
    "tp_training",
    "dtensor_plan",
    "parallelize_gpt",
    "DTensorResult",
    "dtensor_step",
    "DTensorSPResult",
    "dtensor_sequence_parallel_blocks",
    "DPTPResult",
    "dp_tp_training",
    "FSDPTPResult",
    "fsdp_tp_step",
    "notebook_suite",
    "mesh_suite",
    "tp_allreduce_gaps",
    "tp_vs_dp_step_times",
]


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone()


def tp_shard_dim(name: str) -> int | None:
    """Along which dim a full parameter is split in the TP GPT (0 rows, 1 columns, None replicated)."""
    if name.endswith(
        ("c_attn.weight", "c_fc.weight", "lm_head.weight", "wte.weight", "c_attn.bias", "c_fc.bias")
    ):
        return 0
    if name.endswith("c_proj.weight"):
        return 1
    return None


def check_mesh(shape: tuple[int, ...], world_size: int) -> None:
    """Raise unless the mesh's sizes multiply to the world size."""
    if math.prod(shape) != world_size:
        raise ValueError(
            f"mesh shape {tuple(shape)} has {math.prod(shape)} ranks but world_size={world_size}: "
            f"the product of the mesh dimensions must equal the number of ranks"
        )


def _get(result, key: str):
    return result[key] if isinstance(result, dict) else getattr(result, key)


def merge_shards(results: list, key: str = "grads") -> dict[str, torch.Tensor]:
    """Parent-side: the full tensors from the TP ranks' ``results[r][key]`` (in TP-rank order)."""
    merged = {}
    for name, t in _get(results[0], key).items():
        d = tp_shard_dim(name)
        merged[name] = t if d is None else torch.cat([_get(r, key)[name] for r in results], d)
    return merged


def _my_shards(full: dict, names, tp_size: int, tp_rank: int) -> dict:
    """TP rank ``tp_rank``'s slice of each full tensor (``tp_shard_dim``), for the names given."""
    out = {}
    for name in names:
        d = tp_shard_dim(name)
        out[name] = full[name] if d is None else full[name].chunk(tp_size, d)[tp_rank]
    return out


# =========================================================================== single layers


@dataclass
class LinearLayersResult(Result):
    """Column- and row-parallel layers against the unsplit ``nn.Linear``, on this rank.

    ``layers[kind]`` ("column", "row") holds ``y``, ``x_grad``, ``weight_grad`` and ``bias_grad``
    (this rank's slice where the layer is split).
    """

    rank: int
    layers: dict = field(repr=False)


def linear_layers(
    in_features: int = 16, out_features: int = 24, batch: int = 4, bias: bool = True, seed: int = 0
) -> LinearLayersResult:
    """Rank function: ``nn.Linear(seed)`` split column-wise (gathered output) and row-wise (full input).

    Each layer's output, input gradient and parameter-gradient shards for the loss ``Σ (y · w)`` with
    a fixed ``w``, compared on this rank with the unsplit ``nn.Linear`` within
    :data:`~course_lib.results.SGD` (what a technique's gradients must meet before an SGD update: only
    the order of fp32 additions differs, but over O(1) terms, beyond REORDERED's atol).
    """
    dev, rank, t = device(), dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    full = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    full = full.to(dev)
    x = torch.randn(batch, in_features, generator=gen).to(dev)
    w = torch.randn(batch, out_features, generator=gen).to(dev)
    out = {}
    for kind, layer in (
        ("column", ColumnParallelLinear.from_linear(full, gather_output=True)),
        ("row", RowParallelLinear.from_linear(full, input_is_parallel=False)),
    ):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        (y * w).sum().backward()  # a fixed output gradient w: one layer, no model, no optimizer
        out[kind] = {
            "y": _cpu(y),
            "x_grad": _cpu(xi.grad),
            "weight_grad": _cpu(layer.weight.grad),
            "bias_grad": None if layer.bias is None else _cpu(layer.bias.grad),
        }
    xr = x.clone().requires_grad_(True)
    y = full(xr)
    (y * w).sum().backward()
    res = LinearLayersResult(
        rank, out, title=f"parallel linear layers vs nn.Linear, rank {rank} of {t}"
    )
    for kind, dim in (("column", 0), ("row", 1)):
        got = out[kind]
        want = {"y": y, "x_grad": xr.grad, "weight_grad": full.weight.grad.chunk(t, dim)[rank]}
        if bias:  # column: this rank's slice; row: the full bias, added once (not t times)
            want["bias_grad"] = (
                full.bias.grad.chunk(t)[rank] if kind == "column" else full.bias.grad
            )
        for name in want:
            res.equal(f"{kind} parallel: {name}", got[name], want[name], SGD, against="nn.Linear")
    return res


# =========================================================================== the TP GPT


def _phase_counts(log: comm.CommLog) -> dict:
    return {f"{r['op']}:{r['tag']}": r["calls"] for r in log.summary()}


def tp_step(
    config: GPTConfig | None = None, batch_size: int = 8, sequence_parallel: bool = False
) -> dict:
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
    block_linear = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if n.startswith("blocks.") and ".ln_" not in n
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rank": dist.get_rank(),
        "logits": _cpu(logits),
        "loss": loss.item(),
        "grads": {n: _cpu(p.grad) for n, p in model.named_parameters()},
        "forward": _phase_counts(fwd),
        "backward": _phase_counts(bwd),
        "forward_ring_bytes": fwd.total("ring_bytes"),
        "backward_ring_bytes": bwd.total("ring_bytes"),
        "block_tp_ring_bytes": fwd.total("ring_bytes", tag="tp")
        + bwd.total("ring_bytes", tag="tp"),
        "block_linear_bytes": block_linear,
        "other_param_bytes": total - block_linear,
        "activation_bytes": meter.bytes,
        "tokens": x.numel(),
    }


@dataclass
class ShardsResult(Result):
    """This rank's weight shards after training (``state``: names of the full model, local slices)."""

    rank: int
    losses: list
    state: dict = field(repr=False)


def tp_training(
    steps: int = 10,
    optimizer: str = "adamw",
    batch_size: int = 8,
    config: GPTConfig | None = None,
    sequence_parallel: bool = False,
) -> ShardsResult:
    """Rank function: ``steps`` optimizer steps of the TP GPT on ``step_batch(0 … steps−1)``; this rank's shards.

    The row compares them with this rank's slices of one device trained on the same batches
    (``reference_run``, here on the rank).
    """
    config = config or parallel_config()
    dev, rank, t = device(), dist.get_rank(), dist.get_world_size()
    model = tensor_parallel_gpt(GPT(config, seed=0).to(dev), sequence_parallel=sequence_parallel)
    opt = make_optimizer(optimizer, model.parameters())
    sp_grads = lambda: allreduce_sequence_parallel_grads(model)  # noqa: E731 — sums partial LayerNorm grads
    losses = [
        train_step(model, opt, *step_batch(step, config, batch_size, dev), after_backward=sp_grads)
        for step in range(steps)
    ]
    state = {n: _cpu(p) for n, p in model.named_parameters()}
    ref = reference_run(config, steps, batch_size, optimizer)[0].state_dict()
    res = ShardsResult(
        rank, losses, state, title=f"TP{' + SP' if sequence_parallel else ''} training, rank {rank}"
    )
    res.equal(
        f"rank {rank}'s shards after {steps} {optimizer} steps",
        state,
        _my_shards(ref, state, t, rank),
        for_optimizer(optimizer),
    )
    return res


# =========================================================================== DTensor


def _full(t):
    return _cpu(t.full_tensor() if hasattr(t, "full_tensor") else t)


def _one_device_step(config: GPTConfig, batch_size: int, dev) -> tuple[torch.Tensor, float, dict]:
    """One device on ``step_batch(0)``: logits, loss and gradients (one ``reference_run`` SGD step's ``.grad``)."""
    model, losses, _ = reference_run(config, 1, batch_size, "sgd", dev=dev)
    with torch.no_grad():
        logits = GPT(config, seed=0).to(dev)(step_batch(0, config, batch_size, dev)[0])[0]
    return logits, losses[0], {n: p.grad for n, p in model.named_parameters()}


@dataclass
class DTensorResult(Result):
    """The DTensor TP GPT's step on this rank (full tensors) and the two traps."""

    loss: float
    logits: torch.Tensor = field(repr=False)
    grads: dict = field(repr=False)
    collectives: dict  # {"all_reduce:forward"/"…:backward": calls}
    tied_after_parallelize: bool | None = None
    local_logits_error: str | None = None


def dtensor_step(
    config: GPTConfig | None = None, batch_size: int = 8, traps: bool = True
) -> DTensorResult:
    """Rank function: the DTensor TP GPT, one forward + backward under ``loss_parallel()``; full grads.

    With ``traps``: (1) ``parallelize_module`` on a *tied* GPT — is the tie still there afterwards?
    (2) the default ``ColwiseParallel()`` head (local logits) under the GPT's own cross-entropy:
    the error it raises (the local V/t logits meet targets in [0, V)). Rows: logits, loss and
    gradients against one device on this rank, the collectives against ours, the traps sprung.
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
    res = DTensorResult(
        _full(loss).item(),
        _full(logits),
        {n: _full(p.grad) for n, p in model.named_parameters()},
        {f"{r['op']}:{r['tag']}": r["calls"] for r in cc.summary()},
        title=f"DTensor parallelize_module, rank {dist.get_rank()}",
    )
    ref_logits, ref_loss, ref_grads = _one_device_step(config, batch_size, dev)
    res.equal("DTensor logits (full_tensor)", res.logits, ref_logits, SGD)
    res.equal("DTensor loss", res.loss, ref_loss, SGD)
    res.equal("DTensor gradients (full_tensor)", res.grads, ref_grads, SGD)
    L = config.n_layer
    res.exact(
        "DTensor collectives",
        res.collectives,
        {"all_reduce:forward": 2 * L + 1 + 3, "all_reduce:backward": 2 * L + 1},
        "ours: 2 per block + embedding + 3 (loss) forward, 2 per block + head backward",
    )
    if traps:
        out = {}
        tied = GPT(parallel_config(tie_weights=True), seed=0).to(dev)
        plan = dtensor_plan(config.n_layer, loss_parallel=False)
        plan["lm_head"] = type(plan["lm_head"])()  # the trap is about the tie, not the loss
        tied = parallelize_module(tied, mesh, plan)
        out["tied_after_parallelize"] = tied.lm_head.weight is tied.wte.weight
        naive = parallelize_module(
            GPT(config, seed=0).to(dev),
            mesh,
            {**dtensor_plan(config.n_layer), "lm_head": plan["lm_head"]},
        )
        try:
            naive(x, y)
            out["local_logits_error"] = None
        except Exception as exc:  # noqa: BLE001 — the error itself is what we report
            out["local_logits_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        dist.barrier()
        res.tied_after_parallelize, res.local_logits_error = (
            out["tied_after_parallelize"],
            out["local_logits_error"],
        )
        res.condition(
            "trap 1: default ColwiseParallel head under the GPT's loss",
            res.local_logits_error,
            res.local_logits_error is not None,
            "raises (local V/t logits, targets in [0, V))",
        )
        res.condition(
            "trap 2: a tied GPT still tied after parallelize_module",
            res.tied_after_parallelize,
            res.tied_after_parallelize is False,
            "False: the tie is silently gone",
        )
    return res


@dataclass
class DTensorSPResult(Result):
    """The GPT's blocks under DTensor sequence parallelism, on this rank."""

    grads: dict = field(repr=False)  # full tensors
    x_grad: torch.Tensor = field(repr=False)  # this rank's s/t positions
    ln_placements: dict  # LayerNorm weight gradient -> its placement's name
    ln_local: dict = field(repr=False)  # their local (partial) values


def _blocks_sum_of_squares(blocks, x: torch.Tensor) -> torch.Tensor:
    """Σ out² of the blocks on ``x``, backward run: a loss for blocks without the GPT's head."""
    h = x
    for block in blocks:
        h = block(h)
    h.pow(2).sum().backward()  # blocks only, a sequence shard in: no model(x, y) for train_step
    return x.grad


def dtensor_sequence_parallel_blocks(
    config: GPTConfig | None = None, batch_size: int = 2, seed: int = 1
) -> DTensorSPResult:
    """Rank function: the GPT's blocks with DTensor sequence parallelism (torchtitan's plan), loss Σ out².

    The input ``x`` (``randn(b, s, h)`` from ``seed``) arrives as this rank's s/t positions; LayerNorms
    are ``SequenceParallel()``, attention and MLP gather the sequence (``PrepareModuleInput``) and the
    row-parallel outputs are ``Shard(1)``. Returns the full gradients, the LayerNorm weight gradients'
    placements (``Partial``: DTensor defers their all-reduce over TP), their local (partial) values,
    and ``x``'s gradient block; rows compare them with the unsplit blocks run on this rank.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    config = config or parallel_config()
    dev, t, r = device(), dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(dev.type, (t,), mesh_dim_names=("tp",))
    plan = dtensor_sequence_parallel_plan(config.n_layer)
    blocks = parallelize_module(GPT(config, seed=0).blocks.to(dev), mesh, plan)
    x = torch.randn(
        batch_size, config.block_size, config.d_model, generator=torch.Generator().manual_seed(seed)
    )
    x_grad = _blocks_sum_of_squares(
        blocks, x.to(dev).chunk(t, 1)[r].contiguous().requires_grad_(True)
    )
    ln = {n: p.grad for n, p in blocks.named_parameters() if ".ln_" in f".{n}"}
    res = DTensorSPResult(
        {n: _full(p.grad) for n, p in blocks.named_parameters()},
        _cpu(x_grad),
        {n: type(g.placements[0]).__name__ for n, g in ln.items()},
        {n: _cpu(g.to_local()) for n, g in ln.items()},
        title=f"DTensor sequence parallelism (blocks), rank {r}",
    )
    ref = GPT(config, seed=0).blocks.to(dev)
    ref_x_grad = _blocks_sum_of_squares(ref, x.to(dev).clone().requires_grad_(True))
    want = {n: p.grad for n, p in ref.named_parameters()}
    res.equal("full_tensor() of every block gradient", res.grads, want, SGD)
    res.equal("x.grad of this rank's positions", res.x_grad, ref_x_grad.chunk(t, 1)[r], SGD)
    kinds = set(res.ln_placements.values())
    res.condition(
        "LayerNorm weight gradients' placement",
        kinds,
        kinds == {"Partial"} and len(ln) == 2 * config.n_layer,
        f"Partial, all {2 * config.n_layer}: the all-reduce over TP is deferred",
    )
    if t > 1:
        partial = not any(ADAMW.ok(res.ln_local[n], want[n]) for n in ln)
        res.condition(
            "a rank's local LayerNorm gradients alone differ from one device",
            partial,
            partial,
            f"beyond {ADAMW} for every one",
        )
    return res


# =========================================================================== 2-D: DP × TP


def _auto_mesh() -> tuple[int, int]:
    """(world/2, 2) on an even world, else (world, 1): what ``mesh_shape=None`` means."""
    w = dist.get_world_size()
    return (w // 2, 2) if w % 2 == 0 else (w, 1)


@dataclass
class DPTPResult(ShardsResult):
    """One rank of DP × TP: its mesh coordinates, weight shards, and step 0's collectives per mesh dimension."""

    dp_rank: int
    tp_rank: int
    collectives_step0: dict  # {"op@group": calls}
    ring_bytes_step0: dict  # {group: ring bytes}
    tokens_per_rank: int


def _average_over(model: nn.Module, group, size: int) -> None:
    """Every gradient averaged over ``group`` in one flat all-reduce (like one DDP bucket)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group, tag="grad")
    flat /= size
    for g, v in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(v.view_as(g))


def dp_tp_training(
    steps: int = 5,
    optimizer: str = "adamw",
    global_batch: int = 8,
    config: GPTConfig | None = None,
    mesh_shape: tuple[int, int] | None = (2, 2),
) -> DPTPResult:
    """Rank function: ranks on a (dp, tp) mesh; our TP inside each "tp" group, gradients averaged over "dp".

    Each TP group gets ``global_batch / dp`` sequences (its dp rank's shard); after backward every
    gradient shard is averaged over the "dp" group (one flat all-reduce, like a DDP bucket). Rows:
    this rank's shards against one device on the full batches, and step 0's collectives: 4 per block,
    1 embedding, 1 head and 3 loss all-reduces on "tp", one gradient all-reduce on "dp".
    """
    config = config or parallel_config()
    dev = device()
    mesh_shape = mesh_shape or _auto_mesh()
    check_mesh(mesh_shape, dist.get_world_size())
    dp, tp = mesh_shape
    mesh = init_device_mesh(dev.type, mesh_shape, mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh.get_group("tp"), mesh.get_group("dp")
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = tensor_parallel_gpt(GPT(config, seed=0).to(dev), process_group=tp_group)
    opt = make_optimizer(optimizer, model.parameters())
    average = lambda: _average_over(model, dp_group, dp)  # noqa: E731
    losses, per_group, ring = [], {}, {}
    for step in range(steps):
        x, y = shard_batch(*step_batch(step, config, global_batch, dev), dp_rank, dp)
        with comm.CommLog() as log:
            losses.append(train_step(model, opt, x, y, after_backward=average))
        if step == 0:
            for r in log.records:
                key = f"{r.op}@{r.group}"
                per_group[key] = per_group.get(key, 0) + 1
                ring[r.group] = ring.get(r.group, 0.0) + r.ring_bytes
    state = {n: _cpu(p) for n, p in model.named_parameters()}
    res = DPTPResult(
        dist.get_rank(),
        losses,
        state,
        dp_rank,
        tp_rank,
        per_group,
        ring,
        x.numel(),
        title=f"DP × TP, dp rank {dp_rank}, tp rank {tp_rank}",
    )
    ref = reference_run(config, steps, global_batch, optimizer)[0].state_dict()
    res.equal(
        f"dp {dp_rank}, tp {tp_rank}: shards after {steps} {optimizer} steps",
        state,
        _my_shards(ref, state, tp, tp_rank),
        for_optimizer(optimizer),
    )
    if dp > 1 and tp > 1:
        want = {"all_reduce@tp": 4 * config.n_layer + 1 + 1 + 3, "all_reduce@dp": 1}
        res.exact(
            "step 0's collectives per mesh dimension",
            per_group,
            want,
            "4 per block + embedding + head + 3 (loss) on tp; 1 gradient all-reduce on dp",
        )
    return res


@dataclass
class FSDPTPResult(Result):
    """FSDP2 × DTensor TP on this rank: full gradients and the collectives per (op, mesh dimension)."""

    grads: dict = field(repr=False)
    collectives: dict  # {"op@group": calls}


def fsdp_tp_step(
    config: GPTConfig | None = None,
    global_batch: int = 8,
    mesh_shape: tuple[int, int] | None = (2, 2),
) -> FSDPTPResult:
    """Rank function: DTensor TP over "tp", then FSDP2 ``fully_shard`` over the "dp" sub-mesh (torchtitan's order).

    One forward + backward: the full gradients (``full_tensor()`` over both dimensions) against one
    device on this rank, and the collectives per (op, mesh dimension): all-reduces on "tp",
    all-gathers and reduce-scatters on "dp", none on the default group.
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
    x, y = shard_batch(
        *step_batch(0, config, global_batch, dev), mesh.get_local_rank("dp"), mesh_shape[0]
    )
    with CollectiveCounter() as cc, loss_parallel():
        _, loss = model(x, y)
        loss.backward()
    per_group = {}
    for r in cc.records:
        per_group[f"{r.op}@{r.group}"] = per_group.get(f"{r.op}@{r.group}", 0) + 1
    res = FSDPTPResult(
        {n: _full(p.grad) for n, p in model.named_parameters()},
        per_group,
        title=f"FSDP2 (dp) × DTensor TP (tp), rank {dist.get_rank()}",
    )
    res.equal(
        "FSDP2 × TP gradients (full_tensor)",
        res.grads,
        _one_device_step(config, global_batch, dev)[2],
        SGD,
    )
    if mesh_shape[0] > 1 and mesh_shape[1] > 1:
        kinds = ("all_reduce@tp", "all_gather@dp", "reduce_scatter@dp")
        res.condition(
            "collectives per mesh dimension",
            per_group,
            all(per_group.get(k, 0) > 0 for k in kinds)
            and not any(k.endswith("@default") for k in per_group),
            f"{', '.join(kinds)} > 0; none @default",
        )
    return res


# =========================================================================== TP vs DP step time


def tp_allreduce_gaps(forward_s: list, backward_factor: float = 2.0) -> list[float]:
    """The idle seconds before each of the TP GPT's all-reduces in one step under the clock.

    ``forward_s``: the step's ``[(part, forward s)]`` (``wte``, ``wpe``, ``blocks.i``,
    ``lm_head``). The clock sleeps a part's forward *after* its ops and its backward *before*
    them, so each all-reduce waits behind the sleep of the part before it, or comes right after
    its pair's (0 s): forward — the embedding's sum (after the previous step's embedding
    backward), 2 per block (after the previous part's sleep, then back to back), the loss's 3
    (after the head's sleep); backward — the head's ``f`` (after its backward sleep), 2 per block
    (after the block's backward sleep). Same order and count as
    :func:`~course_lib.step_time.tp_allreduces`.
    """
    f = dict(forward_s)
    blocks = [f[f"blocks.{i}"] for i in range(sum(n.startswith("blocks.") for n in f))]
    embed, head = f.get("wte", 0.0) + f.get("wpe", 0.0), f["lm_head"]
    gaps = [backward_factor * embed]
    for prev in [embed] + blocks[:-1]:
        gaps += [prev, 0.0]
    gaps += [blocks[-1], 0.0, 0.0]
    gaps += [backward_factor * head]
    for b in reversed(blocks):
        gaps += [backward_factor * b, 0.0]
    return gaps


def _clocked_alpha(gaps: list[float], rounds: int) -> float:
    """Seconds of one small all-reduce issued as a clocked step issues them: after ``gaps``.

    Each round replays one step's calls alone (1 KiB each, so α alone), each after its idle
    gap. A step pays the *sum* of its calls, so the mean call of a round (not the median call:
    gloo's α has a heavy tail of slow wake-ups, which the step pays); the median round, as
    ``time_steps`` takes the median step; the max over ranks (the slower rank's wait is in the
    step).
    """
    x = torch.zeros(256, device=device())
    dist.barrier()
    means = []
    for _ in range(rounds):
        spent = 0.0
        for gap in gaps:
            time.sleep(gap)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            spent += time.perf_counter() - t0
        means.append(spent / len(gaps))
    t = torch.tensor([statistics.median(means)], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def tp_vs_dp_step_times(
    batches: tuple = (8, 16),
    rounds: int = 3,
    ratio: float = 10.0,
    bucket_cap_mb: float = 0.2,
    config: GPTConfig | None = None,
    alpha_rounds: int = 9,
) -> dict:
    """Rank function: TP and DP steps at the same global batches, timed under the modelled clock.

    For each global batch B of ``batches``: "TP, B=…", our TP GPT over all ranks (every rank the
    same B sequences, 1/t of every layer), and "DP, B=…", our ``DDP`` (each rank B/N sequences,
    all of every layer; buckets of ``bucket_cap_mb``, about one block), SGD steps through
    ``train_step``. One clock rate for all, calibrated on DP's smallest shard so that every block
    sleeps ≥ ``ratio`` × 2 its real compute (10: TP's all-reduces stay a visible part of a step of
    this tiny model); timed in interleaved rounds (``time_steps``).

    Returns what a prediction needs, for the caller to predict with ``course_lib.step_time``:
    ``timings`` (a Timings, no predictions yet), ``forward_s`` (``{name: [(part, forward s)]}``
    at the clock's rate, :func:`~course_lib.step_time.part_seconds`), ``buckets`` (DP's
    ``[(bytes, part whose backward completes it)]``), ``clocked_alpha`` (s: the mean small
    all-reduce of ``alpha_rounds`` replays, right before the timing, of TP's calls with the idle
    gaps its step at the smallest batch leaves before them, :func:`tp_allreduce_gaps`; gloo's α
    after a sleep is not its back-to-back α, so it is measured in the step's conditions),
    ``tp_allreduces`` (counted in one TP step at each batch, by ``CommLog``), ``rate`` and
    ``clock``.
    """
    from .. import step_time as st
    from ..clock import BACKWARD_FACTOR, AcceleratorClock, calibrate, costed_parts
    from ..ddp import DDP
    from ..timing import time_steps

    world, dev = dist.get_world_size(), device()
    config = config or parallel_config()
    bad = [b for b in batches if b % world]
    if bad:
        raise ValueError(f"global batches {bad} do not split over {world} DP ranks")
    x, y = shard_batch(*step_batch(0, config, min(batches), dev))
    rate = calibrate(GPT(config, seed=0).to(dev), x, y, ratio=ratio).rate
    rate = torch.tensor([rate], dtype=torch.float64, device=dev)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)  # one rate on every rank
    clock = AcceleratorClock(float(rate.item()))

    tp = clock.apply(tensor_parallel_gpt(GPT(config, seed=0).to(dev)))
    tp_opt = torch.optim.SGD(tp.parameters(), lr=1e-3)
    model = clock.apply(GPT(config, seed=0).to(dev))
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    dp_opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    owner, order = st.param_parts(model), [n for n, _, _ in costed_parts(model)]
    params = dict(model.named_parameters())
    buckets = []
    for names in ddp.buckets:  # a bucket is ready when its latest part in backward is done
        ps = [params[n] for n in names]
        buckets.append(
            (sum(p.numel() * 4 for p in ps), min((owner[p] for p in ps), key=order.index))
        )

    steps, forward_s, counted = {}, {}, {}
    for b in batches:
        tx, ty = step_batch(0, config, b, dev)  # TP: every rank the whole batch
        dx, dy = shard_batch(tx, ty)  # DP: this rank's B/N of it
        steps[f"TP, B={b}"] = lambda x=tx, y=ty: train_step(tp, tp_opt, x, y)
        steps[f"DP, B={b}"] = lambda x=dx, y=dy: train_step(ddp, dp_opt, x, y)
        forward_s[f"TP, B={b}"] = st.part_seconds(st.part_flops(tp, tx, ty), clock.rate)
        forward_s[f"DP, B={b}"] = st.part_seconds(st.part_flops(model, dx, dy), clock.rate)
        with clock.paused(), comm.CommLog() as log:
            steps[f"TP, B={b}"]()
        counted[b] = sum(1 for r in log.records if r.op == "all_reduce")
    gaps = tp_allreduce_gaps(forward_s[f"TP, B={min(batches)}"], BACKWARD_FACTOR)
    alpha = _clocked_alpha(gaps, alpha_rounds)  # right before the timing, as the step issues calls
    timings = time_steps(steps, rounds=rounds, clock=clock)
    return {
        "timings": timings,
        "forward_s": forward_s,
        "buckets": buckets,
        "clocked_alpha": alpha,
        "tp_allreduces": counted,
        "rate": clock.rate,
        "clock": clock.name,
    }


# =========================================================================== one spawn for the notebook


def notebook_suite(
    config: GPTConfig | None = None,
    batch_size: int = 8,
    steps: int = 10,
    alpha_beta_sizes: tuple = (2**10, 2**12, 2**20, 2**22),
) -> dict:
    """Rank function: what notebook 06 runs on the TP group, in one spawn (each spawn costs seconds).

    Also sweeps all-reduce sizes with chapter 00's benchmark (fit α and β in the parent).
    """
    from .collectives import bandwidth_benchmark

    config = config or parallel_config()
    return {
        "layers": linear_layers(),
        "tp": tp_step(config, batch_size),
        "sp": tp_step(config, batch_size, sequence_parallel=True),
        "train": tp_training(steps, "adamw", batch_size, config),
        "dtensor": dtensor_step(config, batch_size),
        "dtensor_sp": dtensor_sequence_parallel_blocks(config),
        "alpha_beta_rows": bandwidth_benchmark(
            sizes_bytes=alpha_beta_sizes, ops=("all_reduce",), iters=2, warmup=1, repeats=3
        ),
    }


def mesh_suite(config: GPTConfig | None = None, global_batch: int = 8, steps: int = 5) -> dict:
    """Rank function: the 2-D mesh cases of notebook 06 in one spawn (4 ranks): DP×TP (ours), FSDP2×TP."""
    config = config or parallel_config()
    return {
        "dp_tp": dp_tp_training(steps, "adamw", global_batch, config),
        "fsdp_tp": fsdp_tp_step(config, global_batch),
    }
