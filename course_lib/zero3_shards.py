"""ZeRO-3's shards: one fp32 shard per parameter, grouped into units, and what is done with them between steps.

:class:`course_lib.zero3.Zero3` is the technique (gather before a unit runs, reduce-scatter after
its backward). This module holds its bookkeeping, read once and then used by it:

* :class:`_ShardedParam` and :func:`shard_parameters` — flatten, pad to a multiple of N, keep
  this rank's 1/N as an fp32 ``nn.Parameter``;
* :class:`_Unit` — the parameters gathered with one all-gather and reduced with one
  reduce-scatter, and the ``(N, S)`` layout both collectives use;
* :class:`_ShardOps` — the operations on the shards outside forward and backward:
  ``clip_grad_norm_`` (global norm from the shards) and full state dicts (gather / load).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm


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


def shard_parameters(named, rank: int, world_size: int, device, process_group=None) -> dict[int, _ShardedParam]:
    """``{id(parameter): _ShardedParam}`` for ``named`` (unique parameters), broadcast from rank 0 first."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    by_id = {}
    for name, p in named:
        full = p.detach().clone()
        comm.broadcast(full, src=src, group=process_group, tag="init")  # so that all ranks agree
        padded = -(-p.numel() // world_size) * world_size
        s = padded // world_size
        flat = torch.zeros(padded, device=device)
        flat[:p.numel()] = full.reshape(-1)
        shard = nn.Parameter(flat[rank * s:(rank + 1) * s].clone(), requires_grad=p.requires_grad)
        by_id[id(p)] = _ShardedParam(name, p.shape, p.numel(), padded, shard)
    return by_id


@dataclass(eq=False)
class _Unit:
    """Parameters gathered with one all-gather and reduced with one reduce-scatter.

    N ranks; parameter i's shard has s_i elements; S = Σ s_i. Both collectives see the unit as
    an ``(N, S)`` matrix whose row r is rank r's shards side by side (rank-major):

    * all-gather: this rank sends its row (the *copy-in*: its shards concatenated, in the compute
      dtype) and receives the matrix; parameter i's padded full tensor is column block i read
      row by row (its N shards in rank order), copied out into the unit's *full buffer*, where
      the parameters lie one after the other (``buffer[N·o_i : N·(o_i+s_i)]``, o_i = Σ_{j<i} s_j);
    * reduce-scatter: each parameter's padded gradient, viewed ``(N, s_i)``, is added into
      column block i; rank r receives row r summed over ranks: its S shard gradients.

    No padding beyond each parameter's own (to a multiple of N): Ψ_pad is the same as per
    parameter. A one-parameter unit needs neither copy: the matrix *is* the padded parameter.
    """

    name: str
    params: list[_ShardedParam]

    def __post_init__(self):
        self.sizes = [sp.shard.numel() for sp in self.params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.shard_numel = sum(self.sizes)
        self.numel = sum(sp.numel for sp in self.params)
        self.padded = sum(sp.padded for sp in self.params)
        self.requires_grad = any(sp.shard.requires_grad for sp in self.params)

    def blocks(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's padded full tensor in the full buffer, viewed ``(N, s_i)`` (copy-out targets)."""
        n = buffer.numel() // self.shard_numel
        return [buffer[n * o:n * (o + s)].view(n, s) for o, s in zip(self.offsets, self.sizes)]

    def full_views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each parameter's full tensor (unpadded, in its shape) in the full buffer."""
        n = buffer.numel() // self.shard_numel
        return tuple(buffer[n * o:n * o + sp.numel].view(sp.shape) for o, sp in zip(self.offsets, self.params))

    @staticmethod
    def add_grad(grad_in: torch.Tensor, offset: int, size: int, grad: torch.Tensor) -> None:
        """Add one parameter's gradient into its column block of the ``(N, S)`` reduce-scatter input.

        Its padded layout, row by row: rows ``[0, q)`` are full, row q holds the rest, and the
        padding after it stays zero (``q, rest = divmod(numel, s)``).
        """
        block, g = grad_in[:, offset:offset + size], grad.reshape(-1)
        rows, rest = divmod(g.numel(), size)
        block[:rows].add_(g[:rows * size].view(rows, size))
        if rest:
            block[rows, :rest].add_(g[rows * size:])


def group_by_param(module: nn.Module, slots: list, units=None):
    """``unit="param"``: every parameter its own unit, triggered by each module that owns it (once per use).

    ``slots``: ``(submodule, attribute, _ShardedParam)`` for every registered parameter (a tied
    weight has two). Returns ``(units, triggers, root)`` as :func:`group_by_block`, with no root.
    """
    units = {sp: _Unit(sp.name, [sp]) for _, _, sp in slots}
    triggers: dict = {}
    for sub, attr, sp in slots:
        triggers.setdefault(sub, []).append((units[sp], [(sub, attr, 0)]))
    return list(units.values()), triggers, None


def group_by_block(module: nn.Module, slots: list, units=None):
    """``unit="block"``: one unit per module of ``units`` (default: every ``nn.ModuleList``'s children), root last.

    Returns ``(units, triggers, root)``: ``triggers[m]`` = ``[(unit, [(submodule, attribute, i), …])]``,
    the unit gathered when ``m`` runs and the slots where its parameter i's full tensor stands in;
    the root unit (every parameter outside the unit modules) is triggered by ``module`` itself.
    """
    names = {m: n for n, m in module.named_modules(remove_duplicate=False)}
    if units is None:
        units = [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]
        if not units:
            raise ValueError(f"Zero3(unit='block') found no nn.ModuleList in {type(module).__name__} to take "
                             f"its children as units: pass units=[the submodules to gather one at a time], "
                             f"units=[] (one unit: the whole model) or unit='param'")
    units = list(units)
    owner: dict[nn.Module, int] = {}  # every module inside a unit -> that unit's index
    for i, m in enumerate(units):
        if not isinstance(m, nn.Module) or m not in names:
            raise ValueError(f"units[{i}] ({type(m).__name__}) is not a submodule of the wrapped "
                             f"{type(module).__name__}: units must be modules inside the model")
        if m is module:
            raise ValueError("units must not contain the wrapped module itself: it is the root unit already")
        for sub in m.modules():
            if sub in owner:
                j = owner[sub]
                raise ValueError(f"units[{i}] ({names[m]}) and units[{j}] ({names[units[j]]}) overlap: "
                                 f"units must not be nested or repeated")
            owner[sub] = i
    where: dict[_ShardedParam, tuple[int, str]] = {}  # unit index (-1: root) and a slot name, per param
    members: list[list[_ShardedParam]] = [[] for _ in range(len(units) + 1)]
    for sub, attr, sp in slots:
        i = owner.get(sub, -1)
        slot_name = f"{names[sub]}.{attr}" if names[sub] else attr
        if sp in where and where[sp][0] != i:
            j, other = where[sp]
            label = {k: "the root unit" if k < 0 else f"unit {names[units[k]]}" for k in (i, j)}
            raise ValueError(f"parameter {sp.name} is shared by {label[j]} ({other}) and {label[i]} "
                             f"({slot_name}): a tied parameter must lie in one unit (gathered once per unit)")
        if sp not in where:
            where[sp] = (i, slot_name)
            members[i].append(sp)
    out, triggers = [], {}
    for i, trigger in list(enumerate(units)) + [(-1, module)]:
        if not members[i]:
            continue
        u = _Unit(names[trigger] or "(root)", members[i])
        index = {sp: k for k, sp in enumerate(members[i])}
        triggers[trigger] = [(u, [(sub, attr, index[sp]) for sub, attr, sp in slots if owner.get(sub, -1) == i])]
        out.append(u)
    return out, triggers, (out[-1] if members[-1] else None)


class _ShardOps:
    """What a ZeRO-3 wrapper does with its shards outside forward and backward: clipping and full state dicts.

    Needs ``self._sharded`` (name → :class:`_ShardedParam`), ``self._names`` (every state-dict
    name of a parameter), ``self._state_dict_keys``, ``self.module``, ``self.rank``,
    ``self.device`` and ``self.process_group``.
    """

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
