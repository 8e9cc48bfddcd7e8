"""Three axes at once: data × pipeline × tensor parallelism on one mesh, equal to one device.

Rank layout, pipeline outermost and tensor innermost (torchtitan's mesh order: TP's all-reduces
are the most frequent, so its ranks are neighbours — on a GPU node, the GPUs of one NVLink island)::

    rank = (stage · dp + replica) · tp + k        (stage s, data replica d, TP index k)

Three families of process groups follow from it:

* **tensor** (s, d): the ``tp`` ranks that hold the same stage of the same replica; each block of
  the stage is split by :func:`course_lib.tensor_parallel.parallelize_attention` /
  :func:`~course_lib.tensor_parallel.parallelize_mlp` (two all-reduces per block forward, two
  in backward);
* **pipeline** (d, k): the ``pp`` ranks, one per stage, that pass activations along; the
  :class:`~course_lib.pipeline.PipelineRunner` takes their global ranks;
* **data** (s, k): the ``dp`` ranks that hold the same shard of the same stage; their gradients
  are averaged with one all-reduce per parameter after the pipeline step.

The embedding, final LayerNorm and head are not split: within a TP group they see the same input
and the same upstream gradient (the blocks' outputs are all-reduced), so their gradients agree
without any reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .. import comm
from ..launch import device
from ..models import GPT, GPTConfig
from ..pipeline import PipelineRunner, make_schedules, split_gpt
from ..results import Result, for_optimizer
from ..tensor_parallel import check_no_dropout, parallelize_attention, parallelize_mlp
from .common import make_optimizer, parallel_config, reference_run, shard_batch, step_batch

__all__ = ["Mesh3D", "mesh_3d", "tensor_parallel_stage", "Parallel3DResult", "dp_pp_tp_training"]


@dataclass(frozen=True)
class Mesh3D:
    """Where this rank sits on the (pp, dp, tp) mesh, and the three groups it belongs to."""

    stage: int
    replica: int
    k: int  # index inside the tensor-parallel group
    tp_group: object
    dp_group: object
    pipeline_ranks: list  # the global rank of each stage of this (replica, k) pipeline


def mesh_3d(pp: int, dp: int, tp: int) -> Mesh3D:
    """Every rank calls this with the same sizes (``new_group`` is collective over the world)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp * dp * tp != world:
        raise ValueError(f"pp={pp} × dp={dp} × tp={tp} = {pp * dp * tp} ≠ world_size={world}")

    def at(s: int, d: int, k: int) -> int:
        return (s * dp + d) * tp + k

    stage, rest = divmod(rank, dp * tp)
    replica, k = divmod(rest, tp)
    tp_group = dp_group = None
    for s in range(pp):  # every rank creates every group, in the same order
        for d in range(dp):
            group = dist.new_group([at(s, d, j) for j in range(tp)])
            if (s, d) == (stage, replica):
                tp_group = group
    for s in range(pp):
        for j in range(tp):
            group = dist.new_group([at(s, d, j) for d in range(dp)])
            if (s, j) == (stage, k):
                dp_group = group
    pipeline = [at(s, replica, k) for s in range(pp)]
    return Mesh3D(stage, replica, k, tp_group, dp_group, pipeline)


def tensor_parallel_stage(stage_module, n_head: int, tp_group):
    """In place: every block of a pipeline stage split over ``tp_group`` (Megatron's f/g). Returns it."""
    for block in stage_module.blocks.values():
        parallelize_attention(block.attn, n_head, process_group=tp_group)
        parallelize_mlp(block.mlp, process_group=tp_group)
    return stage_module


@dataclass
class Parallel3DResult(Result):
    """One rank's stage shard after DP × PP × TP training, against one device."""

    rank: int
    stage: int
    replica: int
    k: int
    losses: list  # mean loss over the micro-batches per step (last stage only, else None)
    tp_allreduces: int  # per step, in this rank's TP group
    dp_allreduces: int  # per step, in this rank's data-parallel group


def dp_pp_tp_training(
    pp: int = 2,
    dp: int | None = None,
    tp: int = 2,
    optimizer: str = "adamw",
    steps: int = 3,
    num_microbatches: int = 2,
    global_batch: int = 8,
    schedule: str = "1f1b",
    config: GPTConfig | None = None,
) -> Parallel3DResult:
    """Rank function: a GPT trained with ``pp`` stages × ``dp`` replicas × ``tp``-way tensor parallelism.

    Each replica takes its ``1/dp`` of each global batch and runs ``schedule`` over ``pp`` stages
    whose blocks are split ``tp`` ways; then every gradient is averaged over the data-parallel
    group. Rows: this rank's shard against the same shard of one device trained on the full
    batches (the one-device model, cut and split by the same functions), and the collectives per
    step in each group (TP: 4 all-reduces per block and micro-batch; DP: one per parameter).
    ``dp=None``: the world's remaining factor, ``world_size / (pp · tp)``.
    """
    config = config or parallel_config()
    if dp is None:
        dp = max(1, dist.get_world_size() // (pp * tp))
    check_no_dropout(config, "dp_pp_tp_training")
    mesh = mesh_3d(pp, dp, tp)
    dev, rank = device(), dist.get_rank()
    stage = split_gpt(GPT(config, seed=0), pp)[mesh.stage]
    tensor_parallel_stage(stage, config.n_head, mesh.tp_group).to(dev)
    micro = global_batch // dp // num_microbatches
    runner = PipelineRunner(
        [stage],
        mesh.stage,
        make_schedules(schedule, pp, num_microbatches),
        num_microbatches,
        activation_shape=(micro, config.block_size, config.d_model),
        ranks=mesh.pipeline_ranks,
        device=dev,
    )
    opt = make_optimizer(optimizer, runner.params)
    losses = []
    with comm.CommLog() as log:
        for step in range(steps):
            batch = step_batch(step, config, global_batch, dev)
            x, y = shard_batch(*batch, rank=mesh.replica, world_size=dp)
            opt.zero_grad(set_to_none=True)
            mb_losses = runner.step(x, y)
            for q in runner.params if dp > 1 else []:
                comm.all_reduce(q.grad, group=mesh.dp_group, tag="dp_grad")
                q.grad.div_(dp)
            opt.step()
            losses.append(sum(mb_losses) / num_microbatches if mb_losses else None)

    one = reference_run(config, steps, global_batch, optimizer, dev=dev)[0]
    want = tensor_parallel_stage(split_gpt(one, pp)[mesh.stage], config.n_head, mesh.tp_group)
    got = {n: t.detach() for n, t in stage.state_dict().items()}
    want = {n: t.detach() for n, t in want.state_dict().items()}
    blocks = len(stage.blocks)
    res = Parallel3DResult(
        rank,
        mesh.stage,
        mesh.replica,
        mesh.k,
        losses,
        (log.count(op="all_reduce") - log.count(op="all_reduce", tag="dp_grad")) // steps,
        log.count(op="all_reduce", tag="dp_grad") // steps,
        title=f"DP {dp} × PP {pp} × TP {tp}: rank {rank} (stage {mesh.stage}, "
        f"replica {mesh.replica}, TP index {mesh.k})",
    )
    res.equal(
        f"stage {mesh.stage} shard after {steps} {optimizer} steps",
        got,
        want,
        for_optimizer(optimizer),
        against="one device, same shard",
    )
    res.exact(
        "TP all-reduces per step",
        res.tp_allreduces,
        4 * blocks * num_microbatches,
        f"4 per block ({blocks}) and micro-batch ({num_microbatches}): f and g, fwd and bwd",
    )
    res.exact(
        "DP all-reduces per step",
        res.dp_allreduces,
        len(runner.params) if dp > 1 else 0,
        "one per parameter of the stage (none with one replica)",
    )
    return res
