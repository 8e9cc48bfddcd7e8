"""Chapter 00's scaling race under the modelled accelerator clock (one α–β sweep, one race spawn).

* compute-bound (d=1024, batch 64): 2 ranks faster than 1 (min–max ranges separate), each variant
  within ±20 % of the step-time model (FLOPs / rate + real compute + the α–β all-reduce), and the
  layer sleeps ≥ 10× its real compute at the calibrated rate;
* communication-bound (d=256, batch 2): 2 ranks slower than 1 (median step longer).
"""

import pytest

from course_lib.experiments import collectives
from course_lib.launch import spawn

CASES = {"compute-bound": (1024, 64), "communication-bound": (256, 2)}


@pytest.fixture(scope="module")
def race():
    fit, _ = collectives.measure_alpha_beta(2, ops=("all_reduce",))
    cal = collectives.calibrate_rate(*CASES["compute-bound"])
    assert cal.ratio >= 10
    kwargs = dict(cases=CASES, rate=cal.rate, fit=fit, require_ratio=("compute-bound",))
    return spawn(collectives.scaling_race, 2, kwargs=kwargs)[0]


def _row(race, quantity):
    return next(r for r in race.checks() if r.quantity == quantity)


def test_compute_bound_two_ranks_faster_within_the_band(race):
    assert _row(race, "compute-bound: 2 ranks faster than 1").verdict, race.table()
    for v in ("1", "N"):
        assert _row(race, f"step time of {race.name('compute-bound', v)} (s)").verdict, race.table()


def test_compute_bound_sleeps_at_least_ten_times_its_real_compute(race):
    assert race.ratio["compute-bound"] >= 10, race.table()
    assert race.clock.startswith("modelled accelerator clock")


def test_communication_bound_two_ranks_slower(race):
    """By the medians: a step of a few ms, where one slow wake-up of gloo can make the ranges touch.

    Only the direction is a claim; how much slower depends on gloo's wake-ups under the machine's
    load (a CI run at load 3 measured 1.38x where a quiet one measured 3x), so no margin is asserted.
    """
    assert race.expect("communication-bound") == "slower"
    c = race.clocked.compare(
        race.name("communication-bound", "N"), race.name("communication-bound", "1")
    )
    assert c.ratio < 1, race.table()  # ratio = median(1 rank) / median(2 ranks)
