"""Gradient buckets: the one piece DDP (all-reduce) and ZeRO-2 (reduce-scatter) share.

Both reduce gradients *during* backward, a bucket at a time, so communication overlaps the
backward computation of earlier layers (Li et al. 2020, "PyTorch Distributed", arXiv:2006.15704):

1. :func:`make_buckets` packs parameters into buckets of at most ``cap_bytes``, in **reverse**
   registration order — backward produces the last layers' gradients first, so the first bucket
   fills (and its collective starts) while backward is still busy with the early layers.
2. :class:`GradBuckets` registers a post-accumulate-grad hook on every parameter. When a
   parameter's gradient is final it is handed to the owner (``copy_in``: DDP copies it into its
   flat bucket, ZeRO-2 into a staging buffer); once every gradient of a bucket has arrived, the
   owner's ``launch`` issues that bucket's collective.

The rule that keeps every rank in step
---------------------------------------
Collectives are matched by *call order*: the k-th collective on rank 0 pairs with the k-th on rank
1. Hooks fire in the order gradients become ready, and that order can differ between ranks — most
of all when a parameter is unused on one rank (its hook never fires there). So buckets are launched
**strictly in bucket order** 0, 1, 2, …: a ready bucket waits until every earlier one has been
launched. At the end of backward (an autograd callback) every bucket not launched yet is launched,
still in order, with the owner filling in what this rank has (an accumulated ``.grad``, or zeros);
then one small all-reduce (tag ``"used"``, one byte per parameter, MAX over ranks) tells every rank
which parameters had a gradient *anywhere*. Hence, on every rank and every step, the collectives are
identical: ``bucket 0, …, bucket K−1, used-flags``. A parameter with no gradient on any rank keeps
``.grad = None``, so the optimizer skips it, as on one device.

The price: a parameter unused on one rank holds back its bucket *and every later one* until backward
ends (less overlap), and the flag all-reduce costs one small message per step. Torch DDP makes the
same trade only when asked (``find_unused_parameters=True``), and so does :class:`GradBuckets` with
``find_unused=False``: no flag all-reduce; every parameter is taken as used somewhere, and a parameter
whose hook did not fire on this rank raises a clear error at the end of backward (after every bucket
was still launched and waited for, so the collectives stay matched in this step). ZeRO-2 keeps the
flags (``find_unused=True``, the default here).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm

__all__ = ["make_buckets", "GradBuckets"]


def make_buckets(params: list, cap_bytes: float) -> list[list]:
    """Pack parameters into buckets of at most ``cap_bytes`` (a single larger parameter gets its own).

    ``params``: parameters, or ``(name, parameter)`` pairs (the buckets then hold the pairs).
    Reverse registration order (see the module docstring). A bucket holds one dtype on one
    device (it becomes one flat tensor). Torch DDP goes one step further: after the first
    iteration it rebuilds its buckets in the order gradients actually arrived.
    """
    buckets: list[list] = []
    size, first = 0, None
    for item in reversed(list(params)):
        p = item[1] if isinstance(item, tuple) else item
        nbytes = p.numel() * p.element_size()
        if (
            not buckets
            or size + nbytes > cap_bytes
            or first.dtype != p.dtype
            or first.device != p.device
        ):
            buckets.append([])
            size, first = 0, p
        buckets[-1].append(item)
        size += nbytes
    return buckets


class GradBuckets:
    """Launch one collective per bucket, strictly in bucket order, as gradients become final in backward.

    ``GradBuckets(buckets, copy_in, launch, finish, process_group=None, armed=lambda: True)``

    * ``copy_in(i, p)`` — ``p.grad`` is final: take this rank's contribution into bucket ``i``.
    * ``launch(i, missing)`` — issue bucket ``i``'s collective (asynchronously). ``missing`` lists
      the bucket's parameters whose hook did not fire in this backward (empty when launched from
      a hook): the owner puts what this rank has for them (an accumulated ``.grad``, or zeros).
    * ``finish(used_anywhere, t_end_compute)`` — after the last bucket and the "used" flags: wait
      for the collectives and write the results. ``used_anywhere[p]`` is True when some rank had a
      gradient for ``p``.
    * ``armed()`` — False skips the hooks for this backward (DDP's ``no_sync``).
    * ``find_unused`` — True: the "used" flag all-reduce (one-device semantics for unused parameters);
      False: skip it, and raise when a parameter got no gradient in this backward (``names`` maps
      parameters to the names the error message shows).

    One instance per wrapper; hooks stay registered for the parameters' lifetime.
    """

    def __init__(
        self,
        buckets: list[list[nn.Parameter]],
        copy_in: Callable,
        launch: Callable,
        finish: Callable,
        process_group=None,
        armed: Callable[[], bool] = lambda: True,
        find_unused: bool = True,
        names: dict | None = None,
    ):
        self.buckets = buckets
        self.process_group = process_group
        self.find_unused, self._names = find_unused, names or {}
        self._copy_in, self._launch, self._finish, self._armed = copy_in, launch, finish, armed
        self._bucket_of = {p: i for i, ps in enumerate(buckets) for p in ps}
        self.reset()
        for p in self._bucket_of:
            if (
                p.requires_grad
            ):  # a frozen parameter never fires: its bucket goes at the end of backward
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def reset(self) -> None:
        """Forget this backward's progress (a second backward through the same graph syncs again)."""
        self.pending = [len(ps) for ps in self.buckets]  # gradients still missing per bucket
        self.next = 0  # next bucket to launch (launch order = bucket order)
        self.fired: set[nn.Parameter] = set()  # parameters whose hook ran in this backward
        self.callback_queued = False

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``p.grad`` is final for this backward."""
        if not self._armed():
            return
        if not self.callback_queued:  # first hook of this backward: make sure we finish it
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.callback_queued = True
        i = self._bucket_of[p]
        self._copy_in(i, p)
        self.fired.add(p)
        self.pending[i] -= 1
        while self.next < len(self.pending) and self.pending[self.next] == 0:
            self._launch_next([])

    def _launch_next(self, missing: list) -> None:
        self._launch(self.next, missing)
        self.next += 1

    def _end_of_backward(self) -> None:
        """Autograd callback: launch the rest in order, share who had gradients, let the owner finish."""
        t_end_compute = time.perf_counter()
        while self.next < len(self.buckets):
            self._launch_next([p for p in self.buckets[self.next] if p not in self.fired])
        order = [p for ps in self.buckets for p in ps]
        if (
            not self.find_unused
        ):  # like torch DDP's default: every parameter is used in every forward
            unused = [p for p in order if p not in self.fired]
            self._finish(dict.fromkeys(order, True), t_end_compute)
            self.reset()
            if unused:
                shown = [
                    self._names.get(p, f"tensor of shape {tuple(p.shape)}") for p in unused[:5]
                ]
                raise RuntimeError(
                    f"{len(unused)} trainable parameter(s) got no gradient in this backward "
                    f"({', '.join(shown)}{', …' if len(unused) > 5 else ''}): with "
                    f"find_unused_parameters=False every trainable parameter must take part in "
                    f"every forward, as in torch DDP. Pass find_unused_parameters=True (one "
                    f"extra all-reduce of a byte per parameter per step) or freeze the parameter."
                )
            return
        dev = order[0].device if order else torch.device("cpu")
        used = torch.tensor(
            [p.grad is not None or p in self.fired for p in order], dtype=torch.uint8, device=dev
        )
        comm.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, tag="used")
        self._finish(dict(zip(order, map(bool, used.tolist()), strict=True)), t_end_compute)
        self.reset()
