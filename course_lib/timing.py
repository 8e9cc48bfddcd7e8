"""The course's one timing helper: time variants fairly, report what the machine can tell apart.

    t = time_steps({"ddp": ddp_step, "fsdp2": fsdp_step}, rounds=5, clock=clock)
    print(t)                      # clock · rounds · load, each variant's median [min–max]
    t.compare("ddp", "fsdp2")     # "ddp is faster than fsdp2 (...)" only when the ranges separate
    t["ddp"].median               # seconds per step; t.medians(), t.samples() as plain dicts

The contract
------------
* Warm-up. Each variant runs ``warmup`` times first, untimed (first calls allocate, build
  buckets, compile kernels).
* Interleaved rounds. Each of ``rounds`` rounds runs every variant once (``steps_per_round``
  steps, timed together, divided by their number), in an order rotated by one each round. A
  noisy neighbour, a frequency dip or a garbage collection then hits every variant alike,
  instead of all of one variant's steps.
* Everyone starts together. When ``torch.distributed`` is initialised, a barrier precedes each
  timed block; without it (one process) the same code times locally.
* The clock is read after the device is idle. On CUDA, kernels run asynchronously: reading
  the clock returns while they still run. ``torch.cuda.synchronize()`` comes BEFORE each read,
  at the start and at the end of a block, so a block is charged exactly its own kernels.
* Max over ranks. A synchronous step lasts as long as its slowest rank: each round's time is
  the max over ranks (one ``all_reduce(MAX)`` on :func:`launch.device` after the last round,
  outside every timed block). Every rank returns the same numbers.
* Median and range. A variant is reported as the median over rounds, with the min–max range
  beside it (``"12.3 ms [11.9–13.1]"``): the median resists one disturbed round, the range
  shows how far this machine's rounds disagree.
* Verdicts. "a is faster than b" is said only when the ranges separate (a's slowest round is
  faster than b's fastest, :func:`separate`); otherwise "a and b are indistinguishable on this
  machine". On a 2-core laptop shared with other programs the ranks and gloo's threads compete
  for the same cores, a round can take twice the next one, and two variants 5 % apart overlap:
  saying "indistinguishable" then is the honest answer, not a failure to measure — a claim
  read off two medians would flip from run to run. Under the modelled accelerator clock
  (:mod:`course_lib.clock`) the modelled compute dominates and differences of design separate.
* What the numbers stood on. The load average before and after (``os.getloadavg()``, 1 min),
  the cores, the world size and the clock's name (``"real clock"`` without a clock or with it
  off) are kept and printed in the header line of the table.
* Predictions. ``predicted={name: seconds}`` adds a row per name: the measured median within
  :data:`AGREEMENT_BAND` of the prediction (the step-time model, :mod:`course_lib.step_time`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable

import torch
import torch.distributed as dist

from . import launch
from .results import MappingReader, Result, Row

__all__ = [
    "AGREEMENT_BAND",
    "Timing",
    "Comparison",
    "Timings",
    "separate",
    "compare",
    "format_seconds",
    "time_steps",
]

AGREEMENT_BAND = 0.20
"""The course's one agreement band: a measured step time within ±20 % of its prediction agrees.

Why 20 %. Under the modelled accelerator clock a step's time is its modelled compute (sleeps,
accurate to ~2 % per 200 sleeps, see :mod:`course_lib.clock`) plus what the model leaves out:
Python dispatch, the optimizer, gloo's copies, and the scheduling noise of 2 shared cores, which
together stay under about a tenth of a step at the calibrated rate. ±20 % leaves about 2× room
above that, while a prediction that misses a mechanism — an all-reduce that does not overlap, a
recompute not counted, a bubble — is off by 30 % or more. :mod:`course_lib.step_time` and every
notebook import this one value; none chooses its own.
"""

_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))


def _unit(seconds: float) -> tuple[float, str]:
    """The unit a time reads best in: the largest in which it is ≥ 1."""
    for scale, name in _UNITS:
        if abs(seconds) >= scale:
            return scale, name
    return _UNITS[-1]


def _digits(value: float) -> int:
    """Decimals that give a value in [1, 1000) three significant digits."""
    if value == 0 or not math.isfinite(value):
        return 1
    return max(0, 2 - int(math.floor(math.log10(abs(value)))))


def format_seconds(seconds: float) -> str:
    """``0.0123`` → ``"12.3 ms"``, ``4.5e-5`` → ``"45.0 µs"``, ``2.0`` → ``"2.00 s"``."""
    scale, unit = _unit(seconds)
    v = seconds / scale
    return f"{v:.{_digits(v)}f} {unit}"


def separate(a: Iterable[float], b: Iterable[float]) -> int:
    """-1 when a's range lies below b's (max a < min b: a is faster), +1 above, 0 when they overlap."""
    a, b = list(a), list(b)
    if not a or not b:
        raise ValueError("separate() needs at least one sample on each side")
    if max(a) < min(b):
        return -1
    if min(a) > max(b):
        return 1
    return 0


# --------------------------------------------------------------------------- one variant


@dataclass(frozen=True)
class Timing:
    """One variant's seconds per step, one sample per round (max over ranks)."""

    samples: tuple[float, ...]

    def __post_init__(self):
        if not self.samples:
            raise ValueError("a Timing needs at least one sample")
        object.__setattr__(self, "samples", tuple(float(s) for s in self.samples))

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def lo(self) -> float:
        return min(self.samples)

    @property
    def hi(self) -> float:
        return max(self.samples)

    def range_text(self) -> str:
        """``"[11.9–13.1 ms]"``: min–max in the unit of the median."""
        return "[" + self._parts()[1] + " " + self._parts()[2] + "]"

    def _parts(self) -> tuple[str, str, str]:
        scale, unit = _unit(self.median)
        d = _digits(self.median / scale)
        med, lo, hi = (f"{v / scale:.{d}f}" for v in (self.median, self.lo, self.hi))
        return med, f"{lo}–{hi}", unit

    def __str__(self) -> str:
        med, span, unit = self._parts()
        return f"{med} {unit} [{span}]"


# --------------------------------------------------------------------------- two variants


@dataclass(frozen=True)
class Comparison:
    """Two timings compared by their ranges; ``verdict`` says only what the ranges support."""

    a: str
    b: str
    timing_a: Timing
    timing_b: Timing

    @property
    def sign(self) -> int:
        """:func:`separate` of the two: -1 a faster, +1 a slower, 0 indistinguishable."""
        return separate(self.timing_a.samples, self.timing_b.samples)

    @property
    def separated(self) -> bool:
        return self.sign != 0

    @property
    def ratio(self) -> float:
        """median b / median a (> 1: a is quicker by the medians, whether or not that separates)."""
        return self.timing_b.median / self.timing_a.median

    @property
    def verdict(self) -> str:
        ranges = f"ranges {self.timing_a.range_text()} vs {self.timing_b.range_text()}"
        if self.sign == 0:
            return f"{self.a} and {self.b} are indistinguishable on this machine ({ranges} overlap)"
        word = "faster" if self.sign < 0 else "slower"
        factor = max(self.ratio, 1 / self.ratio)  # the slower median over the faster one
        return f"{self.a} is {word} than {self.b} (×{factor:.2f}, {ranges} separate)"

    def __str__(self) -> str:
        return self.verdict


def compare(name_a: str, a: Timing, name_b: str, b: Timing) -> Comparison:
    """:class:`Comparison` of two timings (what :meth:`Timings.compare` returns)."""
    return Comparison(name_a, name_b, a, b)


# --------------------------------------------------------------------------- all variants


@dataclass
class Timings(MappingReader, Result):
    """``time_steps``' result: ``{name: Timing}`` and what they were measured on, as a table.

    Reads like a dict of timings (``t["ddp"]``, ``"ddp" in t``, ``list(t)``); :meth:`medians` and
    :meth:`samples` give plain ``{name: seconds}`` / ``{name: [seconds per round]}``. Rows: one
    per ``predicted`` name (the median within :data:`AGREEMENT_BAND`), plus any added with
    :meth:`compare_row` or the :class:`Result` methods.
    """

    timings: dict[str, Timing] = field(default_factory=dict)
    rounds: int = 0
    steps_per_round: int = 1
    warmup: int = 0
    clock: str = "real clock"
    load_before: float = float("nan")  # 1-minute load average when timing began
    load_after: float = float("nan")
    cores: int = 0
    world_size: int = 1
    predicted: dict[str, float] = field(default_factory=dict)

    _reads: ClassVar[str] = "timings"  # read like a dict of timings (results.MappingReader)

    def _missing(self, name) -> str:
        return f"{name!r} was not timed: timed {list(self.timings)}"

    def medians(self) -> dict[str, float]:
        return {name: t.median for name, t in self.timings.items()}

    def samples(self) -> dict[str, list[float]]:
        return {name: list(t.samples) for name, t in self.timings.items()}

    # -- comparing
    def compare(self, a: str, b: str) -> Comparison:
        return compare(a, self[a], b, self[b])

    def compare_row(self, a: str, b: str, expect: str = "faster") -> Row:
        """A row: the ranges of ``a`` and ``b`` separate in the ``expect``-ed direction."""
        if expect not in ("faster", "slower"):
            raise ValueError(f"expect={expect!r}: use 'faster' or 'slower'")
        c = self.compare(a, b)
        want = -1 if expect == "faster" else 1
        return self.condition(
            f"{a} {expect} than {b}",
            f"{c.timing_a} vs {c.timing_b}",
            c.sign == want,
            f"min–max ranges separate, {a} {expect}",
        )

    # -- the table
    def checks(self) -> list[Row]:
        rows = [
            Row(
                f"step time of {name} (s)",
                self[name].median,
                want,
                "predicted",
                f"within ±{AGREEMENT_BAND:.0%}",
                abs(self[name].median - want) <= AGREEMENT_BAND * abs(want),
            )
            for name, want in self.predicted.items()
        ]
        return rows + list(self.checked)

    def header(self) -> str:
        """``"modelled accelerator clock, 2.0 GFLOP/s · 5 rounds · load 0.4→0.6 on 2 cores"``."""
        steps = f" × {self.steps_per_round} steps" if self.steps_per_round > 1 else ""
        ranks = f" · {self.world_size} ranks" if self.world_size > 1 else ""
        return (
            f"{self.clock} · {self.rounds} rounds{steps}{ranks} · "
            f"load {self.load_before:.1f}→{self.load_after:.1f} on {self.cores} cores"
        )

    def table(self) -> str:
        lines = [self.title] if self.title else []
        lines.append(self.header())
        width = max((len(n) for n in self.timings), default=0)
        lines += [f"  {name:<{width}}  {t}" for name, t in self.timings.items()]
        if self.checks():
            body = Result.table(self)
            lines.append(body.split("\n", 1)[1] if self.title else body)
        return "\n".join(lines)


# --------------------------------------------------------------------------- timing


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return float("nan")


def _read_clock(cuda: bool) -> float:
    """The time after the device is idle: synchronize first, then read the clock."""
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def time_steps(
    steps: dict[str, Callable[[], object]],
    rounds: int = 5,
    steps_per_round: int = 1,
    warmup: int = 1,
    group=None,
    device=None,
    clock=None,
    predicted: dict[str, float] | None = None,
    title: str = "",
) -> Timings:
    """Time ``{name: one_step()}`` as the module docstring says; returns :class:`Timings`.

    ``device`` (default :func:`launch.device`) decides whether to synchronize CUDA before reading
    the clock; ``clock`` (an :class:`~course_lib.clock.AcceleratorClock` or None) is recorded by
    name; ``predicted`` ``{name: seconds}`` adds agreement rows. Every rank must call it with the
    same names in the same order (the barriers and the max over ranks are collectives).
    """
    if not steps:
        raise ValueError("time_steps needs at least one step to time")
    if rounds < 1 or steps_per_round < 1 or warmup < 0:
        raise ValueError(
            f"rounds={rounds}, steps_per_round={steps_per_round} must be ≥ 1, warmup={warmup} ≥ 0"
        )
    unknown = sorted(set(predicted or {}) - set(steps))
    if unknown:
        raise ValueError(f"predicted names {unknown} are not timed: timed {list(steps)}")
    distributed = dist.is_available() and dist.is_initialized()
    cuda = torch.device(device if device is not None else launch.device()).type == "cuda"
    names = list(steps)
    load_before = _load()
    for name in names:
        for _ in range(warmup):
            steps[name]()
    local = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if distributed:
                dist.barrier(group=group)
            t0 = _read_clock(cuda)
            for _ in range(steps_per_round):
                steps[name]()
            local[name].append((_read_clock(cuda) - t0) / steps_per_round)
    per_round = torch.tensor([local[n] for n in names], dtype=torch.float64)
    world = 1
    if distributed:  # a synchronous step lasts as long as its slowest rank
        per_round = per_round.to(launch.device())
        dist.all_reduce(per_round, op=dist.ReduceOp.MAX, group=group)
        world = dist.get_world_size(group)
    per_round = per_round.cpu().tolist()
    return Timings(
        title=title,
        timings={name: Timing(tuple(per_round[i])) for i, name in enumerate(names)},
        rounds=rounds,
        steps_per_round=steps_per_round,
        warmup=warmup,
        clock="real clock" if clock is None else clock.name,
        load_before=load_before,
        load_after=_load(),
        cores=os.cpu_count() or 0,
        world_size=world,
        predicted=dict(predicted or {}),
    )
