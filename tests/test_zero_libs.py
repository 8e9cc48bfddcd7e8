"""ZeRO libraries beside our own: torch's ZeroRedundancyOptimizer and DeepSpeed, measured against the formulas.

One spawn per library and world size (module-scoped fixtures; chapter 03's stage profile rides
in the N = 2 spawn of torch's ZeRO-1); the tests read what they name, and every experiment's
result rows must pass. Equality uses the named tolerances of ``course_lib.results``. DeepSpeed tests skip, with
the reason, when ``deepspeed_available()`` says it cannot run here.
The memory calculator's numbers are the ZeRO paper's (Rajbhandari et al. 2019, Ψ = 7.5B, N = 64).
"""

import math
import re

import pytest

from course_lib.launch import spawn
from course_lib.models import GPT, equality_config, tiny_config
from course_lib.results import ADAMW
from course_lib.experiments.zero_libraries import (
    deepspeed_available,
    deepspeed_config,
    deepspeed_table,
    deepspeed_zero_stages,
    reference_training,
    torch_zero1_memory,
    zero1_partition,
    zero1_table,
)
from course_lib.viz import zero_memory_calculator, zero_memory_table

# d_model = 27 makes several tensors odd-sized and Ψ = 18,927 not a multiple of 2N, so DeepSpeed's
# padding shows: Ψ_pad = 18,928 in stages 1/2 (flat group padded to 2N), 18,936 in stage 3 (per tensor).
ODD = equality_config(vocab_size=32, block_size=16, n_layer=2, n_head=3, d_model=27)
DS_WORLDS, DS_STEPS, DS_GLOBAL_BATCH, BUCKET = [2, 4], 10, 16, 1024
STAGES = [0, 1, 2, 3]
ZERO1_WORLDS = [2, 4]


# --------------------------------------------------------------------------- torch ZeroRedundancyOptimizer


def _zero1_and_profile(profile: bool) -> tuple:
    """Rank function: torch's ZeRO-1 memory, and (when asked) chapter 03's stage profile."""
    from course_lib.experiments import zero

    if not profile:
        return torch_zero1_memory(), None
    stages = zero.zero_stage_profile(micro_batch=2, rounds=1)
    four = zero.zero_stage_profile(
        stages=(3,), micro_batch=2, rounds=0, config=zero.zero_config(n_layer=4)
    )
    return torch_zero1_memory(), (stages, four)


@pytest.fixture(scope="module")
def spawned():
    return {w: spawn(_zero1_and_profile, w, args=(w == 2,), timeout=300) for w in ZERO1_WORLDS}


@pytest.fixture(scope="module")
def zero1(spawned):
    return {w: [z1 for z1, _profile in per_rank] for w, per_rank in spawned.items()}


def test_zero_redundancy_optimizer_results_pass_every_row(zero1):
    for per_rank in zero1.values():
        for result in per_rank:
            result.assert_passed()


@pytest.mark.parametrize("world", ZERO1_WORLDS)
def test_zero_redundancy_optimizer_state_is_imbalanced_at_parameter_granularity(zero1, world):
    result = zero1[world][0]
    bytes_per_rank = [r["optimizer_bytes"] for r in result["per_rank"]]
    assert result["imbalance"] > 1.05, zero1_table(result)
    assert result["imbalance"] == max(bytes_per_rank) / (sum(bytes_per_rank) / world)
    # the rank that owns the embedding holds exactly that one tensor: it is bigger than Ψ/N by itself
    owner = next(r for r in result["per_rank"] if "wte.weight" in r["names"])
    assert owner["names"] == ["wte.weight"] and owner["param_numel"] > result["psi"] / world
    assert max(bytes_per_rank) > result["ideal_bytes"]


@pytest.mark.parametrize("world", ZERO1_WORLDS)
def test_zero_redundancy_optimizer_per_rank_state_sums_to_one_devices_adamw_state(zero1, world):
    result = zero1[world][0]
    model = GPT(tiny_config(vocab_size=2048))
    n_tensors = len(list(model.parameters()))
    assert sum(r["param_numel"] for r in result["per_rank"]) == result["psi"] == model.num_params()
    assert sum(r["n_tensors"] for r in result["per_rank"]) == n_tensors
    # exp_avg + exp_avg_sq (8 bytes per parameter) + one 4-byte step per tensor, split without overlap
    assert result["total_optimizer_bytes"] == 8 * result["psi"] + 4 * n_tensors
    assert all(
        x["per_rank"] == result["per_rank"] and x["losses"] == result["losses"]
        for x in zero1[world]
    )


@pytest.mark.parametrize("world", ZERO1_WORLDS)
def test_zero_redundancy_optimizer_partition_is_greedy_largest_first(zero1, world):
    result = zero1[world][0]
    model = GPT(tiny_config(vocab_size=2048))
    sizes = [p.numel() for p in model.parameters()]
    predicted = sorted(sum(sizes[i] for i in owned) for owned in zero1_partition(sizes, world))
    assert predicted == sorted(r["param_numel"] for r in result["per_rank"])


# --------------------------------------------------------------------------- DeepSpeed


@pytest.fixture(scope="module", params=DS_WORLDS, ids=lambda w: f"world={w}")
def ds(request):
    ok, reason = deepspeed_available()
    if not ok:
        pytest.skip(reason)
    world = request.param
    results = spawn(
        deepspeed_zero_stages,
        world,
        timeout=280,
        kwargs=dict(
            stages=STAGES,
            config=ODD,
            steps=DS_STEPS,
            micro_batch=DS_GLOBAL_BATCH // world,
            bucket_elements=BUCKET,
            return_params=True,
        ),
    )
    by_stage = {s: [rank_results[i] for rank_results in results] for i, s in enumerate(STAGES)}
    reference = reference_training(ODD, steps=DS_STEPS, global_batch=DS_GLOBAL_BATCH)
    return {
        "world": world,
        "by_stage": by_stage,
        "reference": reference,
        "table": deepspeed_table(results[0]),
    }


def test_deepspeed_available_gives_a_reason():
    ok, reason = deepspeed_available()
    assert isinstance(ok, bool) and reason


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_config_does_not_clip_like_one_device(stage):
    # DeepSpeed clips the global gradient norm at 1.0 unless told otherwise; the reference does not
    # (chapter 03's model has norms above 1: left on, every stage drifts from one device by ~lr)
    assert deepspeed_config(stage)["gradient_clipping"] == 0.0


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_zero_trains_like_one_device(ds, stage):
    ref = ds["reference"]
    for r in ds["by_stage"][stage]:
        assert all(math.isfinite(loss) for loss in r["losses"])
        assert r["losses"][-1] < r["losses"][0] - 0.02
        ADAMW.assert_close(r["losses"], ref["losses"], "losses")
        ADAMW.assert_close(r["params"], ref["params"])
        r.assert_passed()  # every byte named; the same equality, with the reference run in the rank


def _predicted_psi_pad(stage: int, world: int) -> int:
    sizes = [p.numel() for p in GPT(ODD).parameters()]
    if stage in (
        1,
        2,
    ):  # one flat group, padded to a multiple of 2N (nccl_start_alignment_factor * N)
        return math.ceil(sum(sizes) / (2 * world)) * 2 * world
    if stage == 3:  # every tensor split in N equal pieces
        return sum(math.ceil(n / world) * world for n in sizes)
    return sum(sizes)


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_pads_psi_as_documented(ds, stage):
    r = ds["by_stage"][stage][0]
    assert r["psi"] == 18927 and r["psi_pad"] == _predicted_psi_pad(stage, ds["world"])


def test_deepspeed_stage0_holds_16_psi(ds):
    for r in ds["by_stage"][0]:
        n_tensors = len(list(GPT(ODD).parameters()))
        assert (
            r["measured"]["total"] == 16 * r["psi"] + 4 * n_tensors
        )  # + AdamW's 4-byte step per tensor
        assert r["adam_step"] == 4 * n_tensors and r["rest"] == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_measured_bytes_are_formula_plus_fp32_master_partition(ds, stage):
    """measured = formula + 4Ψ_pad/N (fp32 master) + grad overhang + in-flight grads + Adam step + rest."""
    for r in ds["by_stage"][stage]:
        n, psi_pad, f = r["world_size"], r["psi_pad"], r["formula_breakdown"]
        m = r["measured"]
        assert (
            r["fp32_master"] == m["master"] == 4 * psi_pad / n
        )  # the clone DeepSpeed keeps for an fp32 model
        assert (
            m["params"] == f["params"]
        )  # 4Ψ_pad (stages 1/2: the flat buffer), 4Ψ_pad/N (stage 3)
        assert (
            m["optimizer"] == f["optimizer"] + r["adam_step"] and r["adam_step"] == 4
        )  # one flat partition
        assert 0 <= r["grad_overhang"] <= r["bounds"]["grad_overhang"]
        assert 0 <= r["in_flight_grads"] <= r["bounds"]["in_flight_grads"]
        assert abs(r["rest"]) <= 4 * (psi_pad - r["psi"]), ds[
            "table"
        ]  # padding a per-tensor grad does not hold
    if stage == 1:  # nothing in flight: all gradients are held anyway -> formula + 4Ψ/N to 0.1 %
        for r in ds["by_stage"][1]:
            assert r["ratio_expected"] == pytest.approx(1.0, abs=1e-3)
            n = ds["world"]
            assert r["ratio"] == pytest.approx((8 + 8 / n + 4 / n) / (8 + 8 / n), abs=1e-3)


def test_deepspeed_stage3_holds_20_psi_over_n_between_backward_and_step(ds):
    """After backward nothing is in flight: params + grads + fp32 master + Adam = (4+4+4+8)Ψ_pad/N."""
    for r in ds["by_stage"][3]:
        held, psi_pad, n = r["held"], r["psi_pad"], r["world_size"]
        states = held["params"] + held["grads"] + held["master"] + held["optimizer"]
        assert states == 20 * psi_pad // n + held["adam_step"]
        assert states / r["formula"] == pytest.approx(1.25, abs=1e-3)


# --------------------------------------------------------------------------- memory calculator


def _totals(table: str) -> list[str]:
    rows = [line for line in table.splitlines() if re.match(r"\s+[0-3] ", line)]
    return [re.findall(r"([\d,.]+) GB", row)[3] for row in rows]


def test_calculator_reproduces_the_zero_paper_7_5b_on_64_gpus():
    assert _totals(zero_memory_table(7.5e9, 64)) == ["120.0", "31.4", "16.6", "1.9"]
    assert _totals(zero_memory_table(7.5e9, 64, precision="mixed", k=12)) == [
        "120.0",
        "31.4",
        "16.6",
        "1.9",
    ]


def test_calculator_widget_text_is_the_table_and_resets_k_with_precision():
    calc = zero_memory_calculator()
    bundle = calc._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert data["text/plain"] == zero_memory_table(7.5e9, 64, stage=3) == repr(calc)
    assert _totals(data["text/plain"]) == ["120.0", "31.4", "16.6", "1.9"]
    precision = next(
        w for w in calc.children[2].children if getattr(w, "options", None) == ("mixed", "fp32")
    )
    precision.value = "fp32"
    assert "K = 8" in calc.table() and "fp32" in calc.table()


def test_zero_stage_profile_time_peak_and_when_each_stage_communicates(spawned):
    """At N = 2: every stage timed; stage 2 reduce-scatters in backward bucket by bucket, stage 1 in
    step; stage 3 gathers each unit in forward and backward and holds at most one block + the root at once;
    activations are the same at every stage; the peak is above what is held after the step."""
    r, four = spawned[2][0][1]
    r.assert_passed()
    four.assert_passed()  # stage 3 on 4 blocks: root + at most 2 blocks gathered at once
    assert any(row.quantity.startswith("stage 3: gathered") for row in four.checks())
    units4 = {u["name"]: u["gathered_bytes"] for u in four["units"]}
    g4 = max(four["peak"][3][ph]["transient"] for ph in ("forward", "backward"))
    assert len(units4) == 5 and g4 < units4["(root)"] + 4 * units4["blocks.0"]
    # stage 2 frees each staging bucket once its reduce-scatter is done (at most MAX_IN_FLIGHT in
    # flight): at the peak it stages a few buckets, well under the 4Ψ bytes of all of them
    staged = r["peak"][2]["backward"]["transient"]
    assert 0 < staged < 2 * r["psi"]
    gap = (
        r.stage2_gap()
    )  # bucketed DDP's peak − ZeRO-2's: the formulas' difference less the staging
    assert (
        gap["measured"] > 0 and abs(gap["measured"] - gap["predicted"]) <= 0.01 * gap["predicted"]
    )
    assert set(r["step_s"]) == {0, 1, 2, 3} and all(t > 0 for t in r["step_s"].values())
    nb = r["buckets_stage2"]
    assert nb > 1
    assert (
        r["calls"][1]["backward"] == {}
        and r["calls"][1]["step"]["reduce_scatter"] == r["buckets_stage1"]
    )
    assert (
        r["calls"][2]["backward"] == {"reduce_scatter": nb}
        and "reduce_scatter" not in r["calls"][2]["step"]
    )
    assert r["calls"][3]["forward"] == {"all_gather": len(r["units"])}
    assert r["calls"][0]["backward"].get("all_reduce", 0) > 0
    units = {u["name"]: u["gathered_bytes"] for u in r["units"]}
    g3 = max(r["peak"][3][ph]["transient"] for ph in ("forward", "backward"))
    k, rest = divmod(
        g3 - units["(root)"], units["blocks.0"]
    )  # blocks gathered at once: in use (+ prefetched)
    assert rest == 0 and 1 <= k <= 2
    assert (
        r["peak"][2]["backward"]["transient"] > 0 and r["peak"][2]["after step"]["transient"] == 0
    )
    assert len(set(r["activation_bytes"].values())) == 1 and r["activation_bytes"][0] > 0
    for st in range(4):
        top = max(r["peak"][st][ph]["total"] for ph in ("forward", "backward", "step"))
        assert top > r["peak"][st]["after step"]["model states"]
    psi = r["psi"]  # stage 0 after the step holds 16Ψ (+ Adam's 4-byte step counters)
    assert 16 * psi <= r["peak"][0]["after step"]["model states"] <= 16 * psi + 4 * 64
