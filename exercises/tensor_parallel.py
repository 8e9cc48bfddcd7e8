"""Chapter 06 exercise: a column-parallel and a row-parallel linear layer, forward and backward.

``nn.Linear`` computes ``y = x Wᵀ + b`` with ``W`` of shape (out, in). On ``t`` ranks:

* **column parallel** — rank i holds ``W_i`` = rows ``[i·out/t, (i+1)·out/t)`` of W (and that slice of b)
  and the *full* input x. Forward: ``y_i = x W_iᵀ + b_i`` (no communication). Backward: every rank
  holds only part of ``∂L/∂x = Σ_i ∂L/∂y_i · W_i``, so it is **all-reduced** (Megatron's f).
* **row parallel** — rank i holds ``W_i`` = columns ``[i·in/t, (i+1)·in/t)`` of W and its block
  ``x_i`` of the input's last dimension. Forward: the partial sums ``x_i W_iᵀ`` are **all-reduced**
  (Megatron's g), then b is added once. Backward: ``∂L/∂x_i = ∂L/∂y · W_i`` needs no communication.

Write each as a ``torch.autograd.Function`` (forward and backward by hand), over ``group``.
Check: ``course-lib check column_parallel_linear`` and ``course-lib check row_parallel_linear``.
"""

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        # TODO: y_i = x W_iᵀ (+ b_i). Does the forward need any communication?
        raise NotImplementedError(
            "column_parallel_linear: the forward; hints: "
            "course_lib.checks.tensor_parallel.hint('column_parallel_linear', 1)"
        )

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        # TODO: ∂L/∂x (this rank only has part of it — what must happen to it?), ∂L/∂W_i, ∂L/∂b_i
        raise NotImplementedError(
            "column_parallel_linear: the backward; hints: "
            "course_lib.checks.tensor_parallel.hint('column_parallel_linear', 1)"
        )


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.save_for_backward(x_shard, weight)
        ctx.has_bias = bias is not None
        # TODO: the partial sum x_i W_iᵀ, combined over ranks; where does the bias go?
        raise NotImplementedError(
            "row_parallel_linear: the forward; hints: "
            "course_lib.checks.tensor_parallel.hint('row_parallel_linear', 1)"
        )

    @staticmethod
    def backward(ctx, grad_y):
        x_shard, weight = ctx.saved_tensors
        # TODO: ∂L/∂x_i, ∂L/∂W_i, ∂L/∂b. Does the backward need any communication?
        raise NotImplementedError(
            "row_parallel_linear: the backward; hints: "
            "course_lib.checks.tensor_parallel.hint('row_parallel_linear', 1)"
        )


def column_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None
) -> torch.Tensor:
    """``x`` (…, in) full; ``weight`` (out/t, in), ``bias`` (out/t,) this rank's rows → y_i (…, out/t)."""
    return _ColumnParallel.apply(x, weight, bias, group)


def row_parallel_linear(
    x_shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None
) -> torch.Tensor:
    """``x_shard`` (…, in/t) this rank's block; ``weight`` (out, in/t); ``bias`` (out,) full → y (…, out) full."""
    return _RowParallel.apply(x_shard, weight, bias, group)
