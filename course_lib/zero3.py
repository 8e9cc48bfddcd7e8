"""Chapter 03 — ZeRO stage 3: every rank keeps 1/N of every parameter; full weights exist only while a unit runs.

Stages 1 and 2 (``zero.py``) shard the optimizer state and the gradients; stage 3 also shards the
*parameters* (Rajbhandari et al. 2019, arXiv:1910.02054, "P_os+g+p"). Before a unit runs, its
full weights are all-gathered from the shards; right after, the gathered memory is freed. In
backward they are gathered again, and the full gradient is reduce-scattered back into the
shards. Per-rank model states: 16Ψ/N; traffic per step: 3Ψ (all-gather forward, all-gather
backward, reduce-scatter) against DDP's 2Ψ. This is the idea behind FSDP (chapter 04).

What is gathered together — the *unit* — is the engineering knob (``Zero3(..., unit=)``):

* ``unit="block"`` (default): FSDP2's design (Zhao et al. 2023, arXiv:2304.11277; ``fully_shard``
  per block): one unit per module of ``units`` (default :func:`zero3_shards.default_units`: a
  ModuleList's blocks, else a Sequential's layers, else the whole model) plus a *root* unit (every
  other parameter: embeddings, ``ln_f``, tied head), each gathered with **one** all-gather and
  reduced with **one** reduce-scatter, launched asynchronously as soon as the unit's gradients are
  complete. ``prefetch=True`` (the default here) issues the next unit's all-gather before the
  current unit computes, so communication overlaps computation.
* ``unit="param"``: the textbook version, for comparison: every parameter is its own unit,
  gathered when the module that owns it runs, once per use (a tied weight twice): one small
  collective per parameter and per use.

* :class:`Zero3` — the module wrapper, with a global ``clip_grad_norm_``, full-tensor
  checkpoints (``full_state_dict`` / ``load_full_state_dict``) and :meth:`Zero3.describe` (the
  units chosen). The shards' layout is :mod:`course_lib.zero3_shards`.
* :class:`Zero3Observer` — what instrumentation (meters, timelines) implements to watch gathers
  and frees from outside (:meth:`Zero3.add_observer`).
* :class:`_GatherUnit` — ZeRO-3 in one autograd piece: all-gather forward, reduce-scatter backward.
* :class:`_RegatherBeforeBackward` — re-gathers a unit's weights before its backward runs.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .memory import storage_bytes
from .sharding import check_fp32, check_same_device, reducer_of
from .zero3_shards import ShardedParam, Unit, group_by_block, group_by_param, shard_parameters

__all__ = ["Zero3", "Zero3Observer"]


class Zero3Observer:
    """Watches a :class:`Zero3` from outside: meters and timelines subclass it (no-op defaults).

    ``gathered(unit, buffer)``: the unit's full weights just landed in ``buffer`` (forward, an
    eval forward, or the re-gather before backward). ``freed(unit, buffer)``: that storage was
    just released (``resize_(0)``). ``waiting(unit, op)`` / ``waited(unit, op)``: this rank is
    about to wait / has waited for the unit's ``"all_gather"`` or ``"reduce_scatter"`` to finish
    (a timer between the two sees what was not hidden). Attach with :meth:`Zero3.add_observer`,
    which returns a handle whose ``remove()`` detaches it.
    """

    def gathered(self, unit: Unit, buffer: torch.Tensor) -> None:
        pass

    def freed(self, unit: Unit, buffer: torch.Tensor) -> None:
        pass

    def waiting(self, unit: Unit, op: str) -> None:
        pass

    def waited(self, unit: Unit, op: str) -> None:
        pass


class _ObserverHandle:
    def __init__(self, observers: list, observer: Zero3Observer):
        self.observers, self.observer = observers, observer

    def remove(self) -> None:
        if self.observer in self.observers:
            self.observers.remove(self.observer)


@dataclass
class _ForwardPass:
    """Bookkeeping of one forward (under autograd) until its backward is done.

    ``pending[u]``: uses of unit ``u`` whose gradients have not arrived yet (a tied weight in
    ``unit="param"`` mode, or a block called twice, has two); ``grad_in[u]``: the ``(N, S)``
    fp32 reduce-scatter input the uses add into; ``order``: the uses in forward order.
    """

    pending: dict = field(default_factory=dict)
    grad_in: dict = field(default_factory=dict)
    order: list = field(default_factory=list)
    next_backward: dict | None = None


@dataclass(eq=False)
class _Use:
    """One gathering of a unit for one module call: the full buffer its parameters live in."""

    unit: Unit
    forward_pass: _ForwardPass | None
    buffer: torch.Tensor | None = None  # storage freed (resized to 0) between forward and backward
    slots: tuple = ()  # (module, attribute, parameter index): where the full weights go while it runs


@dataclass(eq=False)
class _InFlight:
    """An all-gather issued (``async_op=True``) and not yet waited for."""

    unit: Unit
    work: object
    out: torch.Tensor  # the (N, S) matrix, flat; for one parameter, the target use's buffer
    copy_in: torch.Tensor  # kept alive until the collective is done


class _GatherUnit(torch.autograd.Function):
    """forward: the unit's full parameters (all-gathered).  backward: reduce-scatter their gradients.

    The inputs are the fp32 shards, so autograd knows the outputs depend on them; one node per
    unit with one output per parameter, and autograd calls a node's backward once *all* its
    outputs' gradients are in — exactly "the unit's gradients are complete", the moment to
    launch its reduce-scatter. The shard gradients are delivered by :meth:`Zero3.unit_grads_ready`,
    not by autograd (this backward returns None for the shards).
    """

    @staticmethod
    def forward(ctx, use: _Use, zero3: "Zero3", *shards):
        ctx.use, ctx.zero3 = use, zero3
        ctx.set_materialize_grads(
            False
        )  # a parameter this rank did not use: None, not a zero tensor
        return zero3.gather(use)

    @staticmethod
    def backward(ctx, *grads):
        ctx.zero3.unit_grads_ready(ctx.use, grads)
        return (None, None, *([None] * len(grads)))


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
            ctx.zero3.regather(use)
        return (None, None, *grads)


class Zero3(nn.Module):
    """ZeRO stage 3: every rank keeps 1/N of every parameter; full weights exist only while a unit runs.

    ``Zero3(module, compute_dtype=None, process_group=None, *, unit="block", units=None, prefetch=None)``

    * Each unique parameter is flattened, padded to a multiple of N and cut into N shards;
      this rank keeps its shard as an fp32 ``nn.Parameter``, registered in place of the
      original on the same submodule under the same name (as FSDP2 does). ``parameters()`` /
      ``named_parameters()`` yield exactly the shards, one per unique parameter (names gain the
      wrapper's ``module.`` prefix, as under DDP) — hand them to any element-wise torch
      optimizer (AdamW …): its state is then 1/N too. The unit does not change the shards.
    * Units. ``unit="block"`` (the default, FSDP2's design): one unit per module in ``units``
      (default, :func:`zero3_shards.default_units`: the children of every ``nn.ModuleList`` — the
      transformer blocks —, else the layers of the outermost ``nn.Sequential`` s, else none, so any
      module wraps; ``units=[]``: the whole model is one unit) plus the root unit (every other
      parameter), gathered when the wrapper is called and kept through the whole forward, as
      FSDP2's root. :meth:`describe` (and the repr) show the units chosen. ``unit="param"``
      (the textbook version, for comparison): each parameter is gathered when a module that owns
      it runs (a tied weight once per use). Units must not be nested, and a parameter (a tied weight) must
      lie in one unit only: tie within a block, or between modules of the root.
    * Before a unit's module runs forward, its full parameters are all-gathered (tag ``"param"``)
      and stand in for the shards (``linear.weight`` is the full tensor while the unit runs);
      right after, the shards are put back and the gathered storage is freed
      (``untyped_storage().resize_(0)``). Autograd still holds the tensors for backward, but
      they now hold no memory.
    * In backward, :class:`_RegatherBeforeBackward` re-gathers the weights into the same
      storage before the unit's backward ops read them; :class:`_GatherUnit`'s backward then frees
      them again, adds the fp32 gradients into the reduce-scatter input and launches the unit's
      reduce-scatter (tag ``"grad"``) asynchronously. It is waited for (averaged, added into
      ``shard.grad``) when the next unit launches its own, and the last one at the end of
      ``backward()`` (an autograd callback): one reduce-scatter in flight, overlapping the next
      unit's backward; ``shard.grad`` is complete when ``backward()`` returns.
    * ``prefetch`` (default: on with ``unit="block"``): the next unit's all-gather is issued before the
      current unit computes — in forward the order seen in the previous forward (at first, the
      order of ``units``), in backward the reverse (the root first: its outputs are the loss's
      inputs). Memory: at most the root and two units gathered at once.
    * ``compute_dtype=torch.bfloat16`` (or float16): shards are cast before the all-gather, so
      gathers move 2 bytes per element and the layers compute in 16 bits, while the shards,
      their gradients and the optimizer state stay fp32 (master weights).

    Traffic per step (fp32): all-gather Ψ (forward) + all-gather Ψ (backward) + reduce-scatter Ψ,
    each × (N−1)/N per rank: 3Ψ against DDP's 2Ψ — in 3 collectives per unit. Per parameter, a
    tied weight is gathered for each use (more than 3Ψ); per unit, once. Every rank must run the
    same modules in the same order; every parameter of a unit that reached backward gets a
    gradient (zero where no rank used it). A unit's parameters are full only inside its module's
    forward: read them there, not from outside.

    Call the wrapper (``zero3(x)``), not ``zero3.module(x)``. ``state_dict()`` holds this rank's
    1-D shards (a *sharded* state dict, like FSDP2's); for full tensors use :meth:`full_state_dict`.
    Gradient clipping: :meth:`clip_grad_norm_` (one scalar all-reduce; the single-device norm).

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

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        process_group=None,
        *,
        unit: str = "block",
        units=None,
        prefetch: bool | None = None,
    ):
        super().__init__()
        if compute_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"compute_dtype={compute_dtype!r} must be None, torch.float32, torch.bfloat16 "
                f"or torch.float16"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"Zero3 wraps an nn.Module, got {type(module).__name__}")
        owner = reducer_of(module.parameters())
        if owner is not None:
            raise ValueError(
                f"Zero3 does its own gradient reduce-scatter: wrap a plain module, not "
                f"{type(module).__name__}, whose gradients {owner} already reduces "
                f"(build a fresh model)"
            )
        if unit not in ("param", "block"):
            raise ValueError(
                f"unit={unit!r} must be 'param' (one collective per parameter) or 'block' "
                f"(one per transformer block + the root, as FSDP2)"
            )
        if unit == "param" and (units is not None or prefetch):
            raise ValueError(
                "units= and prefetch=True need unit='block' (per parameter there is nothing to "
                "group, and no next unit to prefetch)"
            )
        named = list(module.named_parameters())
        check_fp32(named, "Zero3")
        self.device = check_same_device([p for _, p in named], "Zero3")
        self.module = module
        self.compute_dtype = compute_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.unit, self.prefetch = unit, (unit == "block") if prefetch is None else bool(prefetch)
        self._state_dict_keys = list(module.state_dict().keys())
        self._forward_pass: _ForwardPass | None = None
        self._live: list[tuple] = []  # a stack: (trigger module now running forward, its uses)
        self._uses = weakref.WeakSet()  # every use not yet garbage: what gathered_bytes() measures
        self._in_flight: dict[Unit, _InFlight] = {}  # prefetched all-gathers
        self._reductions: list[tuple] = []  # launched reduce-scatters not yet waited for
        self._callback_queued = False
        self._observers: list[Zero3Observer] = []

        # 1. Shard every unique parameter: flatten, pad to a multiple of N, keep this rank's 1/N.
        by_id = shard_parameters(named, self.rank, self.world_size, self.device, process_group)
        self._sharded: dict[str, ShardedParam] = {sp.name: sp for sp in by_id.values()}
        # every name a parameter is reachable under (a tied weight has two), for full_state_dict
        self._names = {
            name: by_id[id(p)] for name, p in module.named_parameters(remove_duplicate=False)
        }

        # 2. Group the parameters into units, and find each unit's trigger: the module whose
        #    forward gathers it, with the (submodule, name) slots where its full tensors stand in.
        slots = [
            (sub, attr, by_id[id(p)])
            for sub in module.modules()
            for attr, p in sub._parameters.items()
            if p is not None
        ]
        group = group_by_param if unit == "param" else group_by_block
        self.units, self._triggers, self._root = group(module, slots, units)

        # 3. Put each shard where its parameter was: same submodule, same name (as FSDP2 does), so
        #    parameters(), named_parameters() and any optimizer see exactly the shards. A tied weight
        #    is one shard registered on both modules (named_parameters() yields it once).
        for sub, attr, sp in slots:
            sub._parameters[attr] = sp.shard  # same dict slot: registration order is kept
        for trigger in self._triggers:
            trigger.register_forward_pre_hook(self._before_forward)
            trigger.register_forward_hook(self._after_forward)
        # prefetch plan: the next unit in forward order (learned from each forward; at first, units' order)
        blocks = [u for u in self.units if u is not self._root]
        first = [] if self._root is None else [self._root]  # the root unit runs first
        self._next_forward = dict(pairwise(first + blocks))
        self._seen: list[Unit] = []

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._forward_pass = _ForwardPass()  # its backward counts down these uses
        self._seen = []
        try:
            return self.module(*args, **kwargs)
        finally:
            self._forward_pass = None
            while (
                self._live
            ):  # an exception interrupted a unit's forward: shards back, memory freed
                self._put_back(self._live[-1][0])
            if self.prefetch and self._seen:  # the order to prefetch in next time
                order = list(dict.fromkeys(self._seen))
                self._next_forward = dict(pairwise(order))
            self._drop_in_flight()

    # ------------------------------------------------------------------ gather / free

    def _issue(self, unit: Unit, into: _Use | None = None) -> _InFlight:
        """Start the unit's all-gather (async): this rank's shards, cast to the compute dtype (copy-in).

        A one-parameter unit is gathered straight into ``into``'s buffer (storage re-allocated)."""
        dtype = self.compute_dtype or torch.float32
        shards = [sp.shard.detach() for sp in unit.params]
        copy_in = (shards[0] if len(shards) == 1 else torch.cat(shards)).to(dtype)
        if into is not None and len(shards) == 1:
            buf = into.buffer
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
            # write through .data: a plain alias with its own version counter, so autograd does not
            # mistake the refill for an in-place change of a tensor it saved
            out = buf.data
        else:
            out = torch.empty(self.world_size * unit.shard_numel, dtype=dtype, device=self.device)
        work = comm.all_gather(out, copy_in, group=self.process_group, async_op=True, tag="param")
        return _InFlight(unit, work, out, copy_in)

    @torch.no_grad()
    def _land(self, flight: _InFlight, use: _Use) -> None:
        """Wait for ``flight`` and put the unit's full parameters into ``use.buffer`` (copy-out)."""
        self._wait(flight.unit, flight.work, "all_gather")
        unit, buf = flight.unit, use.buffer
        if buf is None and len(unit.params) == 1:
            use.buffer = flight.out  # the gathered matrix is the padded parameter
            return
        if buf is None:
            buf = use.buffer = torch.empty_like(flight.out)
        elif buf.untyped_storage().nbytes() == 0:
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        if flight.out.data_ptr() == buf.data_ptr():
            return
        if len(unit.params) == 1:
            buf.data.copy_(flight.out)
        else:  # column block i of the (N, S) matrix -> parameter i's place in the buffer
            torch.split_with_sizes_copy(
                flight.out.view(self.world_size, unit.shard_numel),
                unit.sizes,
                dim=1,
                out=unit.blocks(buf.data),
            )

    def _wait(self, unit: Unit, work, op: str) -> None:
        for obs in self._observers:
            obs.waiting(unit, op)
        work.wait()
        for obs in self._observers:
            obs.waited(unit, op)

    def gather(self, use: _Use) -> tuple[torch.Tensor, ...]:
        """The unit's full parameters for ``use``: from a prefetched all-gather, else one now.

        Called by :class:`_GatherUnit` (or directly when no backward will come)."""
        flight = self._in_flight.pop(use.unit, None) or self._issue(use.unit)
        self._land(flight, use)
        self._uses.add(use)
        for obs in self._observers:
            obs.gathered(use.unit, use.buffer)
        return use.unit.full_views(use.buffer)

    def _free(self, use: _Use) -> None:
        use.buffer.untyped_storage().resize_(0)
        for obs in self._observers:
            obs.freed(use.unit, use.buffer)

    def regather(self, use: _Use) -> None:
        """Refill a freed buffer in place (autograd's saved tensors point at this storage), then prefetch.

        Called by :class:`_RegatherBeforeBackward` before the unit's backward ops run."""
        flight = self._in_flight.pop(use.unit, None) or self._issue(use.unit, into=use)
        self._land(flight, use)
        for obs in self._observers:
            obs.gathered(use.unit, use.buffer)
        # the full weights back in the modules until the unit's gradients are in: activation
        # checkpointing re-runs the module's forward here, and must not see the shards
        fulls = use.unit.full_views(use.buffer)
        for sub, attr, i in use.slots:  # leaves that require grad, as in forward (same saves)
            sub._parameters[attr] = (
                fulls[i].detach().requires_grad_(use.unit.params[i].shard.requires_grad)
            )
        if self.prefetch:
            fp = use.forward_pass
            if (
                fp.next_backward is None
            ):  # backward order: the root first, then the units in reverse
                seq = fp.order[::-1]
                seq = [u for u in seq if u.unit is self._root] + [
                    u for u in seq if u.unit is not self._root
                ]
                fp.next_backward = dict(pairwise(seq))
            nxt = fp.next_backward.get(use)
            if (
                nxt is not None
                and nxt.buffer.untyped_storage().nbytes() == 0
                and nxt.unit not in self._in_flight
            ):
                self._in_flight[nxt.unit] = self._issue(nxt.unit, into=nxt)

    def _prefetch_forward(self, unit: Unit) -> None:
        if not self.prefetch:
            return
        self._seen.append(unit)
        nxt = self._next_forward.get(unit)
        if nxt is not None and nxt not in self._in_flight:
            self._in_flight[nxt] = self._issue(nxt)

    def _drop_in_flight(self) -> None:
        """Wait for prefetches nobody used (the order changed) and let them go."""
        for flight in self._in_flight.values():
            flight.work.wait()
            flight.out.untyped_storage().resize_(
                0
            )  # a one-parameter refill lands in a use's buffer
        self._in_flight.clear()

    # ------------------------------------------------------------------ gradients

    @torch.no_grad()
    def unit_grads_ready(self, use: _Use, grads) -> None:
        """All of this use's gradients are in: free its weights, add the gradients; after the last use, reduce.

        Called by :class:`_GatherUnit`'s backward."""
        for sub, attr, i in use.slots:  # the shards back in place (regather lent the full weights)
            sub._parameters[attr] = use.unit.params[i].shard
        self._free(use)  # every op that read this use of the weights has finished its backward
        unit, fp, n = use.unit, use.forward_pass, self.world_size
        grad_in = fp.grad_in.get(unit)
        if grad_in is None:  # copy-in: (N, S), row r = what rank r will receive
            grad_in = fp.grad_in[unit] = torch.zeros(n, unit.shard_numel, device=self.device)
        for g, o, s in zip(grads, unit.offsets, unit.sizes, strict=True):
            if g is not None:
                unit.add_grad(grad_in, o, s, g)
        fp.pending[unit] -= 1
        if fp.pending[unit] > 0:
            return  # more uses still to come; the unit is reduced once
        del fp.grad_in[unit]
        self._finish_reductions()  # the previous unit's reduce-scatter: one in flight at a time
        out = torch.empty(unit.shard_numel, device=self.device)
        work = comm.reduce_scatter(
            out, grad_in.view(-1), group=self.process_group, async_op=True, tag="grad"
        )
        self._reductions.append((unit, work, out, grad_in))
        if not self._callback_queued:  # the last one is waited for when backward() ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    @torch.no_grad()
    def _finish_reductions(self) -> None:
        """Wait for the launched reduce-scatters; average; add into ``shard.grad`` (autograd's accumulation)."""
        for unit, work, out, _ in self._reductions:
            self._wait(unit, work, "reduce_scatter")
            out.div_(self.world_size)
            for sp, g in zip(unit.params, out.split(unit.sizes), strict=True):
                if not sp.shard.requires_grad:
                    continue
                if sp.shard.grad is None:
                    sp.shard.grad = g
                else:
                    sp.shard.grad.add_(g)
        self._reductions.clear()

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._finish_reductions()
        self._drop_in_flight()

    # ------------------------------------------------------------------ module hooks

    def _before_forward(self, trigger: nn.Module, args) -> None:
        fp = self._forward_pass if torch.is_grad_enabled() else None
        if torch.is_grad_enabled() and fp is None:
            raise RuntimeError(
                "Zero3: call the wrapper (zero3(x)), not zero3.module(x): the wrapper's forward "
                "sets up the bookkeeping that backward's reduce-scatters rely on"
            )
        uses = []
        for unit, slots in self._triggers[trigger]:
            use = _Use(unit, fp if unit.requires_grad else None, slots=tuple(slots))
            if use.forward_pass is not None:
                fp.pending[unit] = fp.pending.get(unit, 0) + 1
                fp.order.append(use)
                fulls = _GatherUnit.apply(use, self, *[sp.shard for sp in unit.params])
            else:  # no backward will come (eval, no_grad, frozen): gather without autograd
                fulls = self.gather(use)
            self._prefetch_forward(unit)  # the next unit's all-gather runs while this one computes
            for sub, attr, i in slots:  # while the unit runs, its weights are the full tensors
                full = fulls[i]
                sub._parameters[attr] = (
                    full if unit.params[i].shard.requires_grad else full.detach()
                )
            uses.append(use)
        self._live.append((trigger, uses))

    def _put_back(self, trigger: nn.Module) -> list[_Use]:
        _, uses = self._live.pop()
        for (unit, slots), use in zip(self._triggers[trigger], uses, strict=True):
            for sub, attr, i in slots:
                sub._parameters[attr] = unit.params[
                    i
                ].shard  # the shard is back in place of the full weight ...
            self._free(use)  # ... and the memory, which autograd's saved copy shares
        return uses

    def _after_forward(self, trigger: nn.Module, args, output):
        uses = self._put_back(trigger)
        needs = [use for use in uses if use.forward_pass is not None]
        if not needs:
            return output
        outs = (
            [output]
            if isinstance(output, torch.Tensor)
            else list(output)
            if isinstance(output, (tuple, list))
            else None
        )
        if outs is None:
            raise TypeError(
                f"Zero3: {type(trigger).__name__} returned {type(output).__name__}; modules that "
                f"gather parameters must return a tensor or a tuple of tensors"
            )
        grad_idx = [
            i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        wrapped = _RegatherBeforeBackward.apply(needs, self, *[outs[i] for i in grad_idx])
        for i, w in zip(grad_idx, wrapped, strict=True):
            outs[i] = w
        return outs[0] if isinstance(output, torch.Tensor) else type(output)(outs)

    # ------------------------------------------------------------------ gradient clipping

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
            raise ValueError(
                f"norm_type={norm_type} must be > 0 (e.g. 2.0, or math.inf for the largest |g|)"
            )
        with_grad = [sp for sp in self._sharded.values() if sp.shard.grad is not None]
        own = [sp.shard.grad[: sp.own_numel(self.rank)] for sp in with_grad]
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

    # ------------------------------------------------------------------ full state dicts

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unpadded tensors under the keys of the wrapped module's ``state_dict()`` (collective)."""
        buffers = (
            self.module.state_dict()
        )  # buffers (and extra state); parameter keys hold local shards
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
                gathered[sp.name] = full[: sp.numel].view(sp.shape)
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
            raise RuntimeError(
                f"Zero3.load_full_state_dict: missing keys {missing}, unexpected keys {unexpected} "
                f"(expected the wrapped module's state_dict() keys; pass strict=False to skip them)"
            )
        buffers = {}
        for key, value in state_dict.items():
            if key not in keys:
                continue
            sp = self._names.get(key)
            if sp is None:  # a buffer (or extra state): the wrapped module still owns it
                buffers[key] = value
                continue
            if tuple(value.shape) != tuple(sp.shape):
                raise ValueError(
                    f"Zero3.load_full_state_dict: {key} has shape {tuple(value.shape)} in the state "
                    f"dict, {tuple(sp.shape)} in the model"
                )
            size, own = sp.shard.numel(), sp.own_numel(self.rank)
            lo = self.rank * size
            sp.shard.zero_()  # the padding
            sp.shard[:own].copy_(value.detach().reshape(-1)[lo : lo + own])
        # the shards were filled above; strictness was checked against all keys already
        self.module.load_state_dict(buffers, strict=False)

    @property
    def numel(self) -> int:
        return sum(sp.numel for sp in self._sharded.values())

    @property
    def padded_numel(self) -> int:
        """Ψ padded: Σ over unique parameters of the size rounded up to a multiple of N."""
        return sum(sp.padded for sp in self._sharded.values())

    # ------------------------------------------------------------------ accounting

    def held_tensors(self) -> list[torch.Tensor]:
        """Every gathered buffer not yet garbage, and the prefetched all-gathers (freed ones hold 0 bytes)."""
        return [u.buffer for u in list(self._uses) if u.buffer is not None] + [
            f.out for f in self._in_flight.values()
        ]

    def gathered_bytes(self) -> int:
        """Bytes of full weights alive right now, read from the real storages (sample it from module hooks)."""
        return storage_bytes(self.held_tensors())

    def unit_table(self) -> list[dict]:
        """One row per unit: its name, parameter names, Ψ, Ψ_pad and gathered bytes (compute dtype)."""
        size = torch.empty((), dtype=self.compute_dtype or torch.float32).element_size()
        return [
            dict(
                name=u.name,
                params=[sp.name for sp in u.params],
                numel=u.numel,
                padded=u.padded,
                gathered_bytes=u.padded * size,
                root=u is self._root,
            )
            for u in self.units
        ]

    def describe(self) -> str:
        """The units chosen, one line each: name, parameters, Ψ and gathered bytes."""
        lines = [
            f"Zero3(unit={self.unit!r}, prefetch={self.prefetch}) on {self.world_size} ranks: "
            f"{len(self.units)} unit(s)"
        ]
        for row in self.unit_table():
            names = ", ".join(row["params"][:3]) + (" …" if len(row["params"]) > 3 else "")
            lines.append(
                f"  {row['name']:<12} {len(row['params']):>3} params  Ψ {row['numel']:>9,}  "
                f"gathered {row['gathered_bytes']:>10,} B  ({names})"
            )
        return "\n".join(lines)

    def extra_repr(self) -> str:
        units = ", ".join(u.name for u in self.units[:6]) + (" …" if len(self.units) > 6 else "")
        return f"unit={self.unit!r}, prefetch={self.prefetch}, world_size={self.world_size}, units=[{units}]"

    # ------------------------------------------------------------------ instrumentation

    def add_observer(self, observer: Zero3Observer) -> _ObserverHandle:
        """Call ``observer.gathered`` / ``observer.freed`` at every gather and free; ``.remove()`` stops."""
        self._observers.append(observer)
        return _ObserverHandle(self._observers, observer)
