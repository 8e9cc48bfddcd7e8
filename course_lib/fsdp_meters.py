"""Chapter 04's instruments: what FSDP2 holds and sends, measured from outside the technique.

``fsdp.py`` is the technique only; everything that watches it lives here and attaches through
torch's public hooks (module hooks, dispatch modes, ``FSDPMemTracker``):

* :func:`gathered_param_bytes` / :class:`GatheredParamMeter` — full (unsharded) weights alive now,
  and their peak over a forward;
* :func:`held_gradient_bytes` — gradient bytes a rank holds between backward passes (sharded, or
  unsharded while ``set_requires_gradient_sync(False)`` accumulates them);
* :func:`phased_step` — one ``train.train_step`` that tells an instrument when backward and the
  optimizer step begin (at the model's forward hook, and after backward);
* :func:`counted_step` — that step under a :class:`comm.CollectiveCounter` tagged
  ``forward`` / ``backward`` / ``step``;
* :class:`IssueTimeline` — a ``CollectiveCounter`` that also notes *when* each collective is issued;
* :func:`memory_tracker` — ``FSDPMemTracker`` sampled after every operator (phase, total bytes,
  unsharded-parameter bytes); the one place that reads torch's private ``_FSDPRefType``;
* :func:`tracker_bytes` — a tracker snapshot's ``{category: bytes}`` for one device type;
* :class:`Zero3Timeline` — our ``Zero3``'s gathers and frees, attached as a ``zero3.Zero3Observer``;
* :class:`Zero3Waits` — the seconds our ``Zero3`` waits for its all-gathers and reduce-scatters.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from .comm import CollectiveCounter
from .memory import storage_bytes
from .train import train_step
from .zero3 import Zero3Observer

__all__ = [
    "gathered_param_bytes",
    "GatheredParamMeter",
    "held_gradient_bytes",
    "phased_step",
    "counted_step",
    "IssueTimeline",
    "memory_tracker",
    "tracker_bytes",
    "Zero3Timeline",
    "Zero3Waits",
]


# --------------------------------------------------------------------------- gathered parameters


def gathered_param_bytes(model: nn.Module) -> int:
    """Bytes of full (gathered) parameters alive now in ``model``: registered, not a DTensor, holding memory.

    While an FSDP2 unit is unsharded, FSDP2 registers plain ``nn.Parameter`` s (the gathered
    weights) on its modules; when it reshards, it puts the sharded DTensors back and frees the
    gathered storage. Counted per unique storage (a tied weight once). On a model that is not
    sharded this is simply the bytes of its parameters.
    """
    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for m in model.modules():
        for p in m._parameters.values():
            if p is None or isinstance(p, DTensor):
                continue
            s = p.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def held_gradient_bytes(model: nn.Module) -> dict[str, int]:
    """Gradient bytes ``model`` (FSDP2) holds now: ``{"sharded": …, "unsharded": …}``.

    ``sharded``: the local shards of the parameters' ``.grad`` (what a reduce-scatter leaves).
    ``unsharded``: full-size gradients FSDP2 keeps on its gathered parameters while
    ``set_requires_gradient_sync(False)`` skips the reduce-scatter — read from each unit's
    ``FSDPParam`` (torch's private ``_get_fsdp_state()``; read only, to measure). Per unique storage.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded, unsharded = [], []
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad
            sharded.append(g.to_local() if isinstance(g, DTensor) else g)
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group else ():
            held = fp.unsharded_accumulated_grad
            if held is None and hasattr(fp, "_unsharded_param"):
                held = fp._unsharded_param.grad
            if held is not None:
                unsharded.append(held)
    return {"sharded": storage_bytes(sharded), "unsharded": storage_bytes(unsharded)}


class GatheredParamMeter:
    """The largest :func:`gathered_param_bytes` seen while ``model``'s forward runs: FSDP2's weight peak.

    A forward pre-hook on every leaf module samples the gathered bytes just before it runs, so
    ``peak`` is the most full weights held at once during the forward — the root unit plus the
    block(s) being computed, never the whole model when every block is its own unit. In bf16
    (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``) it is half the fp32 peak.

    >>> with GatheredParamMeter(fsdp_model) as meter:
    ...     fsdp_model(x, y)
    >>> meter.peak
    """

    def __init__(self, model: nn.Module):
        self.model, self.peak = model, 0
        self.handles = [
            m.register_forward_pre_hook(self._hook)
            for m in model.modules()
            if not list(m.children())
        ]

    def _hook(self, module, args) -> None:
        self.peak = max(self.peak, gathered_param_bytes(self.model))

    def remove(self) -> None:
        """Remove the hooks (``peak`` keeps its value)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> "GatheredParamMeter":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


# --------------------------------------------------------------------------- collectives


def phased_step(model, optimizer, x, y, set_phase, after_backward=None) -> float:
    """``train_step`` that calls ``set_phase("backward")`` when ``model``'s forward returns (a forward
    hook) and ``set_phase("step")`` after backward (before ``after_backward``, e.g. clipping)."""

    def to_step():
        set_phase("step")
        if after_backward is not None:
            after_backward()

    handle = model.register_forward_hook(lambda m, a, o: set_phase("backward"))
    try:
        return train_step(model, optimizer, x, y, after_backward=to_step)
    finally:
        handle.remove()


def counted_step(
    model, optimizer, x, y, counter: CollectiveCounter | None = None, after_backward=None
) -> tuple[CollectiveCounter, float]:
    """:func:`phased_step` under a counter tagged ``forward`` → ``backward`` → ``step``.

    Returns ``(counter, loss)``. ``counter``: a fresh :class:`CollectiveCounter` by default
    (or an :class:`IssueTimeline`).
    """
    cc = counter if counter is not None else CollectiveCounter()
    cc.tag = "forward"
    with cc:
        loss = phased_step(
            model, optimizer, x, y, lambda phase: setattr(cc, "tag", phase), after_backward
        )
    return cc, loss


class IssueTimeline(CollectiveCounter):
    """A :class:`CollectiveCounter` that also records when each all-gather / reduce-scatter is issued.

    ``events``: ``("AG" | "RS", "", start_s, end_s)`` per call, seconds since ``t0`` (the
    span of the issuing call on the caller's thread, not of the transfer on a GPU stream).
    ``issued(op)``: how many calls of ``op`` so far.
    """

    def __init__(self, t0: float):
        super().__init__()
        self.t0, self.events = t0, []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def issued(self, op: str) -> int:
        return self.count(op=op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before, start = len(self.records), self.now()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.records) > before and self.records[-1].op in ("all_gather", "reduce_scatter"):
            kind = "AG" if self.records[-1].op == "all_gather" else "RS"
            self.events.append((kind, "", start, self.now()))
        return out


# --------------------------------------------------------------------------- memory (FSDPMemTracker)


def memory_tracker(model, optimizer):
    """``FSDPMemTracker`` that also samples ``(phase, total, unsharded-param bytes)`` after every op.

    Set ``tracker.phase`` as the step moves on; ``tracker.trace`` is the list of samples.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    class Traced(FSDPMemTracker):
        def __init__(self):
            super().__init__(model, optimizer)
            self.phase, self.trace = "forward", []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            snaps = self._curr_mem_snap.values()
            self.trace.append(
                (
                    self.phase,
                    sum(s.get("Total", 0) for s in snaps),
                    sum(s.get(_FSDPRefType.UNSHARDED_PARAM, 0) for s in snaps),
                )
            )
            return out

    return Traced()


def tracker_bytes(snapshot: dict, dev) -> dict:
    """A tracker snapshot's entry for ``dev``'s device type: ``{category: bytes}``, empty if none."""
    for d, snap in snapshot.items():
        if torch.device(d).type == torch.device(dev).type:
            return {getattr(k, "value", str(k)): v for k, v in snap.items()}
    return {}


# --------------------------------------------------------------------------- our Zero3


class Zero3Timeline(Zero3Observer):
    """Every gather and free of a ``Zero3``'s units: ``(event, unit, bytes, seconds since t0)``.

    ``bytes`` is what the unit's buffer holds right after the event (0 after a free).

    >>> timeline = Zero3Timeline()
    >>> handle = zero3.add_observer(timeline)
    >>> ...; handle.remove()
    """

    def __init__(self, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.events: list[tuple[str, str, int, float]] = []

    def _note(self, event: str, unit, buffer) -> None:
        nbytes = buffer.untyped_storage().nbytes()
        self.events.append((event, unit.name, nbytes, time.perf_counter() - self.t0))

    def gathered(self, unit, buffer) -> None:
        self._note("gather", unit, buffer)

    def freed(self, unit, buffer) -> None:
        self._note("free", unit, buffer)

    def count(self, event: str) -> int:
        return sum(e[0] == event for e in self.events)


class Zero3Waits(Zero3Observer):
    """Seconds a ``Zero3`` spends waiting for its collectives, by op: what compute did not hide.

    ``seconds["all_gather"]`` / ``seconds["reduce_scatter"]`` add up every ``work.wait()`` since
    the last :meth:`reset` (a prefetched all-gather that already finished costs ~0); ``calls``
    counts them.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = {"all_gather": 0.0, "reduce_scatter": 0.0}
        self.calls = {"all_gather": 0, "reduce_scatter": 0}
        self._start = 0.0

    def waiting(self, unit, op) -> None:
        self._start = time.perf_counter()

    def waited(self, unit, op) -> None:
        self.seconds[op] += time.perf_counter() - self._start
        self.calls[op] += 1
