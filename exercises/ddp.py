"""Chapter 02 exercises: average gradients across data-parallel ranks.

(a) ``allreduce_gradients(module)`` — after ``loss.backward()``, all-reduce every gradient and
    divide by the world size: the simplest correct data parallelism.
(b) ``BucketedReducer(module, bucket_cap_mb)`` — launch *asynchronous* all-reduces of gradient
    buckets from hooks **while backward is still running**, then ``finish()`` waits and writes
    the averages back: the two ideas (overlap + bucketing) inside ``course_lib.ddp.DDP``.
(c) stretch, CS336 A2's ``DDPBucketed``: ``OverlappedDDP(module, bucket_size_mb)`` — a whole
    wrapper: broadcast rank 0's weights, overlap bucketed all-reduces with backward, and
    ``finish_gradient_synchronization()`` before ``optimizer.step()``.

Check: ``course-lib check allreduce_gradients`` / ``course-lib check bucketed_reducer``
(or ``check("allreduce_gradients")`` in a notebook); (c) with
``spawn(course_lib.checks.ddp.check_overlapped_ddp, 2, args=(OverlappedDDP,))``.
Stuck? ``course_lib.checks.ddp.hint(name, level)``: level 1 the idea, 2 the API (never the code).
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import comm  # noqa: F401  (comm.all_reduce(..., tag="grad") counts the bytes you send)


def allreduce_gradients(module: nn.Module) -> None:
    """Replace every ``p.grad`` of ``module`` by its average over all ranks (in place).

    Skip parameters without a gradient (frozen ones). A tied weight is one Parameter:
    ``module.parameters()`` yields it once, so it is reduced once.
    """
    world = dist.get_world_size()  # noqa: F841
    # TODO: make every trainable gradient the mean of that gradient over all ranks.
    raise NotImplementedError(
        "allreduce_gradients: implement it. Idea: each rank's gradient is its shard's; the "
        "full-batch gradient is their mean over ranks. "
        "More: course_lib.checks.ddp.hint('allreduce_gradients', 2)"
    )


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
        # TODO: put p's gradient into its bucket; once the bucket holds all of its gradients,
        # start that bucket's reduction without waiting for it, and remember it for finish().
        raise NotImplementedError(
            "BucketedReducer._on_grad_ready: implement it. Idea: a bucket can travel as soon "
            "as its last gradient is in, while backward goes on. "
            "More: course_lib.checks.ddp.hint('bucketed_reducer', 2)"
        )

    def finish(self) -> None:
        """Wait for every bucket, copy the averaged gradients into ``.grad``, reset for the next step."""
        # TODO: wait for what was launched, put the averages where the optimizer reads them,
        # and make the reducer ready for the next backward.
        raise NotImplementedError(
            "BucketedReducer.finish: implement it. Idea: the optimizer reads .grad, so the "
            "averages must be there after finish(). "
            "More: course_lib.checks.ddp.hint('bucketed_reducer', 2)"
        )


class OverlappedDDP(nn.Module):
    """Stretch (CS336 A2's ``DDPBucketed``): a data-parallel wrapper that overlaps communication.

    Usage, every step::

        loss = ddp(x, y)[1]
        loss.backward()                          # the all-reduces start during backward
        ddp.finish_gradient_synchronization()    # wait; .grad holds the average over ranks
        optimizer.step()

    Must: start every rank from rank 0's weights; pack the trainable parameters (reverse
    registration order, at most ``bucket_size_mb`` MiB per bucket, a larger parameter alone) into
    buckets; launch each bucket's all-reduce (``comm.all_reduce(..., async_op=True, tag="grad")``)
    from a gradient hook as soon as the bucket is complete, while backward still produces the
    other gradients (the checker counts, at each launch, the gradients still pending: buckets
    launched all at once from an end-of-backward callback fail) — none after ``backward()``
    returns; leave frozen parameters without a gradient; work for many steps.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 0.03):
        super().__init__()
        self.module = module
        raise NotImplementedError(
            "OverlappedDDP: implement it. Idea: BucketedReducer plus two things — the same "
            "start on every rank, and the wait inside the wrapper. "
            "More: course_lib.checks.ddp.hint('overlapped_ddp', 2)"
        )

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce; leave each trainable ``.grad`` the mean over ranks."""
        raise NotImplementedError(
            "OverlappedDDP.finish_gradient_synchronization: implement it. Idea: what "
            "BucketedReducer.finish does. "
            "More: course_lib.checks.ddp.hint('overlapped_ddp', 2)"
        )
