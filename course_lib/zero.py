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
* Stage 3 lives in ``zero3.py`` (:class:`~course_lib.zero3.Zero3`); the measurements that compare
  bytes held and sent with the formulas above live in ``experiments/zero.py``.

Every rank issues the same collectives in the same order whatever gradients it has (the rule in
``grad_buckets.py``, shared with DDP): a parameter with no gradient on *any* rank keeps
``.grad = None`` and is not stepped, exactly as a single-device optimizer skips it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .grad_buckets import GradBuckets, make_buckets
from .sharding import ELEMENTWISE_OPTIMIZERS, check_fp32, check_optimizer_cls, check_same_device
from .sharding import mark_reduced_by, reducer_of

__all__ = ["ZeroOptimizer", "ELEMENTWISE_OPTIMIZERS"]


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
    grad_offset: int = (
        0  # stage 2: where this bucket's chunk sits in the group's partition gradient
    )


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


class ZeroOptimizer(torch.optim.Optimizer):
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
    freed; each rank keeps only its partition's averaged gradient. At most
    :attr:`MAX_IN_FLIGHT` reduce-scatters are in flight: launching another waits for the oldest
    and frees its staging bucket. Memory (fp32 AdamW, Ψ =
    padded count): stage 1 ``4Ψ params + 4Ψ grads + 8Ψ/N state``; stage 2 ``4Ψ + 4Ψ/N + 8Ψ/N``.

    After ``step()`` in stage 1 only this rank's slice of each ``p.grad`` holds the averaged
    gradient; in stage 2 ``p.grad`` is None (the gradient lives in the partition).
    """

    #: Stage 2: reduce-scatters in flight at once. Launching one more first waits for the oldest and
    #: frees its full-size staging bucket, so backward holds at most this many staging buckets (plus
    #: the one filling), not all of them until backward ends.
    MAX_IN_FLIGHT = 2

    def __init__(
        self,
        params,
        optimizer_cls,
        stage: int = 1,
        process_group=None,
        *,
        bucket_cap_mb: float | None = 25.0,
        **kwargs,
    ):
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"stage={stage!r} is not one of 1, 2 (use Zero3 for stage 3)")
        check_optimizer_cls(optimizer_cls)
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb must be None (one bucket per param group) or > 0, got {bucket_cap_mb!r}"
            )
        groups = self._param_groups(params)
        self.params: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        check_fp32([(f"parameter {i}", p) for i, p in enumerate(self.params)], "ZeroOptimizer")
        self.device = check_same_device(self.params, "ZeroOptimizer")
        wrapper = reducer_of(self.params)
        if wrapper is not None:
            raise ValueError(
                f"these parameters belong to a module wrapped by {wrapper}, which already reduces "
                f"gradients; ZeroOptimizer does its own reduce-scatter — pass the plain module's "
                f"parameters (e.g. ddp_model.module.parameters()) and do not wrap it"
            )
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
        self._offset_of = {
            p: off for b in self.buckets for p, off in zip(b.params, b.offsets, strict=True)
        }  # p → flat offset

        # 2. This rank's partition, as one segment Parameter per (parameter ∩ owned slice),
        #    and a real torch optimizer over them: optimizer state for the partition only.
        self.segments: list[_Segment] = [s for b in self.buckets for s in self._segments_of(b)]
        inner_groups = []
        for gi, group in enumerate(groups):
            segs = [s.param for s in self.segments if s.bucket.group == gi]
            options = {k: v for k, v in group.items() if k != "params"}
            inner_groups.append({"params": segs, **options})
        self.optimizer = optimizer_cls(inner_groups, **kwargs)
        # A torch.optim.Optimizer itself (LR schedulers check isinstance), whose param groups and
        # state *are* the inner optimizer's: a scheduler changing ``lr`` here changes it there.
        super().__init__(self.params, dict(self.optimizer.defaults))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

        # 3. Gradient storage. Stage 1: a full flat gradient buffer per group (p.grad are views).
        #    Stage 2: only this rank's partition of the gradient (Σ chunks of its buckets).
        if stage == 1:
            self.flat_grads = [torch.zeros_like(f) for f in self.flat_params]
            self._grad_slot = {
                p: self.flat_grads[b.group][off : off + p.numel()].view_as(p)
                for b in self.buckets
                for p, off in zip(b.params, b.offsets, strict=True)
            }
        else:
            sizes = [0] * len(groups)
            for b in self.buckets:
                b.grad_offset = sizes[b.group]
                sizes[b.group] += b.chunk
            self.partition_grads = [torch.zeros(n, device=self.device) for n in sizes]
        self._used = torch.zeros(
            len(self.params), dtype=torch.uint8, device=self.device
        )  # used on any rank
        self._reduced = False  # stage 1: gradients of this step already reduce-scattered
        self._staging: dict[
            int, torch.Tensor
        ] = {}  # stage 2: bucket → full-size gradient, until reduced
        self._inflight: list = []
        if stage == 1:
            for p in self.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._accumulate_flat)
        else:  # reduce-scatter bucket by bucket during backward, in bucket order (grad_buckets.py)
            self._grad_buckets = GradBuckets(
                [b.params for b in self.buckets],
                self._copy_in,
                self._launch,
                self._finish_backward,
                process_group=process_group,
            )
        mark_reduced_by(self.params, "another ZeroOptimizer")

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _param_groups(params) -> list[dict]:
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params must be an iterable of Parameters or of param-group dicts, got a single tensor"
            )
        items = list(params)
        if not items:
            raise ValueError("ZeroOptimizer got an empty parameter list")
        groups = [
            dict(
                g,
                params=[g["params"]]
                if isinstance(g["params"], torch.Tensor)
                else list(g["params"]),
            )
            if isinstance(g, dict)
            else None
            for g in items
        ]
        if any(g is None for g in groups):
            if not all(isinstance(p, torch.Tensor) for p in items):
                raise TypeError("params must be all tensors or all param-group dicts")
            groups = [{"params": items}]
        seen = set()
        for g in groups:
            for p in g["params"]:
                if not isinstance(p, torch.Tensor) or not p.is_leaf:
                    raise TypeError(
                        f"every parameter must be a leaf tensor (nn.Parameter), got {type(p).__name__}"
                    )
                if id(p) in seen:
                    raise ValueError(
                        "a parameter appears twice; pass each (tied) parameter once, "
                        "as model.parameters() does"
                    )
                seen.add(id(p))
        return groups

    @torch.no_grad()
    def _flatten_group(self, gi: int, params: list, cap: float) -> torch.Tensor:
        """Copy the group's parameters into one padded flat buffer; make them views of it."""
        n = self.world_size
        layout, start = [], 0
        for members in make_buckets(params, cap):
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
            for p, off in zip(b.params, b.offsets, strict=True):
                flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
        # Every rank starts from rank 0's weights: the partitions only fit together if they agree.
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        comm.broadcast(flat, src=src, group=self.process_group, tag="init")
        for b in layout:
            for p, off in zip(b.params, b.offsets, strict=True):
                p.data = flat[off : off + p.numel()].view_as(
                    p
                )  # the Parameter now lives in the flat buffer
        self.buckets.extend(layout)
        return flat

    def _owned_range(self, b: _Bucket) -> tuple[int, int]:
        lo = b.start + self.rank * b.chunk
        return lo, lo + b.chunk

    def _segments_of(self, b: _Bucket) -> list[_Segment]:
        own_lo, own_hi = self._owned_range(b)
        flat = self.flat_params[b.group]
        segs = []
        for p, off in zip(b.params, b.offsets, strict=True):
            lo, hi = max(off, own_lo), min(off + p.numel(), own_hi)
            if lo < hi:
                segs.append(_Segment(self._index_of[p], b, lo, hi, nn.Parameter(flat[lo:hi])))
        return segs

    def _owned_grad(self, b: _Bucket) -> torch.Tensor:
        """This rank's averaged gradient for bucket ``b`` (valid after the reduce-scatter)."""
        if self.stage == 1:
            lo, hi = self._owned_range(b)
            return self.flat_grads[b.group][lo:hi]
        return self.partition_grads[b.group][b.grad_offset : b.grad_offset + b.chunk]

    # ------------------------------------------------------------------ during backward

    def _accumulate_flat(self, p: nn.Parameter) -> None:
        """Stage 1 hook: keep ``p.grad`` as a view of the flat gradient buffer (reduced in ``step``)."""
        slot = self._grad_slot[p]
        if p.grad.data_ptr() != slot.data_ptr():  # first backward since zero_grad: a fresh tensor
            slot.copy_(p.grad)
            p.grad = slot  # later backwards accumulate straight into the flat buffer
        self._reduced = False

    def _staging_of(self, i: int) -> torch.Tensor:
        staging = self._staging.get(i)
        if staging is None:
            staging = self._staging[i] = torch.zeros(self.buckets[i].numel, device=self.device)
        return staging

    def _copy_in(self, i: int, p: nn.Parameter) -> None:
        """Stage 2: ``p.grad`` is final — copy it into bucket i's staging buffer and drop the full gradient."""
        b = self.buckets[i]
        off = self._offset_of[p] - b.start
        self._staging_of(i)[off : off + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None  # ZeRO-2: the full gradient is not kept

    def _launch(self, i: int, missing: list) -> None:
        """Stage 2: reduce-scatter bucket i asynchronously (zeros for gradients this rank lacks)."""
        for p in missing:
            if p.grad is not None:  # e.g. accumulated outside a hook: send what this rank has
                self._copy_in(i, p)
        b = self.buckets[i]
        staging = self._staging.pop(i, None)
        if staging is None:
            staging = torch.zeros(b.numel, device=self.device)
        out = torch.empty(b.chunk, device=self.device)
        work = comm.reduce_scatter(
            out, staging, group=self.process_group, async_op=True, tag="grad"
        )
        self._inflight.append((b, work, out, staging))  # staging must live until the work is done
        while len(self._inflight) > self.MAX_IN_FLIGHT:  # the oldest is done: free its staging
            self._land(*self._inflight.pop(0))

    def _land(self, b: _Bucket, work, out: torch.Tensor, staging: torch.Tensor) -> None:
        """Stage 2: wait for bucket b's reduce-scatter and keep this rank's averaged slice.

        Dropping the last reference to ``staging`` here frees the full-size bucket at once."""
        work.wait()
        self._owned_grad(b).add_(out.div_(self.world_size))  # sum/N = average; += accumulates

    def _finish_backward(self, used_anywhere: dict, t_end_compute: float) -> None:
        """Stage 2, end of backward: wait for the buckets still in flight, keep this rank's slices."""
        for p, used in used_anywhere.items():
            if used:
                self._used[self._index_of[p]] = 1
        while self._inflight:
            self._land(*self._inflight.pop(0))

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
            full = self.flat_grads[b.group][b.start : b.start + b.numel]
            works.append(
                comm.reduce_scatter(
                    self._owned_grad(b), full, group=self.process_group, async_op=True, tag="grad"
                )
            )  # in place: output is a slice of input
        comm.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, tag="used")
        self._used |= used
        for b, work in zip(self.buckets, works, strict=True):
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
            local = torch.stack(
                [g.abs().max() if g.numel() else g.new_zeros(()) for g in owned]
            ).max()
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
            raise ValueError(
                "ZeroOptimizer.step does not take a closure (element-wise optimizers don't need one)"
            )
        if self.stage == 1:
            self._reduce_gradients()
        used = self._used.tolist()
        for s in (
            self.segments
        ):  # a parameter without a gradient on any rank is skipped, as on one device
            if used[s.index]:
                own_lo, _ = self._owned_range(s.bucket)
                s.param.grad = self._owned_grad(s.bucket)[s.lo - own_lo : s.hi - own_lo]
            else:
                s.param.grad = None
        self.optimizer.step()
        for b in self.buckets:  # in place: this rank's slice is the input, the bucket the output
            own_lo, own_hi = self._owned_range(b)
            flat = self.flat_params[b.group]
            comm.all_gather(
                flat[b.start : b.start + b.numel],
                flat[own_lo:own_hi],
                group=self.process_group,
                tag="param",
            )

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

    # ------------------------------------------------------------------ checkpoints

    def _layout(self) -> list[tuple[int, int, int]]:
        return [(b.group, b.start, b.numel) for b in self.buckets]

    def state_dict(self) -> dict:
        """Every partition's optimizer state (collective: call on all ranks; each gets the whole dict)."""
        every = [None] * self.world_size
        dist.all_gather_object(every, self.optimizer.state_dict(), group=self.process_group)
        return {
            "stage": self.stage,
            "world_size": self.world_size,
            "layout": self._layout(),
            "partitions": every,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this rank's partition from :meth:`state_dict` (same world size and bucket layout)."""
        if (
            state_dict.get("world_size") != self.world_size
            or state_dict.get("layout") != self._layout()
        ):
            raise ValueError(
                f"this ZeroOptimizer state was saved with world_size={state_dict.get('world_size')} "
                f"and another bucket layout; it loads only into the same model, world size and "
                f"bucket_cap_mb (here world_size={self.world_size})"
            )
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

    def transient_tensors(self) -> list[torch.Tensor]:
        """Stage 2's communication memory right now: staging buckets still filling, and each
        reduce-scatter in flight (its input and output). Empty between steps and in stage 1."""
        transient = list(self._staging.values())
        transient += [t for _bucket, _work, out, staging in self._inflight for t in (out, staging)]
        return transient
