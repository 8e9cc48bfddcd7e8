"""DP × PP × TP on one mesh (experiments/parallel_3d.py): every rank's shard equals one device."""

import pytest

from course_lib.experiments.parallel_3d import dp_pp_tp_training, mesh_3d
from course_lib.launch import RankError, spawn


def _mesh_error():
    mesh_3d(pp=2, dp=1, tp=2)


def test_a_mesh_that_does_not_cover_the_world_is_refused_naming_the_sizes():
    with pytest.raises(RankError, match=r"pp=2 × dp=1 × tp=2 = 4 ≠ world_size=2"):
        spawn(_mesh_error, 2, timeout=60)


@pytest.mark.timeout(300)
def test_pp_2_by_tp_2_on_4_ranks_equals_one_device_after_adamw_steps():
    results = spawn(dp_pp_tp_training, 4, kwargs=dict(pp=2, tp=2, steps=3), timeout=240)
    assert [(r.stage, r.replica, r.k) for r in results] == [
        (0, 0, 0),
        (0, 0, 1),
        (1, 0, 0),
        (1, 0, 1),
    ]
    for r in results:
        r.assert_passed()  # the shard within ADAMW, 4 TP all-reduces per block and micro-batch, no DP
    assert [r.dp_allreduces for r in results] == [0, 0, 0, 0]
    assert results[0].losses == [None] * 3 and all(loss is not None for loss in results[-1].losses)


@pytest.mark.timeout(600)
def test_dp_2_by_pp_2_by_tp_2_on_8_ranks_equals_one_device():
    results = spawn(
        dp_pp_tp_training, 8, kwargs=dict(pp=2, tp=2, steps=2, optimizer="sgd"), timeout=500
    )
    for r in results:
        r.assert_passed()  # the shard within SGD, TP and DP all-reduce counts exact
    assert {r.replica for r in results} == {0, 1} and all(r.dp_allreduces > 0 for r in results)
    last = [r.losses for r in results if r.stage == 1]
    assert all(
        loss == last[0] for loss in last[:2]
    )  # the two TP ranks of a replica's last stage agree
