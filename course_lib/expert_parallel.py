"""Expert parallelism (GShard, Lepikhin et al. 2020): each rank holds E/e of an MoE layer's experts.

The ranks of the expert-parallel group (e ranks) hold *different tokens* — a batch split as data
parallelism splits it — and the router is replicated, so every rank routes its own tokens. The
experts are not replicated: rank q holds experts ``q·E/e … (q+1)·E/e − 1``. So the tokens travel to
their experts and back. Read top to bottom:

1. **Counts first.** Each rank counts its assignments per expert (E numbers) and the group
   all-gathers them (``comm.all_gather``, tag ``"moe_counts"``): every rank now holds the same
   (e × E) matrix ``G[r, i]`` = assignments of rank r's tokens to expert i. That is all the drop
   rule of :mod:`course_lib.moe` needs (the order is rank-major): C from N = ΣG / k, rank r's
   queue offset for expert i = ``Σ_{r' < r} G[r', i]``, and the kept matrix
   ``K[r, i] = clamp(C − offset, 0, G[r, i])``. From K, with no further exchange, every rank knows
   its **send splits** (row r, summed per destination rank's experts) and its **receive splits**
   (its experts' columns, per source rank). An all-to-all of the counts would tell each rank its
   receive splits but not the other ranks' queue offsets: the global drop rule needs the gather
   (Megatron-Core's all-to-all dispatcher all-gathers the same counts).

2. **Dispatch**: rank r sorts its kept assignments by expert (:func:`~course_lib.moe.dispatch_order`),
   which groups them by destination rank, and ``all_to_all_single`` sends chunk q (uneven:
   ``send_splits[q]`` rows of h) to rank q. The chunk for itself is a local copy.

3. **Experts run** on what arrived: per source rank, grouped by expert; a stable sort makes it
   expert-major, each expert seeing its tokens in the global token order — the same rows, in the
   same order, as on one device.

4. **Combine**: the second ``all_to_all_single``, with the splits swapped, returns every output to
   its token's rank, which multiplies by the gates and adds (``index_add``). **Two all-to-alls per
   MoE layer in forward, and two in backward.**

5. **Autograd through both.** :func:`all_to_all` is an ``autograd.Function`` whose backward is the
   reverse all-to-all (splits swapped): the gradient of every token's expert output goes back to
   the expert's rank, the gradient of every dispatched input to the token's rank. Each expert's
   weight gradient therefore sums the contributions of every rank's tokens — it is complete
   without any all-reduce over the EP group. The router (replicated, used on local tokens) gets a
   *partial* gradient on each rank: it must be all-reduced, like a data-parallel parameter.

6. **The auxiliary loss** on rank r is ``E · Σ_i f_i · P_i^(r)`` with ``f`` from the gathered counts
   (the group's) and ``P^(r)`` this rank's probability sum over N/e (its share of the group's
   tokens): the **mean over the group's ranks** equals the one-device loss over all their tokens,
   as each rank's cross-entropy (a mean over its tokens) averages to the one-device mean.

7. **EP × DP** on a (dp, ep) mesh (:func:`expert_data_parallel_mesh`): EP groups of e ranks, each a
   replica of the whole layer's experts; dp replicas of it. Every rank holds different tokens and
   its loss is the mean over them; the model's loss is the mean over all dp·e ranks. Gradients
   (:func:`allreduce_expert_parallel_grads`):

   * **dense** parameters (embeddings, attention, LayerNorms, router, head) are replicated on
     every rank: all-reduce over **all ranks**, ÷ (dp·e);
   * **expert** parameters already hold the sum over their EP group's ranks (step 5): all-reduce
     over the **DP group** only (the ranks holding the same experts), ÷ (dp·e).

8. **Traffic** (:func:`all_to_all_bytes`): per rank and direction, the tokens sent to *other*
   ranks × h × element size (the self chunk is a local copy); a capacity-padded implementation
   (GShard, Switch's einsum dispatch) sends a fixed (E, C, h) buffer instead: E·C·h.

:func:`expert_parallel_gpt` builds the EP form of an :class:`~course_lib.moe.MoEGPT` from its full
weights, as :func:`~course_lib.tensor_parallel.tensor_parallel_gpt` does for TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .moe import (
    MoE,
    RoutingStats,
    dispatch_order,
    expert_capacity,
    load_balancing_loss,
    queue_positions,
    route,
)

__all__ = [
    "check_divisible",
    "all_to_all",
    "kept_matrix",
    "split_sizes",
    "ExpertParallelMoE",
    "expert_parallel_gpt",
    "expert_data_parallel_mesh",
    "allreduce_expert_parallel_grads",
    "all_to_all_bytes",
]


def check_divisible(num_experts: int, ep_size: int) -> None:
    """Raise unless E divides into e equal parts of whole experts."""
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by ep_size={ep_size}: expert "
            "parallelism gives every rank E/e whole experts"
        )


# =========================================================================== 2., 4., 5. the all-to-all


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Forward: rows ``input_splits[q]`` go to rank q; backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0: send ``input_splits[q]`` rows to rank q,
    receive ``output_splits[q]`` from it (uneven splits)."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


# =========================================================================== 1. counts, drops, splits


def kept_matrix(counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """(e × E) assignments kept per source rank and expert: the first C of each column, rank-major."""
    offset = counts.cumsum(dim=0) - counts
    return (capacity - offset).clamp(min=0).minimum(counts)


def split_sizes(kept: torch.Tensor, rank: int) -> tuple[list[int], list[int]]:
    """``(send_splits, recv_splits)`` of ``rank`` from the kept matrix (experts contiguous per rank)."""
    e, E = kept.shape
    check_divisible(E, e)
    per = E // e
    send = kept[rank].view(e, per).sum(dim=1)
    recv = kept[:, rank * per : (rank + 1) * per].sum(dim=1)
    return send.tolist(), recv.tolist()


# =========================================================================== the layer


class ExpertParallelMoE(nn.Module):
    """An MoE layer over ``process_group`` (e ranks): the router replicated, experts ``E/e`` per rank.

    ``experts`` is an ``nn.ModuleDict`` keyed by global expert id, so parameter names are the
    one-device layer's (``experts.5.c_fc.weight``) and the ranks' state dicts merge by union.
    ``forward(x)`` takes this rank's tokens and returns ``(y, aux, RoutingStats)`` like
    :class:`~course_lib.moe.MoE`.
    """

    def __init__(self, moe: MoE, process_group=None):
        super().__init__()
        if not isinstance(moe, MoE):
            raise TypeError(
                f"ExpertParallelMoE needs a course_lib.moe.MoE, got {type(moe).__name__}"
            )
        e, r = dist.get_world_size(process_group), dist.get_rank(process_group)
        E = moe.moe.num_experts
        check_divisible(E, e)
        per = E // e
        self.moe, self.d_model, self.process_group = moe.moe, moe.d_model, process_group
        self.ep_size, self.ep_rank = e, r
        self.expert_ids = list(range(r * per, (r + 1) * per))
        self.router = moe.router  # replicated: a dense parameter
        self.experts = nn.ModuleDict({str(i): moe.experts[i] for i in self.expert_ids})
        for p in self.experts.parameters():
            p.expert_parallel = True

    @classmethod
    def from_moe(cls, moe: MoE, process_group=None) -> "ExpertParallelMoE":
        """The EP form of ``moe`` on ``process_group``: this rank keeps its experts (``moe`` is consumed)."""
        return cls(moe, process_group)

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"input has last dimension {x.shape[-1]}, expected d_model={self.d_model}"
            )
        m, shape, group = self.moe, x.shape, self.process_group
        x = x.reshape(-1, shape[-1])
        E, k, e, r = m.num_experts, m.top_k, self.ep_size, self.ep_rank
        probs, gates, experts = route(x, self.router.weight, k, m.renormalize)

        # 1. counts first: the whole group's (e × E) routing counts on every rank
        local = torch.bincount(experts.flatten(), minlength=E)
        counts = local.new_empty(e * E)
        comm.all_gather(counts, local, group=group, tag="moe_counts")
        counts = counts.view(e, E)
        total = int(counts.sum()) // k  # the group's tokens
        C = expert_capacity(total, E, k, m.capacity_factor)
        kept = kept_matrix(counts, C)
        offset = counts[:r].sum(dim=0)
        keep = queue_positions(experts, E, offset) < C
        send_splits, recv_splits = split_sizes(kept, r)

        # 2. dispatch: kept assignments sorted by expert = grouped by destination rank
        order = dispatch_order(experts, keep)
        received = all_to_all(x[order // k], recv_splits, send_splits, group)

        # 3. my experts on what arrived: (source, expert)-major → expert-major, stably
        mine = kept[:, self.expert_ids]  # (e, E/e)
        local_ids = torch.arange(len(self.expert_ids), device=x.device).repeat(e)
        perm = local_ids.repeat_interleave(mine.flatten()).argsort(stable=True)
        out = torch.cat(
            [
                expert(chunk)
                for expert, chunk in zip(
                    self.experts.values(), received[perm].split(mine.sum(0).tolist()), strict=True
                )
            ]
        )
        out = torch.empty_like(out).index_copy(0, perm, out)  # back to the arrival order

        # 4. combine: outputs back to their tokens' ranks, weighted by the gates
        back = all_to_all(out, send_splits, recv_splits, group)
        y = x.new_zeros(x.shape).index_add(0, order // k, back * gates.flatten()[order, None])

        # 6. auxiliary loss: the group's f, this rank's P over its share (N/e) of the tokens
        aux = load_balancing_loss(counts.sum(0) / (total * k), probs.sum(dim=0) / (total / e))
        stats = RoutingStats(
            counts.sum(0),
            kept.sum(0),
            int(total * k - kept.sum()),
            ~keep,
            C,
            kept,
            send_splits,
            recv_splits,
        )
        return y.view(shape), aux, stats

    def extra_repr(self) -> str:
        return f"experts {self.expert_ids} of {self.moe.num_experts}, ep_size={self.ep_size}"


def expert_parallel_gpt(model: nn.Module, process_group=None) -> nn.Module:
    """In place: every block's MoE layer (``blocks.{i}.mlp``) becomes its EP form; returns ``model``.

    ``model`` is an :class:`~course_lib.moe.MoEGPT`; its forward and loss work unchanged (the
    loss on each rank: the mean cross-entropy of its tokens + ``aux_loss_coef · Σ aux``, step 6).
    """
    layers = [b for b in getattr(model, "blocks", []) if isinstance(b.mlp, MoE)]
    if not layers:
        raise TypeError(f"{type(model).__name__} has no MoE blocks (blocks.{{i}}.mlp is an MoE)")
    for block in layers:
        block.mlp = ExpertParallelMoE.from_moe(block.mlp, process_group)
    return model


# =========================================================================== 7. EP × DP


def expert_data_parallel_mesh(ep_size: int):
    """A (dp, ep) ``DeviceMesh`` over all ranks (dims named ``"dp"`` and ``"ep"``): rank = dp_rank·e + ep_rank.

    ``mesh.get_group("ep")`` holds e ranks with different experts (consecutive ranks, the batch
    chunks in rank-major order); ``mesh.get_group("dp")`` the dp ranks that hold the same experts.
    """
    from torch.distributed.device_mesh import init_device_mesh

    from .launch import device

    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide the number of ranks {world}: the (dp, ep) mesh "
            "needs dp · ep = world size"
        )
    return init_device_mesh(device().type, (world // ep_size, ep_size), mesh_dim_names=("dp", "ep"))


def _allreduce_mean(grads: list[torch.Tensor], group, divide_by: int, tag: str, reduce=True):
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if reduce and dist.get_world_size(group) > 1:
        comm.all_reduce(flat, group=group, tag=tag)
    flat /= divide_by
    for g, v in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(v.view_as(g))


def allreduce_expert_parallel_grads(model: nn.Module, dp_group=None) -> dict[str, int]:
    """Average the gradients of an EP (× DP) model over the right groups (step 7); returns the counts.

    Dense parameters: Σ over all ranks (tag ``"dense_grad"``), ÷ world size. Expert parameters
    (marked ``expert_parallel``): Σ over ``dp_group`` (tag ``"expert_grad"``; None: no DP, nothing
    to sum), ÷ world size — their gradient already summed the EP group's tokens in the combine's
    backward. Each rank's loss must be the mean over its own tokens (the course's convention).
    """
    world = dist.get_world_size()
    params = [p for p in model.parameters() if p.grad is not None]
    dense = [p.grad for p in params if not getattr(p, "expert_parallel", False)]
    expert = [p.grad for p in params if getattr(p, "expert_parallel", False)]
    _allreduce_mean(dense, None, world, "dense_grad")
    _allreduce_mean(expert, dp_group, world, "expert_grad", reduce=dp_group is not None)
    return {"dense": len(dense), "expert": len(expert)}


# =========================================================================== 8. traffic


def all_to_all_bytes(
    kept: torch.Tensor, d_model: int, element_size: int = 4, capacity: int | None = None
) -> list[dict]:
    """Per rank of the EP group, bytes one MoE layer's all-to-alls send in each direction.

    ``kept`` (e × E): assignments kept per source rank and expert. Rank r's dispatch sends its
    tokens for *other* ranks' experts; its combine sends back what it received from other ranks
    (the self chunk is a local copy): ``tokens × d_model × element_size``. Backward sends the
    same amounts the other way (combine's backward = dispatch's volume, and vice versa).
    ``padded``: a capacity-padded implementation's fixed buffer per rank and direction,
    ``E · C · d_model · element_size`` (with ``capacity`` = C of that buffer).
    """
    e, E = kept.shape
    check_divisible(E, e)
    per, row = E // e, d_model * element_size
    out = []
    for r in range(e):
        mine = slice(r * per, (r + 1) * per)
        others = torch.ones(e, dtype=torch.bool)
        others[r] = False
        dispatch = int(kept[r].sum() - kept[r, mine].sum())
        combine = int(kept[others][:, mine].sum())
        out.append(
            {
                "dispatch": dispatch * row,
                "combine": combine * row,
                "padded": None if capacity is None else E * capacity * row,
            }
        )
    return out
