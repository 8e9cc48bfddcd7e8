"""Chapter 04's clocked Zero3 lesson: what the prediction is made of, and what the step is split into.

Structure only (timings are compared in the notebook and ``python -m course_lib.bench``, never
asserted here): each variant's prediction adds the clock's compute, the communication
``zero3_step`` leaves exposed and the host work measured without sleeping; the link is priced at
the sizes Zero3 sends; the waits count every collective of a step.
"""

from __future__ import annotations

import math

import pytest

from course_lib.experiments import fsdp_race
from course_lib.experiments.common import parallel_config
from course_lib.launch import spawn


def _clocked():
    config = parallel_config(d_model=64, n_layer=2, n_head=2, block_size=8)
    return fsdp_race.zero3_clocked(rounds=1, steps_per_round=1, ratio=4.0, config=config)


@pytest.fixture(scope="module")
def clocked():
    return spawn(_clocked, 2, timeout=600)


def test_every_rank_returns_the_same_prediction(clocked):
    a, b = clocked
    assert {n: p.total for n, p in a.predicted.items()} == {
        n: p.total for n, p in b.predicted.items()
    }


def test_each_prediction_is_compute_plus_exposed_communication_plus_host_work(clocked):
    res = clocked[0]
    assert list(res.predicted) == list(fsdp_race.CLOCKED_VARIANTS)
    for p in res.predicted.values():
        assert {"compute", "exposed all_gather + reduce_scatter", "host work"} <= set(p.parts)
        assert math.isclose(p.total, sum(p.parts.values()))
        assert p.parts["host work"] > 0
    # recompute adds one forward of the blocks to what the clock sleeps, nothing to prefetch's comm
    parts = {n: p.parts for n, p in res.predicted.items()}
    assert parts["prefetch + recompute"]["recompute"] > 0
    assert parts["prefetch"]["compute"] == parts["no prefetch"]["compute"]
    exposed = {n: v["exposed all_gather + reduce_scatter"] for n, v in parts.items()}
    assert exposed["prefetch"] < exposed["no prefetch"]
    assert res.host_recompute == pytest.approx(
        parts["prefetch + recompute"]["host work"] - parts["prefetch"]["host work"]
    )


def test_the_link_is_priced_at_the_sizes_zero3_sends(clocked):
    links = clocked[0].links
    assert set(links.alpha_s) == {"all_gather", "reduce_scatter"}
    for op in links.alpha_s:
        assert links.predict(op, links.min_bytes) > 0
        assert links.points[op] == 2  # the root's size and a block's


def test_the_breakdown_splits_each_variant_measured_and_predicted(clocked):
    res = clocked[0]
    text = res.breakdown()
    for name in fsdp_race.CLOCKED_VARIANTS:
        assert f"{name}, measured" in text and f"{name}, predicted" in text
        assert set(res.waits[name]) == {"all_gather", "reduce_scatter"}
        assert res.slept[name] > 0
