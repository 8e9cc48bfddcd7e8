"""ZeRO-3's flat-shard layout: one fp32 shard per parameter, grouped into units.

:class:`course_lib.zero3.Zero3` is the technique (gather before a unit runs, reduce-scatter after
its backward, clipping, full state dicts). This module is the layout it reads once and then uses,
with public names only:

* :class:`ShardedParam` and :func:`shard_parameters` — flatten, pad to a multiple of N, keep
  this rank's 1/N as an fp32 ``nn.Parameter``;
* :class:`Unit` — the parameters gathered with one all-gather and reduced with one
  reduce-scatter, and the ``(N, S)`` layout both collectives use;
* :func:`default_units`, :func:`group_by_block`, :func:`group_by_param` — which parameters form
  a unit, and which module's forward gathers it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm

__all__ = [
    "ShardedParam",
    "shard_parameters",
    "Unit",
    "default_units",
    "group_by_block",
    "group_by_param",
]


@dataclass(eq=False)
class ShardedParam:
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

    def own_numel(self, rank: int) -> int:
        """How many elements of rank ``rank``'s shard are real (the rest, at the end, is padding)."""
        size = self.shard.numel()
        return max(0, min(size, self.numel - rank * size))


def shard_parameters(
    named, rank: int, world_size: int, device, process_group=None
) -> dict[int, ShardedParam]:
    """``{id(parameter): ShardedParam}`` for ``named`` (unique parameters), broadcast from rank 0 first."""
    src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    by_id = {}
    for name, p in named:
        full = p.detach().clone()
        comm.broadcast(full, src=src, group=process_group, tag="init")  # so that all ranks agree
        padded = -(-p.numel() // world_size) * world_size
        s = padded // world_size
        flat = torch.zeros(padded, device=device)
        flat[: p.numel()] = full.reshape(-1)
        shard = nn.Parameter(flat[rank * s : (rank + 1) * s].clone(), requires_grad=p.requires_grad)
        by_id[id(p)] = ShardedParam(name, p.shape, p.numel(), padded, shard)
    return by_id


@dataclass(eq=False)
class Unit:
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
    params: list[ShardedParam]

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
        return [
            buffer[n * o : n * (o + s)].view(n, s)
            for o, s in zip(self.offsets, self.sizes, strict=True)
        ]

    def full_views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each parameter's full tensor (unpadded, in its shape) in the full buffer."""
        n = buffer.numel() // self.shard_numel
        return tuple(
            buffer[n * o : n * o + sp.numel].view(sp.shape)
            for o, sp in zip(self.offsets, self.params, strict=True)
        )

    @staticmethod
    def add_grad(grad_in: torch.Tensor, offset: int, size: int, grad: torch.Tensor) -> None:
        """Add one parameter's gradient into its column block of the ``(N, S)`` reduce-scatter input.

        Its padded layout, row by row: rows ``[0, q)`` are full, row q holds the rest, and the
        padding after it stays zero (``q, rest = divmod(numel, s)``).
        """
        block, g = grad_in[:, offset : offset + size], grad.reshape(-1)
        rows, rest = divmod(g.numel(), size)
        block[:rows].add_(g[: rows * size].view(rows, size))
        if rest:
            block[rows, :rest].add_(g[rows * size :])


def group_by_param(module: nn.Module, slots: list, units=None):
    """``unit="param"``: every parameter its own unit, triggered by each module that owns it (once per use).

    ``slots``: ``(submodule, attribute, ShardedParam)`` for every registered parameter (a tied
    weight has two). Returns ``(units, triggers, root)`` as :func:`group_by_block`, with no root.
    """
    units = {sp: Unit(sp.name, [sp]) for _, _, sp in slots}
    triggers: dict = {}
    for sub, attr, sp in slots:
        triggers.setdefault(sub, []).append((units[sp], [(sub, attr, 0)]))
    return list(units.values()), triggers, None


def default_units(module: nn.Module) -> list[nn.Module]:
    """The modules gathered one at a time when ``units=`` is not given, as a user expects.

    1. the children of every ``nn.ModuleList`` (a transformer's blocks);
    2. else the children of the outermost ``nn.Sequential`` s (the layers of an MLP);
    3. else none: the whole module is one unit (the root), as ``fully_shard(model)`` alone.

    Children without parameters (an ``nn.ReLU``) form no unit.
    """
    lists = [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]
    if lists:
        return lists
    seqs = [m for m in module.modules() if isinstance(m, nn.Sequential)]
    inner = {sub for s in seqs for sub in s.modules() if sub is not s}
    return [child for s in seqs if s not in inner for child in s]


def group_by_block(module: nn.Module, slots: list, units=None):
    """``unit="block"``: one unit per module of ``units`` (default: :func:`default_units`), root last.

    Returns ``(units, triggers, root)``: ``triggers[m]`` = ``[(unit, [(submodule, attribute, i), …])]``,
    the unit gathered when ``m`` runs and the slots where its parameter i's full tensor stands in;
    the root unit (every parameter outside the unit modules) is triggered by ``module`` itself.
    """
    names = {m: n for n, m in module.named_modules(remove_duplicate=False)}
    units = default_units(module) if units is None else list(units)
    owner: dict[nn.Module, int] = {}  # every module inside a unit -> that unit's index
    for i, m in enumerate(units):
        if not isinstance(m, nn.Module) or m not in names:
            raise ValueError(
                f"units[{i}] ({type(m).__name__}) is not a submodule of the wrapped "
                f"{type(module).__name__}: units must be modules inside the model"
            )
        if m is module:
            raise ValueError(
                "units must not contain the wrapped module itself: it is the root unit already"
            )
        for sub in m.modules():
            if sub in owner:
                j = owner[sub]
                raise ValueError(
                    f"units[{i}] ({names[m]}) and units[{j}] ({names[units[j]]}) overlap: "
                    f"units must not be nested or repeated"
                )
            owner[sub] = i
    where: dict[
        ShardedParam, tuple[int, str]
    ] = {}  # unit index (-1: root) and a slot name, per param
    members: list[list[ShardedParam]] = [[] for _ in range(len(units) + 1)]
    for sub, attr, sp in slots:
        i = owner.get(sub, -1)
        slot_name = f"{names[sub]}.{attr}" if names[sub] else attr
        if sp in where and where[sp][0] != i:
            j, other = where[sp]
            label = {k: "the root unit" if k < 0 else f"unit {names[units[k]]}" for k in (i, j)}
            raise ValueError(
                f"parameter {sp.name} is shared by {label[j]} ({other}) and {label[i]} "
                f"({slot_name}): a tied parameter must lie in one unit (gathered once per unit)"
            )
        if sp not in where:
            where[sp] = (i, slot_name)
            members[i].append(sp)
    out, triggers = [], {}
    for i, trigger in list(enumerate(units)) + [(-1, module)]:
        if not members[i]:
            continue
        u = Unit(names[trigger] or "(root)", members[i])
        index = {sp: k for k, sp in enumerate(members[i])}
        triggers[trigger] = [
            (u, [(sub, attr, index[sp]) for sub, attr, sp in slots if owner.get(sub, -1) == i])
        ]
        out.append(u)
    return out, triggers, (out[-1] if members[-1] else None)
