"""Chapter 02 exercises: average gradients across data-parallel ranks.

(a) ``allreduce_gradients(module)`` — after ``loss.backward()``, all-reduce every gradient and
    divide by the world size: the simplest correct data parallelism.
(b) ``BucketedReducer(module, bucket_cap_mb)`` — launch *asynchronous* all-reduces of gradient
    buckets from hooks **while backward is still running**, then ``finish()`` waits and writes
    the averages back: the two ideas (overlap + bucketing) inside ``course_lib.ddp.DDP``.

Check: ``course-lib check allreduce_gradients`` / ``course-lib check bucketed_reducer``
(or ``check("allreduce_gradients")`` in a notebook).
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import comm


def allreduce_gradients(module: nn.Module) -> None:
    """Replace every ``p.grad`` of ``module`` by its average over all ranks (in place).

    Skip parameters without a gradient (frozen ones). A tied weight is one Parameter:
    ``module.parameters()`` yields it once, so it is reduced once.
    """
    world = dist.get_world_size()
    for p in module.parameters():
        if p.grad is None:
            continue
        comm.all_reduce(p.grad, tag="grad")  # sum over ranks, in place
        p.grad.div_(world)  # sum / N = average


class BucketedReducer:
    """Average gradients during backward: one async all-reduce per full bucket.

    Usage, every step::

        loss.backward()     # hooks copy gradients into buckets and launch full buckets
        reducer.finish()    # wait for the all-reduces, copy the averages into .grad
        optimizer.step()

    Assumes every trainable parameter receives a gradient on every rank in every backward
    (true for a GPT step), so buckets fill up in the same order on every rank and the
    collectives match. (``course_lib.ddp.DDP`` also handles unused parameters.)
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 0.05):
        self.world_size = dist.get_world_size()
        # Reverse registration order ≈ the order backward produces gradients (last layer first).
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        cap = bucket_cap_mb * 2**20
        self.buckets: list[list[nn.Parameter]] = []  # buckets[i] = the parameters of bucket i
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if not self.buckets or (size + nbytes > cap and self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        # One flat buffer per bucket; slot[p] is p's piece of it, shaped like p.
        self.flat = [
            torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
            for b in self.buckets
        ]
        self.slot: dict[nn.Parameter, torch.Tensor] = {}
        self.bucket_of: dict[nn.Parameter, int] = {}
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.slot[p] = self.flat[i][offset : offset + p.numel()].view_as(p)
                self.bucket_of[p] = i
                offset += p.numel()
        self.pending = [len(b) for b in self.buckets]  # gradients still missing, per bucket
        self.works: list[tuple[int, object]] = []  # (bucket index, async Work) launched this step
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Hook: ``p.grad`` is final for this backward. Copy it in; launch the bucket when complete."""
        i = self.bucket_of[p]
        self.slot[p].copy_(p.grad)
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self.flat[i].div_(self.world_size)  # sum of (grad / N) over ranks = the average
            self.works.append((i, comm.all_reduce(self.flat[i], async_op=True, tag="grad")))

    def finish(self) -> None:
        """Wait for every bucket, copy the averaged gradients into ``.grad``, reset for the next step."""
        for i, work in self.works:
            work.wait()
            for p in self.buckets[i]:
                p.grad.copy_(self.slot[p])
        self.works = []
        self.pending = [len(b) for b in self.buckets]
