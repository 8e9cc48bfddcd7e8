"""Pipeline schedules as data: which micro-batch each stage runs forward ("F") or backward ("B"), in order.

(Zero bubble splits backward in two: "B" the input gradient, "W" the weight gradient.)

A schedule is one stage's ordered list of :class:`Action` ``(op, microbatch, chunk)``:

* :func:`gpipe` — all forwards, then all backwards (Huang et al. 2019): ``m`` micro-batches alive.
* :func:`one_f_one_b` — ``p − 1 − stage`` warm-up forwards, then one forward / one backward
  (PipeDream-Flush, Narayanan et al. 2021): at most ``p − stage`` micro-batches alive, same bubble.
* :func:`interleaved_one_f_one_b` — ``v`` chunks per rank (virtual stages ``chunk·p + rank``):
  bubble ``(p−1)/(v·m+p−1)`` (Megatron-LM, Narayanan et al. 2021 §2.2.2), more messages.
* :func:`zero_bubble` — ZB-H1 (Qi et al. 2023): 1F1B's F / B order with B only the input gradient;
  each weight gradient W waits until the stage would otherwise idle. Idle ``(p−1)(F+B−W)`` per rank.

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
    "zero_bubble",
    "make_schedules",
    "check_schedule",
    "simulate",
    "peak_live_microbatches",
    "bubble_fractions",
    "SCHEDULES",
]


class Action(NamedTuple):
    """One step of a stage's schedule: ``op`` "F", "B" or "W" on ``microbatch`` (of ``chunk``, interleaving only).

    "B" is the whole backward, or only the input gradient when the schedule also has a "W" for that
    micro-batch (zero bubble: "W" is the weight gradient)."""

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


def zero_bubble(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """ZB-H1 zero bubble (Qi et al. 2023): 1F1B's F / B order, B = input gradient, W = weight gradient.

    Nothing downstream waits for a W, so each stage keeps its W's in a queue and runs one only where
    it would otherwise idle: when the next F or B waits for a peer (or would make more than ``p``
    micro-batches live, 1F1B's peak); the rest at the end. The order is found once, by list
    scheduling every stage together with equal unit costs F = B = W = 1 (the clock costs each
    at one forward). Idle per rank ``(p−1)(F+B−W)`` instead of 1F1B's ``(p−1)(F+B+W)``.
    """
    _check_args(num_stages, num_microbatches, stage)
    p = num_stages
    base = [one_f_one_b(p, num_microbatches, s) for s in range(p)]
    out: list[list[Action]] = [[] for _ in range(p)]
    pos, free, live = [0] * p, [0] * p, [0] * p
    deferred: list[list[int]] = [[] for _ in range(p)]
    done: dict[tuple, int] = {}  # (op, microbatch, stage) -> end time
    while any(pos[s] < len(base[s]) for s in range(p)):
        for s in sorted(range(p), key=lambda s: (free[s], s)):  # the stage free earliest moves
            if pos[s] == len(base[s]):
                continue
            a = base[s][pos[s]]
            dep = _dependency(a, s, p - 1)
            ready = 0 if dep is None else done.get(dep)
            waits = ready is None or ready > free[s] or (a.op == "F" and live[s] >= p)
            if waits and deferred[s]:  # fill the wait with a deferred W
                out[s].append(Action("W", deferred[s].pop(0)))
                free[s], live[s] = free[s] + 1, live[s] - 1
                break
            if ready is None:  # its peer has not run it yet: let another stage move
                continue
            free[s] = max(free[s], ready) + 1
            done[(a.op, a.microbatch, s)] = free[s]
            out[s].append(a)
            pos[s] += 1
            if a.op == "F":
                live[s] += 1
            else:
                deferred[s].append(a.microbatch)
            break
    return out[stage] + [Action("W", i) for i in deferred[stage]]


def _dependency(a: Action, s: int, last: int) -> tuple | None:
    """What action ``a`` on virtual stage ``s`` waits for: the previous stage's F, the next's B."""
    if a.op == "F" and s > 0:
        return ("F", a.microbatch, s - 1)
    if a.op == "B" and s < last:
        return ("B", a.microbatch, s + 1)
    return None


SCHEDULES: dict[str, Callable] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_one_f_one_b,
    "zero_bubble": zero_bubble,
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
    """One stage's rules: every (micro-batch, chunk) exactly one F and one B, and its F before its B.

    With W's (zero bubble) every (micro-batch, chunk) also has exactly one W, after its B.
    """
    where = "" if stage is None else f"stage {stage}: "
    seen_f, seen_b, seen_w = set(), set(), set()
    split = any(isinstance(a, tuple) and len(a) >= 2 and a[0] == "W" for a in actions)
    for i, a in enumerate(actions):
        if not isinstance(a, tuple) or len(a) < 2 or a[0] not in ("F", "B", "W"):
            raise ValueError(
                f"{where}action {i} = {a!r} is not an Action(op, microbatch) with op 'F', 'B' or 'W'"
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
        elif a.op == "W":
            if key not in seen_b:
                raise ValueError(
                    f"{where}action {i} = {a!r}: weight gradient before its backward (W needs the "
                    "gradients its B stored)"
                )
            if key in seen_w:
                raise ValueError(
                    f"{where}action {i} = {a!r}: the weight gradient of micro-batch {a.microbatch} "
                    "runs twice"
                )
            seen_w.add(key)
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
    if split and seen_w != seen_b:
        mb, c = min(seen_b - seen_w)
        raise ValueError(
            f"{where}micro-batch {mb}"
            + (f" (chunk {c})" if num_chunks > 1 else "")
            + " has no W: a schedule with W's splits every backward (one W per B)"
        )


class Event(NamedTuple):
    """One timeline entry of a rank: ``kind`` "F", "B", "W" or "wait", its micro-batch and chunk, seconds."""

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
    t_w: float = 1.0,
) -> list[list[Event]]:
    """Run all stages' schedules on paper: each F costs ``t_f``, each B ``t_b``, each W ``t_w``;
    communication is free (with W's, pass the input gradient's cost as ``t_b``).

    An F on virtual stage ``s`` starts when the rank is free *and* stage ``s−1`` has finished that
    micro-batch's F; a B when stage ``s+1`` has finished its B; a W only on its own B. Returns each rank's events (no
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
                dep = _dependency(a, s, last)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done[dep] if dep else 0.0)
                end = start + {"F": t_f, "B": t_b, "W": t_w}[a.op]
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
    """Most micro-batches whose forward ran and whose backward (B) has not, along one stage's actions.

    (Zero bubble: a micro-batch whose B ran still holds what its W needs until that W.)"""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1, "W": 0}[a[0]]
        peak = max(peak, live)
    return peak


def bubble_fractions(timelines: Sequence[Sequence[Event]]) -> list[float]:
    """Per rank: 1 − busy / (latest end on any rank − earliest start on any rank); busy = Σ F, B, W durations.

    The *bubble fraction* is the share of the whole step a rank spends idle. For GPipe and 1F1B with
    equal stages it is ``(p−1)/(m+p−1)`` (Megatron's papers quote ``(p−1)/m``: idle time / *ideal*
    time instead of / whole step).
    """
    work = [[e for e in tl if e.kind in ("F", "B", "W")] for tl in timelines]
    t0 = min(e.start for tl in work for e in tl)
    t1 = max(e.end for tl in work for e in tl)
    return [1.0 - sum(e.end - e.start for e in tl) / (t1 - t0) for tl in work]
