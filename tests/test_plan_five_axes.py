"""The planner's five axes (course_lib.plan, course_lib.step_time) against chapter 07's measured bytes.

One spawn of 2 ranks runs the chapter's own measurements at its configurations: the bytes each rank
sends in ring attention (``experiments.context_parallel.attention_traffic``: B 2, 4 heads of 8, S/c = 8),
the bytes ring attention saves for backward at c = 1 and c = 2 (``attention_memory``: S = 32), the
parameters an EP = 2 rank of the chapter's MoE GPT holds (8 experts, top-2), and the all-to-all bytes of
the EP layer under balanced routing (the planner's assumption: every expert the same share, nothing
dropped). The planner's numbers must equal them exactly: bytes are integers here.
"""

import pytest
import torch

from course_lib import plan
from course_lib.experiments import expert_parallel as EE
from course_lib.launch import spawn
from course_lib.moe import MoEGPT
from course_lib.step_time import H100_NODE, layout_step

B, HEADS, HEAD_DIM, SEQ_PER_RANK, MEMORY_SEQ = (
    2,
    4,
    8,
    8,
    32,
)  # attention_traffic / _memory defaults
TOKENS, EXPERTS = 64, 8  # the balanced all-to-all: tokens over both ranks


def _suite():
    from course_lib.expert_parallel import expert_parallel_gpt
    from course_lib.experiments import context_parallel as CE
    from course_lib.experiments import expert_parallel as EE
    from course_lib.moe import MoEGPT

    traffic = CE.attention_traffic(B, HEADS, SEQ_PER_RANK, HEAD_DIM)
    memory = CE.attention_memory(B, HEADS, MEMORY_SEQ, HEAD_DIM)
    model = expert_parallel_gpt(MoEGPT(EE.moe_gpt_config(), EE.moe_config(), seed=0))
    params = list(model.parameters())
    return {
        "traffic": traffic.measured,
        "memory": memory.saved["ring"],
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "expert_bytes": sum(
            p.numel() * p.element_size() for p in params if getattr(p, "expert_parallel", False)
        ),
        "all_to_all": EE.balanced_all_to_all(TOKENS, EXPERTS),
    }


@pytest.fixture(scope="module")
def runs():
    return spawn(_suite, 2)


def test_ring_kv_bytes_per_step_equal_measured(runs):
    c = 2
    model = plan.Model(1e6, 1, HEADS * HEAD_DIM, HEADS, c * SEQ_PER_RANK)
    pred = layout_step(
        model, plan.Layout(cp=c), H100_NODE, global_batch=B, micro_batch=B, element_size=4
    )
    for key in ("ring contiguous", "ring zigzag"):
        got = runs[0]["traffic"][key]
        assert got["forward"] == [pred.bytes["CP K/V (forward)"]] * c
        assert got["backward"] == [pred.bytes["CP K/V (backward)"]] * c
    assert pred.bytes["CP K/V (forward)"] == (c - 1) * 2 * B * HEADS * SEQ_PER_RANK * HEAD_DIM * 4
    assert "exposed CP ring K/V" in pred.parts


def test_cp_activation_bytes_equal_measured(runs):
    model = plan.Model(1e6, 1, HEADS * HEAD_DIM, HEADS, MEMORY_SEQ)
    for c in (1, 2):
        for run in runs:
            assert run["memory"][c] == plan.attention_saved_bytes(
                model, plan.Layout(cp=c), micro_batch=B, element_size=4
            )
    one = plan.memory_per_gpu(model, plan.Layout(), micro_batch=B)["activations"]
    two = plan.memory_per_gpu(model, plan.Layout(cp=2), micro_batch=B)["activations"]
    assert one / two == runs[0]["memory"][1] / runs[0]["memory"][2] == 2


def test_ep_parameter_bytes_equal_measured(runs):
    cfg, mcfg = EE.moe_gpt_config(), EE.moe_config()
    model = plan.Model.from_config(cfg, moe=mcfg)
    assert model.params == sum(p.numel() for p in MoEGPT(cfg, mcfg, seed=0).parameters())
    states = plan.model_states_per_gpu(model, plan.Layout(dp=2, ep=2), precision="fp32")
    for run in runs:
        assert run["param_bytes"] == states["params"]
        assert run["expert_bytes"] == states["experts"]["params"]
    dense = plan.model_states_per_gpu(model, plan.Layout(dp=2), precision="fp32")
    assert dense["experts"]["params"] == 2 * states["experts"]["params"]  # ÷ e


def test_ep_all_to_all_bytes_per_step_equal_measured(runs):
    e, per_rank = 2, TOKENS // 2
    model = plan.Model(1e6, 1, 32, 4, per_rank, experts=EXPERTS, top_k=2, expert_hidden=64)
    lay = plan.Layout(dp=e, ep=e)
    pred = layout_step(model, lay, H100_NODE, global_batch=e, micro_batch=1, element_size=4)
    one = pred.bytes["EP all-to-all (forward)"] / 2  # dispatch = combine
    for run in runs:
        calls = run["all_to_all"]["calls"]
        assert run["all_to_all"]["kept"] == [TOKENS * 2 // EXPERTS] * EXPERTS  # balanced
        assert calls["forward"] == [one, one] and calls["backward"] == [one, one]
        assert sum(calls["forward"]) == pred.bytes["EP all-to-all (forward)"]
        assert sum(calls["backward"]) == pred.bytes["EP all-to-all (backward)"]


def test_five_axis_rules_are_named():
    moe = plan.Model(1e9, 8, 1024, 16, 4096, experts=8, top_k=2, expert_hidden=1024)
    with pytest.raises(plan.PlanError, match=r"num_experts=8 is not divisible by ep_size=3"):
        plan.check_layout(moe, plan.Layout(dp=3, ep=3))
    with pytest.raises(plan.PlanError, match=r"ep_size=4 does not divide dp_size × cp_size"):
        plan.Layout(dp=2, ep=4)
    with pytest.raises(plan.PlanError, match=r"needs an MoE model"):
        plan.check_layout(plan.Model(1e9, 8, 1024, 16, 4096), plan.Layout(dp=2, ep=2))
    with pytest.raises(plan.PlanError, match=r"seq_len=4096 is not divisible by 2·cp_size=6"):
        plan.check_layout(moe, plan.Layout(cp=3))
    with pytest.raises(plan.PlanError, match=r"dp_size × tp_size × pp_size × cp_size"):
        plan.check_layout(moe, plan.Layout(dp=2, cp=2), plan.Cluster(80, 8, 1))
    assert (
        plan.Layout(dp=4, tp=2, cp=2, ep=4, zero=3).name()
        == "TP 2 + SP, CP 2, EP 4, ZeRO-3/FSDP (dp 4)"
    )
    assert plan.Layout(dp=8, zero=2).name() == "ZeRO-2 (dp 8)"  # cp = ep = 1: the old names


def test_candidates_add_ep_for_moe_and_cp_for_long_sequences_only():
    cluster = plan.Cluster(80, 8, 1)
    dense = plan.Model(7e9, 32, 4096, 32, 2048, 32000)
    assert all(lay.cp == lay.ep == 1 for lay in plan.candidates(dense, cluster))
    moe = plan.Model(1e10, 32, 4096, 32, 4096, 32000, experts=8, top_k=2, expert_hidden=4096)
    assert {lay.ep for lay in plan.candidates(moe, cluster)} == {1, 2, 4, 8}
    long = plan.Model(1.3e9, 24, 2048, 16, 65536, 32000)
    cps = {lay.cp for lay in plan.candidates(long, cluster)}
    assert cps == {1, 2, 4, 8}
    ranked = plan.rank(long, cluster)
    assert ranked and all(lay.cp > 1 or lay.tp > 1 for lay, _, _ in ranked)  # S = 64K: split it
    assert plan.Layout(cp=8).name() == "CP 8, DDP (over cp)"


@pytest.mark.parametrize("c", [2, 4, 8])
def test_the_planners_formulas_are_the_techniques(c):
    from course_lib.context_parallel import ring_attention_traffic
    from course_lib.expert_parallel import all_to_all_bytes
    from course_lib.step_time import cp_ring_bytes, ep_all_to_all_bytes

    assert cp_ring_bytes(2, 4, 64, 8, c, 2) == ring_attention_traffic(2, 4, 64, 8, c, 2)
    E, k, n = 8, 2, 32  # every rank sends every expert n·k/E of its assignments
    kept = torch.full((c, E), n * k // E)
    for rank in all_to_all_bytes(kept, 16, 2):
        assert rank["dispatch"] == rank["combine"] == ep_all_to_all_bytes(n, 16, k, c, 2)
