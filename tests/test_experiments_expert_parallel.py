"""The MoE / EP chapter's measurements (``course_lib.experiments.expert_parallel``), in one spawn.

``notebook_suite`` runs on 2 ranks once for the module (what the notebook runs); every Result it
returns must have passed, and the tests then check across ranks what no single rank can: the
ranks agree on the routing, every expert is held by exactly one rank, the bytes sent out equal
the bytes that come back, the imbalance data has its shape and direction, the hot rank is the
slow one. A few tests without ranks check the helpers on hand-made inputs.
"""

import pytest
import torch

from course_lib.experiments import expert_parallel as E
from course_lib.moe import MoEGPT

WORLD = 2


@pytest.fixture(scope="module")
def suite() -> list[dict]:
    from course_lib.launch import spawn

    return spawn(E.notebook_suite, WORLD, timeout=240)


NAMES = ["equality", "traffic", "training", "imbalance", "hot_expert"]


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_passed_every_row(suite, name):
    for rank, out in enumerate(suite):
        res = out[name]
        assert res.checks(), f"rank {rank}: {name} checked nothing"
        res.assert_passed()


# =========================================================================== equality


def test_ranks_agree_on_the_routing_and_split_the_experts(suite):
    eq = [out["equality"] for out in suite]
    moe = E.moe_config()
    assert eq[0].tokens_per_expert == eq[1].tokens_per_expert
    assert eq[0].kept_matrix == eq[1].kept_matrix and len(eq[0].kept_matrix) == WORLD
    assert sorted(i for r in eq for i in r.expert_ids) == list(range(moe.num_experts))
    kept = torch.tensor(eq[0].kept_matrix)
    assert kept.sum(0).tolist() == eq[0].kept_per_expert
    assert max(eq[0].kept_per_expert) <= eq[0].capacity  # C respected
    assert eq[0].dropped == sum(eq[0].tokens_per_expert) - sum(eq[0].kept_per_expert) > 0


# =========================================================================== traffic


def test_bytes_sent_out_come_back_and_exclude_the_local_chunk(suite):
    tr = [out["traffic"] for out in suite]
    cfg = E.moe_gpt_config()
    row = cfg.d_model * 4
    for i in range(cfg.n_layer):
        layers = [r.layers[i] for r in tr]
        dispatch = sum(lay["forward"][0] for lay in layers)
        combine = sum(lay["forward"][1] for lay in layers)
        assert dispatch == combine > 0  # every token sent away is sent back
        for rank, lay in enumerate(layers):
            kept = torch.tensor(lay["kept"])
            everything = int(kept[rank].sum()) * row  # the self chunk counted too: wrong
            assert lay["forward"][0] < everything
            # GShard's buffer: C per rank (on this rank's tokens), E·C·d·4, (e−1)/e of it off-rank
            c = lay["capacity_per_rank"]
            assert c < lay["capacity_group"]
            assert lay["padded"] == E.moe_config().num_experts * c * row
            assert lay["padded_offrank"] == lay["padded"] * (WORLD - 1) // WORLD
    assert all(r.calls == {"forward": 2 * cfg.n_layer, "backward": 2 * cfg.n_layer} for r in tr)


# =========================================================================== imbalance


def test_imbalance_data_has_its_shape_and_the_aux_loss_spreads_the_load(suite):
    res = suite[0]["imbalance"]
    s = res.settings
    tokens = s["batch_size"] * E.moe_gpt_config().block_size
    L = E.moe_gpt_config().n_layer
    for name in ("no aux", "aux"):
        run = res.runs[name]
        assert run["tokens_per_expert"].shape == (s["steps"], L, s["num_experts"])
        assert bool((run["tokens_per_expert"].sum(-1) == tokens * s["top_k"]).all())
        assert run["max_over_mean"].shape == run["cv"].shape == run["dropped"].shape
        assert len(run["loss"]) == s["steps"]
    assert res.runs["no aux"]["aux_loss_coef"] == 0 < res.runs["aux"]["aux_loss_coef"]
    no_aux, aux = res.final["no aux"], res.final["aux"]
    assert no_aux >= 2.5  # collapsed: the busiest expert takes ≥ 2.5× its share
    assert aux <= 2.0 and aux < 0.75 * no_aux
    assert res.final_cv["aux"] < res.final_cv["no aux"]
    drops = res.final_dropped
    assert drops["no aux"] > 2 * drops["aux"]  # the crowded experts overflow their capacity
    first = res.runs["no aux"]["max_over_mean"][0].amax().item()
    assert no_aux > first  # the no-aux run got worse as it trained: it was not born collapsed
    assert suite[1]["imbalance"].final == res.final  # both ranks hold both runs


# =========================================================================== the hot expert


def test_the_hot_rank_is_the_slow_one_and_every_rank_sees_the_same_table(suite):
    h0, h1 = suite[0]["hot_expert"], suite[1]["hot_expert"]
    assert h0.per_rank == h1.per_rank and h0.rate == h1.rate
    skewed, balanced = h0.per_rank["skewed"], h0.per_rank["balanced"]
    assert [r["routed"] for r in balanced] == [64, 64]  # exactly N·k/e each
    assert [r["routed"] for r in skewed] == [96, 32]  # three quarters on rank 0
    assert skewed[0]["measured_s"] > 1.2 * max(r["measured_s"] for r in balanced)
    t = h0.timings
    assert t.compare("skewed", "balanced").sign == 1
    assert h0.timings.medians() == h1.timings.medians()  # the max over ranks, on every rank


# =========================================================================== training


def test_ep_training_ranks_hold_the_whole_model_between_them(suite):
    names = {n for n, _ in MoEGPT(E.moe_gpt_config(), E.moe_config()).named_parameters()}
    tr = [out["training"] for out in suite]
    assert set(tr[0].state) | set(tr[1].state) == names
    experts = [{n for n in r.state if ".experts." in n} for r in tr]
    assert experts[0] and experts[1] and not experts[0] & experts[1]
    assert tr[0].losses == tr[1].losses and tr[0].losses[-1] < tr[0].losses[0]


# =========================================================================== no ranks


def test_load_imbalance_is_one_and_zero_when_uniform_and_grows_with_a_hot_expert():
    ratio, cv = E.load_imbalance(torch.tensor([[8, 8, 8, 8], [32, 0, 0, 0]]))
    assert ratio.tolist() == [1.0, 4.0]
    assert cv[0].item() == 0.0 and cv[1].item() == pytest.approx(3**0.5)
