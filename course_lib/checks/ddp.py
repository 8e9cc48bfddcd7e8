"""Chapter 02 checkers: naive DDP (``allreduce_gradients``), the ``BucketedReducer``, and the
stretch ``OverlappedDDP`` (CS336 A2's ``DDPBucketed``); and their hints, in layers (:func:`hint`).

The first two compare every gradient with an identical, independent model whose gradients are averaged
with a plain ``dist.all_reduce`` (not counted by ``CommLog``), on this rank's own batch, within
:data:`results.REORDERED` (the same sums, perhaps in another order). These checkers look at
gradients after ``backward()``, so their loops call it themselves (no optimizer step is checked).
:func:`check_overlapped_ddp` trains k AdamW steps and compares the weights with one device on the
full batch, and fails if any all-reduce is launched after ``backward()`` returned, or if none is
launched while a gradient is still pending (its own post-accumulate-grad hooks, registered after
the learner's, count the gradients made final by each launch).
"""

from __future__ import annotations

import torch.distributed as dist

from . import layered_hint
from .. import comm
from ..configs import make_optimizer, small_config
from ..data import make_batch
from ..launch import device
from ..models import GPT
from ..results import ADAMW, REORDERED, max_abs_diff

__all__ = [
    "HINTS",
    "hint",
    "check_allreduce_gradients",
    "check_bucketed_reducer",
    "check_overlapped_ddp",
]

HINTS: dict[str, tuple[str, str]] = {
    "allreduce_gradients": (
        "Each rank's .grad is the gradient of its own shard's mean loss. The full-batch gradient "
        "is the mean of the N shard gradients (the equation of section 1), so every rank must end "
        "with that mean, for every parameter that has a gradient; frozen ones have none.",
        "torch.distributed's all-reduce sums a tensor over ranks in place "
        "(course_lib.comm.all_reduce takes the same arguments plus tag=, so CommLog counts the "
        "bytes: the checker looks for tag 'grad'); dist.get_world_size() is N; a tied weight is "
        "one Parameter and module.parameters() yields it once.",
    ),
    "bucketed_reducer": (
        "Backward produces gradients last layer first, and the hook tells you the moment one is "
        "final. A bucket needs nothing more once all of its gradients are in: send it then, "
        "without waiting, and wait for everything only once, at the end (finish). Dividing by N "
        "before the sum gives the mean after it.",
        "The constructor already built self.buckets, self.flat (one flat tensor per bucket), "
        "self.slot[p] (p's view into it), self.bucket_of and self.pending. An asynchronous "
        "all-reduce is comm.all_reduce(tensor, async_op=True, tag='grad'); it returns a Work whose "
        ".wait() blocks until the sum is in the tensor. The next backward must find the counters "
        "as the constructor left them.",
    ),
    "overlapped_ddp": (
        "Three things make a wrapper data parallel: every replica starts from the same weights, "
        "each bucket's all-reduce starts while backward still produces gradients (from a "
        "gradient hook, the moment its bucket is complete — not all at once at the end of "
        "backward), and the optimizer steps only after every average has arrived.",
        "dist.broadcast(t, src=0) over the parameters (and buffers) in __init__; your "
        "BucketedReducer does the hooks and the buckets; finish_gradient_synchronization() is the "
        "place to wait. The checker starts rank r from seed r, trains 3 AdamW steps on 2 ranks "
        "and compares with one device on the full batch (AdamW tolerance).",
    ),
}


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` (1: the idea, 2: the API) for exercise ``name``; never the code."""
    return layered_hint(HINTS, name, level)


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


def check_overlapped_ddp(cls, steps: int = 3, bucket_size_mb: float = 0.03) -> list[str]:
    """``steps`` AdamW steps of ``cls(model, bucket_size_mb)`` vs one device on the full batch.

    Rank r builds its model from seed r (the wrapper must broadcast rank 0's weights) and trains
    on its half of each global batch; one device (seed 0, same optimizer) trains on the whole of
    it on the same rank. Fails if no all-reduce tagged 'grad' is launched during ``backward()``;
    if none is launched while gradients are still pending — launching every bucket from an
    end-of-backward callback (``queue_callback``) all-reduces during ``backward()`` but overlaps
    nothing; the checker registers its own post-accumulate-grad hook on every trainable
    parameter after the wrapper's constructor (so it fires after the learner's hook on the same
    parameter) and reads, each time one fires, how many 'grad' all-reduces were launched by
    then; if any is launched after ``backward()`` returned (in
    ``finish_gradient_synchronization``: no overlap); or if the weights differ beyond
    :data:`results.ADAMW`.
    """
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    config = small_config()
    model = GPT(config, seed=rank).to(dev)
    model.wpe.weight.requires_grad_(False)
    ref = GPT(config, seed=0).to(dev)
    ref.wpe.weight.requires_grad_(False)
    ddp = cls(model, bucket_size_mb=bucket_size_mb)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("adamw", trainable)
    ref_opt = make_optimizer("adamw", [p for p in ref.parameters() if p.requires_grad])
    log = comm.CommLog()
    launched: list[int] = []  # launched[k]: 'grad' all-reduces launched once k + 1 grads were final

    def gradient_final(_p) -> None:  # registered last: runs after the learner's hook on _p
        launched.append(log.count(op="all_reduce", tag="grad"))

    handles = [p.register_post_accumulate_grad_hook(gradient_final) for p in trainable]
    problems = []
    try:
        for step in range(steps):
            x, y = make_batch(4 * world, config.block_size, config.vocab_size, seed=step)
            x, y = x.to(dev), y.to(dev)
            mine = slice(4 * rank, 4 * rank + 4)
            opt.zero_grad(set_to_none=True)
            launched.clear()
            log.records.clear()
            with log:
                ddp(x[mine], y[mine])[1].backward()
                during = log.count(op="all_reduce", tag="grad")
                ddp.finish_gradient_synchronization()
                after = log.count(op="all_reduce", tag="grad") - during
            problems += _overlap_problems(rank, step, during, after, launched, len(trainable))
            if model.wpe.weight.grad is not None:
                problems.append(f"rank {rank}: the frozen wpe.weight got a gradient")
            if problems:
                return problems
            opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref(x, y)[1].backward()
            ref_opt.step()
    finally:
        for h in handles:
            h.remove()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if not ADAMW.ok(p.detach(), q.detach()):
            problems.append(
                f"rank {rank}: after {steps} AdamW steps {name} differs from one device on the "
                f"full batch by max |error| {max_abs_diff(p.detach(), q.detach()):.3g} ({ADAMW})"
            )
    return problems


def _overlap_problems(
    rank: int, step: int, during: int, after: int, launched: list[int], trainable: int
) -> list[str]:
    """What one step's launches break. ``launched[k]``: the 'grad' all-reduces launched once
    k + 1 of the ``trainable`` gradients were final (the learner's hook on that one included)."""
    problems = []
    early = [n for n in launched[: trainable - 1] if n > 0]  # while >= 1 gradient was pending
    if during == 0:
        problems.append(
            f"rank {rank}, step {step}: no all-reduce tagged 'grad' was launched during "
            "backward() — launch each bucket from a gradient hook"
        )
    elif not early:
        problems.append(
            f"rank {rank}, step {step}: no all-reduce tagged 'grad' was launched while gradients "
            f"were still pending (the first came after all {trainable} were final): launch each "
            "bucket from a gradient hook as soon as it is complete, while backward still "
            "produces the others — not all at the end of backward"
        )
    if after:
        problems.append(
            f"rank {rank}, step {step}: {after} all-reduce(s) tagged 'grad' were launched "
            "after backward() returned, in finish_gradient_synchronization(): no overlap"
        )
    return problems
