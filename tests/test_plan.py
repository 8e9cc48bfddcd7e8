"""The strategy chooser (course_lib.plan): the ZeRO paper's table, the fixed cases, clear errors, and agreement with
the bytes the course's own ZeRO / FSDP2 runs measure on real ranks (chapter 10's review suite, N = 2)."""

import pytest

from course_lib import plan, viz
from course_lib.experiments import review as R
from course_lib.formulas import pipeline_bubble
from course_lib.experiments.common import bench_config, parallel_config, small_config, zero_config
from course_lib.launch import spawn
from course_lib.results import REORDERED  # formulas summed in another order: a few ulps
from course_lib.models import GPT
from course_lib.step_time import H100_NODE, NodeProfile

SEVEN_B = plan.Model(7e9, 32, 4096, 32, 2048, 32000)


def test_zero_paper_table_is_120_31_4_16_6_1_9_gb():
    table = plan.zero_paper_table(7.5e9, 64)
    assert [round(v, 1) for v in table.values()] == [120.0, 31.4, 16.6, 1.9]
    assert list(table) == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


@pytest.mark.parametrize(
    "make",
    [
        small_config,
        zero_config,
        bench_config,
        parallel_config,
        lambda: small_config(bias=True),
        lambda: parallel_config(mlp_ratio=2),
    ],
    ids=["small", "zero", "bench", "parallel-untied", "bias", "mlp-ratio-2"],
)
def test_gpt_num_params_counts_what_the_model_holds(make):
    config = make()
    assert plan.gpt_num_params(config) == GPT(config).num_params()


def test_tensor_and_pipeline_parallel_divide_model_states_and_zero_shards_them():
    base = plan.memory_per_gpu(SEVEN_B, plan.Layout(dp=1))
    tp = plan.memory_per_gpu(SEVEN_B, plan.Layout(tp=8))
    pp = plan.memory_per_gpu(SEVEN_B, plan.Layout(pp=4))
    REORDERED.assert_close(base["model_states"], 16 * 7e9)
    REORDERED.assert_close(tp["model_states"], 16 * 7e9 / 8)
    REORDERED.assert_close(pp["model_states"], 16 * 7e9 / 4)
    z3 = plan.memory_per_gpu(SEVEN_B, plan.Layout(dp=8, zero=3))
    REORDERED.assert_close(z3["model_states"], 16 * 7e9 / 8)
    assert z3["activations"] == base["activations"]  # ZeRO does not shard activations


def test_1f1b_first_stage_holds_the_activations_of_no_pipeline_and_tp_sp_divides_them():
    model = plan.Model(7e9, 32, 4096, 32, 2048)  # no vocab: blocks only
    none = plan.memory_per_gpu(model, plan.Layout())["activations"]
    REORDERED.assert_close(
        plan.memory_per_gpu(model, plan.Layout(pp=4), num_microbatches=8)["activations"], none
    )
    REORDERED.assert_close(
        plan.memory_per_gpu(model, plan.Layout(pp=4), num_microbatches=2)["activations"], none / 2
    )
    REORDERED.assert_close(plan.memory_per_gpu(model, plan.Layout(tp=8))["activations"], none / 8)
    full = plan.memory_per_gpu(model, plan.Layout(recompute="full"))["activations"]
    REORDERED.assert_close(full, 2 * 2048 * 4096 * 32)  # each layer's input, 16-bit


@pytest.mark.parametrize("name", list(R.FIXED_CASES))
def test_fixed_case(name):
    model, cluster, expected, check = R.FIXED_CASES[name]
    if check is None:
        with pytest.raises(plan.PlanError, match=r"need at least \d+ GPUs"):
            plan.recommend(model, cluster)
        return
    result = plan.recommend(model, cluster)
    assert check(result), f"{name}: expected {expected}, got {result.layout.name()}"
    assert result.memory["total"] <= result.usable_bytes
    assert (
        all(not fits for _, _, fits in result.tried[:-1]) and result.tried[-1][0] == result.layout
    )


def test_fixed_cases_give_the_expected_layouts_by_name():
    got = {c["case"]: c for c in R.fixed_cases()}
    assert all(c["ok"] for c in got.values())
    assert got["7B on 8×80 GB"]["plan"].layout == plan.Layout(dp=8, zero=2)
    assert got["70B on 64×80 GB (8 per node)"]["plan"].layout == plan.Layout(dp=8, tp=8, zero=2)
    assert got["GPT-2 small (124M) on 8×80 GB"]["plan"].layout == plan.Layout(dp=8)
    seventy = got["70B on 64×80 GB (8 per node)"]["plan"]
    assert [alt.name() for alt, _, _ in seventy.alternatives] == ["TP 8 + SP, PP 2, ZeRO-1 (dp 4)"]


def test_the_3d_alternative_uses_the_rankings_micro_batches():
    """One layout, one m in the printout: the "also fits" bubble is at the m the ranking uses."""
    seventy = R.fixed_cases()[1]["plan"]
    alt, _, note = seventy.alternatives[0]
    m = seventy.global_batch // (alt.dp * seventy.micro_batch)
    assert (
        f"= {pipeline_bubble(alt.pp, m):.3f} at m = {m} (a step of {seventy.global_batch}" in note
    )
    ranked = {lay: pred for lay, _, pred in seventy.ranking}
    assert alt in ranked, "the alternative is also in the ranking"
    short = seventy.text(ranking=False)
    assert "ranked by predicted step time" not in short and "fastest predicted" in short
    assert "ranked by predicted step time" in str(seventy)


def test_planner_result_shows_the_missing_gpus_whole():
    rows = {r.quantity: r for r in R.planner_result().checks()}
    got = rows["1T on 16×80 GB"].measured
    assert got.startswith("PlanError: needs ≥ ") and got.endswith("has 16"), got
    need = int(got.split("≥ ")[1].split()[0])
    assert need > 16 * 1e12 / 72e9, "states alone give a lower bound; activations add to it"


def test_one_gpu_that_fits_is_plain_training():
    result = plan.recommend(plan.Model(124e6, 12, 768, 12, 1024, 50257), plan.Cluster(24, 1, 1))
    assert result.layout == plan.Layout(dp=1) and "one GPU" in result.reasons[0]


def test_activations_that_fit_nowhere_are_named():
    huge_seq = plan.Model(7e9, 32, 4096, 32, 2**22)
    with pytest.raises(plan.PlanError, match="activations alone need"):
        plan.recommend(huge_seq, plan.Cluster(80, 8, 4))


def test_full_recompute_is_the_last_resort_and_says_so():
    # 70B on one node: no layout fits with selective recompute; TP 8 × ZeRO-3 with full recompute does
    result = plan.recommend(plan.Model(70e9, 80, 8192, 64, 4096), plan.Cluster(80, 8, 2))
    assert result.layout.recompute == "full" and any(
        "full activation recompute" in r for r in result.reasons
    )


# --------------------------------------------------------------------------- ranked by step time


def test_ranking_holds_every_candidate_that_fits_fastest_first():
    result = plan.recommend(SEVEN_B, plan.Cluster(80, 8, 1))
    ranked = [lay for lay, _, _ in result.ranking]
    totals = [pred.total for _, _, pred in result.ranking]
    assert totals == sorted(totals) and result.fastest == ranked[0]
    fits = []
    for lay in plan.candidates(SEVEN_B, result.cluster):
        mem = plan.memory_per_gpu(SEVEN_B, lay, num_microbatches=64 // lay.dp)
        if mem["total"] <= result.usable_bytes:
            fits.append(lay)
    assert sorted(ranked, key=repr) == sorted(fits, key=repr)
    assert plan.Layout(dp=8) not in ranked  # DDP needs 121 GB per GPU: never ranked
    assert result.layout in ranked  # the ladder's choice fits, so it is ranked too
    for lay, mem, _ in result.ranking:  # the same memory as memory_per_gpu, bit for bit
        assert mem == plan.memory_per_gpu(SEVEN_B, lay, num_microbatches=64 // lay.dp)
    assert plan.rank(SEVEN_B, result.cluster, [plan.Layout(dp=8)]) == []


def test_tensor_parallelism_across_nodes_ranks_last_its_all_reduces_dominate():
    layouts = [
        plan.Layout(tp=16),  # 4 all-reduces per layer over the network
        plan.Layout(dp=16, zero=3),
        plan.Layout(dp=2, tp=8, zero=2),
        plan.Layout(dp=4, tp=4, zero=2),
    ]
    ranked = plan.rank(SEVEN_B, plan.Cluster(80, 8, 2), layouts)
    last, _, pred = ranked[-1]
    parts = plan.step_parts(pred)
    assert last == plan.Layout(tp=16) and len(ranked) == 4
    assert parts["exposed communication"] > parts["compute"]
    assert all(lay.tp <= 8 for lay in plan.candidates(SEVEN_B, plan.Cluster(80, 8, 2)))


def test_plan_text_names_the_profile_the_fastest_and_why():
    result = plan.recommend(SEVEN_B, plan.Cluster(80, 8, 1))
    text = str(result)
    assert H100_NODE.name in text and "assumed 40% MFU" in text and "not a measurement" in text
    assert f"that fit: {result.fastest.name()}," in text
    assert f"next: {result.ranking[1][0].name()}," in text
    assert result.ranking_table() in text
    slow = NodeProfile("a test node", 100e12, 0.5, 100e9, 1e9, 8, 1e-5, 1e-5)
    other = plan.recommend(SEVEN_B, plan.Cluster(80, 8, 1), profile=slow)
    assert "a test node" in str(other) and "assumed 50% MFU" in str(other)
    four = plan.recommend(SEVEN_B, plan.Cluster(80, 4, 2))  # H100_NODE has 8 GPUs per node
    assert four.ranking == [] and "this cluster's 4" in str(four)
    assert "step time" not in str(plan.recommend(SEVEN_B, plan.Cluster(80), profile=None))


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: plan.memory_per_gpu(plan.Model(7e9, 32, 768, 6, 2048), plan.Layout(tp=4)),
            "num_heads=6 is not divisible by tp_size=4",
        ),
        (
            lambda: plan.memory_per_gpu(SEVEN_B, plan.Layout(pp=3)),
            "layers=32 is not divisible by pp_size=3",
        ),
        (
            lambda: plan.check_layout(SEVEN_B, plan.Layout(dp=4, tp=8), plan.Cluster(80, 8, 8)),
            r"dp_size × tp_size × pp_size = 4 × 8 × 1 = 32 must equal the number of GPUs",
        ),
        (
            lambda: plan.check_layout(SEVEN_B, plan.Layout(dp=4, tp=16), plan.Cluster(80, 8, 8)),
            "tp_size=16 does not divide gpus_per_node=8",
        ),
        (lambda: plan.Model(7e9, 32, 4096, 3, 2048), "hidden=4096 is not divisible by num_heads=3"),
        (
            lambda: plan.Model(-1, 32, 4096, 32, 2048),
            r"params=-1 \(the parameter count Ψ\) must be a number > 0",
        ),
        (lambda: plan.Model(7e9, 0, 4096, 32, 2048), "layers=0 must be an int >= 1"),
        (lambda: plan.Cluster(0, 8, 1), "gpu_memory_gb=0 must be a number > 0"),
        (lambda: plan.Cluster(80, 8, 0), "nodes=0 must be an int >= 1"),
        (lambda: plan.Layout(zero=4), "zero_stage=4 must be 0, 1, 2 or 3"),
        (lambda: plan.Layout(recompute="some"), "recompute='some' must be one of"),
        (
            lambda: plan.memory_per_gpu(SEVEN_B, plan.Layout(), precision="bf16"),
            "precision='bf16' must be",
        ),
        (
            lambda: plan.memory_per_gpu(SEVEN_B, plan.Layout(recompute="none"), precision="fp32"),
            "precision='fp32' activations are derived for the course GPT",
        ),
        (
            lambda: plan.recommend(SEVEN_B, plan.Cluster(80), reserve=1.0),
            r"reserve=1.0 must be in \[0, 1\)",
        ),
        (
            lambda: plan.rank(SEVEN_B, plan.Cluster(80), global_batch=12),
            "global_batch=12 must be a multiple of micro_batch × GPUs",
        ),
        (
            lambda: plan.rank(SEVEN_B, plan.Cluster(80, 8, 2), [plan.Layout(dp=8)]),
            "DDP \\(dp 8\\) uses dp × tp × pp = 8 GPUs; the cluster has 16",
        ),
        (
            lambda: plan.rank(SEVEN_B, plan.Cluster(80, 4, 2)),
            "has 8 GPUs per node, the cluster 4",
        ),
    ],
    ids=[
        "heads-tp",
        "layers-pp",
        "world",
        "tp-node",
        "hidden-heads",
        "params",
        "layers",
        "memory",
        "nodes",
        "zero",
        "recompute",
        "precision",
        "fp32-needs-config",
        "reserve",
        "global-batch",
        "rank-world",
        "rank-profile",
    ],
)
def test_bad_input_names_the_rule(make, message):
    with pytest.raises(plan.PlanError, match=message):
        make()


def test_widget_shows_the_plan_as_text():
    pytest.importorskip("ipywidgets")
    text = repr(viz.planner_widget())
    assert "→ ZeRO-2 (dp 8)" in text
    assert "PlanError: hidden=768 is not divisible by num_heads=5" in repr(
        viz.planner_widget(hidden=768, heads=5)
    )
    # heads=6 on 4-GPU nodes: the chooser takes the largest TP size that divides both (2)
    assert "TP 2 + SP" in repr(
        viz.planner_widget(
            params_billions=200,
            layers=32,
            hidden=768,
            heads=6,
            gpus_per_node=4,
            nodes=16,
            seq_len=2**15,
        )
    )


# --------------------------------------------------------------------------- against real ranks


@pytest.fixture(scope="module")
def suite():
    return spawn(R.review_suite, 2, timeout=600)[0]


def test_planner_agrees_with_the_bytes_measured_by_chapters_03_and_04(suite):
    rows = R.plan_vs_measured(suite)
    assert [r["layout"] for r in rows] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2"]
    result = R.review_result(suite)
    planner = [r for r in result.checks() if "planner" in r.quantity]
    assert len(planner) == 5 + 4, (
        "model states of five layouts, activations of the four ZeRO stages"
    )
    assert all(r.verdict for r in planner), result.table()


def test_review_suite_measures_every_technique_at_its_formula(suite):
    result = R.review_result(suite)
    claims = result.claims()
    for name in (
        "DDP (ours)",
        "ZeRO-1 (ours)",
        "ZeRO-2 (ours)",
        "ZeRO-3 (ours)",
        "FSDP2 (torch)",
        "TP (Megatron, ours)",
    ):
        assert f"{name}: model states per rank / formula" in claims
        assert f"{name}: sent per step / formula" in claims
    assert (
        sum("bubble of the worst rank" in q for q in claims) == 4
    )  # gpipe and 1f1b at m = 1 and 4
    result.assert_passed()
    assert "PP (GPipe, 1F1B)" in R.comparison_table(R.comparison_rows(suite))


def test_review_parts_split_the_suites_rows(suite):
    """The parts together are every row once; the suite itself prints them; TP shrinks activations."""
    whole = [r.quantity for r in suite.checks()]
    parts = {p: R.review_result(suite, part=p) for p in R.REVIEW_PARTS}
    assert sorted(q for p in parts.values() for q in p.claims()) == sorted(whole)
    assert all("one device" in r.against for r in parts["equality"].checks())
    assert {"TP t=2: activation bytes per rank", "TP + SP t=2: activation bytes per rank"} <= set(
        parts["bytes"].claims()
    )
    assert suite.passed and suite["world_size"] == 2
    with pytest.raises(ValueError, match="part='memory' is not one of"):
        R.review_result(suite, part="memory")


def test_planner_result_reproduces_the_zero_paper_and_the_fixed_cases():
    result = R.planner_result()
    assert len(result.checks()) == 4 + len(R.FIXED_CASES)
    result.assert_passed()
