"""Pipeline parallelism: schedules valid, training equal to one device, bubbles as the formula says, live memory.

Every distributed case runs inside ONE spawn per world size (each spawn costs seconds on 2 cores):
``_suite`` trains every configuration (world 4 also PP × DP) and returns its results; the
parametrized tests read the case they name, check its rows (each rank compared itself with one
device) and compare the merged stages with a single-device run computed here.
"""

import functools

import pytest
import torch

from course_lib.experiments import pipeline as E
from course_lib.configs import parallel_config
from course_lib.formulas import pipeline_bubble, pipeline_p2p_bytes
from course_lib.launch import RankError, spawn
from course_lib.models import GPT
from course_lib.pipeline import (
    Action,
    LiveMicrobatches,
    PipelineObserver,
    PipelineRunner,
    Timeline,
    check_schedule,
    gpipe,
    interleaved_one_f_one_b,
    make_schedules,
    zero_bubble,
    measured_step,
    one_f_one_b,
    peak_live_microbatches,
    simulate,
    split_gpt,
    split_microbatches,
)
from course_lib.results import EXACT, SGD, for_optimizer
from course_lib.step_time import AGREEMENT_BAND, part_flops, pipeline_step, slowest_stage_step
from course_lib.train import reference_run, step_batch

STEPS, BATCH, M = 10, 16, 4
OPTS = ["sgd", "adamw"]
SCHEDULES = ["gpipe", "1f1b"]


def _suite(world: int) -> dict:
    """Rank function: every case of this world size; returns {case: result}."""
    out = {}
    for sched in SCHEDULES:
        for opt in OPTS:
            out[(sched, opt)] = E.pipeline_training(sched, opt, STEPS, M, BATCH)
    out[("zero_bubble", "sgd")] = E.pipeline_training("zero_bubble", "sgd", STEPS, M, BATCH)
    if world == 2:
        out[("interleaved", "sgd")] = E.pipeline_training(
            "interleaved", "sgd", STEPS, M, BATCH, num_chunks=2
        )
        for sched in ("gpipe", "1f1b", "interleaved"):
            out[("torch", sched)] = E.torch_pipelining_grads(sched, M, BATCH)
        out["bubbles"] = E.measure_bubbles(
            ("gpipe", "1f1b"), (1, 2, 4, 8), t_f=0.02, t_b=0.04, steps=5, warmup=1
        )
        # each of a rank's 2 chunks sleeps t_f/2: 20 ms keeps the host's work between its
        # ops (sends, receives, hooks) a small part of the step even on a loaded machine
        out["interleaved_bubbles"] = E.measure_bubbles(
            ("interleaved",), {"interleaved": (2, 4)}, t_f=0.04, steps=5, warmup=1
        )
        out["slow"] = E.unbalanced_timing(num_microbatches=2, t_f=0.02, factor=2, steps=2)
        out["timelines"] = E.gpt_timelines(
            ("gpipe", "1f1b"), num_microbatches=8, global_batch=16, steps=2
        )
        out["clocked"] = E.gpt_clocked(num_microbatches=2, global_batch=4, steps=1, warmup=0)
    if world == 4:
        out["zb_timing"] = E.zero_bubble_timing(4, t_f=0.02, steps=2, warmup=1)
        # 2 stages × 2 replicas
        out["pp_dp"] = E.pp_dp_training(
            num_stages=2,
            schedule="1f1b",
            optimizer="sgd",
            steps=5,
            num_microbatches=2,
            global_batch=16,
        )
    return out


@functools.lru_cache(maxsize=None)
def suite(world: int) -> list[dict]:
    return spawn(_suite, world, args=(world,), timeout=240)


@functools.lru_cache(maxsize=None)
def reference(opt: str, steps: int = STEPS) -> dict:
    return reference_run(parallel_config(), steps, BATCH, opt)[0].state_dict()


# =========================================================================== schedules (no ranks)


GRID = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("p,m", GRID, ids=[f"p={p},m={m}" for p, m in GRID])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedule_is_valid_and_bubble_matches_formula_in_unit_time(name, p, m):
    scheds = make_schedules(name, p, m)
    events = simulate(scheds, m, t_f=1.0, t_b=2.0)  # raises if any dependency cannot be met
    step = max(e.end for tl in events for e in tl)
    assert step == pytest.approx(3.0 * (m + p - 1))  # (m + p − 1) slots of t_F + t_B
    for r, acts in enumerate(scheds):
        want = m if name == "gpipe" else min(p - r, m)
        assert peak_live_microbatches(acts) == want


@pytest.mark.parametrize(
    "p,m,v", [(2, 2, 2), (2, 4, 2), (2, 8, 2), (4, 4, 2), (4, 8, 2), (2, 4, 3), (3, 6, 2)]
)
def test_interleaved_schedule_is_valid_and_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, m, v):
    scheds = make_schedules("interleaved", p, m, num_chunks=v)
    events = simulate(scheds, m, v, t_f=1.0 / v, t_b=2.0 / v)  # a chunk does 1/v of a stage's work
    busy = 3.0 * m
    step = max(e.end for tl in events for e in tl)
    assert 1 - busy / step == pytest.approx(pipeline_bubble(p, m, v))


@pytest.mark.parametrize("p,m", GRID, ids=[f"p={p},m={m}" for p, m in GRID])
def test_zero_bubble_is_valid_and_idles_p_minus_1_times_f_plus_b_minus_w(p, m):
    scheds = make_schedules("zero_bubble", p, m)
    events = simulate(scheds, m, t_f=1.0, t_b=1.0, t_w=1.0)  # raises if a dependency cannot be met
    step = max(e.end for tl in events for e in tl)
    if m >= p:  # the steady state the formula describes; 1F1B idles (p−1)(F+B+W) = 3(p−1)
        assert step - 3.0 * m == pytest.approx((p - 1) * (1 + 1 - 1))
    for acts in scheds:  # 1F1B's F / B order, one W per B after it
        assert [a for a in acts if a.op != "W"] == one_f_one_b(p, m, scheds.index(acts))
        assert sorted(a.microbatch for a in acts if a.op == "W") == list(range(m))


def test_zero_bubble_defers_w_into_the_cooldown():
    assert zero_bubble(2, 4, 0) == [
        Action(op, i)
        for op, i in [("F", 0), ("F", 1), ("B", 0), ("W", 0), ("F", 2), ("B", 1)]
        + [("W", 1), ("F", 3), ("B", 2), ("W", 2), ("B", 3), ("W", 3)]
    ]


def test_weight_gradient_rules_are_checked():
    with pytest.raises(ValueError, match="weight gradient before its backward"):
        check_schedule([Action("F", 0), Action("W", 0), Action("B", 0)], 1)
    with pytest.raises(ValueError, match="micro-batch 1 has no W"):
        check_schedule(
            [Action("F", 0), Action("F", 1), Action("B", 0), Action("W", 0), Action("B", 1)], 2
        )


def test_one_f_one_b_alternates_after_warmup():
    assert one_f_one_b(4, 6, 1) == [
        Action("F", 0),
        Action("F", 1),
        Action("F", 2),
        Action("B", 0),
        Action("F", 3),
        Action("B", 1),
        Action("F", 4),
        Action("B", 2),
        Action("F", 5),
        Action("B", 3),
        Action("B", 4),
        Action("B", 5),
    ]
    assert gpipe(2, 2, 0) == [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]


def test_formulas():
    assert pipeline_bubble(4, 4) == pytest.approx(3 / 7)
    assert pipeline_bubble(4, 4, 2) == pytest.approx(3 / 11)
    assert pipeline_p2p_bytes(2, 4, 100, stage=0) == 400  # activations forward only
    assert pipeline_p2p_bytes(4, 4, 100, stage=1) == 800  # activations forward + gradients backward


# =========================================================================== bad inputs (no ranks)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="more stages than layers"):
        split_gpt(GPT(parallel_config()), 5)


def test_interleaving_more_virtual_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="v·p > layers"):
        split_gpt(GPT(parallel_config()), 2, num_chunks=3)


def test_tied_weights_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="tied weights"):
        split_gpt(GPT(parallel_config(tie_weights=True)), 2)


@pytest.mark.parametrize("m", [0, -1, 1.5])
def test_microbatches_below_one_are_refused(m):
    for fn in (gpipe, one_f_one_b):
        with pytest.raises(ValueError, match="num_microbatches"):
            fn(2, m, 0)


def test_batch_not_divisible_into_microbatches_is_refused():
    with pytest.raises(ValueError, match="not divisible into num_microbatches=3"):
        split_microbatches(torch.zeros(8, 4), 3)


def test_backward_before_forward_is_refused():
    with pytest.raises(ValueError, match="backward before its forward"):
        check_schedule([Action("B", 0), Action("F", 0)], 1)
    bad = make_schedules("gpipe", 2, 2)
    bad[1] = [Action("F", 0), Action("B", 1), Action("F", 1), Action("B", 0)]
    with pytest.raises(ValueError, match="stage 1: .*backward before its forward"):
        simulate(bad, 2)


def test_cross_stage_deadlock_is_refused():
    scheds = make_schedules("gpipe", 2, 2)
    scheds[0] = [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)]  # fine alone
    scheds[1] = [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]
    simulate(scheds, 2)  # valid: orders differ, dependencies can be met
    scheds[0] = [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]
    scheds[1] = [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(scheds, 2)  # stage 0 waits for B0 from stage 1, which waits for F1 from stage 0


def test_interleaved_needs_m_divisible_by_p():
    with pytest.raises(ValueError, match="divisible by num_stages"):
        interleaved_one_f_one_b(2, 3, 0, 2)


def _raising_stage():
    """Rank function: stage 1's forward raises on its second micro-batch."""
    import torch.distributed as dist

    from course_lib.launch import device

    class Boom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if dist.get_rank() == 1 and self.calls == 2:
                raise RuntimeError("boom")
            return self.lin(x)

    runner = PipelineRunner(
        [Boom()],
        dist.get_rank(),
        make_schedules("1f1b", 2, 4),
        4,
        activation_shape=(2, 4),
        loss_fn=lambda out, y: out.pow(2).mean(),
        device=device(),
    )
    x = torch.randn(8, 4)
    runner.step(x, x)


class _Calls(PipelineObserver):
    """Counts every hook: an observer written outside the runner."""

    def __init__(self):
        self.calls = []

    def begin(self, kind, microbatch, chunk):
        self.calls.append(("begin", kind, microbatch))

    def end(self, kind, microbatch, chunk):
        self.calls.append(("end", kind, microbatch))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_observers_see_every_action_and_change_nothing(name):
    """One stage (p = 1: no messages, no process group): observed and unobserved steps give the same bits."""
    config, m = parallel_config(), 4
    x, y = step_batch(0, config, 8, "cpu")
    grads = []
    for observe in (False, True):
        stage = split_gpt(GPT(config, seed=0), 1)[0]
        runner = PipelineRunner(
            [stage],
            0,
            make_schedules(name, 1, m),
            m,
            activation_shape=(2, config.block_size, config.d_model),
            device="cpu",
        )
        calls, timeline, live = _Calls(), Timeline(), LiveMicrobatches()
        losses = runner.step(x, y, observers=(calls, timeline, live) if observe else ())
        grads.append({n: q.grad.clone() for n, q in stage.named_parameters()})
    EXACT.assert_close(grads[1], grads[0], "observers must not change the step")
    want = [
        (h, a.op, a.microbatch) for a in make_schedules(name, 1, m)[0] for h in ("begin", "end")
    ]
    assert calls.calls == want  # no waits on one stage
    assert [(e.kind, e.microbatch) for e in timeline.events] == [
        (a.op, a.microbatch) for a in runner.schedules[0]
    ]
    assert live.peak == peak_live_microbatches(runner.schedules[0]) and live.live == 0
    assert len(losses) == m
    stats = measured_step(runner, x, y)
    assert stats.peak_live_microbatches == live.peak and stats.peak_live_bytes > 0
    assert (
        len(stats.live_bytes) == 2 * m and stats.live_bytes[-1][1] == 0
    )  # every saved tensor released


def test_a_stage_raising_mid_schedule_names_the_stage_and_does_not_hang():
    with pytest.raises(
        RankError, match=r"pipeline stage 1 \(rank 1\) failed in F1: RuntimeError: boom"
    ) as err:
        spawn(_raising_stage, 2, timeout=60)
    assert err.value.rank == 1


# =========================================================================== equality with one device


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("sched", SCHEDULES)
def test_pipeline_training_matches_single_device(sched, opt, world):
    results = [r[(sched, opt)] for r in suite(world)]
    for r in results:  # each rank against one device trained on that rank
        r.assert_passed()
    got, ref = E.merge_states(results), reference(opt)
    assert set(got) == set(ref)  # every parameter on exactly one stage
    for_optimizer(opt).assert_close(got, ref, f"{sched}, {opt}, p={world}")


@pytest.mark.parametrize("world", [2, 4])
def test_zero_bubble_training_matches_single_device(world):
    results = [r[("zero_bubble", "sgd")] for r in suite(world)]
    for r in results:
        r.assert_passed()
    SGD.assert_close(E.merge_states(results), reference("sgd"), f"zero bubble, p={world}")


def test_zero_bubble_split_backward_gives_one_backwards_gradients():
    """p = 1: B (input gradient) + W (weight gradients) = one torch.autograd.backward, bit for bit."""
    config, m = parallel_config(), 4
    x, y = step_batch(0, config, 8, "cpu")
    grads = []
    for name in ("1f1b", "zero_bubble"):
        stage = split_gpt(GPT(config, seed=0), 1)[0]
        shape = (2, config.block_size, config.d_model)
        runner = PipelineRunner([stage], 0, make_schedules(name, 1, m), m, activation_shape=shape)
        stats = measured_step(runner, x, y)
        assert stats.live_bytes[-1][1] == 0  # W released every micro-batch's graph
        grads.append({n: q.grad for n, q in stage.named_parameters()})
    EXACT.assert_close(grads[1], grads[0], "zero bubble's B + W vs one backward")


def test_zero_bubble_idles_less_than_1f1b_on_four_ranks():
    res = suite(4)[0]["zb_timing"]
    one, zb = res.rows
    assert zb["W"] > 0 and one["W"] == 0  # W steps ran, costed by the clock
    # formulas: 3·(F+B+W) vs 3·(F+B−W) with F = B = W = 20 ms; timing: only the order is asserted
    assert all(z < 0.7 * o for z, o in zip(zb["idle"], one["idle"], strict=True)), res
    assert {e[0] for tl in res.timelines["zero_bubble"] for e in tl} >= {"F", "B", "W"}


def test_interleaved_training_matches_single_device():
    results = [r[("interleaved", "sgd")] for r in suite(2)]
    for r in results:
        r.assert_passed()
    SGD.assert_close(E.merge_states(results), reference("sgd"), "interleaved 1F1B")


@pytest.mark.parametrize("sched", ["gpipe", "1f1b", "interleaved"])
def test_torch_pipelining_gives_our_gradients_bit_for_bit(sched):
    for r in suite(2):
        r[("torch", sched)].assert_passed()  # EXACT: the same operations in the same order
        assert r[("torch", sched)].max_grad_diff == 0.0


def test_pp_times_dp_matches_single_device():
    res = [r["pp_dp"] for r in suite(4)]
    for r in res:  # its stage vs one device, one all-reduce per parameter and step, one group
        r.assert_passed()
    ref = reference("sgd", 5)
    for replica in (0, 1):
        SGD.assert_close(
            E.merge_states([r for r in res if r.replica == replica]), ref, f"replica {replica}"
        )
    assert (
        len({g for r in res for g in r.groups}) == 2
    )  # stage 0's group and stage 1's, never across stages


# =========================================================================== bubbles and memory, measured


@pytest.mark.parametrize("sched", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_sleep_bubble_within_005_of_formula(sched, m):
    res = suite(2)[0]["bubbles"]
    row = next(r for r in res.checks() if r.quantity.startswith(f"{sched}, p=2, m={m}:"))
    assert row.reference == pipeline_bubble(2, m)
    assert row.verdict, row  # the rank farthest from the formula is within 0.05 of it
    per_rank = next(r for r in res.rows if r["schedule"] == sched and r["m"] == m)["per_rank"]
    assert all(abs(b - row.reference) <= abs(row.measured - row.reference) for b in per_rank)


def test_sleep_bubble_stages_are_costed_by_the_shared_clock():
    res = suite(2)[0]["bubbles"]
    assert res.clock.startswith("modelled accelerator clock") and res.clock in res.title
    assert all(r["clock"] == res.clock for r in res.rows)
    # every step of every m: m forwards of t_F and m backwards of t_B on each rank, 1 + 5 steps
    want = 2 * (1 + 5) * sum((1, 2, 4, 8)) * (res.t_f + res.t_b)  # 2 schedules
    assert res.slept == pytest.approx(want, rel=1e-9), "the clock slept every F and B"


def test_bubble_result_survives_as_dict_and_back():
    res = suite(2)[0]["bubbles"]
    again = E.BubbleResult(**res.as_dict())
    assert again.claims() == res.claims() and len(again.claims()) == 8


def test_interleaved_bubble_measured_within_005_of_p_minus_1_over_vm_plus_p_minus_1():
    res = suite(2)[0]["interleaved_bubbles"]
    assert [(r["schedule"], r["m"]) for r in res.rows] == [("interleaved", 2), ("interleaved", 4)]
    for row, r in zip(res.checks(), res.rows, strict=True):
        assert row.reference == pipeline_bubble(2, r["m"], 2)
        assert row.verdict, row
    # v = 2 chunks: a smaller bubble than 1F1B's at the same m
    one = {
        r["m"]: max(r["per_rank"]) for r in suite(2)[0]["bubbles"].rows if r["schedule"] == "1f1b"
    }
    assert all(max(r["per_rank"]) < one[r["m"]] for r in res.rows)


def test_slowest_stage_step_is_the_simulated_step():
    """GPipe wherever the slowest stage is; 1F1B with it last (exact) or earlier (an upper bound)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        p = int(torch.randint(2, 6, (1,), generator=gen))
        m = int(torch.randint(1, 9, (1,), generator=gen))
        f = (0.01 + 0.09 * torch.rand(p, generator=gen)).tolist()
        want = slowest_stage_step(f, m)
        for name in ("gpipe", "1f1b"):
            sim = pipeline_step([[tuple(a) for a in s] for s in make_schedules(name, p, m)], f, m)
            if name == "gpipe" or f.index(max(f)) == p - 1:
                assert sim.total == pytest.approx(want, rel=1e-9), (name, p, m, f)
            else:
                assert sim.total <= want * (1 + 1e-9), (name, p, m, f)
    assert slowest_stage_step([0.04, 0.04], 4) == pytest.approx((4 + 2 - 1) * 0.12)
    with pytest.raises(ValueError, match="num_microbatches >= 1"):
        slowest_stage_step([0.04], 0)


def test_slow_stage_sets_the_pace_of_the_measured_step():
    res = suite(2)[0]["slow"]
    assert res.slow_stage == 1 and [r["schedule"] for r in res.rows] == ["gpipe", "1f1b"]
    for r in res.rows:
        assert r["predicted"] == pytest.approx(2 * 0.12 + 0.06)  # m·(F+B)_slow + (F+B)_fast
        assert abs(r["step"] - r["predicted"]) <= AGREEMENT_BAND * r["predicted"], r
        assert (
            r["per_rank"][0] > pipeline_bubble(2, 2) + 0.1
        )  # the fast stage waits for the slow one
    assert res.passed


def test_clocked_gpt_is_predicted_from_each_stages_flops_over_the_rate():
    """The plumbing of gpt_clocked's prediction (no assertion on measured seconds)."""
    res, cfg = suite(2)[0]["clocked"], parallel_config()
    flops = E.gpt_stage_flops(cfg, 2, 2)
    whole = part_flops(GPT(cfg, seed=0), *step_batch(0, cfg, 2, "cpu"))
    assert res.stage_flops == flops and sum(flops) == sum(f for _, _, f in whole)
    assert flops[1] > flops[0]  # the last stage also runs the head and the loss
    assert res.stage_forward_s == pytest.approx([f / res.rate for f in flops], rel=1e-12)
    assert res.clock.startswith("modelled accelerator clock")
    assert [r["schedule"] for r in res.rows] == ["gpipe", "1f1b"]
    for r in res.rows:
        sim = pipeline_step(make_schedules(r["schedule"], 2, 2), res.stage_forward_s, 2)
        assert r["predicted"] == pytest.approx(sim.total, rel=1e-12)
        busy = [2 * 3 * f for f in res.stage_forward_s]  # m·(F + 2F) per stage
        assert r["simulated"] == pytest.approx([1 - b / sim.total for b in busy], rel=1e-12)
        for bubble, split in zip(r["bubble"], r["split"], strict=True):  # the split adds up
            assert bubble == pytest.approx(
                split["fill_drain"] + split["waiting"] + split["overhead"]
            )
    names = [row.quantity for row in res.checks()]
    assert names == [
        f"{s}, p=2, m=2: {q}"
        for s in ("gpipe", "1f1b")
        for q in ("step (s)", "rank 0 bubble 1 − busy/step", "rank 1 bubble 1 − busy/step")
    ]
    with pytest.raises(ValueError, match="one stage per rank"):
        E.gpt_clocked(("interleaved",))


def test_idle_split_adds_up_to_the_bubble():
    events = [[tuple(e) for e in tl] for tl in simulate(make_schedules("1f1b", 2, 4), 4)]
    events[0].append(("wait", 0, -1, 2.0, 3.0))  # blocked between its first and last action
    split = E.idle_split(events)
    assert [s.step for s in split] == [15.0, 15.0]  # (m + p − 1)·(F + B) slots
    assert [s.compute for s in split] == [12.0, 12.0]
    assert split[0].waiting == 1.0 and split[1].fill_drain == 3.0
    for s in split:
        assert s.compute + s.fill_drain + s.waiting + s.overhead == pytest.approx(s.step)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_live_microbatches_gpipe_m_1f1b_at_most_p_minus_stage(m):
    res = suite(2)[0]["bubbles"]
    assert next(r for r in res.rows if r["schedule"] == "gpipe" and r["m"] == m)["peak_live"] == m
    assert (
        next(r for r in res.rows if r["schedule"] == "1f1b" and r["m"] == m)["peak_live"] <= 2
    )  # rank 0: p − 0


def test_one_f_one_b_holds_fewer_live_activation_bytes_than_gpipe():
    for r in suite(2):
        t = r["timelines"]
        t.assert_passed()  # live micro-batches as predicted, bytes sent as the formula, the bytes ratio
        g, o = t.schedules["gpipe"], t.schedules["1f1b"]
        assert g["peak_live"] == 8
        assert o["peak_live"] == 2 - t.rank
        # bytes follow the live micro-batches: 8 vs 2 (rank 0), 8 vs 1 (rank 1), with a margin
        assert g["peak_live_bytes"] / o["peak_live_bytes"] >= 0.8 * 8 / o["peak_live"]


def test_p2p_bytes_match_prediction():
    for r in suite(2):
        t = r["timelines"]
        want = pipeline_p2p_bytes(2, 8, t.activation_bytes, stage=t.rank)
        for sched in ("gpipe", "1f1b"):
            assert t.schedules[sched]["sent_bytes"] == want


def test_exercise_checker_rejects_gpipe_order_naming_the_first_wrong_action(learner_answer):
    run = learner_answer(
        "pipeline",
        "from course_lib.pipeline import gpipe\n"
        "def one_f_one_b_schedule(p, m, stage):\n    return gpipe(p, m, stage)\n",
    )
    res = run("one_f_one_b_schedule")
    assert res.status == "failed"
    assert "p=1, m=2, stage=0: action 1 is F1, 1F1B runs B0" in res.message


def _crossing_messages():
    """Rank function: both ranks send a large tensor to each other in one batch (1F1B's crossing)."""
    import torch.distributed as dist

    from course_lib import comm
    from course_lib.pipeline import post_together

    rank, n = dist.get_rank(), 1 << 20  # 4 MiB each way
    out = torch.full((n,), float(rank))
    buf = torch.empty(n)
    with comm.CommLog() as log:
        works = post_together([("send", out, 1 - rank, "grad"), ("recv", buf, 1 - rank, "act")])
        for ws in works:
            for w in ws:
                w.wait()
    return buf[0].item(), log.total(op="send", tag="grad"), log.total(op="recv", tag="act")


def test_sends_and_receives_posted_together_cross_and_are_counted():
    got = spawn(_crossing_messages, 2, timeout=60)
    assert got == [(1.0, 4 << 20, 4 << 20), (0.0, 4 << 20, 4 << 20)]
