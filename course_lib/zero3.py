"""Chapter 03 — ZeRO stage 3: every rank keeps 1/N of every parameter; full weights exist only while a layer runs.

Stages 1 and 2 (``zero.py``) shard the optimizer state and the gradients; stage 3 also shards the
*parameters* (Rajbhandari et al. 2019, arXiv:1910.02054, "P_os+g+p"). Before a layer runs, its
full weights are all-gathered from the shards; right after, the gathered memory is freed. In
backward they are gathered again, and the full gradient is reduce-scattered back into the
shards. Per-rank model states: 16Ψ/N; traffic per step: 3Ψ (all-gather forward, all-gather
backward, reduce-scatter) against DDP's 2Ψ. This is the idea behind FSDP (chapter 04).

* :class:`Zero3` — the module wrapper, with a global ``clip_grad_norm_`` and full-tensor
  checkpoints (``full_state_dict`` / ``load_full_state_dict``).
* :class:`_AllGatherParam` — ZeRO-3 in one autograd piece: all-gather forward, reduce-scatter backward.
* :class:`_RegatherBeforeBackward` — re-gathers a module's weights before its backward runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .sharding import _check_fp32, _check_same_device, _is_data_parallel_module

__all__ = ["Zero3"]


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
      this rank keeps its shard as an fp32 ``nn.Parameter``, registered in place of the
      original on the same submodule under the same name (as FSDP2 does). ``parameters()`` /
      ``named_parameters()`` yield exactly the shards, one per unique parameter (names gain the
      wrapper's ``module.`` prefix, as under DDP) — hand them to any element-wise torch
      optimizer (AdamW …): its state is then 1/N too.
    * Before a module that owns parameters runs forward, its full parameters are all-gathered
      (tag ``"param"``) and stand in for the shards (``linear.weight`` is the full tensor while
      the module runs); right after, the shard is put back and the gathered storage is freed
      (``untyped_storage().resize_(0)``). Autograd still holds the tensor for backward, but it
      now holds no memory.
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

    Call the wrapper (``zero3(x)``), not ``zero3.module(x)``. ``state_dict()`` holds this rank's
    1-D shards (a *sharded* state dict, like FSDP2's); for full tensors use :meth:`full_state_dict`.

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

        # 2. Put each shard where its parameter was: same submodule, same name (as FSDP2 does), so
        #    parameters(), named_parameters() and any optimizer see exactly the shards. A tied weight
        #    is one shard registered on both modules (named_parameters() yields it once).
        self._owned: dict[nn.Module, list[tuple[str, _ShardedParam]]] = {}
        for sub in module.modules():
            own = [(attr, by_id[id(p)]) for attr, p in sub._parameters.items() if p is not None]
            if not own:
                continue
            for attr, sp in own:
                sub._parameters[attr] = sp.shard  # same dict slot: registration order is kept
            self._owned[sub] = own
            sub.register_forward_pre_hook(self._before_forward)
            sub.register_forward_hook(self._after_forward)

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
            sub._parameters[attr] = full  # while the module runs, its weight is the full tensor
            uses.append(use)
        self._live_uses.append(uses)

    def _after_forward(self, sub: nn.Module, args, output):
        uses = self._live_uses.pop()
        for (attr, sp), use in zip(self._owned[sub], uses):
            sub._parameters[attr] = sp.shard  # the shard is back in place of the full weight ...
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
        buffers = self.module.state_dict()  # buffers (and extra state); parameter keys hold local shards
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
        # the shards were filled above; strictness was checked against all keys already
        self.module.load_state_dict(buffers, strict=False)

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
