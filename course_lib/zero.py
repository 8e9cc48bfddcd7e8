"""Chapter 03 — ZeRO from scratch: stop replicating what data parallelism replicates.

Data parallelism (chapter 02) keeps a full copy of the *model states* on every rank:
parameters, gradients and optimizer state. With fp32 AdamW that is 4 + 4 + 8 = 16 bytes per
parameter, on each of the N ranks. ZeRO (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", arXiv:1910.02054) notices that each rank only
*needs* all of it for a moment, and shards it instead:

==========  ==========================================  ============================  ===============
stage       what is sharded over the N ranks            per-rank bytes, fp32 AdamW    sent per step
==========  ==========================================  ============================  ===============
DDP         nothing                                     16 Ψ                          2 Ψ (all-reduce)
ZeRO-1      optimizer state                             4Ψ + 4Ψ + 8Ψ/N = 8Ψ + 8Ψ/N    2 Ψ
ZeRO-2      + gradients                                 4Ψ + 12Ψ/N                    2 Ψ
ZeRO-3      + parameters                                16 Ψ/N                        3 Ψ
==========  ==========================================  ============================  ===============

("sent" = elements per rank, times the ring factor (N−1)/N; Ψ = parameter count, padded.)

The trick that makes stages 1 and 2 free in communication: an all-reduce *is* a
reduce-scatter followed by an all-gather (each moves (N−1)/N of the data). DDP all-reduces the
gradients and then every rank does the same optimizer step on the same numbers. ZeRO instead

1. **reduce-scatters** the gradients: rank r receives only the average of *its* 1/N slice;
2. steps the optimizer on that slice only — so it needs optimizer state for 1/N of the model;
3. **all-gathers** the updated parameter slices, so every rank has the full model again.

Same bytes on the wire as DDP, N times less optimizer state. Stage 2 additionally drops each
gradient as soon as it has been reduce-scattered (during backward), keeping only its slice.
Stage 3 also keeps only a slice of each *parameter*, and all-gathers a layer's weights just
before that layer runs (forward, and again in backward) — one extra all-gather, hence 3Ψ.

In this file
------------
* :class:`ZeroOptimizer` — stages 1 and 2 around any element-wise torch optimizer.
* :class:`Zero3` — stage 3 as a module wrapper (the idea behind FSDP, chapter 04), with a global
  ``clip_grad_norm_`` and full-tensor checkpoints (``full_state_dict`` / ``load_full_state_dict``).
* :func:`model_state_accounting`, :func:`comm_accounting` — measure bytes held and bytes sent,
  and compare them with the formulas above.

The rule that keeps every rank in step (as in ``ddp.py``): collectives are matched by call
order, so every rank issues exactly the same collectives in the same order, whatever
gradients it happens to have. A gradient this rank does not have is sent as zeros, and one
small all-reduce (tag ``"used"``) tells every rank which parameters had a gradient anywhere:
a parameter with no gradient on *any* rank keeps ``.grad = None`` and is not stepped,
exactly as a single-device optimizer skips it.
"""
from __future__ import annotations

import gc
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .memory import model_state_bytes, zero_model_state_breakdown

__all__ = ["ZeroOptimizer", "Zero3", "ELEMENTWISE_OPTIMIZERS", "model_state_accounting", "comm_accounting"]

# Optimizers whose update of element i reads only element i of the parameter, its gradient and
# its state (plus per-tensor scalars such as the step count). Only those can be cut into
# slices: a slice's update is then exactly the slice of the full update. LBFGS (global dot
# products), Adafactor (row/column statistics of a matrix) or Muon (orthogonalises a matrix)
# need the whole tensor and cannot be sharded this way.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                          torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
                          torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)


# =========================================================================== input checks


def _check_optimizer_cls(optimizer_cls) -> None:
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be an element-wise torch.optim.Optimizer class (each element's "
                        f"update depends on that element alone: {names}), got {optimizer_cls!r}")
    if not issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS):
        raise ValueError(f"{optimizer_cls.__name__} is not an element-wise optimizer: ZeRO steps each rank's "
                         f"slice of a flat buffer on its own, which is only the same as stepping the whole "
                         f"tensor when every element's update depends on that element alone. Supported: {names}")


def _check_same_device(tensors, who: str) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{who}: parameters are on several devices {sorted(map(str, devices))}; "
                         f"move the model to one device (this rank's, launch.device()) first")
    return devices.pop() if devices else torch.device("cpu")


def _check_fp32(named, who: str) -> None:
    for name, p in named:
        if p.dtype != torch.float32:
            raise ValueError(f"{who} keeps fp32 parameters (master weights); {name} is {p.dtype}. "
                             f"Keep the model in fp32"
                             + (" and pass compute_dtype=torch.bfloat16 for 16-bit compute" if who == "Zero3" else ""))


def _data_parallel_wrapper_of(params) -> str | None:
    """The data-parallel wrapper that already reduces these parameters' gradients, if any.

    ZeRO does its own gradient reduction; under DDP every gradient would be all-reduced
    *and* reduce-scattered (twice the traffic, and a full gradient copy we meant to free).
    ``course_lib.ddp.DDP`` is recognised by the post-accumulate-grad hooks it registers;
    ``torch.nn.parallel.DistributedDataParallel`` registers its hooks in C++, invisible from
    Python, so we look for a live wrapper object whose module holds one of these parameters.
    """
    try:
        from .ddp import DDP as CourseDDP
    except ImportError:  # pragma: no cover - the DDP chapter is optional here
        CourseDDP = ()
    for p in params:
        for hook in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
            owner = getattr(hook, "__self__", None)
            if CourseDDP and isinstance(owner, CourseDDP):
                return "course_lib.ddp.DDP"
            if isinstance(owner, ZeroOptimizer):
                return "another ZeroOptimizer"
    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for p in params}  # type(), not isinstance(): some lazy objects warn on __class__
    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel) and any(id(q) in ids for q in obj.module.parameters()):
            return "torch.nn.parallel.DistributedDataParallel"
    return None


def _is_data_parallel_module(module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    try:
        from .ddp import DDP as CourseDDP
    except ImportError:  # pragma: no cover
        CourseDDP = DistributedDataParallel
    return isinstance(module, (DistributedDataParallel, CourseDDP))


# =========================================================================== ZeRO-1 and ZeRO-2


@dataclass(eq=False)
class _Bucket:
    """A contiguous range of a group's flat buffer, reduced with one collective.

    ``numel`` is padded up to a multiple of N so it splits evenly: rank r owns elements
    ``[start + r·chunk, start + (r+1)·chunk)``. Padding elements are zeros that are
    never stepped; they are the only cost of the even split (< N per bucket).
    """

    group: int
    params: list
    offsets: list  # where each parameter starts in the group's flat buffer
    start: int
    numel: int
    chunk: int  # = numel // N, this rank's share
    grad_offset: int = 0  # stage 2: where this bucket's chunk sits in the group's partition gradient


@dataclass(eq=False)
class _Segment:
    """The part of one model parameter that falls in this rank's partition.

    ``param`` is an ``nn.Parameter`` *viewing* the flat buffer, so stepping it updates the
    model's weights in place. Why one segment per (parameter ∩ partition) rather than one
    Parameter for the whole partition: for an element-wise optimizer the math is identical,
    and the torch optimizer then keeps per-parameter bookkeeping exactly as on one device —
    a parameter nobody computed a gradient for gets ``grad = None`` and is skipped (no weight
    decay, no momentum, no step count), and Adam's step count is per parameter.
    """

    index: int  # which model parameter (position in ZeroOptimizer.params)
    bucket: _Bucket
    lo: int  # [lo, hi) in the group's flat buffer
    hi: int
    param: nn.Parameter


def _pack_buckets(params: list, cap_bytes: float) -> list[list]:
    """Group parameters into buckets of at most ``cap_bytes`` (a larger parameter gets its own).

    Reverse registration order, as in DDP: backward produces the last layers' gradients
    first, so the first bucket fills (and its reduce-scatter starts) while backward is still
    working on the early layers.
    """
    buckets, size = [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around an element-wise torch optimizer.

    ``ZeroOptimizer(params, optimizer_cls, stage=1, process_group=None, bucket_cap_mb=25.0, **kwargs)``

    ``params`` are the model's parameters (or param groups, dicts with per-group options, as for
    any torch optimizer); ``kwargs`` go to ``optimizer_cls`` (``lr``, ``weight_decay`` …). Use
    it like a torch optimizer on a plain, *unwrapped* model — it does the gradient reduction::

        opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
        loss = model(x_local, y_local)[1]; loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

    Layout. The parameters of each param group are copied into **one flat fp32 buffer** and
    every Parameter's ``.data`` becomes a view into it (the model does not notice). The buffer
    is cut into buckets of ≤ ``bucket_cap_mb`` (``None``: one bucket per group), each padded to
    a multiple of N and split evenly; rank r owns slice r of every bucket — its *partition*.
    With one bucket that is the textbook picture: rank r owns the r-th contiguous 1/N.

    Per step, stage 1::

        backward          full local gradients accumulate in a flat gradient buffer (p.grad are views)
        step()            reduce-scatter each bucket: own slice ← average over ranks (in place)
                          torch optimizer steps this rank's slice (its state exists only for it)
                          all-gather each bucket: every rank gets every updated slice

    Stage 2: as soon as every gradient of a bucket is ready *during backward* (post-accumulate-grad
    hooks), the bucket is reduce-scattered asynchronously and the full ``.grad`` tensors are
    freed; each rank keeps only its partition's averaged gradient. Memory (fp32 AdamW, Ψ =
    padded count): stage 1 ``4Ψ params + 4Ψ grads + 8Ψ/N state``; stage 2 ``4Ψ + 4Ψ/N + 8Ψ/N``.

    After ``step()`` in stage 1 only this rank's slice of each ``p.grad`` holds the averaged
    gradient (the rest is this rank's local gradient); in stage 2 ``p.grad`` is None — the
    gradient lives in the partition. Call ``zero_grad()`` between steps.
    """

    def __init__(self, params, optimizer_cls, stage: int = 1, process_group=None, *,
                 bucket_cap_mb: float | None = 25.0, **kwargs):
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"stage={stage!r} is not one of 1, 2 (use Zero3 for stage 3)")
        _check_optimizer_cls(optimizer_cls)
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be None (one bucket per param group) or > 0, got {bucket_cap_mb!r}")
        groups = self._param_groups(params)
        self.params: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        _check_fp32([(f"parameter {i}", p) for i, p in enumerate(self.params)], "ZeroOptimizer")
        self.device = _check_same_device(self.params, "ZeroOptimizer")
        wrapper = _data_parallel_wrapper_of(self.params)
        if wrapper is not None:
            raise ValueError(f"these parameters belong to a module wrapped by {wrapper}, which already reduces "
                             f"gradients; ZeroOptimizer does its own reduce-scatter — pass the plain module's "
                             f"parameters (e.g. ddp_model.module.parameters()) and do not wrap it")
        self.stage = stage
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._index_of = {p: i for i, p in enumerate(self.params)}

        # 1. Flat buffers and buckets, one flat fp32 buffer per param group.
        cap = math.inf if bucket_cap_mb is None else bucket_cap_mb * 2**20
        self.flat_params: list[torch.Tensor] = []
        self.buckets: list[_Bucket] = []
        for gi, group in enumerate(groups):
            self.flat_params.append(self._flatten_group(gi, group["params"], cap))
        self._bucket_of = {p: i for i, b in enumerate(self.buckets) for p in b.params}  # p → bucket index
        self._offset_of = {p: off for b in self.buckets for p, off in zip(b.params, b.offsets)}  # p → flat offset

        # 2. This rank's partition, as one segment Parameter per (parameter ∩ owned slice),
        #    and a real torch optimizer over them: optimizer state for the partition only.
        self.segments: list[_Segment] = [s for b in self.buckets for s in self._segments_of(b)]
        inner_groups = []
        for gi, group in enumerate(groups):
            segs = [s.param for s in self.segments if s.bucket.group == gi]
            options = {k: v for k, v in group.items() if k != "params"}
            inner_groups.append({"params": segs, **options})
        self.optimizer = optimizer_cls(inner_groups, **kwargs)

        # 3. Gradient storage. Stage 1: a full flat gradient buffer per group (p.grad are views).
        #    Stage 2: only this rank's partition of the gradient (Σ chunks of its buckets).
        if stage == 1:
            self.flat_grads = [torch.zeros_like(f) for f in self.flat_params]
            self._grad_slot = {p: self.flat_grads[b.group][off:off + p.numel()].view_as(p)
                               for b in self.buckets for p, off in zip(b.params, b.offsets)}
        else:
            sizes = [0] * len(groups)
            for b in self.buckets:
                b.grad_offset = sizes[b.group]
                sizes[b.group] += b.chunk
            self.partition_grads = [torch.zeros(n, device=self.device) for n in sizes]
        self._used = torch.zeros(len(self.params), dtype=torch.uint8, device=self.device)  # used on any rank
        self._reduced = False  # stage 1: gradients of this step already reduce-scattered
        self._reset_backward_state()
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _param_groups(params) -> list[dict]:
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of Parameters or of param-group dicts, got a single tensor")
        items = list(params)
        if not items:
            raise ValueError("ZeroOptimizer got an empty parameter list")
        groups = [dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]))
                  if isinstance(g, dict) else None for g in items]
        if any(g is None for g in groups):
            if not all(isinstance(p, torch.Tensor) for p in items):
                raise TypeError("params must be all tensors or all param-group dicts")
            groups = [{"params": items}]
        seen = set()
        for g in groups:
            for p in g["params"]:
                if not isinstance(p, torch.Tensor) or not p.is_leaf:
                    raise TypeError(f"every parameter must be a leaf tensor (nn.Parameter), got {type(p).__name__}")
                if id(p) in seen:
                    raise ValueError("a parameter appears twice; pass each (tied) parameter once, "
                                     "as model.parameters() does")
                seen.add(id(p))
        return groups

    @torch.no_grad()
    def _flatten_group(self, gi: int, params: list, cap: float) -> torch.Tensor:
        """Copy the group's parameters into one padded flat buffer; make them views of it."""
        n = self.world_size
        layout, start = [], 0
        for members in _pack_buckets(params, cap):
            size = sum(p.numel() for p in members)
            padded = -(-size // n) * n  # round up to a multiple of N
            offsets, off = [], start
            for p in members:
                offsets.append(off)
                off += p.numel()
            layout.append(_Bucket(gi, members, offsets, start, padded, padded // n))
            start += padded
        flat = torch.zeros(start, dtype=torch.float32, device=self.device)
        for b in layout:
            for p, off in zip(b.params, b.offsets):
                flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
        # Every rank starts from rank 0's weights: the partitions only fit together if they agree.
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        comm.broadcast(flat, src=src, group=self.process_group, tag="init")
        for b in layout:
            for p, off in zip(b.params, b.offsets):
                p.data = flat[off:off + p.numel()].view_as(p)  # the Parameter now lives in the flat buffer
        self.buckets.extend(layout)
        return flat

    def _owned_range(self, b: _Bucket) -> tuple[int, int]:
        lo = b.start + self.rank * b.chunk
        return lo, lo + b.chunk

    def _segments_of(self, b: _Bucket) -> list[_Segment]:
        own_lo, own_hi = self._owned_range(b)
        flat = self.flat_params[b.group]
        segs = []
        for p, off in zip(b.params, b.offsets):
            lo, hi = max(off, own_lo), min(off + p.numel(), own_hi)
            if lo < hi:
                segs.append(_Segment(self._index_of[p], b, lo, hi, nn.Parameter(flat[lo:hi])))
        return segs

    def _owned_grad(self, b: _Bucket) -> torch.Tensor:
        """This rank's averaged gradient for bucket ``b`` (valid after the reduce-scatter)."""
        if self.stage == 1:
            lo, hi = self._owned_range(b)
            return self.flat_grads[b.group][lo:hi]
        return self.partition_grads[b.group][b.grad_offset:b.grad_offset + b.chunk]

    # ------------------------------------------------------------------ during backward

    def _reset_backward_state(self) -> None:
        self._pending = [len(b.params) for b in self.buckets]  # stage 2: gradients still missing per bucket
        self._next = 0  # next bucket to launch: strictly in bucket order on every rank
        self._fired: set[int] = set()  # indices of parameters whose hook ran in this backward
        self._staging: dict[int, torch.Tensor] = {}  # stage 2: bucket → full-size gradient, until reduced
        self._inflight: list = []
        self._callback_queued = False

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``p.grad`` is final for this backward."""
        if self.stage == 1:
            slot = self._grad_slot[p]
            if p.grad.data_ptr() != slot.data_ptr():  # first backward since zero_grad: a fresh tensor
                slot.copy_(p.grad)
                p.grad = slot  # later backwards accumulate straight into the flat buffer
            self._reduced = False
            return
        if not self._callback_queued:  # first hook of this backward: make sure we finish it
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        i = self._bucket_of[p]
        b = self.buckets[i]
        staging = self._staging.get(i)
        if staging is None:
            staging = self._staging[i] = torch.zeros(b.numel, device=self.device)
        off = self._offset_of[p] - b.start
        staging[off:off + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None  # ZeRO-2: the full gradient is not kept
        self._fired.add(self._index_of[p])
        self._pending[i] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)

    def _launch(self, i: int) -> None:
        """Stage 2: reduce-scatter bucket i asynchronously (zeros for gradients this rank lacks)."""
        b = self.buckets[i]
        staging = self._staging.pop(i, None)
        if staging is None:
            staging = torch.zeros(b.numel, device=self.device)
        out = torch.empty(b.chunk, device=self.device)
        work = comm.reduce_scatter(out, staging, group=self.process_group, async_op=True, tag="grad")
        self._inflight.append((b, work, out, staging))  # staging must live until the work is done
        self._next = i + 1

    def _finish_backward(self) -> None:
        """Stage 2, end of backward: launch the rest in order, share who had gradients, wait, keep the slices."""
        for i in range(self._next, len(self.buckets)):
            self._launch(i)
        used = torch.zeros(len(self.params), dtype=torch.uint8, device=self.device)
        used[sorted(self._fired)] = 1
        comm.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, tag="used")
        self._used |= used
        for b, work, out, _staging in self._inflight:
            work.wait()
            self._owned_grad(b).add_(out.div_(self.world_size))  # sum/N = average; += for accumulation
        self._reset_backward_state()

    # ------------------------------------------------------------------ stage 1: reduce after backward

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        """Stage 1: every rank's own slice of the flat gradient ← the average over ranks."""
        if self._reduced:
            return
        used = torch.zeros(len(self.params), dtype=torch.uint8, device=self.device)
        for i, p in enumerate(self.params):
            if p.grad is None:
                self._grad_slot[p].zero_()  # no gradient here: contribute zeros
            else:
                used[i] = 1
        works = []
        for b in self.buckets:
            full = self.flat_grads[b.group][b.start:b.start + b.numel]
            works.append(comm.reduce_scatter(self._owned_grad(b), full, group=self.process_group,
                                             async_op=True, tag="grad"))  # in place: output is a slice of input
        comm.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, tag="used")
        self._used |= used
        for b, work in zip(self.buckets, works):
            work.wait()
            self._owned_grad(b).div_(self.world_size)
        self._reduced = True

    # ------------------------------------------------------------------ the optimizer API

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the *global* gradient norm to ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` would on one device.

        Each rank holds 1/N of the averaged gradient, so the norm is assembled from pieces:
        ``‖g‖₂ = sqrt(Σ_ranks Σ_own g²)`` (one all-reduce of a scalar; ``inf``-norm: MAX of
        maxima). Every rank then scales its slice by ``min(1, max_norm / (‖g‖ + 1e-6))``.
        Padding and never-used parameters hold zeros, so they do not change the sum.
        Returns the total norm (before clipping).
        """
        norm_type = float(norm_type)
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"norm_type={norm_type} is not supported; use 2.0 or math.inf")
        if self.stage == 1:
            self._reduce_gradients()
        owned = [self._owned_grad(b) for b in self.buckets]
        if norm_type == 2.0:
            local = torch.stack([g.pow(2).sum() for g in owned]).sum()
            comm.all_reduce(local, group=self.process_group, tag="norm")
            total = local.sqrt()
        else:
            local = torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in owned]).max()
            comm.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group, tag="norm")
            total = local
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in owned:
            g.mul_(coef)
        return total

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Reduce-scatter (stage 1), step this rank's partition, all-gather the new parameters."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure (element-wise optimizers don't need one)")
        if self.stage == 1:
            self._reduce_gradients()
        used = self._used.tolist()
        for s in self.segments:  # a parameter without a gradient on any rank is skipped, as on one device
            if used[s.index]:
                own_lo, _ = self._owned_range(s.bucket)
                s.param.grad = self._owned_grad(s.bucket)[s.lo - own_lo:s.hi - own_lo]
            else:
                s.param.grad = None
        self.optimizer.step()
        for b in self.buckets:  # in place: this rank's slice is the input, the bucket the output
            own_lo, own_hi = self._owned_range(b)
            flat = self.flat_params[b.group]
            comm.all_gather(flat[b.start:b.start + b.numel], flat[own_lo:own_hi], group=self.process_group,
                            tag="param")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (the flat buffers stay allocated; ``p.grad`` become None)."""
        for p in self.params:
            p.grad = None
        for s in self.segments:
            s.param.grad = None
        if self.stage == 1:
            for g in self.flat_grads:
                g.zero_()
        else:
            for g in self.partition_grads:
                g.zero_()
        self._used.zero_()
        self._reduced = False

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (change ``lr`` here); their params are this rank's segments."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """The inner optimizer's state: only this rank's partition."""
        return self.optimizer.state

    # ------------------------------------------------------------------ checkpoints

    def _layout(self) -> list[tuple[int, int, int]]:
        return [(b.group, b.start, b.numel) for b in self.buckets]

    def state_dict(self) -> dict:
        """Every partition's optimizer state (collective: call on all ranks; each gets the whole dict)."""
        every = [None] * self.world_size
        dist.all_gather_object(every, self.optimizer.state_dict(), group=self.process_group)
        return {"stage": self.stage, "world_size": self.world_size, "layout": self._layout(), "partitions": every}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this rank's partition from :meth:`state_dict` (same world size and bucket layout)."""
        if state_dict.get("world_size") != self.world_size or state_dict.get("layout") != self._layout():
            raise ValueError(f"this ZeroOptimizer state was saved with world_size={state_dict.get('world_size')} "
                             f"and another bucket layout; it loads only into the same model, world size and "
                             f"bucket_cap_mb (here world_size={self.world_size})")
        self.optimizer.load_state_dict(state_dict["partitions"][self.rank])

    # ------------------------------------------------------------------ accounting

    @property
    def numel(self) -> int:
        """Ψ: parameters managed (a tied weight once)."""
        return sum(p.numel() for p in self.params)

    @property
    def padded_numel(self) -> int:
        """Ψ padded: elements in the flat buffers (each bucket rounded up to a multiple of N)."""
        return sum(f.numel() for f in self.flat_params)

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this wrapper keeps besides params / grads / optimizer state (for memory accounting)."""
        held = list(self.flat_params) + list(self._staging.values())
        held += self.flat_grads if self.stage == 1 else self.partition_grads
        return held


# =========================================================================== ZeRO-3


@dataclass(eq=False)
class _ShardedParam:
    """One unique parameter of the wrapped module, as this rank's fp32 shard.

    The full parameter, flattened and padded to ``padded`` = a multiple of N elements, is
    split into N equal shards; ``shard`` (an ``nn.Parameter``, what the optimizer sees) is
    rank r's elements ``[r·S, (r+1)·S)``.
    """

    name: str
    shape: torch.Size
    numel: int
    padded: int
    shard: nn.Parameter


@dataclass(eq=False)
class _Use:
    """One use of a full parameter in one module call: the gathered buffer it reads from."""

    param: _ShardedParam
    forward_pass: "_ForwardPass | None"
    buffer: torch.Tensor | None = None  # all-gather output; its storage is freed between uses


@dataclass
class _ForwardPass:
    """Bookkeeping of one forward (under autograd) until its backward is done.

    ``pending[p]``: uses of ``p`` whose gradient has not arrived yet. A tied weight is used
    twice (embedding and output layer); its gradient is reduce-scattered once, when the last
    use has contributed to ``grad_sum[p]``.
    """

    pending: dict = field(default_factory=dict)
    grad_sum: dict = field(default_factory=dict)


class _AllGatherParam(torch.autograd.Function):
    """forward: all-gather the full parameter from the shards.  backward: reduce-scatter its gradient.

    The pair is ZeRO-3 in one autograd piece, the mirror image of each other (all-gather's
    adjoint is reduce-scatter). The input is the fp32 shard, so autograd delivers the
    returned shard gradient into ``shard.grad`` (accumulating over backward calls).
    """

    @staticmethod
    def forward(ctx, shard, use: _Use, zero3: "Zero3"):
        ctx.use, ctx.zero3 = use, zero3
        use.buffer = zero3._all_gather(use.param)
        return use.buffer[:use.param.numel].view(use.param.shape)

    @staticmethod
    def backward(ctx, grad_full):
        use, zero3 = ctx.use, ctx.zero3
        zero3._free(use)  # every op that read this use of the weight has finished its backward
        return zero3._reduce_scatter_grad(use, grad_full), None, None


class _RegatherBeforeBackward(torch.autograd.Function):
    """forward: identity on a module's outputs.  backward: all-gather its weights again, then pass grads on.

    A backward *pre*-hook for the module: autograd runs this node's backward before any of
    the module's own backward ops, which need the weights the forward freed.
    """

    @staticmethod
    def forward(ctx, uses, zero3, *outputs):
        ctx.uses, ctx.zero3 = uses, zero3
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        for use in ctx.uses:
            ctx.zero3._regather(use)
        return (None, None, *grads)


class Zero3(nn.Module):
    """ZeRO stage 3: every rank keeps 1/N of every parameter; full weights exist only while a layer runs.

    ``Zero3(module, compute_dtype=None, process_group=None)``

    * Each unique parameter is flattened, padded to a multiple of N and cut into N shards;
      this rank keeps its shard as an fp32 ``nn.Parameter``. The original Parameters are
      removed from their modules. ``parameters()`` / ``named_parameters()`` yield exactly the
      shards, one per unique parameter, under the original names — hand them to any
      element-wise torch optimizer (AdamW …): its state is then 1/N too.
    * Before a module that owns parameters runs forward, its full parameters are all-gathered
      (tag ``"param"``) and set as plain tensor attributes (``linear.weight``); right after, the
      gathered storage is freed (``untyped_storage().resize_(0)``). Autograd still holds the
      tensor for backward, but it now holds no memory.
    * In backward, :class:`_RegatherBeforeBackward` re-gathers the weights into the same
      storage before the module's backward ops read them; :class:`_AllGatherParam`'s backward
      then frees them again, casts the full gradient to fp32, and reduce-scatters it (tag
      ``"grad"``, averaged) into ``shard.grad`` — all before ``backward()`` returns.
    * A tied parameter (``lm_head.weight is wte.weight``) is sharded once, gathered for each
      use, and reduce-scattered once, after every use has added its gradient.
    * ``compute_dtype=torch.bfloat16`` (or float16): shards are cast before the all-gather, so
      gathers move 2 bytes per element and the layer computes in 16 bits, while the shards,
      their gradients and the optimizer state stay fp32 (master weights).

    Traffic per step (fp32): all-gather Ψ (forward) + all-gather Ψ (backward) + reduce-scatter Ψ,
    each × (N−1)/N per rank: 3Ψ against DDP's 2Ψ. Simplifications against FSDP (chapter 04): one
    collective per parameter and per use, no prefetching of the next layer, synchronous
    reduce-scatter; the re-gather happens even for a layer whose backward does not read its
    weight (an embedding). Every rank must run the same modules in the same order.

    Call the wrapper (``zero3(x)``), not ``zero3.module(x)``. ``state_dict()`` holds no
    parameters (they are not registered anywhere); use :meth:`full_state_dict`.

    Gradient clipping: :meth:`clip_grad_norm_` computes the norm of the whole model's
    gradient from the shards (one scalar all-reduce) — the same number as
    ``torch.nn.utils.clip_grad_norm_`` on one device.

    Checkpoint and resume (same world size)::

        model_sd = zero3.full_state_dict()      # collective; full tensors, identical on every rank
        optim_sd = optimizer.state_dict()       # local; this rank's shards' state only (AdamW: 2 × 1/N)
        # rank 0 saves model_sd once; every rank saves its own optim_sd (e.g. optim.rank{r}.pt)
        ...
        zero3 = Zero3(build_model())
        zero3.load_full_state_dict(model_sd)    # each rank slices its shard out of the full tensors
        optimizer = torch.optim.AdamW(zero3.parameters(), ...)
        optimizer.load_state_dict(optim_sd)     # this rank's file

    Why one optimizer file per rank: the optimizer runs over the shards, so its state *is*
    sharded already; saving it as is needs no communication and no code (DeepSpeed writes
    ``zero_pp_rank_{r}_…_optim_states.pt`` the same way). The price: the shards' shapes depend
    on N, so it resumes at the same world size only. The model weights are saved full, so they
    also load into a plain model or into a ``Zero3`` at another world size.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, process_group=None):
        super().__init__()
        if compute_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"compute_dtype={compute_dtype!r} must be None, torch.float32, torch.bfloat16 "
                             f"or torch.float16")
        if not isinstance(module, nn.Module):
            raise TypeError(f"Zero3 wraps an nn.Module, got {type(module).__name__}")
        if _is_data_parallel_module(module):
            raise ValueError(f"Zero3 does its own gradient reduce-scatter: wrap the plain module, not "
                             f"{type(module).__name__} (pass ddp_model.module)")
        named = list(module.named_parameters())
        _check_fp32(named, "Zero3")
        self.device = _check_same_device([p for _, p in named], "Zero3")
        self.module = module
        self.compute_dtype = compute_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._state_dict_keys = list(module.state_dict().keys())
        self._forward_pass: _ForwardPass | None = None
        self._live_uses: list[list[_Use]] = []  # a stack: one entry per module currently running forward

        # 1. Shard every unique parameter (broadcast from rank 0 first, so all ranks agree).
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        self._sharded: dict[str, _ShardedParam] = {}
        by_id: dict[int, _ShardedParam] = {}
        for name, p in named:
            full = p.detach().clone()
            comm.broadcast(full, src=src, group=process_group, tag="init")
            padded = -(-p.numel() // self.world_size) * self.world_size
            s = padded // self.world_size
            flat = torch.zeros(padded, device=self.device)
            flat[:p.numel()] = full.reshape(-1)
            shard = nn.Parameter(flat[self.rank * s:(self.rank + 1) * s].clone(), requires_grad=p.requires_grad)
            self._sharded[name] = by_id[id(p)] = _ShardedParam(name, p.shape, p.numel(), padded, shard)
        # every name a parameter is reachable under (a tied weight has two), for full_state_dict
        self._names = {name: by_id[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}

        # 2. Remove the original Parameters from their modules; remember who owned what.
        self._owned: dict[nn.Module, list[tuple[str, _ShardedParam]]] = {}
        for sub in module.modules():
            own = [(attr, by_id[id(p)]) for attr, p in sub._parameters.items() if p is not None]
            if not own:
                continue
            for attr, _ in own:
                del sub._parameters[attr]
                setattr(sub, attr, None)  # a plain attribute, filled only while the module runs
            self._owned[sub] = own
            sub.register_forward_pre_hook(self._before_forward)
            sub.register_forward_hook(self._after_forward)

    # ------------------------------------------------------------------ the parameters the optimizer sees

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """``(original name, fp32 shard)`` for every unique parameter of the wrapped module.

        Overridden on purpose: the shards are the only trainable tensors, and their names are
        the wrapped module's (``blocks.0.attn.c_attn.weight``), not ``module.…``.
        ``parameters()`` and ``zero_grad()`` go through this method.
        """
        for name, sp in self._sharded.items():
            yield (f"{prefix}.{name}" if prefix else name), sp.shard

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._forward_pass = _ForwardPass()  # its backward counts down these uses
        try:
            return self.module(*args, **kwargs)
        finally:
            self._forward_pass = None

    # ------------------------------------------------------------------ gather / free / reduce

    def _all_gather(self, sp: _ShardedParam) -> torch.Tensor:
        """All-gather ``sp``'s shards (in the compute dtype) into a new padded 1-D buffer."""
        shard = sp.shard.detach()
        if self.compute_dtype is not None:
            shard = shard.to(self.compute_dtype)  # cast before sending: 2 bytes per element for 16-bit
        out = torch.empty(sp.padded, dtype=shard.dtype, device=self.device)
        comm.all_gather(out, shard, group=self.process_group, tag="param")
        return out

    @staticmethod
    def _free(use: _Use) -> None:
        use.buffer.untyped_storage().resize_(0)

    @torch.no_grad()
    def _regather(self, use: _Use) -> None:
        """Refill a freed buffer in place (autograd's saved tensors point at this storage)."""
        buf = use.buffer
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        shard = use.param.shard.detach().to(buf.dtype)
        # write through .data: a plain alias with its own version counter, so autograd does not
        # mistake the refill for an in-place change of a tensor it saved
        comm.all_gather(buf.data, shard, group=self.process_group, tag="param")

    @torch.no_grad()
    def _reduce_scatter_grad(self, use: _Use, grad_full: torch.Tensor) -> torch.Tensor | None:
        """Add this use's gradient; after the last use, reduce-scatter the fp32 sum into a shard gradient."""
        sp, fp = use.param, use.forward_pass
        total = fp.grad_sum.get(sp.name)
        if total is None:
            total = fp.grad_sum[sp.name] = torch.zeros(sp.padded, device=self.device)
        total[:sp.numel].add_(grad_full.reshape(-1).float())
        fp.pending[sp.name] -= 1
        if fp.pending[sp.name] > 0:
            return None  # more uses still to come; the shard gets its gradient once
        del fp.grad_sum[sp.name]
        shard_grad = torch.empty(sp.shard.numel(), device=self.device)
        comm.reduce_scatter(shard_grad, total, group=self.process_group, tag="grad")
        return shard_grad.div_(self.world_size)

    # ------------------------------------------------------------------ module hooks

    def _before_forward(self, sub: nn.Module, args) -> None:
        fp = self._forward_pass if torch.is_grad_enabled() else None
        if torch.is_grad_enabled() and fp is None:
            raise RuntimeError("Zero3: call the wrapper (zero3(x)), not zero3.module(x): the wrapper's forward "
                               "sets up the bookkeeping that backward's reduce-scatters rely on")
        uses = []
        for attr, sp in self._owned[sub]:
            use = _Use(sp, fp if sp.shard.requires_grad else None)
            if use.forward_pass is not None:
                fp.pending[sp.name] = fp.pending.get(sp.name, 0) + 1
                full = _AllGatherParam.apply(sp.shard, use, self)
            else:  # no backward will come (eval, no_grad, frozen): gather without autograd
                use.buffer = self._all_gather(sp)
                full = use.buffer[:sp.numel].view(sp.shape)
            setattr(sub, attr, full)
            uses.append(use)
        self._live_uses.append(uses)

    def _after_forward(self, sub: nn.Module, args, output):
        uses = self._live_uses.pop()
        for (attr, _), use in zip(self._owned[sub], uses):
            setattr(sub, attr, None)  # drop the module's reference ...
            self._free(use)  # ... and the memory, which autograd's saved copy shares
        needs = [use for use in uses if use.forward_pass is not None]
        if not needs:
            return output
        outs = [output] if isinstance(output, torch.Tensor) else list(output) if isinstance(output, (tuple, list)) \
            else None
        if outs is None:
            raise TypeError(f"Zero3: {type(sub).__name__} returned {type(output).__name__}; "
                            f"modules that own parameters must return a tensor or a tuple of tensors")
        grad_idx = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrapped = _RegatherBeforeBackward.apply(needs, self, *[outs[i] for i in grad_idx])
        for i, w in zip(grad_idx, wrapped):
            outs[i] = w
        return outs[0] if isinstance(output, torch.Tensor) else type(output)(outs)

    # ------------------------------------------------------------------ gradient clipping

    def _own_numel(self, sp: _ShardedParam) -> int:
        """How many elements of this rank's shard are real (the rest, at the end, is padding)."""
        size = sp.shard.numel()
        return max(0, min(size, sp.numel - self.rank * size))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient norm of the *whole* model, as ``torch.nn.utils.clip_grad_norm_`` on one device.

        Call after ``backward()`` and before ``optimizer.step()``. No rank has the whole
        gradient — rank r holds the averaged gradient of its shard of every parameter — but a
        p-norm is a sum over elements, and the shards partition the elements::

            ‖g‖_p = ( Σ_ranks Σ_{own elements} |g|^p )^(1/p)     one all-reduce (SUM) of a scalar
            ‖g‖_∞ = max_ranks max_{own elements} |g|              one all-reduce (MAX) of a scalar

        Only the *real* elements of each shard count (padding is cut off; it holds zeros
        anyway, but a max or a stray value there must not decide the norm). Every rank gets
        the same total, so every rank scales its shard gradients in place by the same
        ``min(1, max_norm / (total + 1e-6))`` — torch's formula — and the step is the
        single-device one (up to the rounding of a sum taken in another order). Returns the
        total norm (before clipping). Collective (tag ``"norm"``): call it on every rank, also
        on one whose shards have no gradient.
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type={norm_type} must be > 0 (e.g. 2.0, or math.inf for the largest |g|)")
        with_grad = [sp for sp in self._sharded.values() if sp.shard.grad is not None]
        own = [sp.shard.grad[:self._own_numel(sp)] for sp in with_grad]
        local = torch.zeros((), device=self.device)  # a fresh tensor: the all-reduce works in place
        if norm_type == math.inf:
            for g in own:
                if g.numel():
                    local = torch.maximum(local, g.abs().max())
            comm.all_reduce(local, op=dist.ReduceOp.MAX, group=self.process_group, tag="norm")
            total = local
        else:
            for g in own:
                local += g.abs().pow(norm_type).sum()
            comm.all_reduce(local, group=self.process_group, tag="norm")
            total = local.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for sp in with_grad:
            sp.shard.grad.mul_(coef)  # padding is zero and stays zero
        return total

    # ------------------------------------------------------------------ checkpoints and accounting

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unpadded tensors under the keys of the wrapped module's ``state_dict()`` (collective)."""
        buffers = self.module.state_dict()  # the parameters were removed: buffers (and extra state) only
        gathered: dict[str, torch.Tensor] = {}
        out = {}
        for key in self._state_dict_keys:
            sp = self._names.get(key)
            if sp is None:
                out[key] = buffers[key]
                continue
            if sp.name not in gathered:
                full = torch.empty(sp.padded, device=self.device)
                comm.all_gather(full, sp.shard.detach(), group=self.process_group, tag="state")
                gathered[sp.name] = full[:sp.numel].view(sp.shape)
            out[key] = gathered[sp.name]
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict, strict: bool = True) -> None:
        """Load full tensors (keys and shapes of the wrapped module's ``state_dict()``) into the shards.

        The inverse of :meth:`full_state_dict`, and it also takes a plain single-device
        model's ``state_dict()``. Not a collective: every rank is handed the same full
        tensors and copies only its own slice — elements ``[r·S, (r+1)·S)`` of the flattened
        tensor, zeros where that runs past the end (padding). Buffers go to the wrapped
        module. A tied weight appears under two keys; as in ``nn.Module.load_state_dict`` both
        are loaded into the one shard (the later key wins; :meth:`full_state_dict` writes the
        same tensor under both). The shards stay the same ``nn.Parameter`` objects, so an
        optimizer built over ``parameters()`` keeps pointing at them.

        ``strict=True`` (default) raises on missing or unexpected keys; a shape mismatch
        always raises.
        """
        keys = set(self._state_dict_keys)
        missing = [k for k in self._state_dict_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in keys]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Zero3.load_full_state_dict: missing keys {missing}, unexpected keys {unexpected} "
                               f"(expected the wrapped module's state_dict() keys; pass strict=False to skip them)")
        buffers = {}
        for key, value in state_dict.items():
            if key not in keys:
                continue
            sp = self._names.get(key)
            if sp is None:  # a buffer (or extra state): the wrapped module still owns it
                buffers[key] = value
                continue
            if tuple(value.shape) != tuple(sp.shape):
                raise ValueError(f"Zero3.load_full_state_dict: {key} has shape {tuple(value.shape)} in the state "
                                 f"dict, {tuple(sp.shape)} in the model")
            size, own = sp.shard.numel(), self._own_numel(sp)
            lo = self.rank * size
            sp.shard.zero_()  # the padding
            sp.shard[:own].copy_(value.detach().reshape(-1)[lo:lo + own])
        self.module.load_state_dict(buffers, strict=strict)

    @property
    def numel(self) -> int:
        return sum(sp.numel for sp in self._sharded.values())

    @property
    def padded_numel(self) -> int:
        """Ψ padded: Σ over unique parameters of the size rounded up to a multiple of N."""
        return sum(sp.padded for sp in self._sharded.values())

    def held_tensors(self) -> list[torch.Tensor]:
        """Gather buffers still referenced (normally freed: 0 bytes) — for memory accounting."""
        return [u.buffer for uses in self._live_uses for u in uses if u.buffer is not None]


# =========================================================================== measured vs formula


def model_state_accounting(model, optimizer, extra=()) -> dict:
    """Per-rank model-state bytes, measured from real tensors and predicted by the ZeRO formula.

    Call after ``step()`` (k ≥ 1) and before ``zero_grad()``, when everything exists.
    ``measured`` sums ``untyped_storage().nbytes()`` over unique storages reachable from the
    parameters, their ``.grad``, the optimizer state and every tensor the wrapper holds
    (``memory.model_state_bytes``). ``formula`` is fp32 AdamW on the padded count Ψ:

    * ``model`` plain (or DDP), ``optimizer`` a torch optimizer → DDP, 16Ψ
    * ``optimizer`` a :class:`ZeroOptimizer` → stage 1: 8Ψ + 8Ψ/N; stage 2: 4Ψ + 12Ψ/N
    * ``model`` a :class:`Zero3`, ``optimizer`` a torch optimizer over its shards → 16Ψ/N

    Returns ``{"stage", "world_size", "psi", "psi_pad", "measured", "formula", "formula_breakdown",
    "ratio"}``; ``measured`` and ``formula_breakdown`` split the bytes into params / grads / optimizer
    (ZeRO-2's partition gradient and the flat buffers are charged as ``grads`` / ``params``).
    """
    if isinstance(optimizer, ZeroOptimizer):
        stage, n, psi, psi_pad = optimizer.stage, optimizer.world_size, optimizer.numel, optimizer.padded_numel
        # the segments' .grad are this rank's gradient slices: count them as "grads"
        measured = model_state_bytes(optimizer.params + [s.param for s in optimizer.segments], optimizer.optimizer,
                                     extra=list(optimizer.held_tensors()) + list(extra))
    elif isinstance(model, Zero3):
        stage, n, psi, psi_pad = 3, model.world_size, model.numel, model.padded_numel
        measured = model_state_bytes(list(model.parameters()), optimizer,
                                     extra=list(model.held_tensors()) + list(extra))
    else:
        params = list(model.parameters())
        stage, psi = 0, sum(p.numel() for p in params)
        psi_pad = psi
        n = dist.get_world_size() if dist.is_initialized() else 1
        measured = model_state_bytes(params, optimizer, extra=list(extra))
    breakdown = zero_model_state_breakdown(psi_pad, n, stage, precision="fp32")
    return dict(stage=stage, world_size=n, psi=psi, psi_pad=psi_pad, measured=measured, formula=breakdown["total"],
                formula_breakdown=breakdown, ratio=measured["total"] / breakdown["total"])


def comm_accounting(log: comm.CommLog, wrapper, steps: int = 1) -> dict:
    """Bytes one rank sent per step (ring model), against ``(N−1)/N · c · Ψ · 4`` bytes.

    ``log`` recorded ``steps`` full training steps; only tags ``"param"`` and ``"grad"``
    count (not the one-time ``"init"`` broadcast or the tiny ``"used"``/``"norm"`` all-reduces).
    c = 2 for ZeRO-1/2 (reduce-scatter + all-gather = one all-reduce, as DDP) and 3 for ZeRO-3
    (an extra all-gather in backward). ``wrapper`` is the :class:`ZeroOptimizer` or :class:`Zero3`.
    The formula assumes fp32 traffic; with ``compute_dtype`` 16-bit the gathers are half.
    """
    if isinstance(wrapper, ZeroOptimizer):
        stage, c = wrapper.stage, 2
    elif isinstance(wrapper, Zero3):
        stage, c = 3, 3
    else:
        raise TypeError(f"wrapper must be a ZeroOptimizer or Zero3, got {type(wrapper).__name__}")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    n, psi_pad = wrapper.world_size, wrapper.padded_numel
    sent = (log.total("ring_bytes", tag="param") + log.total("ring_bytes", tag="grad")) / steps
    formula = (n - 1) / n * c * psi_pad * 4
    return dict(stage=stage, world_size=n, psi_pad=psi_pad, sent_per_step=sent, formula=formula,
                ratio=sent / formula if formula else float("nan"))
