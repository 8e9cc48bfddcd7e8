"""Chapter 03 checkers: ``Zero1Step`` (ZeRO-1, one flat buffer), ``ShardedLinear`` (ZeRO-3 layer).

Tolerances are the course's named ones (:mod:`course_lib.results`): ``Zero1Step`` trains with AdamW
against one device (``ADAMW``); ``ShardedLinear`` computes one layer's output and gradients in
another order of fp32 additions than ``nn.Linear`` (``REORDERED``).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from . import layered_hint
from .. import comm
from ..configs import OPTIMIZERS, small_config
from ..launch import device
from ..models import GPT
from ..results import ADAMW, REORDERED, Tolerance, max_abs_diff
from ..train import shard_batch, step_batch, train_step

__all__ = ["HINTS", "hint", "check_zero1_step", "check_sharded_linear"]

HINTS: dict[str, tuple[str, str]] = {
    "zero1_step": (
        "An all-reduce is a reduce-scatter followed by an all-gather. Put the optimizer between "
        "the two halves: after the first, rank r holds the summed gradient of its own slice only "
        "(divide by N for the mean), so it can step that slice, and nothing else; the second half "
        "then hands every rank every updated slice. The other ranks' optimizer state is never "
        "needed, which is the whole saving.",
        "self.flat_grads has the flat layout and _copy_grads_in() fills it; self.shard is a "
        "Parameter viewing this rank's S elements of self.flat_params, and self.optimizer steps "
        "only it (give it a .grad of S elements). comm.reduce_scatter(output, input, "
        "group=self.process_group, tag='grad') takes an input of N·S elements and an output of S; "
        "comm.all_gather(output, input, group=..., tag='param') the reverse, and can write "
        "straight into flat_params. The checker counts exactly one of each per step and no "
        "all-reduce.",
    ),
    "sharded_linear": (
        "Between uses, a rank keeps only its 1/N of the weight. Forward needs the whole weight "
        "for one matmul: gather it, use it, drop it. Backward needs it again for the input's "
        "gradient, so gather it a second time; the weight's gradient is then the sum over ranks "
        "that data parallelism wants, of which this rank keeps only the slice matching its shard "
        "(divide by N for the mean).",
        "gather_weight() fills full_weight by comm.all_gather(..., tag='param') into a storage "
        "re-grown with untyped_storage().resize_(numel · element_size); free_weight() shrinks it "
        "to 0 bytes. In the autograd.Function, grad_x = grad_y @ W and dL/dW = grad_yᵀ · x over "
        "the flattened batch and time dimensions; reduce_scatter_grad pads it to N·S elements and "
        "calls comm.reduce_scatter(..., tag='grad'). backward returns one gradient per forward "
        "input (None for the layer itself).",
    ),
}


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` (1: the idea, 2: the API) for exercise ``name``; never the code."""
    return layered_hint(HINTS, name, level)


def _close(got, want, tol: Tolerance) -> tuple[bool, float]:
    """(every element within ``tol``, max |error|)."""
    return tol.ok(got, want), max_abs_diff(got, want)


def check_zero1_step(cls) -> list[str]:
    """ZeRO-1 on N ranks, each on 1/N of the batch, == AdamW on one device over the whole batch."""
    rank, dev = dist.get_rank(), device()
    # Ψ = 26,272: not a multiple of 3, so the padding is exercised at N = 3
    config = small_config()
    model, ref = GPT(config, seed=0).to(dev), GPT(config, seed=0).to(dev)
    adamw, options = OPTIMIZERS["adamw"]
    options = {**options, "lr": 1e-2}  # the course's AdamW, with this check's learning rate
    zero1 = cls(model, adamw, **options)
    ref_opt = adamw(ref.parameters(), **options)
    padded, shard = zero1.flat_params.numel(), zero1.shard.numel()
    problems = []
    for step in range(3):
        x, y = step_batch(step, config, 6, dev)  # the global batch; rank r trains on its 1/N of it
        train_step(ref, ref_opt, x, y)
        # Zero1Step is not a torch optimizer: its contract is backward(); step(); zero_grad()
        model(*shard_batch(x, y))[1].backward()
        with comm.CommLog() as log:
            zero1.step()
        zero1.zero_grad()
        where = f"rank {rank}, step {step}"
        if log.count(op="all_reduce"):
            problems.append(
                f"{where}: used all_reduce; ZeRO-1 replaces it by its two halves, "
                "comm.reduce_scatter(tag='grad') and comm.all_gather(tag='param')"
            )
        scattered = [r.numel for r in log.select(op="reduce_scatter", tag="grad")]
        if scattered != [padded]:
            problems.append(
                f"{where}: expected one reduce_scatter tagged 'grad' of the whole flat gradient "
                f"({padded} elements); CommLog saw {scattered or 'none'}"
            )
        gathered = [r.numel for r in log.select(op="all_gather", tag="param")]
        if gathered != [padded]:
            problems.append(
                f"{where}: expected one all_gather tagged 'param' into flat_params ({padded} "
                f"elements); CommLog saw {gathered or 'none'}"
            )
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            ok, err = _close(p, q, ADAMW)
            if not ok:
                problems.append(
                    f"{where}: parameter {name} differs from single-device AdamW on the whole batch "
                    f"by max |error| {err:.3g}, beyond {ADAMW} (did you divide the "
                    "reduce-scattered sum by N?)"
                )
        if problems:
            return problems
    state = sum(
        t.numel()
        for st in zero1.optimizer.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    if state != 2 * shard:
        problems.append(
            f"rank {rank}: the optimizer state holds {state} elements, expected 2 × {shard} "
            "(AdamW's two moments for this rank's shard only)"
        )
    return problems


def check_sharded_linear(cls) -> list[str]:
    """Outputs, input gradients and shard gradients == a full nn.Linear's; the full weight is freed in between."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    in_f, out_f = 7, 5  # 35 weight elements: padded at N = 2 and 3
    full = nn.Linear(in_f, out_f, bias=False).to(dev)
    with torch.no_grad():
        full.weight.copy_(torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)))
    layer = cls(copy.deepcopy(full))
    size = -(-full.weight.numel() // world)  # S
    if layer.shard.numel() != size:
        return [
            f"rank {rank}: shard has {layer.shard.numel()} elements, expected ceil(35 / {world}) = {size}"
        ]
    problems = []
    for step in range(2):  # twice: the freed storage must be refillable
        where = f"rank {rank}, step {step}"
        # every rank's input and loss weights (known everywhere, so each rank can build the reference);
        # drawn on the CPU, so the numbers are the same on any device
        gens = [torch.Generator().manual_seed(100 * step + q) for q in range(world)]
        xs = [
            torch.randn(2, 3, in_f, generator=g).to(dev) for g in gens
        ]  # a (batch, time, features) input
        gs = [
            torch.randn(2, 3, out_f, generator=g).to(dev) for g in gens
        ]  # loss = Σ y · g, so dL/dy = g
        x = xs[rank].clone().requires_grad_()
        layer.shard.grad = None
        with comm.CommLog() as log:
            y = layer(x)
        held = layer.full_weight.untyped_storage().size()
        if held:
            problems.append(
                f"{where}: after forward full_weight still holds {held} bytes; free it "
                "(untyped_storage().resize_(0)) as soon as F.linear has run"
            )
        if log.count(op="all_gather", tag="param") != 1:
            problems.append(
                f"{where}: forward issued {log.count(op='all_gather', tag='param')} all_gather(s) "
                "tagged 'param', expected exactly 1"
            )
        x_ref = xs[rank].clone().requires_grad_()
        y_ref = full(x_ref)
        if y.shape != y_ref.shape:
            return problems + [
                f"{where}: output has shape {tuple(y.shape)}, nn.Linear's {tuple(y_ref.shape)}"
            ]
        ok, err = _close(y, y_ref, REORDERED)
        if not ok:
            return problems + [
                f"{where}: output differs from nn.Linear's by max |error| "
                f"{err:.3g}, beyond {REORDERED}"
            ]
        with comm.CommLog() as log:
            (y * gs[rank]).sum().backward()
        held = layer.full_weight.untyped_storage().size()
        if held:
            problems.append(
                f"{where}: after backward full_weight still holds {held} bytes; free it again"
            )
        counts = (
            log.count(op="all_gather", tag="param"),
            log.count(op="reduce_scatter", tag="grad"),
        )
        if counts != (1, 1):
            problems.append(
                f"{where}: backward issued {counts[0]} all_gather(s) tagged 'param' and {counts[1]} "
                "reduce_scatter(s) tagged 'grad', expected 1 and 1 (re-gather W, scatter dL/dW)"
            )
        (y_ref * gs[rank]).sum().backward()
        if x.grad is None:
            problems.append(f"{where}: the input got no gradient (return grad_x from backward)")
        else:
            ok, err = _close(x.grad, x_ref.grad, REORDERED)
            if not ok:
                problems.append(
                    f"{where}: input gradient differs from nn.Linear's by max |error| "
                    f"{err:.3g}, beyond {REORDERED}"
                )
        # the weight gradient data parallelism wants: the average over ranks of each rank's dL/dW
        pairs = zip(gs, xs, strict=True)
        want = sum(g.reshape(-1, out_f).T @ xq.reshape(-1, in_f) for g, xq in pairs) / world
        want = torch.cat([want.reshape(-1), torch.zeros(size * world - want.numel(), device=dev)])
        want = want[rank * size : (rank + 1) * size]
        if layer.shard.grad is None:
            problems.append(
                f"{where}: shard.grad is None after backward (return the reduce-scattered gradient "
                "as the shard's gradient)"
            )
        else:
            ok, err = _close(layer.shard.grad, want, REORDERED)
            if not ok:
                problems.append(
                    f"{where}: shard.grad differs from slice {rank} of the rank-averaged full weight "
                    f"gradient by max |error| {err:.3g}, beyond {REORDERED}"
                )
        if problems:
            return problems
    return problems
