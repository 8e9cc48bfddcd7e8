"""Chapter 02 checkers: naive DDP (``allreduce_gradients``) and the ``BucketedReducer``.

Both compare every gradient with an identical, independent model whose gradients are averaged
with a plain ``dist.all_reduce`` (not counted by ``CommLog``), on this rank's own batch, within
:data:`results.REORDERED` (the same sums, perhaps in another order). These checkers look at
gradients after ``backward()``, so their loops call it themselves (no optimizer step is checked).
"""

from __future__ import annotations

import torch.distributed as dist

from .. import comm
from ..configs import small_config
from ..data import make_batch
from ..launch import device
from ..models import GPT
from ..results import REORDERED, max_abs_diff

__all__ = ["check_allreduce_gradients", "check_bucketed_reducer"]


def _setup(rank: int, step: int):
    """The small equality GPT (tied weights, wpe frozen) and this rank's own batch for ``step``."""
    dev, config = device(), small_config()
    model = GPT(config, seed=0).to(dev)
    model.wpe.weight.requires_grad_(False)
    x, y = make_batch(4, config.block_size, config.vocab_size, seed=100 * rank + step)
    return model, x.to(dev), y.to(dev)


def _reference_grads(ref, x, y) -> dict:
    """Gradients of an identical, independent model, averaged with plain dist.all_reduce (not counted)."""
    ref.zero_grad(set_to_none=True)
    ref(x, y)[1].backward()
    out = {}
    for name, p in ref.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            out[name] = p.grad / dist.get_world_size()
    return out


def _compare_grads(model, want: dict, rank: int, what: str) -> list[str]:
    problems = []
    for name, p in model.named_parameters():
        if name not in want:
            if p.grad is not None:
                problems.append(f"rank {rank}, {what}: {name} is frozen but got a gradient")
            continue
        if p.grad is None:
            problems.append(f"rank {rank}, {what}: {name}.grad is None")
            continue
        if not REORDERED.ok(p.grad, want[name]):
            problems.append(
                f"rank {rank}, {what}: {name}.grad differs from the average over ranks "
                f"by max |error| {max_abs_diff(p.grad, want[name]):.3g} ({REORDERED})"
            )
    return problems


def check_allreduce_gradients(fn) -> list[str]:
    """After one backward, ``fn(model)`` leaves every gradient averaged over ranks, via tagged all-reduces."""
    rank = dist.get_rank()
    model, x, y = _setup(rank, 0)
    want = _reference_grads(_setup(rank, 0)[0], x, y)
    model(x, y)[1].backward()
    with comm.CommLog() as log:
        fn(model)
    problems = _compare_grads(model, want, rank, "after allreduce_gradients")
    if not log.count(op="all_reduce", tag="grad"):
        problems.append(
            f"rank {rank}: CommLog saw no all-reduce tagged 'grad' — use "
            "comm.all_reduce(p.grad, tag='grad') so the bytes are counted"
        )
    return problems


def check_bucketed_reducer(cls) -> list[str]:
    """Three steps: one all-reduce per bucket launched during backward, each gradient once, averages right."""
    rank = dist.get_rank()
    model, _, _ = _setup(rank, 0)
    ref = _setup(rank, 0)[0]
    reducer = cls(model, bucket_cap_mb=0.03)
    n_buckets = len(reducer.buckets)
    want_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    problems = []
    for step in range(3):  # several steps: the reducer must reset itself
        _, x, y = _setup(rank, step)
        want = _reference_grads(ref, x, y)
        model.zero_grad(set_to_none=True)
        with comm.CommLog() as log:
            model(x, y)[1].backward()
            launched = log.count(op="all_reduce", tag="grad")
            reducer.finish()
        if launched != n_buckets:
            problems.append(
                f"rank {rank}, step {step}: {launched} all-reduce(s) tagged 'grad' were launched "
                f"during backward, expected one per bucket = {n_buckets} (launch each bucket from "
                "the hook, as soon as it is complete)"
            )
        sent = log.total("tensor_bytes", tag="grad")
        if sent != want_bytes:
            problems.append(
                f"rank {rank}, step {step}: all-reduced {sent} bytes tagged 'grad', expected the "
                f"trainable parameters' {want_bytes} bytes (each gradient exactly once)"
            )
        problems += _compare_grads(model, want, rank, f"step {step} after finish()")
        if problems:
            break
    return problems
