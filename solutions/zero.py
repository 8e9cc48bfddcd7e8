"""Chapter 03 exercises: ZeRO by hand, on real ranks.

(a) ``Zero1Step(module, optimizer_cls, **kwargs)`` — ZeRO-1 over one flat, padded buffer. Its
    ``step()`` replaces DDP's all-reduce by its two halves with the optimizer in between:
    reduce-scatter the gradients (each rank gets the average of *its* 1/N), step only that
    slice, all-gather the updated slices. Same bytes on the wire as DDP, 1/N of the optimizer state.
(b) ``ShardedLinear(linear)`` — ZeRO-3 for one ``nn.Linear``: keep 1/N of the weight, all-gather
    it just before forward, free it right after, gather it again for backward, and
    reduce-scatter the weight gradient straight into the shard.

``course_lib.zero`` does both for a whole model (buckets, param groups, tied and unused
weights, hooks); here every step is in front of you. Check: ``course-lib check zero1_step`` /
``course-lib check sharded_linear`` (or ``check("zero1_step")`` in a notebook).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib import comm


class Zero1Step:
    """ZeRO-1 for one flat buffer: every rank keeps optimizer state for 1/N of the model.

    Layout (built for you in ``__init__``)::

        flat_params  [ p0 | p1 | p2 | ... | 0 0 ]   every parameter copied in, zero-padded to N·S elements;
                       rank 0   | rank 1 | ...      each p.data becomes a view of it (the model does not notice)
        flat_grads   same layout: this rank's *local* gradients, copied in by _copy_grads_in()
        shard        nn.Parameter viewing flat_params[r·S:(r+1)·S] — stepping it updates the model in place
        optimizer    optimizer_cls([shard]): its state (AdamW: 2 × S floats) exists for this slice only

    Usage, every step (every rank, its own batch)::

        loss.backward(); zero1.step(); zero1.zero_grad()

    Why it is exact: an element-wise optimizer (SGD, Adam, AdamW …) updates element i from
    element i of the parameter, gradient and state alone, so stepping N slices separately is
    the same as stepping the whole buffer. Simplification against ``course_lib.zero``: the
    whole model is one slice per rank, so every parameter must get a gradient every step (one
    without would still be decayed by AdamW), and all parameters share one set of options.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer_cls=torch.optim.AdamW,
        process_group=None,
        **optimizer_kwargs,
    ):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.params = list(module.parameters())  # a tied weight appears once
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        padded = -(-total // self.world_size) * self.world_size  # round up to a multiple of N
        self.flat_params = torch.zeros(padded, dtype=torch.float32, device=self.params[0].device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets, strict=True):
                self.flat_params[off : off + p.numel()].copy_(p.reshape(-1))
        # every rank starts from rank 0's weights: the slices only fit together if the ranks agree
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        comm.broadcast(self.flat_params, src=src, group=process_group, tag="init")
        for p, off in zip(self.params, self.offsets, strict=True):
            p.data = self.flat_params[off : off + p.numel()].view_as(p)
        self.flat_grads = torch.zeros_like(self.flat_params)
        size = padded // self.world_size  # S
        self.shard = nn.Parameter(
            self.flat_params[self.rank * size : (self.rank + 1) * size]
        )  # a view, not a copy
        self.optimizer = optimizer_cls([self.shard], **optimizer_kwargs)

    @torch.no_grad()
    def _copy_grads_in(self) -> None:
        """``flat_grads`` ← this rank's local gradients (zeros for a parameter without one)."""
        for p, off in zip(self.params, self.offsets, strict=True):
            slot = self.flat_grads[off : off + p.numel()]
            if p.grad is None:
                slot.zero_()
            else:
                slot.copy_(p.grad.reshape(-1))

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter the gradients (average), step this rank's shard, all-gather the parameters.

        1. ``comm.reduce_scatter(out, self.flat_grads, tag="grad")``: rank r receives
           Σ_ranks flat_grads[r·S:(r+1)·S] in ``out`` (S elements); divide by N → the average,
           exactly the slice of what DDP's all-reduce would have produced.
        2. Give it to the shard (``self.shard.grad``) and ``self.optimizer.step()``.
        3. ``comm.all_gather(self.flat_params, self.shard.detach(), tag="param")``: every rank
           receives every updated slice, so every model is complete and identical again.
        Steps 1 + 3 move (N−1)/N · 2 · Ψ elements per rank: one all-reduce's worth.
        """
        self._copy_grads_in()
        grad = torch.empty(
            self.shard.numel(), dtype=self.flat_grads.dtype, device=self.flat_grads.device
        )
        comm.reduce_scatter(
            grad, self.flat_grads, group=self.process_group, tag="grad"
        )  # sum of my slice
        self.shard.grad = grad.div_(self.world_size)  # sum / N = average
        self.optimizer.step()  # only my slice; its state is 1/N of the model
        # in place: my slice of flat_params is the input, the whole buffer the output
        comm.all_gather(
            self.flat_params, self.shard.detach(), group=self.process_group, tag="param"
        )

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.shard.grad = None


class _ShardedLinearFunction(torch.autograd.Function):
    """y = x Wᵀ with W gathered on demand: all-gather → compute → free, in forward and again in backward.

    Backward of a linear layer needs W (for dL/dx = dL/dy · W) and x (for dL/dW = dL/dyᵀ · x).
    We save x, but *not* W — that is the whole point of ZeRO-3 — and gather W again instead.
    The returned gradient for ``shard`` is already reduce-scattered: autograd adds it to ``shard.grad``.
    """

    @staticmethod
    def forward(ctx, x, shard, layer):
        weight = layer.gather_weight()  # the full weight exists from here ...
        y = F.linear(x, weight)
        layer.free_weight()  # ... to here
        ctx.save_for_backward(x)
        ctx.layer = layer
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        layer = ctx.layer
        weight = layer.gather_weight()  # re-gather: forward freed it
        grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
        layer.free_weight()
        # dL/dW = Σ over every leading (batch, time …) position of dL/dy ⊗ x, on this rank's data
        grad_weight = grad_y.reshape(-1, layer.out_features).T @ x.reshape(-1, layer.in_features)
        return grad_x, layer.reduce_scatter_grad(grad_weight), None


class ShardedLinear(nn.Module):
    """ZeRO-3 for one ``nn.Linear`` (no bias): this rank keeps only 1/N of the weight.

    ``ShardedLinear(linear, process_group=None)``

    * ``shard`` — the module's only parameter: elements ``[r·S, (r+1)·S)`` of the flattened
      weight, zero-padded to N·S. Give it to any optimizer.
    * ``full_weight`` — a flat buffer of N·S elements for the gathered weight. Its *storage* is
      resized to 0 bytes whenever the weight is not in use (``untyped_storage().resize_(0)``);
      the tensor object stays, so gathering again just refills the same storage.

    Per forward + backward: all-gather (forward), all-gather (backward), reduce-scatter (the
    weight gradient) — 3 × (N−1)/N × the weight's bytes per rank, against DDP's 2. In exchange
    the full weight exists only while this layer computes. ``course_lib.zero3.Zero3`` does the
    same for every module of a model with hooks; FSDP (chapter 04) adds prefetching.
    """

    def __init__(self, linear: nn.Linear, process_group=None):
        super().__init__()
        if linear.bias is not None:
            raise ValueError(
                "ShardedLinear shards the weight only; build nn.Linear(..., bias=False) "
                "(course_lib.zero3.Zero3 shards every parameter, biases included)"
            )
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.out_features, self.in_features = linear.weight.shape
        self.numel = linear.weight.numel()
        self.padded = -(-self.numel // self.world_size) * self.world_size
        size = self.padded // self.world_size  # S
        flat = torch.zeros(self.padded, dtype=linear.weight.dtype, device=linear.weight.device)
        flat[: self.numel] = linear.weight.detach().reshape(-1)
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        comm.broadcast(
            flat, src=src, group=process_group, tag="init"
        )  # every rank shards rank 0's weight
        self.shard = nn.Parameter(flat[self.rank * size : (self.rank + 1) * size].clone())
        self.full_weight = torch.empty_like(flat)  # a plain attribute, not a parameter or buffer
        self.free_weight()

    def free_weight(self) -> None:
        """Release the gathered weight's memory (the tensor object, and autograd's view of it, stay)."""
        self.full_weight.untyped_storage().resize_(0)

    @torch.no_grad()
    def gather_weight(self) -> torch.Tensor:
        """Refill ``full_weight`` from every rank's shard; return it as ``[out_features, in_features]``.

        Give the storage its bytes back (``untyped_storage().resize_(numel · element_size)``),
        then ``comm.all_gather(self.full_weight, self.shard.detach(), tag="param")`` writes
        rank r's shard at ``[r·S, (r+1)·S)``. Drop the padding and reshape.
        """
        buf = self.full_weight
        buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        comm.all_gather(buf, self.shard.detach(), group=self.process_group, tag="param")
        return buf[: self.numel].view(self.out_features, self.in_features)

    @torch.no_grad()
    def reduce_scatter_grad(self, grad_weight: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the weight gradient, averaged over ranks (what goes into ``shard.grad``)."""
        flat = torch.zeros(self.padded, dtype=grad_weight.dtype, device=grad_weight.device)
        flat[: self.numel] = grad_weight.reshape(-1)  # padding contributes zeros
        out = torch.empty(self.padded // self.world_size, dtype=flat.dtype, device=flat.device)
        comm.reduce_scatter(out, flat, group=self.process_group, tag="grad")
        return out.div_(self.world_size)  # sum / N = average, as data parallelism needs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ShardedLinearFunction.apply(x, self.shard, self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"shard={self.shard.numel()} of {self.numel} elements"
        )
