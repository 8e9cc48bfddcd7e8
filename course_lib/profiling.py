"""Profiler traces of a few training steps, read back and drawn: where a step's time goes.

What practitioners do every day — open a trace of one step and see what overlaps — with
``torch.profiler`` on whatever device the rank has (CPU here, CUDA where there is one):

    prof = profile_steps(lambda: marked_step(model, opt, x, y), steps=3, name="one_device")
    print(prof)                          # ProfilerStep ranges, trace vs wall clock, top ops
    events = read_trace(prof.trace_path) # every complete range: thread, name, start, duration, kind
    draw_trace(events, title="one device, 3 steps")

    res = spawn(ddp_step_trace, 2, kwargs={"variant": "torch_ddp"})   # one DDPTrace per rank
    print(res[0]); res[0].overlap_s      # how long all-reduces ran while backward computed

The contract
------------
* What is recorded. CPU activities (plus CUDA when the device is a GPU), ``record_shapes=True``,
  and — with ``all_threads=True`` — every thread of the process
  (``_ExperimentalConfig(profile_all_threads=True)``); by default the profiler records ops
  only on the thread that started it (gloo's ranges appear either way, see below). Each profiled
  step is one ``ProfilerStep#N`` range (``torch.profiler.schedule``: ``warmup`` steps first,
  recorded but dropped, then ``steps`` active ones); the step's phases, where the step marks them
  (:func:`marked_step`), are ``record_function`` ranges ``forward`` / ``backward`` /
  ``optimizer``.
* Where the trace goes. A Chrome-trace JSON under the project's ``.cache/traces/`` (not
  committed), or ``trace_path``. Open it in https://ui.perfetto.dev (drag the file in) or in
  Chrome at ``chrome://tracing`` (Load). :attr:`Profile.trace_file` is the path relative to the
  repository root, for printing.
* What comes back. A :class:`Profile` — a :class:`~course_lib.results.Result` whose rows are the
  trace's ``ProfilerStep`` count (exact) and its total step time against a wall clock
  (``perf_counter`` around the same steps, ±20 %: a check that the trace's timestamps are the
  real clock, not a performance claim — the two time the same interval) — plus the top-N ops of
  ``key_averages()`` as rows (:attr:`Profile.top_ops`), printed under the table per step.
* Reading a trace. :func:`read_trace` keeps every complete (``"ph": "X"``) range with its thread
  and classifies it: ``communication`` (``gloo:``/``nccl:`` ranges, ``record_param_comms``,
  ``c10d::`` ops), ``clock sleep`` (the modelled accelerator clock's ``clock: <part> fwd|bwd``
  ranges, :mod:`course_lib.clock`), ``optimizer`` (``Optimizer.step#…``, ``Optimizer.zero_grad#…``,
  our ``optimizer`` mark), ``backward`` (autograd's ``evaluate_function`` ranges and
  ``*Backward0`` nodes, our ``backward`` mark), ``forward`` (the ``forward`` mark, a module's
  ``forward``) — a range whose own name says nothing inherits the kind of the innermost range that
  encloses it on its thread, else it is ``other``. Each event also has a ``phase`` (forward /
  backward / optimizer / "") — a clock sleep in backward has phase backward. A GPU kernel takes
  the kind and phase of the CPU op that launched it (their shared ``External id``).
* What gloo looks like (torch 2.13, CPU, all threads): the training thread holds the short
  ``c10d::allreduce_`` / ``c10d::broadcast_`` calls that enqueue each collective; the collective
  itself is a ``gloo:all_reduce`` / ``gloo:broadcast`` range on one of gloo's worker threads (one
  named ``pt_gloo_runloop``, the other named or not from run to run). No ``record_param_comms``
  range appears with gloo. The ``gloo:`` ranges are async record functions begun on the training
  thread, so they are in the trace even without ``all_threads`` (checked in 2.13); what
  ``all_threads`` adds is whatever else those and other threads run (their own ops, data-loader
  or autograd device threads). :func:`overlap` asks the learner's
  question of a trace: for how long does a collective run (on its own thread) while backward
  computes (:func:`computing`: autograd's nodes and their ops, and under the modelled clock its
  backward sleeps — not :func:`marked_step`'s ``backward`` mark, which also spans DDP's wait for
  the last bucket and the copy of the averages into ``.grad``, nor the ``c10d::`` calls that
  enqueue the collectives)?
* Quiet. Kineto writes ``USDT: … profiler_start`` lines straight to file descriptor 2, which a
  Jupyter kernel copies into the cell: the profiler's own start/step/stop calls run with fd 2
  sent to /dev/null (the step itself does not).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from .results import FieldAccess, Result

__all__ = [
    "ROOT",
    "TRACE_DIR",
    "KINDS",
    "relative",
    "marked_step",
    "profile_steps",
    "Profile",
    "TraceEvent",
    "read_trace",
    "read_traces",
    "classify",
    "overlap",
    "computing",
    "busy",
    "training_threads",
    "draw_trace",
    "DDPTrace",
    "ddp_step_trace",
    "quiet_stderr",
    "top_ops",
    "ops_text",
    "MemoryCurve",
    "memory_curve",
    "read_memory",
    "draw_memory_curve",
    "MEMORY_PEAK_BAND",
    "draw_ops",
]

ROOT = Path(__file__).resolve().parents[1]
TRACE_DIR = ROOT / ".cache" / "traces"
KINDS = ("forward", "backward", "optimizer", "communication", "clock sleep", "other")
COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "optimizer": "#8172b3",
    "communication": "#dd8452",
    "clock sleep": "#c9c9c9",
    "clock sleep in forward": "#b4c7e7",  # a lighter tint of its phase: modelled compute
    "clock sleep in backward": "#b9dfc2",
    "other": "#937860",
}
TRACE_VS_WALL_BAND = 0.20  # the trace's step ranges against perf_counter around the same steps
# course_lib.clock labels each sleep "clock: <part> fwd|bwd" (or "clock: <label>" for a spend)
CLOCK_PREFIX = "clock: "
MARKS = ("forward", "backward", "optimizer")  # what marked_step names its phases
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # ranges that run on a device stream
MEMORY_PEAK_BAND = 0.10
"""A step's allocated peak against model states + saved activations (the course's meters): ±10 %.

Why 10 %. At the peak (early in backward) the allocator also holds what neither meter counts:
the loss's and logits' gradients, each op's gradient outputs before autograd accumulates them, and
the gradients already written while some activations are not yet freed. On the tiny GPT at b=32
these add about 4 % (measured, notebook 01); an accounting that missed a whole term — the
optimizer state, the gradients, the activations — would be off by 10 % or more."""


def relative(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root when it lies inside it (for printing), else absolute."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def marked_step(model, optimizer, x, y) -> float:
    """``train.train_step`` with its phases marked for the profiler: ``forward``, ``backward``,
    ``optimizer`` ranges (zero_grad counts as optimizer). Returns the loss."""
    rf = torch.profiler.record_function
    with rf("optimizer"):
        optimizer.zero_grad(set_to_none=True)
    with rf("forward"):
        _, loss = model(x, y)
    with rf("backward"):
        loss.backward()
    with rf("optimizer"):
        optimizer.step()
    return loss.item()


# --------------------------------------------------------------------------- profiling a few steps


@contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to /dev/null for a moment: kineto writes ``USDT: … profiler_start`` /
    ``profiler_stop`` lines straight to it (no log level turns them off in torch 2.13), and a
    Jupyter kernel captures fd 2 into the cell's output. Only the profiler's own calls run inside."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (an embedded interpreter): nothing to quiet
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


quiet_stderr = _quiet_stderr  # public: a notebook's own ``with profile(...)`` block runs inside it


def _sync(dev) -> None:
    if dev is not None and torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def _activities(dev) -> list:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available() and (dev is None or torch.device(dev).type == "cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def _op_rows(prof, n: int) -> list[dict]:
    """The top ``n`` of ``key_averages()`` by self time (CPU, or device time when larger)."""
    rows = []
    for a in prof.key_averages():
        dev_self = getattr(a, "self_device_time_total", 0.0) or 0.0
        rows.append(
            {
                "name": a.key,
                "calls": int(a.count),
                "self_cpu_ms": a.self_cpu_time_total / 1e3,
                "cpu_total_ms": a.cpu_time_total / 1e3,
                "self_device_ms": dev_self / 1e3,
            }
        )
    rows.sort(key=lambda r: max(r["self_cpu_ms"], r["self_device_ms"]), reverse=True)
    return rows[:n]


def top_ops(prof, n: int = 10) -> list[dict]:
    """The top ``n`` ops of a finished ``torch.profiler.profile`` by self time, summed over its
    steps: rows ``{name, calls, self_cpu_ms, cpu_total_ms, self_device_ms}``."""
    return _op_rows(prof, n)


def ops_text(rows: list[dict], per: int = 1) -> str:
    """:func:`top_ops` rows as an aligned table, each number divided by ``per`` (the steps)."""
    return _ops_text(rows, per)


def _ops_text(rows: list[dict], per: int) -> str:
    if not rows:
        return "(no ops)"
    device = any(r["self_device_ms"] for r in rows)
    head = ["op", "calls/step", "self CPU ms/step", "CPU total ms/step"] + (
        ["self device ms/step"] if device else []
    )
    body = []
    for r in rows:
        line = [
            r["name"][:60],
            f"{r['calls'] / per:g}",
            f"{r['self_cpu_ms'] / per:.3f}",
            f"{r['cpu_total_ms'] / per:.3f}",
        ]
        body.append(line + ([f"{r['self_device_ms'] / per:.3f}"] if device else []))
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)).rstrip() for b in body]
    return "\n".join(out)


@dataclass
class Profile(FieldAccess, Result):
    """What :func:`profile_steps` measured: the trace file, its steps against a wall clock, top ops.

    ``step_s_trace`` / ``step_s_wall``: each profiled step's seconds, from the trace's
    ``ProfilerStep#N`` ranges and from ``perf_counter`` around the same steps. ``top_ops``: rows
    ``{name, calls, self_cpu_ms, cpu_total_ms, self_device_ms}`` summed over the profiled steps
    (the printed table divides by the number of steps).
    """

    trace_path: str = ""
    steps: int = 0
    step_s_trace: list = field(default_factory=list)
    step_s_wall: list = field(default_factory=list)
    top_ops: list = field(default_factory=list)

    @property
    def trace_file(self) -> str:
        """The trace's path relative to the repository root (what a notebook prints)."""
        return relative(self.trace_path)

    def ops_table(self) -> str:
        """The top ops, per step, as aligned text."""
        return _ops_text(self.top_ops, max(self.steps, 1))

    def table(self) -> str:
        return (
            super().table()
            + f"\ntrace: {self.trace_file} (open in https://ui.perfetto.dev or chrome://tracing)"
            + f"\n\ntop ops by self time, per step (key_averages over {self.steps} steps)\n"
            + self.ops_table()
        )


def _step_ranges(events: list[TraceEvent]) -> list[TraceEvent]:
    return sorted((e for e in events if e.name.startswith("ProfilerStep#")), key=lambda e: e.start)


def profile_steps(
    step: Callable[[], object],
    steps: int = 3,
    warmup: int = 1,
    trace_path: str | os.PathLike | None = None,
    *,
    name: str = "steps",
    all_threads: bool = True,
    record_shapes: bool = True,
    top: int = 12,
    device=None,
    title: str | None = None,
) -> Profile:
    """Run ``step()`` ``warmup + steps`` times under ``torch.profiler``; export and summarise the trace.

    ``trace_path`` defaults to ``.cache/traces/<name>.json``. ``device``: the device the step runs
    on (default :func:`course_lib.launch.device`), to add CUDA activities and synchronise before
    each clock read on a GPU.
    """
    from torch.profiler import profile, schedule

    from . import launch

    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    dev = launch.device() if device is None else torch.device(device)
    path = Path(trace_path) if trace_path is not None else TRACE_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    kwargs = {}
    if all_threads:
        kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(
            profile_all_threads=True
        )
    walls = []
    prof = profile(
        activities=_activities(dev),
        record_shapes=record_shapes,
        schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
        **kwargs,
    )
    with _quiet_stderr():
        prof.start()
    try:
        for i in range(warmup + steps):
            _sync(dev)
            t0 = time.perf_counter()
            step()
            _sync(dev)
            if i >= warmup:
                walls.append(time.perf_counter() - t0)
            with _quiet_stderr():
                prof.step()
    finally:
        with _quiet_stderr():
            prof.stop()
    prof.export_chrome_trace(str(path))
    ranges = _step_ranges(read_trace(path))
    res = Profile(
        title=title or f"profiler trace of {steps} step(s) ({name})",
        trace_path=str(path),
        steps=steps,
        step_s_trace=[e.duration for e in ranges],
        step_s_wall=walls,
        top_ops=_op_rows(prof, top),
    )
    res.exact("ProfilerStep ranges in the trace", len(ranges), steps, "profiled steps")
    if ranges:
        res.within(
            "trace: sum of ProfilerStep ranges (s)",
            sum(res.step_s_trace),
            sum(walls),
            TRACE_VS_WALL_BAND,
            "s, perf_counter around the same steps",
        )
    return res


# --------------------------------------------------------------------------- reading a trace


@dataclass(frozen=True)
class TraceEvent:
    """One complete range of a trace: seconds from the trace's first range; ``kind`` in :data:`KINDS`."""

    thread: str
    name: str
    start: float
    duration: float
    kind: str = "other"
    phase: str = ""
    category: str = ""

    @property
    def end(self) -> float:
        return self.start + self.duration


def _own_kind(name: str) -> tuple[str | None, str]:
    """(kind, phase) that an event's own name says, or (None, "") when it says nothing."""
    low = name.lower()
    if name.startswith(CLOCK_PREFIX):
        phase = "backward" if low.endswith(" bwd") else "forward" if low.endswith(" fwd") else ""
        return "clock sleep", phase
    if low.startswith(("gloo:", "nccl", "c10d::")) or "record_param_comms" in low:
        return "communication", ""
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")) or name == "optimizer":
        return "optimizer", "optimizer"
    if (
        name == "backward"
        or name.startswith("autograd::engine::evaluate_function")
        or name.endswith("Backward0")
        or name.endswith("Backward1")
    ):
        return "backward", "backward"
    if name == "forward" or name.endswith(".forward") or name.startswith("nn.Module:"):
        return "forward", "forward"
    return None, ""


def classify(events: Sequence[dict]) -> list[TraceEvent]:
    """Give each raw range (``thread, name, start, duration`` dicts; optional ``category``,
    ``external_id``, ``gpu``) its kind and phase.

    An event's own name decides when it can (:func:`_own_kind`); otherwise it takes the kind and
    phase of the innermost enclosing range on its thread that has one. A communication or clock
    range takes its phase from what encloses it (the phase it was issued in). A GPU kernel
    (``gpu=True``) takes them from the CPU op that launched it (the same ``External id``)."""
    out = []
    by_thread: dict[str, list[dict]] = {}
    for e in events:
        if not e.get("gpu"):
            by_thread.setdefault(e["thread"], []).append(e)
    launched: dict = {}
    for thread, evs in by_thread.items():
        evs.sort(key=lambda e: (e["start"], -e["duration"]))
        stack: list[tuple[float, str, str]] = []  # (end, kind, phase) of enclosing ranges
        for e in evs:
            end = e["start"] + e["duration"]
            while stack and stack[-1][0] < end - 1e-9:  # ended before this one: not an enclosure
                stack.pop()
            parent_kind = next((k for _, k, _ in reversed(stack) if k), None)
            parent_phase = next((p for _, _, p in reversed(stack) if p), "")
            kind, phase = _own_kind(e["name"])
            if kind is None:
                kind, phase = (parent_kind or "other"), parent_phase
            elif not phase:
                phase = parent_phase
            if e.get("external_id") is not None:
                launched[e["external_id"]] = (kind, phase)
            out.append(
                TraceEvent(
                    thread, e["name"], e["start"], e["duration"], kind, phase, e.get("category", "")
                )
            )
            stack.append((end, kind if kind != "other" else "", phase))
    for e in events:
        if e.get("gpu"):
            kind, phase = _own_kind(e["name"])
            if kind is None:
                kind, phase = launched.get(e.get("external_id"), ("other", ""))
            out.append(
                TraceEvent(
                    e["thread"],
                    e["name"],
                    e["start"],
                    e["duration"],
                    kind,
                    phase,
                    e.get("category", ""),
                )
            )
    out.sort(key=lambda e: (e.start, e.thread))
    return out


def _load(path) -> tuple[list[dict], dict, dict, float]:
    """A trace file's complete ranges, thread and process names, and its time base in µs."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    raw = data["traceEvents"] if isinstance(data, dict) else data
    base = float(data.get("baseTimeNanoseconds", 0)) / 1e3 if isinstance(data, dict) else 0.0
    names: dict[tuple, str] = {}
    procs: dict = {}
    for e in raw:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", e.get("tid")))
        elif e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", e.get("pid")))
    ranges = [e for e in raw if e.get("ph") == "X" and "dur" in e and "ts" in e]
    return ranges, names, procs, base


def _start_us(path) -> float:
    ranges, _, _, base = _load(path)
    return base + min((float(e["ts"]) for e in ranges), default=0.0)


def read_trace(path: str | os.PathLike, origin_us: float | None = None) -> list[TraceEvent]:
    """Every complete range (``"ph": "X"``) of a Chrome-trace JSON file, classified (:func:`classify`).

    Times are seconds from the earliest range (or from ``origin_us``, an absolute time in µs as
    :func:`read_traces` uses to put several ranks on one axis); ``thread`` is the process and
    thread name the trace gives (``"<process> / <thread>"``, e.g. a gloo worker thread, the main
    thread, a CUDA stream)."""
    ranges, names, procs, base = _load(path)
    if not ranges:
        return []
    t0 = min(float(e["ts"]) for e in ranges) if origin_us is None else origin_us - base
    events = []
    for e in ranges:
        pid, tid = e.get("pid"), e.get("tid")
        thread = names.get((pid, tid), f"thread {tid}")
        proc = procs.get(pid)
        events.append(
            {
                "thread": f"{proc} / {thread}" if proc else thread,
                "name": str(e.get("name", "")),
                "start": (float(e["ts"]) - t0) / 1e6,
                "duration": float(e["dur"]) / 1e6,
                "category": str(e.get("cat", "")),
                "external_id": (e.get("args") or {}).get("External id"),
                "gpu": str(e.get("cat", "")).lower() in GPU_CATEGORIES,
            }
        )
    return classify(events)


def read_traces(paths) -> dict[str, list[TraceEvent]]:
    """Several ranks' traces on one time axis: ``{label: events}`` from ``{label: path}`` or a list
    of paths (labelled ``rank 0``, ``rank 1``, …). The files' clocks are the host's (Kineto writes
    ``baseTimeNanoseconds`` + ``ts``), so ranks on one machine line up; times are seconds from the
    earliest range of any file. :func:`draw_trace` draws the result with a row per rank and thread."""
    if not isinstance(paths, dict):
        paths = {f"rank {i}": p for i, p in enumerate(paths)}
    origin = min(_start_us(p) for p in paths.values())
    return {label: read_trace(p, origin_us=origin) for label, p in paths.items()}


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def training_threads(events: Sequence[TraceEvent]) -> set[str]:
    """The threads that ran the steps: those holding ``ProfilerStep#`` ranges or phase marks."""
    return {e.thread for e in events if e.name.startswith("ProfilerStep#") or e.name in MARKS}


def _elsewhere(events: Sequence[TraceEvent], kind: str) -> list[TraceEvent]:
    """``kind`` ranges that ran off the training thread(s): gloo's worker threads, a device stream."""
    mains = training_threads(events)
    return [e for e in events if e.kind == kind and e.thread not in mains and e.duration > 0]


def _subtract(xs: list[tuple[float, float]], cuts: list[tuple[float, float]]):
    """Merged intervals ``xs`` with the merged intervals ``cuts`` taken out."""
    out = []
    for a, b in xs:
        for c, d in cuts:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Seconds two lists of merged intervals share."""
    total, j = 0.0, 0
    for x0, x1 in xs:
        while j < len(ys) and ys[j][1] <= x0:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < x1:
            total += max(0.0, min(x1, ys[k][1]) - max(x0, ys[k][0]))
            k += 1
    return total


def computing(events: Sequence[TraceEvent], phase: str = "backward") -> list[tuple[float, float]]:
    """When ``phase``'s compute runs: merged ``(start, end)`` intervals, seconds.

    Compute is the ranges whose own name says ``phase`` — for backward autograd's nodes
    (``evaluate_function`` ranges and the ``…Backward0`` ops inside them), for forward a module's
    ``forward`` — and, under the modelled clock, the clock's sleeps of that phase; the ops they
    call lie inside them. Not compute: :func:`marked_step`'s phase marks and what runs under a mark
    but outside every node — for backward, the end-of-backward callback that waits for the
    all-reduces and copies the averages into ``.grad`` — and the host's ``c10d::`` calls that
    enqueue a collective (inside a node: a DDP hook launching a bucket). A GPU kernel
    counts when it was launched in ``phase`` (its launching op is not told apart here)."""
    work = [
        (e.start, e.end)
        for e in events
        if e.phase == phase
        and e.duration > 0
        and e.name not in MARKS
        and (
            _own_kind(e.name)[0] in (phase, "clock sleep")
            or (e.category.lower() in GPU_CATEGORIES and e.kind != "communication")
        )
    ]
    enqueue = [  # the host's calls that enqueue a collective (gloo's own ranges are the work)
        (e.start, e.end)
        for e in events
        if e.kind == "communication"
        and e.duration > 0
        and e.category.lower() not in GPU_CATEGORIES
        and not e.name.lower().startswith("gloo:")
    ]
    return _subtract(_merge(work), _merge(enqueue))


def overlap(
    events: Sequence[TraceEvent],
    a: str = "communication",
    b: str = "backward",
    *,
    ranges: Sequence[TraceEvent] | None = None,
) -> float:
    """Seconds during which an ``a`` range runs off the training thread while ``b``'s compute runs.

    ``a`` is a kind, counted where it runs (gloo's worker threads, a CUDA stream's NCCL kernels —
    not the ``c10d::`` call on the training thread that enqueues the collective). ``b`` is a
    phase; its compute is :func:`computing`'s: autograd's nodes and the ops they call, and —
    under the modelled clock — the phase's sleeps; not the phase mark (:func:`marked_step`'s
    ``backward`` range also spans DDP's end-of-backward wait for the last all-reduce and the copy
    of the averages into ``.grad``), nor the enqueueing ``c10d::`` calls. ``ranges``: count only
    these ``a`` ranges (e.g. one all-reduce) instead of every one in ``events``.
    """
    xs = _elsewhere(events, a) if ranges is None else [e for e in ranges if e.duration > 0]
    return _intersection(_merge([(e.start, e.end) for e in xs]), computing(events, b))


def busy(events: Sequence[TraceEvent], kind: str = "communication") -> float:
    """Seconds during which some ``kind`` range runs off the training thread (overlaps merged):
    for communication, how long collectives were running — what :func:`overlap` is a part of."""
    return sum(b - a for a, b in _merge([(e.start, e.end) for e in _elsewhere(events, kind)]))


# --------------------------------------------------------------------------- drawing a trace


def _style(e: TraceEvent) -> str:
    """The legend entry a range is drawn as: its kind; a clock sleep also names its phase."""
    if e.kind == "clock sleep" and e.phase in ("forward", "backward"):
        return f"clock sleep in {e.phase}"
    return e.kind


def _kinds_legend(ax, seen: set, title: str | None):
    """The legend of the kinds drawn (``seen``, in ``COLORS``' order) beside ``ax``, and its title."""
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS[k], label=k) for k in COLORS if k in seen]
    ax.legend(
        handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=8
    )
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_trace(
    events: Sequence[TraceEvent] | dict[str, Sequence[TraceEvent]],
    ax=None,
    title: str | None = None,
    *,
    window: tuple[float, float] | None = None,
    steps_only: bool = True,
    max_threads: int = 8,
):
    """A Gantt of the trace: one row per thread, a bar per range, coloured by kind, time in ms.

    ``steps_only``: only the span of the ``ProfilerStep`` ranges (the warm-up and export are
    cut); ``window=(start_s, end_s)`` picks a span explicitly. Threads with nothing in the span
    are left out (at most ``max_threads``, the busiest). Nested ranges are drawn over their
    parents. A clock sleep is drawn in a light tint of its phase (it is that phase's modelled
    compute). The thread that ran the steps is labelled "training thread …". ``events`` may be
    :func:`read_traces`' ``{label: events}`` (several ranks on one axis): rows are then
    ``"<label> · <thread>"``, grouped by label. Returns the axes; the legend lists the kinds present.
    """
    import dataclasses

    import matplotlib.pyplot as plt

    group = {}
    if isinstance(events, dict):
        flat = []
        for i, (label, evs) in enumerate(events.items()):
            for e in evs:
                thread = f"{label} · {e.thread.split(' / ', 1)[-1]}"
                group[thread] = i
                flat.append(dataclasses.replace(e, thread=thread))
        events = flat
    if window is None and steps_only:
        steps = _step_ranges(list(events))
        if steps:
            window = (steps[0].start, max(e.end for e in steps))
    lo, hi = window if window is not None else (0.0, max((e.end for e in events), default=0.0))
    shown = [
        e
        for e in events
        if e.end > lo
        and e.start < hi
        and not e.name.startswith(("ProfilerStep#", "PyTorch Profiler"))
    ]
    busy: dict[str, float] = {}
    for e in shown:
        busy[e.thread] = busy.get(e.thread, 0.0) + e.duration
    threads = sorted(busy, key=lambda t: -busy[t])[:max_threads]
    threads.sort(key=lambda t: (group.get(t, 0), min(e.start for e in shown if e.thread == t)))
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.45 * len(threads) + 1.4))
    seen = set()
    for row, thread in enumerate(threads):
        evs = sorted((e for e in shown if e.thread == thread), key=lambda e: -e.duration)
        bars, colors = [], []  # longest first: a range's children are drawn over it
        for e in evs:
            style = _style(e)
            seen.add(style)
            bars.append(((max(e.start, lo) - lo) * 1e3, (min(e.end, hi) - max(e.start, lo)) * 1e3))
            colors.append(COLORS[style])
        if bars:
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors, linewidth=0)
    mains = {e.thread for e in events if e.name.startswith("ProfilerStep#")}
    procs = {t.split(" / ")[0] for t in threads if " / " in t}
    labels = [t.split(" / ", 1)[-1] if len(procs) <= 1 else t for t in threads]
    labels = [
        x.replace("thread ", "training thread ", 1) if t in mains else x
        for t, x in zip(threads, labels, strict=True)
    ]
    ax.set_yticks(range(len(threads)), [t[-48:] for t in labels])
    ax.set_ylim(len(threads) - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) * 1e3)
    ax.set_xlabel("time from the first profiled step (ms)")
    return _kinds_legend(ax, seen, title)


# --------------------------------------------------------------------------- a DDP step, per rank


@dataclass
class DDPTrace(FieldAccess, Result):
    """One rank's trace of a few DDP steps: the :class:`Profile` rows, the overlap, the top ops.

    ``comm_s``: seconds during which a collective runs (gloo's worker threads / a CUDA stream;
    merged), over the profiled steps; ``overlap_s``: the part of it while backward computes
    (:func:`overlap`); ``comm_names``: the communication range names the trace holds."""

    rank: int = 0
    variant: str = ""
    trace_path: str = ""
    steps: int = 0
    top_ops: list = field(default_factory=list)
    overlap_s: float = 0.0
    comm_s: float = 0.0
    comm_names: list = field(default_factory=list)

    @property
    def trace_file(self) -> str:
        return relative(self.trace_path)

    @property
    def overlaps(self) -> bool:
        """Does a collective run while backward still computes (any time > 0 in the trace)?"""
        return self.overlap_s > 0

    @property
    def exposed_s(self) -> float:
        """Seconds of collectives that ran while backward did not compute (upper bound on what
        they added to the step: the optimizer may overlap the tail of the last one)."""
        return max(0.0, self.comm_s - self.overlap_s)

    def table(self) -> str:
        return (
            super().table()
            + f"\ntrace: {self.trace_file}"
            + f"\ncommunication ranges seen: {', '.join(self.comm_names) or 'none'}"
            + f"\n\ntop ops by self time, per step ({self.steps} steps)\n"
            + _ops_text(self.top_ops, max(self.steps, 1))
        )


def ddp_step_trace(
    variant: str = "torch_ddp",
    steps: int = 3,
    warmup: int = 1,
    *,
    config=None,
    batch_size: int = 8,
    bucket_cap_mb: float | None = 0.025,
    clock_rate: float | None = None,
    optimizer: str = "adamw",
    name: str | None = None,
    trace_dir: str | os.PathLike | None = None,
    top: int = 10,
    all_threads: bool = True,
) -> DDPTrace:
    """Rank function: profile ``steps`` DDP steps of a small GPT on this rank's device; one trace per rank.

    ``variant``: ``"torch_ddp"`` (``DistributedDataParallel``) or ``"own"`` (:class:`course_lib.ddp.DDP`).
    ``config``: default :func:`course_lib.configs.small_config`; ``bucket_cap_mb`` small enough to
    make several buckets of its 26k parameters (~104 kB of fp32 gradients), so that an all-reduce
    can start before backward ends. Torch DDP's first step uses a 1 MiB first bucket and then
    rebuilds its buckets in the order gradients arrived: keep ``warmup >= 1`` so the profiled
    steps have the rebuilt buckets (seen at the default cap: 4 all-reduces per step for torch
    DDP, 6 for ours, which buckets in reverse registration order). ``clock_rate``: put
    the model under the modelled accelerator clock at that FLOP/s (None: the real clock). Each
    step is :func:`marked_step` on this rank's shard of ``train.step_batch(step)``. Run it with
    ``launch.spawn(ddp_step_trace, 2, kwargs=…)``.
    """
    import torch.distributed as dist

    from . import launch
    from .configs import make_optimizer, small_config
    from .ddp import DDP, torch_ddp
    from .models import GPT
    from .train import shard_batch, step_batch

    if variant not in ("torch_ddp", "own"):
        raise ValueError(f"variant={variant!r} is not 'torch_ddp' or 'own'")
    rank = dist.get_rank() if dist.is_initialized() else 0
    dev = launch.device()
    config = small_config() if config is None else config
    model = GPT(config).to(dev)
    clock = None
    if clock_rate is not None:
        from .clock import AcceleratorClock

        clock = AcceleratorClock(clock_rate, device=dev)
        clock.apply(model)
    if variant == "own":
        wrapped = DDP(model, bucket_cap_mb=bucket_cap_mb)
    else:
        wrapped = torch_ddp(model, bucket_cap_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb)
    opt = make_optimizer(optimizer, wrapped.parameters())
    counter = iter(range(10**9))

    def one_step():
        x, y = shard_batch(*step_batch(next(counter), config, batch_size, dev))
        marked_step(wrapped, opt, x, y)

    label = name or f"ddp_{variant}"
    folder = Path(trace_dir) if trace_dir is not None else TRACE_DIR
    prof = profile_steps(
        one_step,
        steps=steps,
        warmup=warmup,
        trace_path=folder / f"{label}_rank{rank}.json",
        name=label,
        top=top,
        device=dev,
        all_threads=all_threads,
    )
    if clock is not None:
        clock.remove()
    events = read_trace(prof.trace_path)
    steps_ev = _step_ranges(events)
    if steps_ev:
        lo, hi = steps_ev[0].start, max(e.end for e in steps_ev)
        events = [e for e in events if e.end > lo and e.start < hi]
    comm = [e for e in events if e.kind == "communication"]
    ran = _elsewhere(events, "communication")
    ov = overlap(events)
    running = busy(events, "communication")
    res = DDPTrace(
        title=f"rank {rank}: {variant} trace of {steps} step(s)"
        + (f" under {clock.name}" if clock is not None else " (real clock)"),
        rank=rank,
        variant=variant,
        trace_path=prof.trace_path,
        steps=steps,
        top_ops=prof.top_ops,
        overlap_s=ov,
        comm_s=running,
        comm_names=sorted({e.name for e in comm}),
    )
    res.checked += prof.checked
    res.condition(
        "collective ranges off the training thread",
        len(ran),
        len(ran) > 0,
        "> 0 (gloo's worker threads / a device stream)",
    )
    res.condition(
        "collectives running (ms, merged, per rank)",
        round(running * 1e3, 3),
        True,
        "shown, not asserted",
    )
    res.condition(
        "of which while backward computes (ms)",
        round(ov * 1e3, 3),
        True,
        "shown, not asserted",
    )
    return res


# --------------------------------------------------------------------------- memory over a step


def read_memory(path: str | os.PathLike, device_type: int = 0) -> tuple[list[float], list[int]]:
    """The allocator's ``[memory]`` events of a trace recorded with ``profile_memory=True``.

    Returns ``(times_s, allocated)``: seconds from the trace's first complete range (the axis of
    :func:`read_trace`) and the bytes allocated on that device *since profiling began*: the
    running sum of the events' ``Bytes`` (+ an allocation, − a free). Not their ``Total
    Allocated``: that is the allocator's counter when the event was made, and events of several
    threads (gloo's workers allocate too) reach the trace in another order than the counter
    moved. ``device_type``: 0 CPU, 1 CUDA (Kineto's numbering). Memory allocated before the
    profiler started is not tracked: its frees are not reported (Kineto warns once), so profile
    from a clean point.
    """
    mem, t0 = _memory_events(path, device_type)
    times = [(float(e["ts"]) - t0) / 1e6 for e in mem]
    return times, list(itertools.accumulate(int(e["args"]["Bytes"]) for e in mem))


def _memory_events(path, device_type: int) -> tuple[list[dict], float]:
    """The raw ``[memory]`` events of one device type, in time order, and the axis' origin (µs)."""
    ranges, _, _, _ = _load(path)
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    raw = data["traceEvents"] if isinstance(data, dict) else data
    mem = [
        e
        for e in raw
        if e.get("name") == "[memory]"
        and int((e.get("args") or {}).get("Device Type", -1)) == device_type
    ]
    mem.sort(key=lambda e: float(e["ts"]))
    t0 = min((float(e["ts"]) for e in ranges), default=float(mem[0]["ts"]) if mem else 0.0)
    return mem, t0


def unseen_frees(path: str | os.PathLike, device_type: int = 0) -> list[tuple[float, int, str]]:
    """Buffers of a collective whose free the trace lacks: ``[(free_s, bytes, call)]``.

    gloo runs a collective on a worker thread, which holds the work (and its buffers: FSDP2's
    all-gather output, the clone ``_reduce_scatter_base_`` all-reduces) until the work has run.
    The profiler records a free on that thread only inside the work's ``gloo:`` range; when the
    worker drops the last reference a moment after the range, after the training thread dropped
    its own, the free goes unrecorded — which thread is last is a race. Lost: a buffer the
    training thread made whose address the trace hands out again unfreed, or one it made inside
    a ``c10d::`` call (or right before an all-gather: its output) and the trace never frees;
    one made right before another call is held (a reduce-scatter's output: the gradient shard).
    It belongs to the ``c10d::`` call it was made in
    or, made before one, the next (``call``), and is freed when that call's ``gloo:`` range ends
    (``free_s``; no later than the address' reuse).
    """
    mem, t0 = _memory_events(path, device_type)
    live: dict = {}
    lost = []  # (allocation, when its address was handed out again: it was freed by then)
    for e in mem:
        a = e["args"]
        if int(a["Bytes"]) > 0:
            if a["Addr"] in live:
                lost.append((live[a["Addr"]], (float(e["ts"]) - t0) / 1e6))
            live[a["Addr"]] = e
        else:
            live.pop(a["Addr"], None)
    lost += [(e, None) for e in live.values()]
    if not lost:
        return []
    ranges, _, _, _ = _load(path)
    tids = {
        r.get("tid")
        for r in ranges
        if r.get("name") in MARKS or str(r.get("name", "")).startswith("ProfilerStep#")
    }
    events = read_trace(path)
    mains = training_threads(events)
    calls = sorted((e for e in events if e.thread in mains and e.name.startswith("c10d::")),
                   key=lambda e: e.start)  # fmt: skip
    works = sorted((e for e in events if e.thread not in mains and e.name.startswith("gloo:")),
                   key=lambda e: e.start)  # fmt: skip
    out = []
    for e, reused in lost:
        t = (float(e["ts"]) - t0) / 1e6
        call = next((c for c in calls if c.end >= t), None) if e.get("tid") in tids else None
        if reused is None and call is not None and call.start > t and "allgather" not in call.name:
            call = None  # never freed, made before the call: held (a gradient shard), not lost
        work = next((w for w in works if w.start >= call.start), None) if call else None
        if work is None:
            if reused is not None:  # freed unseen, when is unknown: by the reuse at the latest
                out.append((reused, int(e["args"]["Bytes"]), "?"))
            continue  # still held: not a lost free
        free_s = work.end if reused is None else min(work.end, reused)
        out.append((free_s, int(e["args"]["Bytes"]), call.name))
    return sorted(out)


@dataclass
class MemoryCurve(FieldAccess, Result):
    """What :func:`memory_curve` measured: bytes held over one training step, its peak and phases.

    ``times`` (s from the trace's start) and ``allocated`` (bytes: the model states held before
    the step + what the allocator handed out since, net of frees), ``phases``
    ``[(name, start_s, end_s)]`` from :func:`marked_step`'s marks, ``peak`` / ``peak_s`` /
    ``peak_phase``, ``states_before`` / ``states_after`` (:func:`course_lib.memory.model_state_bytes`),
    ``unseen``: :func:`unseen_frees`' ``[(free_s, bytes, call)]``, already applied to ``allocated``.
    """

    trace_path: str = ""
    times: list = field(default_factory=list)
    allocated: list = field(default_factory=list)
    phases: list = field(default_factory=list)
    peak: int = 0
    peak_s: float = 0.0
    peak_phase: str = ""
    states_before: dict = field(default_factory=dict)
    states_after: dict = field(default_factory=dict)
    unseen: list = field(default_factory=list)

    @property
    def trace_file(self) -> str:
        return relative(self.trace_path)

    def at_end_of(self, phase: str) -> int:
        """Bytes held at the end of the last ``phase`` range (``forward``, ``backward``, ``optimizer``)."""
        ends = [b for n, _, b in self.phases if n == phase]
        if not ends:
            raise ValueError(
                f"no {phase!r} range in the trace: phases {[n for n, _, _ in self.phases]}"
            )
        held = [a for t, a in zip(self.times, self.allocated, strict=True) if t <= ends[-1]]
        return held[-1] if held else self.states_before["total"]


def memory_curve(
    model,
    optimizer,
    x,
    y,
    *,
    name: str = "memory_curve",
    trace_path: str | os.PathLike | None = None,
    title: str | None = None,
) -> MemoryCurve:
    """Profile one :func:`marked_step` with ``profile_memory=True``; the bytes held over it.

    The gradients are set to None first, outside the profiler (their frees would otherwise
    happen inside it, untracked: the allocator only reports memory it saw allocated). The curve
    starts at the model states held then (parameters + optimizer state, counted by
    :func:`course_lib.memory.model_state_bytes`) and adds every allocation and free of the step
    on the inputs' device, and the frees gloo's worker threads made unrecorded
    (:func:`unseen_frees`; a row shows their bytes when there are any). Rows: the bytes the step
    left allocated equal the model states it added (the gradients, and on a first step Adam's
    moments), exactly. The trace goes to
    ``.cache/traces/<name>.json`` or ``trace_path``.
    """
    import gc

    from torch.profiler import profile

    from . import memory

    dev = torch.device(x.device)
    path = Path(trace_path) if trace_path is not None else TRACE_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    before = memory.model_state_bytes(model, optimizer)
    prof = profile(activities=_activities(dev), profile_memory=True)
    _sync(dev)
    with _quiet_stderr():
        prof.start()
    try:
        marked_step(model, optimizer, x, y)
        _sync(dev)
    finally:
        with _quiet_stderr():
            prof.stop()
    prof.export_chrome_trace(str(path))
    after = memory.model_state_bytes(model, optimizer)
    kind = 1 if dev.type == "cuda" else 0
    times, allocated = read_memory(path, device_type=kind)
    unseen = unseen_frees(path, device_type=kind)
    for free_s, nbytes, _ in unseen:  # the frees gloo's worker threads made unrecorded
        k = sum(t <= free_s for t in times)
        times.insert(k, free_s)
        allocated.insert(k, allocated[k - 1] if k else 0)
        allocated[k:] = [a - nbytes for a in allocated[k:]]
    held = [before["total"] + a for a in allocated]
    mains = training_threads(read_trace(path))
    phases = sorted(
        (
            (e.name, e.start, e.end)
            for e in read_trace(path)
            if e.name in MARKS and e.thread in mains
        ),
        key=lambda p: p[1],
    )
    i = max(range(len(held)), key=held.__getitem__) if held else 0
    peak = held[i] if held else before["total"]
    peak_s = times[i] if held else 0.0
    peak_phase = next((n for n, a, b in phases if a <= peak_s <= b), "")
    res = MemoryCurve(
        title=title or f"memory over one training step ({name})",
        trace_path=str(path),
        times=times,
        allocated=held,
        phases=phases,
        peak=peak,
        peak_s=peak_s,
        peak_phase=peak_phase,
        states_before=before,
        states_after=after,
        unseen=unseen,
    )
    if unseen:
        res.condition(
            "collective buffers freed unrecorded (bytes)",
            sum(b for _, b, _ in unseen),
            True,
            "freed when their gloo range ends (unseen_frees)",
        )
    res.exact(
        "bytes left allocated by the step",
        (held[-1] if held else before["total"]) - before["total"],
        after["total"] - before["total"],
        "model states added (memory.model_state_bytes after − before)",
    )
    return res


def draw_memory_curve(
    curve: MemoryCurve,
    ax=None,
    title: str | None = None,
    *,
    references: dict[str, float] | None = None,
):
    """Bytes held over the step (MB against ms), the phases shaded, the peak annotated.

    ``references``: ``{label: bytes}`` drawn as dashed horizontal lines (e.g. the meters' model
    states + activations). Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    t0 = curve.phases[0][1] if curve.phases else 0.0
    ms = [(t - t0) * 1e3 for t in curve.times]
    mb = [a / 1e6 for a in curve.allocated]
    seen = set()
    for name, a, b in curve.phases:
        label = name if name not in seen else None
        seen.add(name)
        ax.axvspan(
            (a - t0) * 1e3, (b - t0) * 1e3, color=COLORS[name], alpha=0.15, lw=0, label=label
        )
    ax.step(ms, mb, where="post", color="black", lw=1.2, label="allocated")
    ax.axhline(curve.states_before["total"] / 1e6, color="gray", ls=":", lw=1,
               label="model states before the step")  # fmt: skip
    for k, (label, v) in enumerate((references or {}).items()):
        ax.axhline(v / 1e6, color=f"C{k + 1}", ls="--", lw=1, label=label)
    pk = ((curve.peak_s - t0) * 1e3, curve.peak / 1e6)
    ax.plot(*pk, "o", color="crimson", ms=6)
    ax.annotate(
        f"peak {curve.peak / 1e6:.2f} MB ({curve.peak_phase or 'step'})",
        pk,
        xytext=(8, -4),
        textcoords="offset points",
        fontsize=8,
        va="top",
    )
    ax.set_xlabel("time from the start of the step (ms)")
    ax.set_ylabel("allocated (MB)")
    ax.set_ylim(0, max(mb + [0.0]) * 1.15 or 1.0)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def draw_ops(
    events: Sequence[TraceEvent],
    window: tuple[float, float],
    ax=None,
    title: str | None = None,
    *,
    max_depth: int = 5,
    chars: int = 120,
):
    """The training thread's ranges in ``window`` as a flame chart: one lane per nesting depth
    (depth 0: the phase marks; below them the ops each one called), coloured by kind; a range
    carries as much of its name as fits (``chars``: the characters the whole window holds). Returns the axes."""
    import matplotlib.pyplot as plt

    lo, hi = window
    mains = training_threads(events)
    evs = sorted(
        (
            e
            for e in events
            if e.thread in mains
            and e.end > lo
            and e.start < hi
            and e.duration > 0
            and not e.name.startswith(("ProfilerStep#", "PyTorch Profiler"))
        ),
        key=lambda e: (e.start, -e.duration),
    )
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 * max_depth + 1.2))
    stack: list[float] = []
    seen = set()
    for e in evs:
        while stack and stack[-1] <= e.start + 1e-9:
            stack.pop()
        depth = len(stack)
        stack.append(e.end)
        if depth >= max_depth:
            continue
        x0, x1 = (max(e.start, lo) - lo) * 1e3, (min(e.end, hi) - lo) * 1e3
        style = _style(e)
        seen.add(style)
        ax.broken_barh([(x0, x1 - x0)], (depth - 0.42, 0.84), facecolors=COLORS[style],
                       edgecolor="white", linewidth=0.3)  # fmt: skip
        fits = int((x1 - x0) / ((hi - lo) * 1e3) * chars)  # characters that fit in the bar
        if fits >= 6:
            name = e.name.replace("aten::", "").replace("autograd::engine::evaluate_function: ", "")
            ax.text(x0 + 0.01 * (hi - lo) * 1e3 / 10, depth, name.split("#")[0][: fits - 1],
                    fontsize=6.5, va="center", color="white", clip_on=True)  # fmt: skip
    ax.set_yticks(range(max_depth), ["phase marks"] + [f"depth {d}" for d in range(1, max_depth)])
    ax.set_ylim(max_depth - 0.5, -0.5)
    ax.set_xlim(0, (hi - lo) * 1e3)
    ax.set_xlabel("time from the start of the step (ms)")
    return _kinds_legend(ax, seen, title)
