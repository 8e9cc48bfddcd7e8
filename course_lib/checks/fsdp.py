"""Chapter 04 checker: ``FlatUnit``, one FSDP unit from scratch (FSDP1's flat parameter, gathered on demand).

On 2 ranks, a transformer block (``zero_config(bias=True)``: Ψ = 48,447, odd, so the flat buffer is
padded) is wrapped by the learner's ``FlatUnit`` and trained 3 AdamW steps, each rank on its half of
the batch, beside the same block on one device on the whole batch. Checked, each with the rule it
enforces in its failure message:

* layout — ``unit.shard`` is slice r of the flattened, zero-padded parameters and the unit's only
  parameter; at rest the unit holds its shard's bytes and no more;
* memory — right after forward, the unit and autograd's saved tensors hold at most the activations
  one device saves plus this rank's shard (the full weights are freed); after backward, the shard
  and its gradient only;
* collectives — per step, one all-gather in forward, one all-gather and one reduce-scatter in
  backward (counted at the dispatcher, whatever API issues them);
* numbers — forward's output (``REORDERED``), the first step's shard gradient (``SGD``: the average of
  the two halves' gradients against the full batch's) and the weights after 3 AdamW steps (``ADAMW``).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import functools

from torch.utils._python_dispatch import TorchDispatchMode

from . import layered_hint
from ..configs import make_optimizer, zero_config
from ..launch import device
from ..models import Block
from ..results import ADAMW, REORDERED, SGD, max_abs_diff
from ..train import train_step

__all__ = ["HINTS", "hint", "check_flat_unit"]

HINTS: dict[str, tuple[str, str]] = {
    "flat_unit": (
        "One flat buffer holds the whole module: every parameter flattened and laid end to end, "
        "padded so that N equal shards cover it; rank r keeps shard r and nothing else. The "
        "module's weights are views into that buffer. While they are needed (the forward, then "
        "the module's own backward) the buffer holds every rank's shard; the rest of the time its "
        "storage holds no bytes. Autograd keeps the views it saved, so refilling the same storage "
        "before backward brings them back. The views' gradients meet in one flat gradient: rank r "
        "needs the sum over ranks of its slice r, divided by N.",
        "dist.all_gather_into_tensor(out, shard) fills an N·S tensor from every rank's S; "
        "dist.reduce_scatter_tensor(out, flat) gives each rank the sum of its slice (gloo has no "
        "average: divide). t.untyped_storage().resize_(nbytes) allocates or frees (0) a tensor's "
        "memory in place; refill through flat.data, whose version counter is its own, or autograd "
        "sees an in-place change of a tensor it saved. torch.func.functional_call(module, "
        "{name: tensor}, args) runs a module with other tensors for its parameters; delattr("
        "submodule, name) removes one. A torch.autograd.Function whose forward returns the "
        "gathered buffer receives the flat gradient in its backward; Tensor.register_hook on the "
        "module's output runs before autograd enters the module's backward.",
    ),
}


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` (1: the idea, 2: the API) for exercise ``name``; never the code."""
    return layered_hint(HINTS, name, level)


def _storages(tensors, skip=frozenset()) -> dict:
    """``{data_ptr: nbytes}`` of the distinct storages behind ``tensors`` that hold bytes now."""
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() > 0 and s.data_ptr() not in skip:
            out[s.data_ptr()] = s.nbytes()
    return out


def _saving(into: list):
    """Context: every tensor autograd saves for backward is appended to ``into`` (and kept unchanged)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: into.append(t) or t, lambda t: t)


def _tensors_of(unit: nn.Module) -> list:
    """Every tensor the unit and its submodules keep: parameters, buffers, plain attributes (and in lists, dicts)."""
    out = []
    for m in unit.modules():
        for v in vars(m).values():
            items = (
                v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
            )
            out += [t for t in items if isinstance(t, torch.Tensor)]
    return out


class _Collectives(TorchDispatchMode):
    """Counts the collective operators issued while active, per ``tag`` (any API: they all dispatch).

    (``CollectiveCounter``'s module tracker expects hooks on every module; a learner's unit may run
    its module through ``functional_call``.)"""

    def __init__(self):
        super().__init__()
        self.tag, self.counts = "forward", {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = (
            func.name()
        )  # e.g. "c10d::_allgather_base_", "_c10d_functional::reduce_scatter_tensor"
        if name.split("::")[0] in ("c10d", "_c10d_functional"):
            op = name.split("::")[1].replace("allgather", "all_gather")
            for kind in ("all_gather", "reduce_scatter"):
                if kind in op:
                    self.counts[self.tag, kind] = self.counts.get((self.tag, kind), 0) + 1
        return func(*args, **(kwargs or {}))


class _Scored(nn.Module):
    """``(output, loss)`` of ``unit`` on ``(x, g)`` with loss = mean(output · g): what ``train_step`` steps.

    With a counter, its tag says the phase (``"forward"`` until the loss exists, then ``"backward"``);
    ``on_forward(out, saved)``, when set, sees the output and what autograd saved, before backward.
    """

    def __init__(self, unit: nn.Module, counter: _Collectives | None = None):
        super().__init__()
        self.unit, self.counter, self.on_forward = unit, counter, None

    def forward(self, x, g):
        if self.counter is not None:
            self.counter.tag = "forward"
        saved = []
        with _saving(saved):
            out = self.unit(x)
        if self.on_forward is not None:
            self.on_forward(out, saved)
        saved.clear()
        if self.counter is not None:
            self.counter.tag = "backward"
        return out, (out * g).mean()  # the mean over equal halves: the full batch's mean


def _any_rank(problems: list) -> bool:
    """True on every rank when any rank has a problem: all stop together (no collective left unmatched)."""
    flag = torch.tensor([float(bool(problems))], device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _flat(tensors, size: int) -> torch.Tensor:
    """``tensors`` flattened end to end, zero-padded to ``size`` elements."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return torch.cat([flat, flat.new_zeros(size - flat.numel())])


def _batch(step: int, rows: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` (input and loss weights), drawn on the CPU: the same on every rank."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, 16, 63, generator=gen)
    return x.to(dev), torch.randn(rows, 16, 63, generator=gen).to(dev)


def check_flat_unit(cls, steps: int = 3) -> list[str]:
    """Layout, memory after forward, one collective of each kind, and 3 AdamW steps == one device."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = Block(zero_config(bias=True)).to(dev)
    reference = copy.deepcopy(block)
    ref_params = list(reference.parameters())
    psi = sum(p.numel() for p in ref_params)
    size = -(-psi // world)  # S = ⌈Ψ/N⌉
    where = f"rank {rank}"

    unit = cls(block)
    problems = []
    shard = getattr(unit, "shard", None)
    held = sum(p.numel() for p in unit.parameters())
    if not isinstance(shard, nn.Parameter) or shard.numel() != size:
        got = "none" if shard is None else f"{type(shard).__name__} of {shard.numel()} elements"
        problems.append(
            f"{where}: unit.shard is {got}; expected an nn.Parameter of S = ⌈Ψ/N⌉ = "
            f"⌈{psi}/{world}⌉ = {size} elements"
        )
    elif held != size:
        problems.append(
            f"{where}: unit.parameters() hold {held:,} elements, expected only the shard's {size:,} "
            f"— the module must keep no parameters of its own (delete them once they are in the flat "
            f"buffer)"
        )
    else:
        want = _flat(ref_params, size * world)[rank * size : (rank + 1) * size]
        if not torch.equal(shard.detach(), want):
            problems.append(
                f"{where}: unit.shard is not slice [{rank}·S, {rank + 1}·S) of the module's "
                f"parameters flattened in named_parameters() order and zero-padded to N·S "
                f"(max |error| {max_abs_diff(shard.detach(), want):.3g})"
            )
    at_rest = sum(_storages(_tensors_of(unit)).values())
    if not problems and at_rest > 4 * size:
        problems.append(
            f"{where}: after construction the unit holds {at_rest:,} bytes, expected its shard's "
            f"{4 * size:,}: free the gathered buffer (storage resized to 0) until forward needs it"
        )
    if _any_rank(problems):
        return problems

    opt = make_optimizer("adamw", unit.parameters())
    ref_opt = make_optimizer("adamw", reference.parameters())
    cc = _Collectives()
    scored, ref_scored = _Scored(unit, cc), _Scored(reference)
    rows = 2  # per rank
    for step in range(steps):
        x, g = _batch(step, rows * world, dev)
        mine = slice(rank * rows, (rank + 1) * rows)
        if step == 0:  # memory and output, checked between forward and backward
            scored.on_forward = functools.partial(
                _after_forward, problems, unit, reference, x[mine], size, where
            )
        cc.counts.clear()
        try:
            with cc:
                train_step(scored, opt, x[mine], g[mine])
        except RuntimeError as err:
            if "storage of size 0" not in str(err):
                raise
            return problems + [
                f"{where}, step {step}: backward read the freed weights ({str(err).splitlines()[0]}) "
                f"— gather them again, into the same storage, before the module's backward runs"
            ]
        scored.on_forward = None
        counts = tuple(cc.counts.get((t, op), 0) for t in ("forward", "backward")
                       for op in ("all_gather", "reduce_scatter"))  # fmt: skip
        if counts != (1, 0, 1, 1):
            problems.append(
                f"{where}, step {step}: forward issued {counts[0]} all-gather(s) and {counts[1]} "
                f"reduce-scatter(s), backward {counts[2]} and {counts[3]}; expected 1 and 0, then "
                f"1 and 1 — one all-gather of the whole flat buffer before forward, one again before "
                f"the module's backward, one reduce-scatter of the flat gradient"
            )
        after = sum(_storages(_tensors_of(unit)).values())
        if after > 8 * size:
            problems.append(
                f"{where}, step {step}: after backward and the step the unit holds {after:,} "
                f"bytes, expected the shard and its gradient, {8 * size:,}: free the gathered "
                f"buffer once the flat gradient has been reduce-scattered"
            )
        train_step(ref_scored, ref_opt, x, g)  # the .grad of both stay until the next step
        if step == 0 and not problems:
            problems += _first_gradient(unit, ref_params, size, world, rank, where)
        if _any_rank(problems):
            return problems
    full = torch.empty(size * world, device=dev)
    dist.all_gather_into_tensor(full, unit.shard.detach())
    want = _flat(ref_params, size * world)
    if not ADAMW.ok(full, want):
        problems.append(
            f"{where}: after {steps} AdamW steps the gathered shards differ from one device's "
            f"weights (whole batch) by max |error| {max_abs_diff(full, want):.3g}, beyond {ADAMW}"
        )
    return problems


def _after_forward(problems, unit, reference, x, size, where, out, saved) -> None:
    """Into ``problems``: output == one device's; bytes held beyond one device's activations ≤ the shard."""
    problems += _forward_problems(unit, saved, out, reference, x, size, where)


def _forward_problems(unit, saved, out, reference, x, size, where) -> list[str]:
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return [
            f"{where}: forward returned {type(out).__name__}, expected the block's output {tuple(x.shape)}"
        ]
    ref_saved = []
    with _saving(ref_saved):
        ref_out = reference(x)
    params = {p.untyped_storage().data_ptr() for p in reference.parameters()}
    activations = sum(_storages(ref_saved, skip=params).values())
    problems = []
    if not REORDERED.ok(out, ref_out):
        problems.append(
            f"{where}: forward's output differs from the block's on one device by max |error| "
            f"{max_abs_diff(out, ref_out):.3g}, beyond {REORDERED}"
        )
    held = sum(_storages(saved + _tensors_of(unit)).values())
    extra, shard_bytes, full_bytes = held - activations, 4 * size, 4 * size * dist.get_world_size()
    if extra > shard_bytes:
        problems.append(
            f"{where}: between forward and backward the unit and autograd hold {extra:,} bytes beyond "
            f"the activations one device saves ({activations:,}); expected at most this rank's shard, "
            f"{shard_bytes:,} (the full parameters are {full_bytes:,}): free the gathered weights "
            f"right after forward, the views autograd saved included, and gather again before backward"
        )
    return problems


def _first_gradient(unit, ref_params, size, world, rank, where) -> list[str]:
    """Step 0: shard.grad == slice r of one device's (whole batch) gradient, i.e. the average over ranks."""
    grad = unit.shard.grad
    if grad is None:
        return [
            f"{where}: shard.grad is None after backward — the flat gradient's slice must reach the shard"
        ]
    want = _flat([p.grad for p in ref_params], size * world)[rank * size : (rank + 1) * size]
    if SGD.ok(grad, want):
        return []
    note = ""
    if SGD.ok(grad, want * world):
        note = f" — it is {world}× too large: the reduce-scatter sums, divide by N for the average"
    return [
        f"{where}: after the first backward shard.grad differs from slice {rank} of one device's "
        f"gradient (whole batch) by max |error| {max_abs_diff(grad, want):.3g}, beyond {SGD}{note}"
    ]
