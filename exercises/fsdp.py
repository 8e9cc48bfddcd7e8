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
Stuck? ``course_lib.checks.fsdp.hint("flat_unit", 1)`` is the idea, level 2 the API (never the code).
"""

import torch  # noqa: F401
import torch.distributed as dist  # noqa: F401  (all_gather_into_tensor, reduce_scatter_tensor)
import torch.nn as nn
from torch.func import functional_call  # noqa: F401  (runs a module with tensors you pass)


class FlatUnit(nn.Module):
    """ZeRO-3 for one module: this rank keeps 1/N of the module's flattened parameters.

    ``FlatUnit(module, process_group=None)``; usage, every step (each rank its own batch)::

        out = unit(x)               # the module's output, computed with the full weights
        loss.backward()             # unit.shard.grad: this rank's slice of the averaged gradient
        optimizer.step()            # the optimizer was built over unit.parameters()

    Must:

    * Layout: ``module.named_parameters()`` in order, each ``reshape(-1)``, concatenated and
      zero-padded to N·S elements, S = ⌈Ψ/N⌉ (Ψ: the module's parameter count). ``self.shard``, an
      ``nn.Parameter`` of S elements, is slice ``[r·S, (r+1)·S)`` of it and the unit's **only**
      parameter: the module keeps none of its own.
    * Memory: the full parameters exist only while they are needed — from the all-gather before
      forward until the module returns, and again from before the module's backward until the
      flat gradient is reduce-scattered. In between, and at rest, the unit (and autograd's saved
      tensors) hold this rank's shard, not the full weights.
    * Collectives, per step: one all-gather in forward; one all-gather and one reduce-scatter in
      backward (any API: the checker counts the operators).
    * Numbers: after ``backward()``, ``shard.grad`` is slice r of the gradient averaged over ranks,
      so N ranks on their halves train exactly like one device on the whole batch.

    One forward, then its backward (no second forward of the same unit before backward); the
    module returns one tensor.
    """

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        # TODO: build the layout of the docstring, keep this rank's shard, release the rest.
        raise NotImplementedError(
            "FlatUnit: implement it (hints in layers, the idea then the API: "
            "course_lib.checks.fsdp.hint('flat_unit', 1), then level 2)"
        )

    def forward(self, *args):
        # TODO: gather, run the module on the full weights, free; arrange the re-gather before
        # the module's backward and the reduce-scatter after it.
        raise NotImplementedError(
            "FlatUnit.forward: implement it (hints in layers: "
            "course_lib.checks.fsdp.hint('flat_unit', 1), then level 2)"
        )
