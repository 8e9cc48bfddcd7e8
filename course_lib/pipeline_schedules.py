"""Pipeline schedules as data: which micro-batch each stage runs forward ("F") or backward ("B"), in order.

A schedule is one stage's ordered list of :class:`Action` ``(op, microbatch, chunk)``:

* :func:`gpipe` — all forwards, then all backwards (Huang et al. 2019): ``m`` micro-batches alive.
* :func:`one_f_one_b` — ``p − 1 − stage`` warm-up forwards, then one forward / one backward
  (PipeDream-Flush, Narayanan et al. 2021): at most ``p − stage`` micro-batches alive, same bubble.
* :func:`interleaved_one_f_one_b` — ``v`` chunks per rank (virtual stages ``chunk·p + rank``):
  bubble ``(p−1)/(v·m+p−1)`` (Megatron-LM, Narayanan et al. 2021 §2.2.2), more messages.

:func:`check_schedule` checks one stage's rules (every F before its B, each once) and :func:`simulate`
the dependencies across stages with unit costs (F = 1, B = 2): a schedule that would deadlock is
rejected before any rank runs it. :func:`bubble_fractions` measures idle time / whole step time
per rank from a timeline of :class:`Event` s. The runner that executes schedules is ``pipeline.py``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

__all__ = [
    "Action",
    "Event",
    "check_microbatches",
    "gpipe",
    "one_f_one_b",
    "interleaved_one_f_one_b",
    "make_schedules",
    "check_schedule",
    "simulate",
    "peak_live_microbatches",
    "bubble_fractions",
    "SCHEDULES",
]


class Action(NamedTuple):
    """One step of a stage's schedule: ``op`` "F" or "B" on ``microbatch`` (of ``chunk``, interleaving only)."""

    op: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.op}{self.microbatch}" + (f"@{self.chunk}" if self.chunk else "")


def check_microbatches(num_microbatches) -> None:
    """Raise unless ``num_microbatches`` is an int ≥ 1 (the schedules and the batch split)."""
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or num_microbatches < 1
    ):
        raise ValueError(f"num_microbatches={num_microbatches!r} must be an int >= 1")


def _check_args(num_stages, num_microbatches, stage) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be an int >= 1")
    check_microbatches(num_microbatches)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage={stage} must be in 0 … num_stages−1 = {num_stages - 1}")


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """GPipe: every forward, then every backward. All ``m`` micro-batches are alive at once."""
    _check_args(num_stages, num_microbatches, stage)
    m = num_microbatches
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """1F1B: ``p − 1 − stage`` warm-up forwards, then one forward / one backward, then the remaining backwards.

    Stage ``k`` never holds more than ``p − k`` micro-batches' activations (GPipe: ``m``); the bubble
    is GPipe's, ``(p−1)/(m+p−1)``.
    """
    _check_args(num_stages, num_microbatches, stage)
    m = num_microbatches
    warmup = min(num_stages - 1 - stage, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(
        m - warmup
    ):  # steady state: the forward of micro-batch warmup+i, the backward of i
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(m - warmup, m)]
    return actions


def interleaved_one_f_one_b(
    num_stages: int, num_microbatches: int, stage: int, num_chunks: int = 2
) -> list[Action]:
    """Interleaved 1F1B (Megatron-LM): rank ``stage`` runs chunks ``c`` = virtual stages ``c·p + stage``.

    Micro-batches go round in groups of ``p``: forward number ``k`` is micro-batch
    ``(k // (p·v))·p + k % p`` on chunk ``(k // p) % v``; backwards walk the chunks in reverse. Warm-up:
    ``2·(p − 1 − stage) + (v − 1)·p`` forwards. Bubble ``(p−1)/(v·m+p−1)``; activations and gradients
    cross ranks ``v`` times as often.
    """
    _check_args(num_stages, num_microbatches, stage)
    p, m, v = num_stages, num_microbatches, num_chunks
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"num_chunks={v!r} must be an int >= 1")
    if m % p:
        raise ValueError(
            f"interleaved 1F1B needs num_microbatches divisible by num_stages: m={m}, p={p} "
            "(micro-batches go round the ranks in groups of p)"
        )
    total = m * v

    def fwd(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warmup = min(2 * (p - 1 - stage) + (v - 1) * p, total)
    actions = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [fwd(warmup + i), bwd(i)]
    actions += [bwd(k) for k in range(total - warmup, total)]
    return actions


SCHEDULES: dict[str, Callable] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_one_f_one_b,
}


def make_schedules(
    schedule, num_stages: int, num_microbatches: int, **kwargs
) -> list[list[Action]]:
    """Every stage's action list: ``schedule`` is a name in :data:`SCHEDULES` or a generator function."""
    fn = SCHEDULES.get(schedule) if isinstance(schedule, str) else schedule
    if fn is None:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {sorted(SCHEDULES)}")
    return [list(fn(num_stages, num_microbatches, s, **kwargs)) for s in range(num_stages)]


def check_schedule(
    actions: Sequence[Action], num_microbatches: int, num_chunks: int = 1, stage: int | None = None
):
    """One stage's rules: every (micro-batch, chunk) exactly one F and one B, and its F before its B."""
    where = "" if stage is None else f"stage {stage}: "
    seen_f, seen_b = set(), set()
    for i, a in enumerate(actions):
        if not isinstance(a, tuple) or len(a) < 2 or a[0] not in ("F", "B"):
            raise ValueError(
                f"{where}action {i} = {a!r} is not an Action(op, microbatch) with op 'F' or 'B'"
            )
        a = Action(*a)
        if not (0 <= a.microbatch < num_microbatches and 0 <= a.chunk < num_chunks):
            raise ValueError(
                f"{where}action {i} = {a!r}: micro-batch must be in 0…{num_microbatches - 1} and "
                f"chunk in 0…{num_chunks - 1}"
            )
        key = (a.microbatch, a.chunk)
        if a.op == "F":
            if key in seen_f:
                raise ValueError(
                    f"{where}action {i} = {a!r}: the forward of micro-batch {a.microbatch} runs twice"
                )
            seen_f.add(key)
        else:
            if key not in seen_f:
                raise ValueError(
                    f"{where}action {i} = {a!r}: backward before its forward (a micro-batch's F must "
                    "come before its B on the same stage)"
                )
            if key in seen_b:
                raise ValueError(
                    f"{where}action {i} = {a!r}: the backward of micro-batch {a.microbatch} runs twice"
                )
            seen_b.add(key)
    missing = {(mb, c) for mb in range(num_microbatches) for c in range(num_chunks)} - seen_b
    if missing:
        mb, c = min(missing)
        raise ValueError(
            f"{where}micro-batch {mb}"
            + (f" (chunk {c})" if num_chunks > 1 else "")
            + " never runs its forward and backward (every micro-batch needs one F and one B)"
        )


class Event(NamedTuple):
    """One timeline entry of a rank: ``kind`` "F", "B" or "wait", its micro-batch and chunk, seconds."""

    kind: str
    microbatch: int
    chunk: int
    start: float
    end: float


def simulate(
    schedules: Sequence[Sequence[Action]],
    num_microbatches: int,
    num_chunks: int = 1,
    t_f: float = 1.0,
    t_b: float = 2.0,
) -> list[list[Event]]:
    """Run all stages' schedules on paper: each F costs ``t_f``, each B ``t_b``, communication is free.

    An F on virtual stage ``s`` starts when the rank is free *and* stage ``s−1`` has finished that
    micro-batch's F; a B when stage ``s+1`` has finished its B. Returns each rank's events (no
    waits). Raises ``ValueError`` if a schedule breaks a stage's rules or the stages wait on each other
    forever (the dependencies across stages cannot be met in these orders).
    """
    p, v = len(schedules), num_chunks
    for r, acts in enumerate(schedules):
        check_schedule(acts, num_microbatches, v, stage=r)
    last = p * v - 1
    done: dict[tuple, float] = {}  # (op, microbatch, virtual stage) -> end time
    free = [0.0] * p
    pos = [0] * p
    events: list[list[Event]] = [[] for _ in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(schedules[r]):
                a = Action(*schedules[r][pos[r]])
                s = a.chunk * p + r
                dep = None
                if a.op == "F" and s > 0:
                    dep = ("F", a.microbatch, s - 1)
                elif a.op == "B" and s < last:
                    dep = ("B", a.microbatch, s + 1)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep else 0.0)
                end = start + (t_f if a.op == "F" else t_b)
                done[(a.op, a.microbatch, s)] = free[r] = end
                events[r].append(Event(a.op, a.microbatch, a.chunk, start, end))
                pos[r] += 1
                progress = True
    stuck = [r for r in range(p) if pos[r] < len(schedules[r])]
    if stuck:
        waits = ", ".join(f"stage {r} at {Action(*schedules[r][pos[r]])!r}" for r in stuck)
        raise ValueError(
            f"the schedules deadlock: {waits} each wait for a micro-batch another stage has not "
            "produced (an F needs the previous stage's F, a B the next stage's B)"
        )
    return events


def peak_live_microbatches(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not, along one stage's actions."""
    live = peak = 0
    for a in actions:
        live += 1 if a[0] == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_fractions(timelines: Sequence[Sequence[Event]]) -> list[float]:
    """Per rank: 1 − busy / (latest end on any rank − earliest start on any rank); busy = Σ F and B durations.

    The *bubble fraction* is the share of the whole step a rank spends idle. For GPipe and 1F1B with
    equal stages it is ``(p−1)/(m+p−1)`` (Megatron's papers quote ``(p−1)/m``: idle time / *ideal*
    time instead of / whole step).
    """
    work = [[e for e in tl if e.kind in ("F", "B")] for tl in timelines]
    t0 = min(e.start for tl in work for e in tl)
    t1 = max(e.end for tl in work for e in tl)
    return [1.0 - sum(e.end - e.start for e in tl) / (t1 - t0) for tl in work]
