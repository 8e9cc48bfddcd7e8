"""Chapter 04 exercise: one FSDP unit from scratch — FSDP1's flat parameter, gathered on demand.

``FlatUnit(module, process_group=None)`` wraps one module (the checker's: a transformer block). All of
its parameters are flattened into one 1-D buffer, zero-padded to N·S elements, and cut into N equal
shards (FSDP1's ``FlatParameter``); this rank keeps shard r as its only parameter. Per step:

* forward: one all-gather of the whole flat buffer, the module runs on views of it, the buffer's
  storage is freed the moment the module returns;
* before the module's backward: the same buffer is gathered again, in place;
* after it: the flat gradient is reduce-scattered (averaged over ranks) into the shard's gradient,
  and the buffer is freed again.

One unit, one collective of each kind, no prefetch: ``course_lib.zero3.Zero3`` (chapter 03) does the
same for every block of a model, per parameter padded, with prefetch and the root unit.

Check: ``course-lib check flat_unit`` (or ``check("flat_unit")`` in a notebook), on 2 ranks.
Stuck? ``course_lib.checks.fsdp.hint("flat_unit", 1)`` is the idea, level 2 the API.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call


class _GatherFlat(torch.autograd.Function):
    """forward: the full flat parameters, all-gathered.  backward: their gradient, reduce-scattered."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        unit._gather()
        return unit.flat.view_as(unit.flat)  # the module's weights are views of this storage

    @staticmethod
    def backward(ctx, grad_flat):
        unit = ctx.unit
        unit._free()  # every op that read the weights has run its backward
        grad = torch.empty_like(unit.shard)
        dist.reduce_scatter_tensor(grad, grad_flat.contiguous(), group=unit.process_group)
        return grad.div_(unit.world_size), None  # the sum over ranks / N: the average


class FlatUnit(nn.Module):
    """ZeRO-3 for one module: this rank keeps 1/N of the module's flattened parameters.

    ``FlatUnit(module, process_group=None)``

    * Layout: ``module.named_parameters()`` in order, each ``reshape(-1)``, concatenated, zero-padded
      to N·S elements with S = ⌈Ψ/N⌉. ``shard`` (an ``nn.Parameter``, S elements) is slice
      ``[r·S, (r+1)·S)`` of it and the unit's only parameter: the module keeps none of its own.
    * ``flat``: a plain tensor attribute of N·S elements for the gathered parameters; its storage
      holds 0 bytes whenever the weights are not in use.
    * ``forward(*args)`` returns the module's output (one tensor), computed with the full weights.
    """

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        rank = dist.get_rank(process_group)
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        total = sum(self.numels)
        size = -(-total // self.world_size)  # S = ⌈Ψ/N⌉
        flat = torch.zeros(size * self.world_size, device=named[0][1].device)
        flat[:total] = torch.cat([p.detach().reshape(-1) for _, p in named])
        self.shard = nn.Parameter(flat[rank * size : (rank + 1) * size].clone())
        self.flat = flat  # the gathered buffer: a plain attribute, freed below
        self._free()
        for name in self.names:  # the module keeps no parameters: the shard is the only copy
            owner, _, leaf = name.rpartition(".")
            delattr(module.get_submodule(owner), leaf)
        self.module = module

    def _free(self) -> None:
        self.flat.untyped_storage().resize_(0)

    @torch.no_grad()
    def _gather(self) -> None:
        """Refill ``flat`` from every rank's shard, in place (autograd's saved views see it)."""
        if self.flat.untyped_storage().nbytes() > 0:
            return
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())
        # through .data: its own version counter, so a refill before backward is not an in-place
        # change of the tensors autograd saved
        dist.all_gather_into_tensor(self.flat.data, self.shard.detach(), group=self.process_group)

    def _views(self, flat: torch.Tensor) -> dict:
        views = flat[: sum(self.numels)].split(self.numels)
        return {n: v.view(s) for n, v, s in zip(self.names, views, self.shapes, strict=True)}

    def _before_backward(self, grad: torch.Tensor) -> None:
        self._gather()  # runs before autograd passes the gradient into the module's ops

    def forward(self, *args):
        if not torch.is_grad_enabled():  # no backward will come: gather, run, free
            self._gather()
            try:
                return functional_call(self.module, self._views(self.flat), args)
            finally:
                self._free()
        flat = _GatherFlat.apply(self.shard, self)
        out = functional_call(self.module, self._views(flat), args)
        self._free()
        if out.requires_grad:
            out.register_hook(self._before_backward)
        return out
