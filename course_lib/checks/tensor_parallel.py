"""Chapter 06 checker: the learner's column- and row-parallel linear layers on real ranks.

For several shapes (2-D and 3-D inputs, with and without bias) each rank feeds its slice of a full
``nn.Linear`` (built here from a seed, the same on every rank) to the learner's function, runs a
backward with a fixed output gradient, and compares with the unsplit layer computed on this rank:
the output, ``∂L/∂x`` (column: the full input; row: this rank's block) and the weight/bias
gradients of its slice, within :data:`~course_lib.results.SGD` (a technique's outputs and gradients
against one device before any update: only the order of fp32 additions may differ). It also counts
the collectives (``CollectiveCounter``): column parallel communicates only in backward, row parallel
only in forward — one all-reduce each.

Stuck: :func:`hint` gives the idea (level 1), then the API (level 2), never the code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from . import layered_hint
from ..comm import CollectiveCounter
from ..launch import device
from ..results import SGD, max_abs_diff

__all__ = ["HINTS", "hint", "check_column_parallel_linear", "check_row_parallel_linear"]

HINTS: dict[str, tuple[str, str]] = {
    "column_parallel_linear": (
        "Ask which tensors this rank holds whole and which only in part. Forward: x is whole and "
        "W_i is this rank's output rows, so its output columns y_i = x·W_iᵀ (+ b_i) are complete "
        "here. Backward: ∂L/∂x = Σ_i ∂L/∂y_i · W_i is a sum over every rank's columns, and this "
        "rank holds one term of it; ∂L/∂W_i and ∂L/∂b_i need only this rank's ∂L/∂y_i.",
        "A torch.autograd.Function: forward(ctx, x, weight, bias, group) saves what backward "
        "needs (ctx.save_for_backward) and returns x @ weight.t() (+ bias); backward(ctx, grad_y) "
        "returns one gradient per forward input, None for group. dist.all_reduce(t, group=group) "
        "sums t in place over the group. For a 3-D x, flatten the leading dims (reshape(-1, in)) "
        "before grad_yᵀ @ x; the bias gradient sums grad_y over every dim but the last.",
    ),
    "row_parallel_linear": (
        "Each rank holds a block of the input's last dim and the matching columns of W, so "
        "x_i·W_iᵀ already has the full output shape but is one term of a sum over ranks: the "
        "terms must be added before anyone uses y, and the bias added once (not t times). "
        "Backward: ∂L/∂x_i = ∂L/∂y · W_i uses the full ∂L/∂y, which every rank has.",
        "The same torch.autograd.Function shape as the column layer: forward sums the partial "
        "product with dist.all_reduce(t, group=group) (in place; sum is the default op) and then "
        "adds the bias; backward returns grad_y @ weight, grad_yᵀ @ x_shard (leading dims "
        "flattened) and grad_y summed over every dim but the last, None for group.",
    ),
}


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` (1: the idea, 2: the API) for exercise ``name``; never the code."""
    return layered_hint(HINTS, name, level)


CASES = [
    ((4, 8), 12, True),
    ((2, 3, 8), 12, False),
    ((2, 5, 16), 8, True),
]  # (x shape, out_features, bias)


def _close(name, got, want, rank, shape) -> list[str]:
    if got is None:
        return [f"rank {rank}, x{shape}: {name} is None (did backward return it?)"]
    if tuple(got.shape) != tuple(want.shape):
        return [
            f"rank {rank}, x{shape}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        ]
    if SGD.ok(got, want):
        return []
    return [
        f"rank {rank}, x{shape}: {name} differs from the unsplit nn.Linear by {max_abs_diff(got, want):.3g} "
        f"(beyond {SGD})"
    ]


def _check(fn, kind: str) -> list[str]:
    rank, t, dev = dist.get_rank(), dist.get_world_size(), device()
    problems = []
    for shape, out_f, bias in CASES:
        in_f = shape[-1]
        gen = torch.Generator().manual_seed(in_f * out_f + len(shape))
        full = nn.Linear(in_f, out_f, bias=bias)
        with torch.no_grad():
            for p in full.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        full = full.to(dev)
        x = torch.randn(shape, generator=gen).to(dev)
        gy = torch.randn(shape[:-1] + (out_f,), generator=gen).to(dev)
        dim = 0 if kind == "column" else 1
        w = full.weight.detach().chunk(t, dim)[rank].clone().requires_grad_(True)
        b = None
        if bias:
            b = (
                full.bias.detach().chunk(t)[rank] if kind == "column" else full.bias.detach()
            ).clone()
            b.requires_grad_(True)
        xi = (x if kind == "column" else x.chunk(t, -1)[rank]).clone().requires_grad_(True)
        with CollectiveCounter(tag="forward") as cc:
            y = fn(xi, w, b)
            cc.tag = "backward"
            y.backward(gy if kind == "row" else gy.chunk(t, -1)[rank])
        xr = x.clone().requires_grad_(True)
        full(xr).backward(gy)
        want_y = full(x).detach() if kind == "row" else full(x).detach().chunk(t, -1)[rank]
        want_x = xr.grad if kind == "column" else xr.grad.chunk(t, -1)[rank]
        problems += _close("the output", y.detach(), want_y, rank, shape)
        problems += _close("x.grad", xi.grad, want_x, rank, shape)
        problems += _close("weight.grad", w.grad, full.weight.grad.chunk(t, dim)[rank], rank, shape)
        if bias:
            want_b = full.bias.grad.chunk(t)[rank] if kind == "column" else full.bias.grad
            problems += _close("bias.grad", b.grad, want_b, rank, shape)
        counts = (
            cc.count(op="all_reduce", tag="forward"),
            cc.count(op="all_reduce", tag="backward"),
        )
        want_counts = (0, 1) if kind == "column" else (1, 0)
        if counts != want_counts:
            problems.append(
                f"rank {rank}, x{shape}: {counts[0]} all-reduce(s) in forward and {counts[1]} in "
                f"backward; {kind} parallel needs {want_counts[0]} and {want_counts[1]}"
            )
        if problems:
            return problems
    return problems


def check_column_parallel_linear(fn) -> list[str]:
    return _check(fn, "column")


def check_row_parallel_linear(fn) -> list[str]:
    return _check(fn, "row")
