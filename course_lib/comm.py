"""Collectives with accounting: what every from-scratch technique in the course calls.

Each function is a thin, named wrapper over ``torch.distributed`` that also records
the call in every active :class:`CommLog`. Two byte counts per call:

* ``tensor_bytes`` — the size nccl-tests reports: the all_reduce buffer, the
  reduce_scatter *input* (the full tensor), the all_gather *output* (the full tensor),
  the broadcast buffer, the sent/received tensor.
* ``ring_bytes`` — what one rank sends with a ring algorithm (N ranks); ring-model accounting,
  computed from the tensor size, not bytes counted on the wire (gloo and nccl pick their own
  algorithms — chapter 00 measures the time instead and fits the α–β model to it):

  ====================  =====================================
  all_reduce            tensor_bytes · 2(N−1)/N
  reduce_scatter        tensor_bytes · (N−1)/N
  all_gather            tensor_bytes · (N−1)/N
  broadcast             tensor_bytes            (pipelined chain)
  send / recv           tensor_bytes / 0
  ====================  =====================================

  All-reduce = reduce-scatter + all-gather, which is why its factor is the sum of theirs.
  These are also the nccl-tests "bus bandwidth" factors: ``busbw = algbw · factor``.

  N is the size of the **process group the call ran on**, not the world size: an all-reduce
  over a 2-rank subgroup of 4 ranks moves 2·(2−1)/2 of its tensor. Each record names that
  group (``group``): ``"default"`` for the default group, a ``DeviceMesh`` dimension's name
  (``"dp"``, ``"tp"``) for a mesh dimension's group, else the c10d group name.

Two recorders, one record type (:class:`CommRecord`) and one query API (``select`` / ``total`` /
``count``, keyword-only ``op=`` and ``tag=``):

* :class:`CommLog` — records the calls made through *this module* (our own techniques), p2p
  ``send`` / ``recv`` / ``isend`` / ``irecv`` included;
* :class:`CollectiveCounter` — records the collectives *anything* issues (FSDP2, DTensor,
  torch DDP) by watching the dispatcher (``CommDebugMode``); it does not see p2p.

These bytes are ring-model accounting (what a ring moves per rank), not bytes counted on the wire.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

__all__ = [
    "CommLog",
    "CommRecord",
    "CollectiveCounter",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_gather_single",
    "reduce_scatter_single",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
    "ring_factor",
    "group_name",
]

_ACTIVE: list["CommLog"] = []


def ring_factor(op: str, world_size: int) -> float:
    """Bytes one rank sends in a ring, per byte of ``tensor_bytes``."""
    n = world_size
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "broadcast": 1.0 if n > 1 else 0.0,
        "send": 1.0,
        "recv": 0.0,
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; expected one of {sorted(factors)}")
    return factors[op]


@dataclass(frozen=True)
class CommRecord:
    """One communication call. ``world_size`` is the size of ``group``, the group it ran on."""

    op: str
    tag: str | None
    dtype: str
    numel: int
    tensor_bytes: int
    ring_bytes: float
    world_size: int
    group: str = "default"


def group_name(group=None) -> str:
    """A readable name for a process group: ``"default"``, a mesh dimension's name, or the c10d name.

    ``DeviceMesh`` creates each dimension's groups with the description ``mesh_<dim name>``
    (``mesh_dp``, ``mesh_tp``; ``mesh_dim_0`` without names); a 1-D mesh over every rank reuses
    the default group. Any other group (``dist.new_group``) is named by its c10d ``group_name``.
    """
    if group is None or group is dist.GroupMember.WORLD:
        return "default"
    if group.group_name == dist.distributed_c10d._get_default_group().group_name:
        return "default"
    desc = getattr(group, "group_desc", "") or ""
    if desc.startswith("mesh_"):
        return desc[len("mesh_") :]
    return group.group_name


class _Records:
    """The query API shared by :class:`CommLog` and :class:`CollectiveCounter` (over ``self.records``)."""

    records: list[CommRecord]

    def select(self, *, op: str | None = None, tag: str | None = None) -> list[CommRecord]:
        return [
            r for r in self.records if (op is None or r.op == op) and (tag is None or r.tag == tag)
        ]

    def total(
        self, field: str = "tensor_bytes", *, op: str | None = None, tag: str | None = None
    ) -> float:
        return sum(getattr(r, field) for r in self.select(op=op, tag=tag))

    def count(self, *, op: str | None = None, tag: str | None = None) -> int:
        return len(self.select(op=op, tag=tag))

    def summary(self) -> list[dict]:
        """One row per (op, tag, dtype, group): calls, Σ tensor_bytes, Σ ring_bytes."""
        rows: dict[tuple, dict] = {}
        for r in self.records:
            row = rows.setdefault(
                (r.op, r.tag, r.dtype, r.group),
                {
                    "op": r.op,
                    "tag": r.tag,
                    "dtype": r.dtype,
                    "group": r.group,
                    "calls": 0,
                    "tensor_bytes": 0,
                    "ring_bytes": 0.0,
                },
            )
            row["calls"] += 1
            row["tensor_bytes"] += r.tensor_bytes
            row["ring_bytes"] += r.ring_bytes
        return list(rows.values())

    def as_dicts(self) -> list[dict]:
        return [asdict(r) for r in self.records]


class CommLog(_Records):
    """Context manager that records every collective issued through this module.

    >>> with CommLog() as log:
    ...     all_reduce(grad, tag="grad")
    >>> log.total("tensor_bytes", tag="grad")
    """

    def __init__(self):
        self.records: list[CommRecord] = []

    def __enter__(self) -> "CommLog":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)


def _world(group) -> int:
    return dist.get_world_size(group)


def _record(op: str, t: torch.Tensor, tag: str | None, group, nbytes: int | None = None) -> None:
    if not _ACTIVE:
        return
    n = _world(group)
    tb = t.numel() * t.element_size() if nbytes is None else nbytes
    rec = CommRecord(
        op,
        tag,
        str(t.dtype).replace("torch.", ""),
        tb // t.element_size(),
        tb,
        tb * ring_factor(op, n),
        n,
        group_name(group),
    )
    for log in _ACTIVE:
        log.records.append(rec)


def all_reduce(
    tensor: torch.Tensor, op=dist.ReduceOp.SUM, *, group=None, async_op: bool = False, tag=None
):
    """In place: every rank ends with the reduction (default: sum) of all ranks' ``tensor``."""
    _record("all_reduce", tensor, tag, group)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


# torch 2.13 names the flat collectives all_gather_single / reduce_scatter_single and marks the
# older all_gather_into_tensor / reduce_scatter_tensor deprecated; a cluster's torch <= 2.12 has only
# the older names (same arguments). These two are the uncounted calls; the functions below count.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op=dist.ReduceOp.SUM,
    *,
    group=None,
    async_op: bool = False,
    tag=None,
):
    """Rank r receives chunk r of the reduction of every rank's ``input`` (``input.numel() == N·output.numel()``)."""
    n = _world(group)
    if input.numel() != n * output.numel():
        raise ValueError(
            f"reduce_scatter: input has {input.numel()} elements, expected world_size={n} × "
            f"output's {output.numel()} = {n * output.numel()}"
        )
    _record("reduce_scatter", input, tag, group)
    return reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False, tag=None
):
    """``output`` = concatenation of every rank's ``input`` in rank order (``output.numel() == N·input.numel()``)."""
    n = _world(group)
    if output.numel() != n * input.numel():
        raise ValueError(
            f"all_gather: output has {output.numel()} elements, expected world_size={n} × "
            f"input's {input.numel()} = {n * input.numel()}"
        )
    _record("all_gather", output, tag, group)
    return all_gather_single(output, input, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, *, group=None, async_op: bool = False, tag=None):
    """In place: every rank ends with rank ``src``'s ``tensor``."""
    _record("broadcast", tensor, tag, group)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, *, group=None, tag=None) -> None:
    _record("send", tensor, tag, group)
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, *, group=None, tag=None) -> None:
    _record("recv", tensor, tag, group)
    dist.recv(tensor, src=src, group=group)


def isend(tensor: torch.Tensor, dst: int, *, group=None, tag=None):
    """Non-blocking send; returns a Work whose ``.wait()`` completes it."""
    _record("send", tensor, tag, group)
    return dist.isend(tensor, dst=dst, group=group)


def irecv(tensor: torch.Tensor, src: int, *, group=None, tag=None):
    """Non-blocking receive into ``tensor``; call ``.wait()`` before reading it."""
    _record("recv", tensor, tag, group)
    return dist.irecv(tensor, src=src, group=group)


# --------------------------------------------------------------------------- collectives issued by anything

# c10d operators (what torch.distributed's Python API dispatches to) and functional collectives,
# by the names this module uses
_C10D, _FUNCOL = torch.ops.c10d, torch.ops._c10d_functional
_OP_NAMES = {
    _C10D._allgather_base_: "all_gather",
    _C10D.allgather_: "all_gather",
    _C10D.allgather_into_tensor_coalesced_: "all_gather",
    _C10D.allgather_coalesced_: "all_gather",
    _C10D._reduce_scatter_base_: "reduce_scatter",
    _C10D.reduce_scatter_: "reduce_scatter",
    _C10D.reduce_scatter_tensor_coalesced_: "reduce_scatter",
    _C10D.allreduce_: "all_reduce",
    _C10D.allreduce_coalesced_: "all_reduce",
    _C10D.broadcast_: "broadcast",
    _FUNCOL.all_gather_into_tensor: "all_gather",
    _FUNCOL.all_gather_into_tensor_coalesced: "all_gather",
    _FUNCOL.reduce_scatter_tensor: "reduce_scatter",
    _FUNCOL.reduce_scatter_tensor_coalesced: "reduce_scatter",
    _FUNCOL.all_reduce: "all_reduce",
    _FUNCOL.all_reduce_coalesced: "all_reduce",
    _FUNCOL.broadcast: "broadcast",
}


def _tensor_groups(values) -> list[list[torch.Tensor]]:
    """The tensor arguments (or results) of an op: a tensor, a list of tensors, or a list of lists."""
    groups = []
    for a in values:
        if isinstance(a, torch.Tensor):
            groups.append([a])
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            groups.append(list(a))
        elif isinstance(a, (list, tuple)) and a and all(isinstance(t, (list, tuple)) for t in a):
            groups.append([t for sub in a for t in sub if isinstance(t, torch.Tensor)])
    return groups


def _op_group(func, args, kwargs):
    """The ProcessGroup an op ran on: its ``process_group`` argument (c10d ops, a boxed ScriptObject)
    or its ``group_name`` (functional collectives, resolved by name); None if it has neither."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name not in ("process_group", "group_name"):
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if value is None:
            return None
        if isinstance(value, str):
            return dist.distributed_c10d._resolve_process_group(value)
        if isinstance(value, dist.ProcessGroup):
            return value
        return dist.ProcessGroup.unbox(value)
    return None


class CollectiveCounter(_Records, CommDebugMode):
    """``torch.distributed.tensor.debug.CommDebugMode`` that also records each collective as a :class:`CommRecord`.

    ``CommDebugMode`` is a ``TorchDispatchMode``: it sees every operator call made while it is
    active, including the c10d collectives FSDP2 issues through ``torch.distributed``
    (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``) and the functional collectives
    of DTensor, in forward *and* in backward (autograd runs backward with the caller's dispatch
    modes active). It counts them per op (``get_comm_counts()``) but records no sizes and no
    groups; this subclass records one :class:`CommRecord` per call, with :class:`CommLog`'s
    conventions and query API:

    * ``tensor_bytes`` = the largest tensor argument or result (all_gather output,
      reduce_scatter input, all_reduce buffer — the full tensor);
    * ``group`` / ``world_size`` = the process group the op ran on (its ``process_group`` or
      ``group_name`` argument) and its size; ``ring_bytes = tensor_bytes · ring_factor(op, size)``;
    * ``tag``: a label you set (``counter.tag = "backward"``) that each following record carries.

    Nothing is patched; the mode runs the operator unchanged and only looks at its arguments.
    Point-to-point ops (``send`` / ``recv``) do not pass through the dispatcher: count those with
    :class:`CommLog`.

    >>> with CollectiveCounter(tag="forward") as cc:
    ...     _, loss = fsdp_model(x, y)
    ...     cc.tag = "backward"
    ...     loss.backward()
    >>> cc.count(op="all_gather", tag="backward"), cc.total("ring_bytes", op="reduce_scatter")
    """

    def __init__(self, tag: str | None = None):
        super().__init__()
        self.records: list[CommRecord] = []
        self.tag = tag

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        packet = getattr(func, "_overloadpacket", None)
        if out is not NotImplemented and packet in _OP_NAMES:
            op = _OP_NAMES[packet]
            results = out if isinstance(out, (list, tuple)) else [out]
            groups = _tensor_groups(list(args) + list(kwargs.values()) + list(results))
            biggest = max(groups, key=lambda g: sum(t.numel() * t.element_size() for t in g))
            tb = sum(t.numel() * t.element_size() for t in biggest)
            pg = _op_group(func, args, kwargs)
            n = pg.size() if pg is not None else dist.get_world_size()
            self.records.append(
                CommRecord(
                    op,
                    self.tag,
                    str(biggest[0].dtype).replace("torch.", ""),
                    sum(t.numel() for t in biggest),
                    tb,
                    tb * ring_factor(op, n),
                    n,
                    group_name(pg),
                )
            )
        return out
