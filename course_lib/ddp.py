"""Chapter 02 — data parallelism from scratch: every rank holds the whole model, and they average gradients.

Data parallelism (DP) in one sentence: N ranks start from the same weights, each runs
forward/backward on its own 1/N of the global batch, the gradients are *averaged* with
an all-reduce, and every rank takes the same optimizer step — so the weights stay
identical, and the run is mathematically the same as one device on the full batch
(the mean of N equal-sized shard means is the full-batch mean).

Three versions of "average the gradients", side by side:

1. :func:`naive_allreduce_gradients` — after ``loss.backward()`` returns, all-reduce every
   gradient, one blocking call per parameter. Correct, but communication starts only
   when computation has ended, and each small tensor pays the full per-call latency.
2. :class:`DDP` with ``bucket_cap_mb=None`` — an *asynchronous* all-reduce per parameter,
   launched from a hook the moment that parameter's gradient is final. Backward keeps
   computing earlier layers while later layers' gradients travel: **overlap**.
3. :class:`DDP` with ``bucket_cap_mb=25`` (the default, like ``torch.nn.parallel.DDP``) —
   gradients are copied into a few flat *buckets*; one all-reduce per full bucket. Fewer,
   larger messages amortise the per-call latency (α in the α + β·bytes cost model) while
   keeping the overlap. This is the design of PyTorch DDP (Li et al. 2020, "PyTorch
   Distributed: Experiences on Accelerating Data Parallel Training", arXiv:2006.15704).

:func:`torch_ddp` wraps a module with the real ``torch.nn.parallel.DistributedDataParallel``
so the notebook can race the two.

Instrumentation (timelines, meters) attaches from outside: ``DDP(..., observer=obj)`` calls the
hooks of :class:`DDPObserver` at the points of a step (forward, each bucket's launch and completion,
the wait at the end of backward); the algorithm has no branch for them. ``experiments/ddp.py``'s
``DDPTimeline`` is the one chapter 02 draws.

The rule that keeps every rank in step (buckets launched strictly in bucket order, a "used" flag
all-reduce at the end of backward, zeros for gradients a rank does not have) lives in
``grad_buckets.py``, shared with ZeRO-2; read its docstring before changing the code.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .grad_buckets import GradBuckets, make_buckets
from .sharding import mark_reduced_by

__all__ = [
    "DDP",
    "DDPObserver",
    "naive_allreduce_gradients",
    "torch_ddp",
    "trainable_parameters",
    "make_buckets",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "COMM_HOOKS",
]


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, param)`` for every *unique* parameter that requires grad, in registration order.

    ``named_parameters()`` already removes duplicates by identity: a tied weight (one
    Parameter reached under two names) appears once, under its first name. Frozen
    parameters (``requires_grad=False``) get no gradient, so there is nothing to reduce.
    """
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


class DDPObserver:
    """What an instrument sees of a :class:`DDP` step; every hook is a no-op here: override what you need.

    Called in this order each synced step: ``on_forward_start()``, ``on_forward_end(output)``,
    ``on_bucket_launch(i, work)`` per bucket (``work``: the async Work, in bucket order),
    ``on_wait_start(t_end_compute)`` (backward's compute ended at ``t_end_compute``,
    ``time.perf_counter`` seconds; the training thread now waits), ``on_bucket_done(i)`` per bucket
    after its wait, and ``on_step_done()`` once every ``.grad`` holds the average.
    """

    def on_forward_start(self) -> None: ...

    def on_forward_end(self, output) -> None: ...

    def on_bucket_launch(self, i: int, work) -> None: ...

    def on_wait_start(self, t_end_compute: float) -> None: ...

    def on_bucket_done(self, i: int) -> None: ...

    def on_step_done(self) -> None: ...


class DDP(nn.Module):
    """Data-parallel wrapper: after ``loss.backward()`` returns, every ``.grad`` is the average over ranks.

    ``DDP(module, bucket_cap_mb=25.0, process_group=None, gradient_as_bucket_view=False,
    find_unused_parameters=False, comm_hook=None, observer=None)``

    * At wrap time every parameter and buffer is broadcast from rank 0, so all ranks start
      identical even if they were initialised differently. (Buffers are broadcast only here;
      torch DDP re-broadcasts them every forward by default, which matters for BatchNorm.)
    * During backward a ``register_post_accumulate_grad_hook`` on each trainable parameter
      fires once its gradient is final for this backward (once, after *all* uses of a tied
      weight have accumulated). Full buckets are launched as async all-reduces, in bucket
      order; a callback queued on the autograd engine (``Variable._execution_engine.
      queue_callback``) runs when backward is done, launches the rest, waits, and writes the
      averaged gradients back — so no extra call is needed before ``optimizer.step()``.
    * ``bucket_cap_mb=None``: one bucket per parameter, and the all-reduce runs **in place on
      ``.grad``** — no extra memory. ``bucket_cap_mb=<MiB>``: parameters are packed (reverse
      registration order, :func:`make_buckets`) into flat buffers allocated once at wrap
      time; each gradient is **copied** into its bucket, the bucket is reduced, and the result
      is **copied back** into ``.grad``. The buckets are a second copy of the gradients:
      +4 bytes per trainable fp32 parameter of memory (what torch DDP does by default,
      ``gradient_as_bucket_view=False``). ``.buckets`` lists the parameter names per bucket;
      ``.bucket_bytes`` is the memory the flat buffers hold (0 with ``bucket_cap_mb=None``).
    * ``gradient_as_bucket_view=True`` (as in torch): the first time a gradient arrives it is copied
      into its bucket and ``.grad`` is then **replaced by the view into the bucket**; the bucket is
      reduced in place, so nothing is copied back, and the separate gradient tensor is freed. With
      ``zero_grad(set_to_none=False)`` autograd accumulates straight into the view on later steps:
      no copy at all.
    * ``find_unused_parameters=False`` (the default, like torch): every trainable parameter must get
      a gradient in every synced backward; one that does not raises a clear error at the end of that
      backward. ``True``: the "used" flag all-reduce of ``grad_buckets.py`` (one-device semantics for
      parameters unused on some or all ranks) at one extra small all-reduce per step.
    * ``comm_hook``: ``None`` (fp32 all-reduce), ``"fp16"`` / ``"bf16"`` (:func:`fp16_compress_hook`:
      cast each bucket, all-reduce the half-size copy, cast back — half the bytes, a rounding error),
      or any ``hook(bucket, process_group) -> (work, finish)``: ``work`` an async Work, ``finish()``
      called after ``work.wait()`` to write the result into ``bucket`` (or None).
    * The gradient is divided by N *before* the sum-all-reduce (like torch DDP): the
      average, with less risk of overflow in low precision.
    * ``no_sync()``: backward passes inside it only accumulate local gradients; the next
      synced backward reduces the accumulated sum once. The decision is taken at forward
      time (as in torch DDP): run both forward and backward inside the context.
    * ``observer``: a :class:`DDPObserver` (also settable later as ``.observer``) told about each
      step's forward, bucket launches and completions, and the wait — how timelines are recorded
      without touching the algorithm.

    See ``grad_buckets.py`` for the rule that keeps the ranks' collectives matched.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float | None = 25.0,
        process_group=None,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        comm_hook=None,
        observer: DDPObserver | None = None,
    ):
        super().__init__()
        if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
            raise ValueError(
                f"bucket_cap_mb must be None (one all-reduce per parameter) or a size >= 0 in MiB, "
                f"got {bucket_cap_mb!r}"
            )
        if isinstance(comm_hook, str):
            if comm_hook not in COMM_HOOKS:
                raise ValueError(
                    f"comm_hook must be None, one of {sorted(COMM_HOOKS)} or a callable "
                    f"hook(bucket, process_group) -> (work, finish), got {comm_hook!r}"
                )
            comm_hook = COMM_HOOKS[comm_hook]
        self.comm_hook = comm_hook
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.bucket_cap_mb = bucket_cap_mb
        self.observer = observer if observer is not None else DDPObserver()
        self._sync_enabled = True  # False inside no_sync()
        self._armed = False  # set at forward: will the next backward reduce?

        self._broadcast_from_rank0()

        named = trainable_parameters(module)
        names = {p: name for name, p in named}
        if bucket_cap_mb is None:
            groups = [[p] for _, p in reversed(named)]
        else:
            groups = make_buckets([p for _, p in named], int(bucket_cap_mb * 2**20))
        self.buckets: list[list[str]] = [[names[p] for p in g] for g in groups]
        self._bucket_params: list[list[nn.Parameter]] = groups
        # Bucketed mode: one flat buffer per bucket and, per parameter, a view shaped like it.
        self._flat: list[torch.Tensor | None] = [None] * len(groups)
        self._slot: dict[nn.Parameter, torch.Tensor] = {}
        if bucket_cap_mb is not None:
            for i, params in enumerate(groups):
                flat = torch.zeros(
                    sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
                )
                self._flat[i], offset = flat, 0
                for p in params:
                    self._slot[p] = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
        self._inflight: list[tuple] = []  # (bucket, work, buffer, finish)
        # How the averages reach .grad at the end of backward: one writer per mode.
        if bucket_cap_mb is None:
            self._write_grad = self._grad_reduced_in_place
        elif gradient_as_bucket_view:
            self._write_grad = self._grad_as_bucket_view
        else:
            self._write_grad = self._grad_copied_back
        self._grad_buckets = GradBuckets(
            groups,
            self._copy_in,
            self._launch,
            self._finish_backward,
            process_group=process_group,
            armed=lambda: self._armed,
            find_unused=find_unused_parameters,
            names=names,
        )
        mark_reduced_by([p for _, p in named], "course_lib.ddp.DDP")

    @property
    def bucket_bytes(self) -> int:
        """Bytes held by the flat bucket buffers: a second copy of the gradients (0 in per-parameter mode)."""
        return sum(f.numel() * f.element_size() for f in self._flat if f is not None)

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        """Make every rank start from rank 0's weights (and buffers): DP only works if they agree."""
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            comm.broadcast(t.detach(), src=src, group=self.process_group, tag="init")

    # ------------------------------------------------------------------ forward

    def forward(self, *args, **kwargs):
        if (
            torch.is_grad_enabled()
        ):  # an eval forward under no_grad must not disarm a pending backward
            self._armed = self._sync_enabled
            self._grad_buckets.reset()
            self._inflight = []
        self.observer.on_forward_start()
        out = self.module(*args, **kwargs)
        self.observer.on_forward_end(out)
        return out

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for forward+backward passes inside the block."""
        before = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = before

    # ------------------------------------------------------------------ during backward (called by GradBuckets)

    def _copy_in(self, i: int, p: nn.Parameter) -> None:
        slot = self._slot.get(p)
        if slot is None or p.grad.data_ptr() == slot.data_ptr():
            return  # per-parameter mode, or .grad already is the bucket view (accumulated in place)
        slot.copy_(p.grad)  # into the bucket's flat buffer
        if self.gradient_as_bucket_view:
            p.grad = (
                slot  # from now on .grad *is* the bucket: no copy back, one gradient copy in memory
            )

    def _launch(self, i: int, missing: list) -> None:
        """All-reduce bucket i asynchronously; ``missing`` params contribute an accumulated .grad or zeros."""
        for p in missing:
            if p in self._slot:
                if p.grad is None:
                    self._slot[p].zero_()
                elif p.grad.data_ptr() != self._slot[p].data_ptr():
                    self._slot[p].copy_(p.grad)
        if self._flat[i] is not None:
            buf = self._flat[i]
        else:  # per-parameter mode reduces .grad in place (zeros if this rank has no gradient)
            p = self._bucket_params[i][0]
            buf = p.grad if p.grad is not None else torch.zeros_like(p)
        buf.div_(self.world_size)  # sum of grad/N over ranks = the average
        if self.comm_hook is None:
            work, finish = (
                comm.all_reduce(buf, group=self.process_group, async_op=True, tag="grad"),
                None,
            )
        else:
            work, finish = self.comm_hook(buf, self.process_group)
        self.observer.on_bucket_launch(i, work)
        self._inflight.append((i, work, buf, finish))

    def _finish_backward(self, used_anywhere: dict, t_end_compute: float) -> None:
        """End of backward: wait for every bucket and write the averages back into ``.grad``."""
        self.observer.on_wait_start(t_end_compute)
        for i, work, buf, finish in self._inflight:
            work.wait()
            if finish is not None:
                finish()
            self.observer.on_bucket_done(i)
            for p in self._bucket_params[i]:
                if used_anywhere[p]:
                    self._write_grad(p, buf)
                else:
                    p.grad = (
                        None  # no rank has a gradient: the optimizer must skip it, as on one device
                    )
        self._inflight = []
        self.observer.on_step_done()

    # ------------------------------------------------------------------ the three gradient writers

    def _grad_reduced_in_place(self, p: nn.Parameter, buf: torch.Tensor) -> None:
        """Per parameter: ``.grad`` itself was reduced; a rank without one takes the reduced zeros."""
        if p.grad is None:
            p.grad = buf

    def _grad_copied_back(self, p: nn.Parameter, buf: torch.Tensor) -> None:
        """Bucketed (the default): copy the average out of the bucket into ``.grad``."""
        if p.grad is None:
            p.grad = self._slot[p].clone()
        else:
            p.grad.copy_(self._slot[p])

    def _grad_as_bucket_view(self, p: nn.Parameter, buf: torch.Tensor) -> None:
        """``gradient_as_bucket_view``: ``.grad`` is the bucket's view (nothing to copy)."""
        if p.grad is None or p.grad.data_ptr() != self._slot[p].data_ptr():
            p.grad = self._slot[p]


# --------------------------------------------------------------------------- gradient compression


def _cast_hook(bucket: torch.Tensor, process_group, dtype: torch.dtype):
    low = bucket.to(
        dtype
    )  # bucket already holds grad / N: the sum cannot overflow where the grads did not
    work = comm.all_reduce(low, group=process_group, async_op=True, tag="grad")
    return work, lambda: bucket.copy_(low)  # cast back into the fp32 bucket


def fp16_compress_hook(bucket: torch.Tensor, process_group=None):
    """Cast the bucket to float16, all-reduce it (half the bytes), cast back (torch's ``fp16_compress_hook``)."""
    return _cast_hook(bucket, process_group, torch.float16)


def bf16_compress_hook(bucket: torch.Tensor, process_group=None):
    """As :func:`fp16_compress_hook` with bfloat16: fp32's range, 8 bits of mantissa (on gloo too)."""
    return _cast_hook(bucket, process_group, torch.bfloat16)


COMM_HOOKS = {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}


# --------------------------------------------------------------------------- for contrast


def naive_allreduce_gradients(
    module: nn.Module, process_group=None, timeline: list | None = None
) -> None:
    """Average every gradient over ranks *after* backward: one blocking all-reduce per parameter.

    The simplest correct data parallelism (what chapter 02's exercise (a) asks for). Two
    costs it does not hide: nothing is sent until backward has finished (no overlap), and
    every small tensor pays the full per-call latency (no bucketing). Every rank reduces every
    trainable parameter in registration order; a missing gradient is sent as zeros (so no rank
    ever hangs), which means such a parameter ends with a (zero-based) gradient on all ranks.
    ``timeline`` (optional list) receives one ``("comm", name, t_start, t_end)`` per call.
    """
    world = dist.get_world_size(process_group)
    for name, p in trainable_parameters(module):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        t0 = time.perf_counter()
        comm.all_reduce(p.grad, group=process_group, tag="grad")
        p.grad.div_(world)
        if timeline is not None:
            timeline.append(("comm", name, t0, time.perf_counter()))


def torch_ddp(
    module: nn.Module, bucket_cap_mb: float = 25.0, process_group=None, **kwargs
) -> nn.Module:
    """Wrap ``module`` with PyTorch's own ``DistributedDataParallel`` (for comparison with :class:`DDP`).

    On CPU ``device_ids`` must be None; under nccl the module's GPU is passed. Extra keyword
    arguments go straight to torch (e.g. ``find_unused_parameters=True``).
    """
    from torch.nn.parallel import DistributedDataParallel

    device = next(module.parameters()).device
    device_ids = [device] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(
        module,
        device_ids=device_ids,
        bucket_cap_mb=bucket_cap_mb,
        process_group=process_group,
        **kwargs,
    )
    mark_reduced_by(module.parameters(), "torch.nn.parallel.DistributedDataParallel")
    return wrapped
