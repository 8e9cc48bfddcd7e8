"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): split the matrices *inside* every layer.

Read top to bottom:

1. **The communication pieces**, each a tiny ``autograd.Function`` whose forward and backward are
   one collective (or none) over the tensor-parallel ``process_group`` (t ranks):

   ====================  ============================  ==============================
   piece                 forward                       backward
   ====================  ============================  ==============================
   ``f`` copy_to_tp      identity                      all-reduce (Σ of partial dX)
   ``g`` reduce_from_tp  all-reduce (Σ of partial Y)   identity
   gather_last_dim       all-gather of column blocks   keep my block
   split_last_dim        keep my block                 all-gather
   sequence: gather      all-gather along s            reduce-scatter along s
   sequence: scatter     reduce-scatter along s        all-gather along s
   ====================  ============================  ==============================

2. **The layers**. Y = XA with A of shape (in, out) — ``nn.Linear`` stores Aᵀ as ``weight (out, in)``:

   * :class:`ColumnParallelLinear`: A = [A_1 … A_t] by *output* columns; Y_i = X·A_i from the full X,
     no communication in forward (f in front: all-reduce of dX in backward).
   * :class:`RowParallelLinear`: A = [A_1; …; A_t] by *input* rows; rank i computes the partial sum
     X_i·A_i, and Y = Σ_i X_i·A_i needs one all-reduce (g). The bias is added once, after the sum.

   Column then row (MLP: c_fc then c_proj; attention: q/k/v then c_proj) needs nothing in between:
   the column output block *is* the row input block, and GELU / per-head attention are local.
   So each block has one f and one g: **2 all-reduces forward, 2 backward per transformer layer.**

3. **Attention by heads.** The tiny GPT's fused ``c_attn`` lays its 3h outputs out head by head
   (``[q_0 k_0 v_0 | q_1 k_1 v_1 | …]``, Megatron's layout), so a contiguous column block is whole
   heads' q, k and v: :func:`qkv_rows` says which rows rank i holds. With a ``[q | k | v]`` layout
   a contiguous block would hand rank 0 all of q and part of k — it must then be sliced per q, k, v.

4. **Vocabulary parallel**: :class:`VocabParallelEmbedding` (rows of the table; out-of-range tokens
   give 0, then g sums) and :func:`vocab_parallel_cross_entropy` (max, Σexp and the target logit
   each all-reduced: 3 small all-reduces of (b·s) numbers instead of gathering (b, s, V) logits).

5. **Sequence parallelism** (Korthikanti et al. 2022): outside the parallel regions (LayerNorm,
   residual) each rank keeps s/t positions; g's all-reduce becomes a reduce-scatter along s and f's
   identity an all-gather along s — same volume (all-reduce = reduce-scatter + all-gather). Parameters
   used on a sequence shard (LayerNorm weights, position embedding, row biases) get *partial* gradients:
   :func:`allreduce_sequence_parallel_grads` sums them over the TP group.

6. :func:`tensor_parallel_gpt` builds the TP form of a tiny GPT from its full weights. Dropout > 0
   is refused (:func:`check_no_dropout`): it would need a model-parallel RNG tracker.

7. **The same plan with DTensor** (torchtitan style): :func:`dtensor_plan` is the
   ``parallelize_module`` plan for the GPT, :func:`parallelize_gpt` applies it to a "tp" mesh, and
   :func:`dtensor_sequence_parallel_plan` is the sequence-parallel plan for the GPT's blocks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import comm

__all__ = [
    "check_no_dropout",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_last_dim",
    "split_last_dim",
    "gather_sequence",
    "scatter_sequence",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "qkv_rows",
    "parallelize_mlp",
    "parallelize_attention",
    "TensorParallelGPT",
    "tensor_parallel_gpt",
    "allreduce_sequence_parallel_grads",
    "dtensor_plan",
    "parallelize_gpt",
    "dtensor_sequence_parallel_plan",
]


def check_no_dropout(config, where: str) -> None:
    """Refuse ``dropout > 0``: TP dropout needs a model-parallel RNG, which this course's TP has not.

    The rule (Megatron-LM's ``get_cuda_rng_tracker``): dropout on a *split* activation (attention
    probabilities of my heads, the MLP's hidden block) must draw a *different* mask on every TP rank,
    and dropout on a *replicated* activation (the residual stream) the *same* mask on every rank, or
    the ranks' copies of the residual stream drift apart. Two generators, forked per region, do that.
    """
    if getattr(config, "dropout", 0.0) > 0:
        raise ValueError(
            f"{where}: dropout={config.dropout} > 0 is refused — tensor parallelism needs a "
            "model-parallel RNG (Megatron's RNG tracker): split activations must draw different masks "
            "on each TP rank and replicated ones the same mask on every rank; this course's TP has no "
            "such tracker, so use dropout=0 (parallel_config())"
        )


def _size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _divisible(what: str, n: int, t: int) -> None:
    if n % t:
        raise ValueError(
            f"{what}={n} is not divisible by the tensor-parallel size t={t}: tensor parallelism "
            f"splits it into t equal parts"
        )


# =========================================================================== 1. communication pieces


def _identity(x, group, tag):
    return x


def _all_reduce(x, group, tag):
    x = x.contiguous().clone()
    comm.all_reduce(x, group=group, tag=tag)
    return x


def _all_gather_dim(x, dim, group, tag):
    t, _ = _size_rank(group)
    xs = x.movedim(dim, 0).contiguous()
    out = xs.new_empty((t * xs.shape[0],) + xs.shape[1:])
    comm.all_gather(out, xs, group=group, tag=tag)
    return out.movedim(0, dim)


def _reduce_scatter_dim(x, dim, group, tag):
    t, _ = _size_rank(group)
    _divisible(f"dimension {dim} of size", x.shape[dim], t)
    xs = x.movedim(dim, 0).contiguous()
    out = xs.new_empty((xs.shape[0] // t,) + xs.shape[1:])
    comm.reduce_scatter(out, xs, group=group, tag=tag)
    return out.movedim(0, dim)


def _my_block(x, dim, group):
    t, r = _size_rank(group)
    _divisible(f"dimension {dim} of size", x.shape[dim], t)
    return x.chunk(t, dim=dim)[r].contiguous()


_OPS = {
    "identity": _identity,
    "all_reduce": _all_reduce,
    "all_gather_last": lambda x, g, tag: _all_gather_dim(x, -1, g, tag),
    "my_block_last": lambda x, g, tag: _my_block(x, -1, g),
    "all_gather_seq": lambda x, g, tag: _all_gather_dim(x, 1, g, tag),
    "reduce_scatter_seq": lambda x, g, tag: _reduce_scatter_dim(x, 1, g, tag),
}


class _Comm(torch.autograd.Function):
    """Forward runs ``_OPS[fwd]``, backward runs ``_OPS[bwd]``: the pairs of the table above."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, group, tag):
        ctx.bwd, ctx.group, ctx.tag = bwd, group, tag
        out = _OPS[fwd](x, group, tag)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        return _OPS[ctx.bwd](grad, ctx.group, ctx.tag), None, None, None, None


def copy_to_tp(x, group=None, tag="tp"):
    """f: identity forward, all-reduce backward (entry of a parallel region)."""
    return _Comm.apply(x, "identity", "all_reduce", group, tag)


def reduce_from_tp(x, group=None, tag="tp"):
    """g: all-reduce forward, identity backward (exit of a parallel region)."""
    return _Comm.apply(x, "all_reduce", "identity", group, tag)


def gather_last_dim(x, group=None, tag="tp"):
    return _Comm.apply(x, "all_gather_last", "my_block_last", group, tag)


def split_last_dim(x, group=None, tag="tp"):
    return _Comm.apply(x, "my_block_last", "all_gather_last", group, tag)


def gather_sequence(x, group=None, tag="tp"):
    """Sequence-parallel f: all-gather along s (dim 1) forward, reduce-scatter backward."""
    return _Comm.apply(x, "all_gather_seq", "reduce_scatter_seq", group, tag)


def scatter_sequence(x, group=None, tag="tp"):
    """Sequence-parallel g: reduce-scatter along s (dim 1) forward, all-gather backward."""
    return _Comm.apply(x, "reduce_scatter_seq", "all_gather_seq", group, tag)


# =========================================================================== 2. the layers


class ColumnParallelLinear(nn.Module):
    """Y_i = X·A_i: this rank's ``out_features / t`` output columns (``weight`` is (out/t, in)).

    ``gather_output=True`` all-gathers the column blocks into the full Y; leave it False when a
    row-parallel layer (or a vocab-parallel loss) follows. ``sequence_parallel=True``: the input is
    this rank's s/t positions, all-gathered along s in forward (reduce-scattered in backward).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        process_group=None,
        sequence_parallel: bool = False,
        tag: str = "tp",
    ):
        super().__init__()
        t, _ = _size_rank(process_group)
        _divisible("out_features", out_features, t)
        self.in_features, self.out_features, self.tp_size = in_features, out_features, t
        self.gather_output, self.process_group, self.sequence_parallel, self.tag = (
            gather_output,
            process_group,
            sequence_parallel,
            tag,
        )
        self.copy_input = True
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features // t)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    @classmethod
    def from_linear(cls, linear: nn.Linear, process_group=None, **kwargs) -> "ColumnParallelLinear":
        """This rank's rows of ``linear.weight`` (= columns of A) and of its bias: comparable with ``linear``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        t, r = _size_rank(process_group)
        _divisible(f"out_features of {tuple(linear.weight.shape)} weight", linear.out_features, t)
        m = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            process_group=process_group,
            **kwargs,
        ).to(linear.weight.device, linear.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(linear.weight.chunk(t, 0)[r])
            if linear.bias is not None:
                m.bias.copy_(linear.bias.chunk(t, 0)[r])
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_sequence(x, self.process_group, self.tag)
        elif (
            self.copy_input
        ):  # False only when the caller already gathered the sequence (attention under SP)
            x = copy_to_tp(x, self.process_group, self.tag)  # f
        y = F.linear(x, self.weight, self.bias)
        return gather_last_dim(y, self.process_group, self.tag) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (local {self.out_features // self.tp_size})"


class RowParallelLinear(nn.Module):
    """Y = Σ_i X_i·A_i: this rank's ``in_features / t`` input rows of A (``weight`` is (out, in/t)).

    ``input_is_parallel=True``: the input already is this rank's last-dim block (a column-parallel
    output); False: the full input arrives and this rank keeps its block. The partial sums are
    all-reduced (g) — or reduce-scattered along s with ``sequence_parallel`` — and the bias is
    added **once**, after the sum (added before it, the all-reduce would add it t times).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        process_group=None,
        sequence_parallel: bool = False,
        tag: str = "tp",
    ):
        super().__init__()
        t, _ = _size_rank(process_group)
        _divisible("in_features", in_features, t)
        self.in_features, self.out_features, self.tp_size = in_features, out_features, t
        self.input_is_parallel, self.process_group, self.sequence_parallel, self.tag = (
            input_is_parallel,
            process_group,
            sequence_parallel,
            tag,
        )
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, process_group=None, **kwargs) -> "RowParallelLinear":
        """This rank's columns of ``linear.weight`` (= rows of A); the full bias."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        t, r = _size_rank(process_group)
        _divisible(f"in_features of {tuple(linear.weight.shape)} weight", linear.in_features, t)
        m = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            process_group=process_group,
            **kwargs,
        ).to(linear.weight.device, linear.weight.dtype)
        with torch.no_grad():
            m.weight.copy_(linear.weight.chunk(t, 1)[r])
            if linear.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last_dim(x, self.process_group, self.tag)
        y = F.linear(x, self.weight)  # partial sum X_i·A_i
        if self.sequence_parallel:
            y = scatter_sequence(y, self.process_group, self.tag)
        else:
            y = reduce_from_tp(y, self.process_group, self.tag)  # g
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features} (local {self.in_features // self.tp_size}), out={self.out_features}"


# =========================================================================== 3. MLP and attention


def parallelize_mlp(
    mlp: nn.Module, process_group=None, sequence_parallel: bool = False
) -> nn.Module:
    """In place: ``c_fc`` column-parallel, ``c_proj`` row-parallel; GELU stays local. Returns ``mlp``."""
    kw = dict(process_group=process_group, sequence_parallel=sequence_parallel)
    mlp.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, **kw)
    mlp.c_proj = RowParallelLinear.from_linear(mlp.c_proj, **kw)
    return mlp


def qkv_rows(n_head: int, head_dim: int, tp_size: int, rank: int) -> dict[str, list[int]]:
    """Rows of the fused ``c_attn.weight`` (layout ``[q_0 k_0 v_0 | q_1 k_1 v_1 | …]``) that rank holds, per q/k/v."""
    _divisible("n_head", n_head, tp_size)
    per = n_head // tp_size
    heads = range(rank * per, (rank + 1) * per)
    return {
        w: [(3 * h + j) * head_dim + d for h in heads for d in range(head_dim)]
        for j, w in enumerate("qkv")
    }


def parallelize_attention(
    attn: nn.Module, n_head: int, process_group=None, sequence_parallel: bool = False
):
    """In place: q/k/v (``c_attn``) column-parallel *by heads*, ``c_proj`` row-parallel. Returns ``attn``.

    Each rank gets ``n_head / t`` whole heads; the attention forward reads its head count off the
    tensor, so the same code runs on the shard. Heads must divide by t; ``c_attn`` must be h → 3h.
    """
    t, r = _size_rank(process_group)
    _divisible("n_head", n_head, t)
    h = attn.c_proj.in_features
    if tuple(attn.c_attn.weight.shape) != (3 * h, h):
        raise ValueError(
            f"c_attn.weight has shape {tuple(attn.c_attn.weight.shape)}, expected (3h, h) = "
            f"({3 * h}, {h}): a fused q, k, v projection"
        )
    rows = qkv_rows(n_head, h // n_head, t, r)
    kw = dict(process_group=process_group, sequence_parallel=sequence_parallel)
    col = ColumnParallelLinear.from_linear(attn.c_attn, **kw)
    with (
        torch.no_grad()
    ):  # by heads: the rows of q, k and v of this rank's heads, in the layout's order
        idx = sorted(rows["q"] + rows["k"] + rows["v"])
        col.weight.copy_(attn.c_attn.weight[idx])
        if col.bias is not None:
            col.bias.copy_(attn.c_attn.bias[idx])
    attn.c_attn = col
    attn.c_proj = RowParallelLinear.from_linear(attn.c_proj, **kw)
    if (
        sequence_parallel
    ):  # attention needs all s positions (it reads T off its input): gather before it
        col.sequence_parallel, col.copy_input = False, False
        attn.register_forward_pre_hook(
            lambda m, args: (gather_sequence(args[0], process_group, col.tag),)
        )
    return attn


# =========================================================================== 4. vocabulary parallel


class VocabParallelEmbedding(nn.Module):
    """Rows ``[r·V/t, (r+1)·V/t)`` of the token table; tokens outside give 0, then g sums the ranks' rows."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        process_group=None,
        sequence_parallel: bool = False,
        tag: str = "embed",
    ):
        super().__init__()
        t, r = _size_rank(process_group)
        _divisible("vocab_size", num_embeddings, t)
        self.num_embeddings, self.tp_size, self.process_group = num_embeddings, t, process_group
        self.sequence_parallel, self.tag = sequence_parallel, tag
        self.start, self.end = r * num_embeddings // t, (r + 1) * num_embeddings // t
        self.weight = nn.Parameter(torch.randn(num_embeddings // t, embedding_dim))

    @classmethod
    def from_embedding(
        cls, emb: nn.Embedding, process_group=None, **kwargs
    ) -> "VocabParallelEmbedding":
        t, r = _size_rank(process_group)
        m = cls(emb.num_embeddings, emb.embedding_dim, process_group, **kwargs).to(
            emb.weight.device
        )
        with torch.no_grad():
            m.weight.copy_(emb.weight.chunk(t, 0)[r])
        return m

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        out = F.embedding((idx - self.start).masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return scatter_sequence(out, self.process_group, self.tag)
        return reduce_from_tp(out, self.process_group, self.tag)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, tag):
        t, r = _size_rank(group)
        v = logits.shape[-1]
        logits = logits.float()
        m = logits.max(dim=-1).values
        comm.all_reduce(m, op=dist.ReduceOp.MAX, group=group, tag=tag)
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, group=group, tag=tag)
        local = targets - r * v
        mine = (local >= 0) & (local < v)
        picked = shifted.gather(-1, local.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1) * mine
        comm.all_reduce(picked, group=group, tag=tag)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local.clamp(0, v - 1), mine)
        return (sum_exp.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
        return g * (grad / local.numel()), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, process_group=None, tag: str = "loss"
) -> torch.Tensor:
    """Mean cross-entropy of logits split along V (this rank: columns ``[r·V/t, (r+1)·V/t)``), never gathered."""
    return _VocabParallelCE.apply(logits, targets, process_group, tag)


# =========================================================================== 5./6. the tiny GPT


class TensorParallelGPT(nn.Module):
    """The tiny GPT with every block's Linears, the token embedding and the head split over t ranks.

    ``forward(idx, targets)`` returns ``(logits, loss)``: logits are this rank's V/t vocabulary
    columns (the loss never gathers them). LayerNorms and the position embedding are replicated.
    """

    def __init__(self, gpt: nn.Module, process_group=None, sequence_parallel: bool = False):
        super().__init__()
        c = gpt.config
        check_no_dropout(c, "TensorParallelGPT")
        t, _ = _size_rank(process_group)
        for what, n in (
            ("n_head", c.n_head),
            ("d_model", c.d_model),
            ("MLP hidden size", c.mlp_ratio * c.d_model),
            ("vocab_size", c.vocab_size),
        ):
            _divisible(what, n, t)
        if sequence_parallel:
            _divisible("block_size (sequence parallelism splits the sequence)", c.block_size, t)
        self.config, self.process_group, self.sequence_parallel, self.tp_size = (
            c,
            process_group,
            sequence_parallel,
            t,
        )
        kw = dict(process_group=process_group, sequence_parallel=sequence_parallel)
        self.wte = VocabParallelEmbedding.from_embedding(gpt.wte, **kw)
        self.wpe, self.drop, self.blocks, self.ln_f = gpt.wpe, gpt.drop, gpt.blocks, gpt.ln_f
        for block in self.blocks:
            parallelize_attention(block.attn, c.n_head, **kw)
            parallelize_mlp(block.mlp, **kw)
        self.lm_head = ColumnParallelLinear.from_linear(gpt.lm_head, tag="head", **kw)
        if (
            c.tie_weights
        ):  # both split the V rows of the same (V, h) table: the tie survives as one shard
            self.lm_head.weight = self.wte.weight
        if sequence_parallel:  # used on s/t positions: partial gradients, summed over the TP group
            for p in [self.wpe.weight] + [
                p for n, p in self.named_parameters() if ".ln_" in n or n.startswith("ln_")
            ]:
                p.sequence_parallel = True

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        pos = _my_block(pos, 0, self.process_group) if self.sequence_parallel else pos
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V/t)
        loss = (
            None
            if targets is None
            else vocab_parallel_cross_entropy(logits, targets, self.process_group)
        )
        return logits, loss


def tensor_parallel_gpt(
    gpt: nn.Module, process_group=None, sequence_parallel: bool = False
) -> TensorParallelGPT:
    """The TP form of ``gpt`` on ``process_group``, sliced from its full weights (``gpt`` is consumed)."""
    return TensorParallelGPT(gpt, process_group, sequence_parallel)


def allreduce_sequence_parallel_grads(model: nn.Module, process_group=None) -> int:
    """Σ over the TP group of the gradients of parameters marked ``sequence_parallel``; returns how many."""
    grads = [
        p.grad
        for p in model.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=process_group, tag="sp_grad")
        for g, v in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(v.view_as(g))
    return len(grads)


# =========================================================================== 7. the same plan with DTensor


def dtensor_plan(n_layer: int, loss_parallel: bool = True) -> dict:
    """A ``parallelize_module`` plan for the tiny GPT (untied), as torchtitan writes one for Llama.

    ``c_attn`` is ColwiseParallel: ``Shard(0)`` of its weight is a contiguous row block, which is
    whole heads because the GPT lays q, k, v out head by head. ``loss_parallel=True`` keeps the head's
    logits a DTensor sharded on V (``use_local_output=False``), which ``loss_parallel()`` needs.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=not loss_parallel),
    }
    for i in range(n_layer):
        plan.update(
            {
                f"blocks.{i}.attn.c_attn": ColwiseParallel(),
                f"blocks.{i}.attn.c_proj": RowwiseParallel(),
                f"blocks.{i}.mlp.c_fc": ColwiseParallel(),
                f"blocks.{i}.mlp.c_proj": RowwiseParallel(),
            }
        )
    return plan


def parallelize_gpt(gpt: nn.Module, tp_mesh, loss_parallel: bool = True) -> nn.Module:
    """``parallelize_module(gpt, tp_mesh, dtensor_plan(...))``; refuses a tied GPT (it would silently untie)."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_no_dropout(gpt.config, "parallelize_gpt")
    if gpt.lm_head.weight is gpt.wte.weight:
        raise ValueError(
            "tied embedding and head: parallelize_module re-wraps the second module's parameter and "
            "silently unties them; use an untied config (parallel_config) or re-tie after it"
        )
    return parallelize_module(gpt, tp_mesh, dtensor_plan(gpt.config.n_layer, loss_parallel))


def dtensor_sequence_parallel_plan(n_layer: int) -> dict:
    """The plan for the GPT's ``blocks`` with sequence parallelism (torchtitan's): activations ``Shard(1)``.

    LayerNorms are ``SequenceParallel()`` (their weight gradients become ``Partial``: DTensor defers
    the all-reduce over TP), attention and MLP gather the sequence first (``PrepareModuleInput``), and
    the row-parallel outputs are reduce-scattered back to ``Shard(1)``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {}
    for i in range(n_layer):
        plan.update(
            {
                f"{i}.ln_1": SequenceParallel(),
                f"{i}.ln_2": SequenceParallel(),
                f"{i}.attn": gather,
                f"{i}.mlp": gather,
                f"{i}.attn.c_attn": ColwiseParallel(),
                f"{i}.mlp.c_fc": ColwiseParallel(),
                f"{i}.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                f"{i}.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    return plan
