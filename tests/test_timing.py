"""The course's timing helper (course_lib/timing.py).

* verdicts from ranges: separated faster, separated slower, overlapping → indistinguishable;
* ``Timing``'s text: median [min–max] in one unit;
* ``time_steps`` in one process: warm-up and round counts, the order rotated each round,
  predicted rows within the agreement band, the header naming clock, rounds and load;
* on CUDA the device is synchronized BEFORE the clock is read, at both ends of a block;
* on 2 gloo ranks a round lasts as long as its slowest rank (one rank sleeps 30 ms more).
"""

import math
import time

import pytest
import torch

from course_lib import timing
from course_lib.launch import spawn
from course_lib.timing import AGREEMENT_BAND, Timing, Timings, separate, time_steps

FAST = [0.010, 0.011, 0.012]
SLOW = [0.020, 0.021, 0.025]
MIDDLE = [0.0115, 0.013, 0.021]  # overlaps both


def timings(**samples) -> Timings:
    return Timings(timings={k: Timing(tuple(v)) for k, v in samples.items()}, rounds=3)


# --------------------------------------------------------------------------- verdicts


def test_separate_says_which_range_lies_below():
    assert separate(FAST, SLOW) == -1
    assert separate(SLOW, FAST) == 1
    assert separate(FAST, MIDDLE) == 0 and separate(MIDDLE, SLOW) == 0
    assert separate([1.0], [1.0]) == 0, "touching ranges do not separate"
    with pytest.raises(ValueError, match="at least one sample"):
        separate([], FAST)


def test_compare_claims_a_speed_only_when_the_ranges_separate():
    t = timings(fast=FAST, slow=SLOW, middle=MIDDLE)
    faster = t.compare("fast", "slow")
    assert faster.separated and faster.sign == -1
    assert faster.ratio == pytest.approx(0.021 / 0.011)
    assert faster.verdict.startswith("fast is faster than slow (×1.91, ranges [")
    slower = t.compare("slow", "fast")
    assert slower.separated and slower.verdict.startswith("slow is slower than fast (×1.91")
    same = t.compare("fast", "middle")
    assert not same.separated
    assert same.verdict.startswith("fast and middle are indistinguishable on this machine")


def test_compare_row_passes_only_in_the_expected_direction():
    t = timings(fast=FAST, slow=SLOW, middle=MIDDLE)
    assert t.compare_row("fast", "slow", expect="faster").verdict
    assert not t.compare_row("fast", "slow", expect="slower").verdict
    assert t.compare_row("slow", "fast", expect="slower").verdict
    assert not t.compare_row("fast", "middle", expect="faster").verdict
    assert [r.verdict for r in t.checks()] == [True, False, True, False]
    with pytest.raises(ValueError, match="'faster' or 'slower'"):
        t.compare_row("fast", "slow", expect="quicker")


def test_timing_text_uses_one_unit_for_median_and_range():
    assert str(Timing((0.0123, 0.0119, 0.0131))) == "12.3 ms [11.9–13.1]"
    assert str(Timing((4.5e-5, 4.0e-5, 5.0e-5))) == "45.0 µs [40.0–50.0]"
    assert str(Timing((2.0, 1.5, 2.5))) == "2.00 s [1.50–2.50]"
    t = Timing((0.3, 0.1, 0.2))
    assert (t.median, t.lo, t.hi) == (0.2, 0.1, 0.3)
    assert t.range_text() == "[100–300 ms]"


def test_predicted_rows_use_the_agreement_band():
    assert AGREEMENT_BAND == 0.20
    t = timings(a=[0.10, 0.11, 0.12], b=[0.10, 0.11, 0.12])
    t.predicted = {"a": 0.11 / (1 + AGREEMENT_BAND) * 1.01, "b": 0.11 / (1 + AGREEMENT_BAND) * 0.99}
    assert [r.verdict for r in t.checks()] == [True, False]
    assert t.checks()[0].quantity == "step time of a (s)"
    assert not t.passed


# --------------------------------------------------------------------------- timing in one process


def test_time_steps_warms_up_then_rotates_the_order_each_round():
    calls = []
    steps = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    t = time_steps(steps, rounds=4, steps_per_round=2, warmup=1, device="cpu")
    assert calls[:3] == ["a", "b", "c"], "one warm-up call each"
    orders = ["abc", "bca", "cab", "abc"]
    assert calls[3:] == [n for order in orders for n in order for _ in range(2)], (
        "each round runs every variant's 2 steps back to back, the order rotated by one"
    )
    assert list(t) == ["a", "b", "c"] and all(len(t[n].samples) == 4 for n in t)
    assert t.samples()["a"] == list(t["a"].samples) and t.medians()["a"] == t["a"].median
    assert (t.rounds, t.steps_per_round, t.warmup, t.world_size) == (4, 2, 1, 1)
    head = t.header()
    assert head.startswith("real clock · 4 rounds × 2 steps · load ") and "cores" in head
    assert math.isfinite(t.load_before) and math.isfinite(t.load_after) and t.cores >= 1


def test_time_steps_names_the_clock_and_checks_its_arguments():
    class Clock:  # what time_steps reads of an AcceleratorClock: its name
        name = "modelled accelerator clock, 2.0 GFLOP/s"

    t = time_steps({"a": lambda: None}, rounds=1, warmup=0, clock=Clock(), title="T")
    assert str(t).splitlines()[0] == "T"
    assert str(t).splitlines()[1] == t.header()
    assert t.header().startswith(f"{Clock.name} · 1 rounds · load ")
    with pytest.raises(ValueError, match="not timed"):
        time_steps({"a": lambda: None}, predicted={"b": 1.0})
    with pytest.raises(ValueError, match="must be ≥ 1"):
        time_steps({"a": lambda: None}, rounds=0)


def test_cuda_blocks_synchronize_before_reading_the_clock(monkeypatch):
    events = []
    real = time.perf_counter
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: events.append("sync"))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: events.append("clock") or real())
    time_steps({"a": lambda: events.append("step")}, rounds=2, warmup=0, device="cuda")
    assert events == ["sync", "clock", "step", "sync", "clock"] * 2


# --------------------------------------------------------------------------- two ranks


def _slow_rank_one():
    import torch.distributed as dist

    extra = 0.030 if dist.get_rank() == 1 else 0.0
    t = time_steps({"a": lambda: time.sleep(0.001 + extra)}, rounds=3, warmup=1)
    return t.samples()["a"], t.world_size, t.load_before, t.load_after, t.cores


def test_a_round_lasts_as_long_as_the_slowest_rank():
    per_rank = spawn(_slow_rank_one, 2, backend="gloo")
    samples, world, before, after, cores = per_rank[0]
    assert all(s >= 0.030 for s in samples), f"rank 0 reported its own time: {samples}"
    assert per_rank[1][0] == samples, "every rank returns the max over ranks"
    assert world == 2 and math.isfinite(before) and math.isfinite(after) and cores >= 1
