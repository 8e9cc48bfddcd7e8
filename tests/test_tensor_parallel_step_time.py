"""Chapter 06's TP-vs-DP step times under the modelled clock, and the exercise's layered hints.

One spawn of 2 ranks, one round at a global batch of 2: the timed variants and what a prediction
needs (each variant's forward parts, DP's buckets, TP's all-reduces counted by ``CommLog``). No
assertion on the times themselves: the notebook displays them against the step-time model, and a
2-core machine shared with other tests does not keep a ±20 % band.
"""

import pytest

from course_lib import step_time as st
from course_lib.checks.tensor_parallel import HINTS, hint
from course_lib.configs import parallel_config
from course_lib.experiments import tensor_parallel as E
from course_lib.launch import spawn
from course_lib.models import GPT
from course_lib.quiz.exercises import EXERCISES


@pytest.fixture(scope="module")
def race():
    return spawn(
        E.tp_vs_dp_step_times, 2, kwargs=dict(batches=(2,), rounds=1, alpha_rounds=1), timeout=240
    )[0]


def test_tp_and_dp_are_timed_with_what_their_prediction_needs(race):
    cfg = parallel_config()
    assert list(race["timings"]) == ["TP, B=2", "DP, B=2"]
    assert race["clock"].startswith("modelled accelerator clock") and race["clocked_alpha"] > 0
    fwd, bwd = st.tp_allreduces(cfg.n_layer, 2 * cfg.block_size, cfg.d_model)
    assert race["tp_allreduces"] == {2: len(fwd) + len(bwd)}  # the model lists what CommLog counted
    gaps = E.tp_allreduce_gaps(race["forward_s"]["TP, B=2"])
    assert len(gaps) == len(fwd) + len(bwd)  # one idle gap before each call of the replay
    assert sum(gaps) <= 3 * sum(s for _, s in race["forward_s"]["TP, B=2"])
    assert sum(b for b, _ in race["buckets"]) == GPT(cfg).num_params() * 4  # each gradient once
    tp_s = sum(s for _, s in race["forward_s"]["TP, B=2"])
    dp_s = sum(s for _, s in race["forward_s"]["DP, B=2"])
    assert tp_s == pytest.approx(dp_s, rel=0.05)  # 1/t of every layer for B vs all of it for B/N


def test_the_step_time_model_puts_every_tp_all_reduce_on_the_path_and_overlaps_dp(race):
    cfg = parallel_config()
    alpha = race["clocked_alpha"]
    ab = st.AlphaBeta({"all_reduce": alpha}, {"all_reduce": 1e9}, 2, 0)
    fwd, bwd = st.tp_allreduces(cfg.n_layer, 2 * cfg.block_size, cfg.d_model)
    tp = st.tp_step(race["forward_s"]["TP, B=2"], fwd, bwd, ab, 2)
    dp = st.ddp_step(race["forward_s"]["DP, B=2"], race["buckets"], ab, 2)
    assert tp.total - tp.parts["compute"] >= 21 * alpha
    assert dp.total - dp.parts["compute"] < sum(
        ab.predict("all_reduce", b) for b, _ in race["buckets"]
    )


@pytest.mark.parametrize("name", ["column_parallel_linear", "row_parallel_linear"])
def test_each_exercise_has_two_layers_of_hints_and_no_third(name):
    assert name in EXERCISES and name in HINTS
    assert all(len(hint(name, level)) > 80 for level in (1, 2))
    with pytest.raises(ValueError, match="there is no level with the code"):
        hint(name, 3)
