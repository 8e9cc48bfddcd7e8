"""Expert parallelism: the EP MoE layer, the EP GPT and EP × DP equal one device; bytes equal the formula.

One spawn per world size (e = 2, 4): ``_suite`` runs every case and returns plain dicts; the tests
compare them with the one-device MoE computed here, in the test process. The capacity factor
(0.75) drops assignments, so "the same tokens dropped" is tested, not vacuous. Tolerances are the
named ones of :mod:`course_lib.results`: ``SGD`` for outputs and gradients before any update
(only the order of fp32 additions differs), ``ADAMW`` after AdamW steps.

The token all-to-alls call ``torch.distributed`` directly (``course_lib.comm`` has no all-to-all
wrapper, so :class:`~course_lib.comm.CommLog` does not see them): their bytes are *measured* on the
ranks by a dispatch mode that reads the split sizes of every ``c10d.alltoall_base_`` call, forward
and backward, and compared with :func:`~course_lib.expert_parallel.all_to_all_bytes` of the kept
matrix computed here from the one-device run. CommLog does see the counts' all-gather and the
gradient all-reduces.
"""

import functools

import pytest
import torch

from course_lib.configs import small_config
from course_lib.expert_parallel import all_to_all_bytes, kept_matrix, split_sizes
from course_lib.moe import MoE, MoEConfig, MoEGPT, route
from course_lib.results import ADAMW, SGD
from course_lib.train import step_batch

WORLDS = [2, 4]
CONFIG = small_config(mlp_ratio=2)  # d_model 32, 2 layers, expert hidden 64
MOE = MoEConfig(num_experts=8, top_k=2, capacity_factor=0.75, aux_loss_coef=0.5)
TOKENS, BATCH, STEPS, COEF = 64, 8, 3, MOE.aux_loss_coef


def _layer_case():
    """The same MoE layer, tokens and output weights in every process (seeded)."""
    torch.manual_seed(0)
    moe = MoE(CONFIG, MOE)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, CONFIG.d_model, generator=gen)
    w = torch.randn(TOKENS, CONFIG.d_model, generator=gen)
    return moe, x, w


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# =========================================================================== rank side


def _observer():
    """A dispatch mode recording, per all-to-all, the bytes this rank sends to *other* ranks."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllToAllBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase, self.calls = "forward", {"forward": [], "backward": []}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.c10d.alltoall_base_.default:
                _, inp, _, _, in_splits = args[:5]
                row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
                me = dist.get_rank()  # the layer runs on the default group
                sent = sum(s for q, s in enumerate(in_splits) if q != me)
                self.calls[self.phase].append(sent * row)
            return func(*args, **(kwargs or {}))

    return AllToAllBytes()


def _layer() -> dict:
    """The EP layer on this rank's chunk of the tokens: outputs, loss, gradients, drops, bytes."""
    import torch.distributed as dist

    from course_lib.comm import CommLog
    from course_lib.expert_parallel import ExpertParallelMoE, allreduce_expert_parallel_grads
    from course_lib.launch import device

    e, r = dist.get_world_size(), dist.get_rank()
    moe, x, w = _layer_case()
    ep = ExpertParallelMoE.from_moe(moe.to(device()))
    xr = x.chunk(e)[r].to(device()).requires_grad_(True)
    wr = w.chunk(e)[r].to(device())
    seen = _observer()
    with CommLog() as log, seen:
        y, aux, stats = ep(xr)
        loss = (y * wr).sum() / xr.shape[0] + COEF * aux  # the mean over this rank's tokens
        seen.phase = "backward"
        loss.backward()
    with CommLog() as grad_log:
        counts = allreduce_expert_parallel_grads(ep)
    return {
        "y": y.detach().cpu(),
        "aux": aux.item(),
        "loss": loss.item(),
        "x_grad": xr.grad.cpu(),
        "grads": {n: p.grad.cpu() for n, p in ep.named_parameters()},
        "dropped_mask": stats.dropped_mask.cpu(),
        "dropped": stats.dropped,
        "capacity": stats.capacity,
        "tokens_per_expert": stats.tokens_per_expert.cpu(),
        "kept_matrix": stats.kept_matrix.cpu(),
        "splits": (stats.send_splits, stats.recv_splits),
        "a2a_bytes": seen.calls,
        "comm": [(c.op, c.tag, c.tensor_bytes, c.dtype) for c in log.records],
        "grad_comm": [(c.op, c.tag, c.group) for c in grad_log.records],
        "grad_counts": counts,
    }


def _gpt_step() -> dict:
    """The EP GPT (no DP), one forward + backward on this rank's batch chunk."""
    import torch.distributed as dist

    from course_lib.expert_parallel import allreduce_expert_parallel_grads, expert_parallel_gpt
    from course_lib.launch import device
    from course_lib.train import shard_batch

    model = expert_parallel_gpt(MoEGPT(CONFIG, MOE, seed=0).to(device()))
    x, y = shard_batch(*step_batch(0, CONFIG, BATCH, device()))
    logits, loss = model(x, y)
    loss.backward()
    allreduce_expert_parallel_grads(model)
    losses = torch.tensor([loss.item()])
    dist.all_reduce(losses)  # mean over ranks = the one-device loss
    return {
        "logits": logits.detach().cpu(),
        "loss": losses.item() / dist.get_world_size(),
        "grads": {n: p.grad.cpu() for n, p in model.named_parameters()},
        "dropped": [s.dropped for s in model.routing_stats()],
    }


def _ep_dp() -> dict:
    """EP 2 × DP 2: STEPS AdamW steps, gradients averaged over the right groups."""
    from course_lib.comm import CommLog
    from course_lib.configs import make_optimizer
    from course_lib.expert_parallel import (
        allreduce_expert_parallel_grads,
        expert_data_parallel_mesh,
        expert_parallel_gpt,
    )
    from course_lib.launch import device
    from course_lib.train import shard_batch, train_step

    mesh = expert_data_parallel_mesh(2)
    dp_group = mesh.get_group("dp")
    model = expert_parallel_gpt(MoEGPT(CONFIG, MOE, seed=0).to(device()), mesh.get_group("ep"))
    opt = make_optimizer("adamw", model.parameters())
    with CommLog() as log:
        for step in range(STEPS):
            x, y = shard_batch(*step_batch(step, CONFIG, BATCH, device()))
            train_step(model, opt, x, y, lambda: allreduce_expert_parallel_grads(model, dp_group))
    return {
        "dp_rank": mesh.get_local_rank("dp"),
        "ep_rank": mesh.get_local_rank("ep"),
        "state": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "groups": sorted({(c.op, c.tag, c.group) for c in log.records}),
    }


def _hot_expert() -> dict:
    """Every token's first choice is expert 0 (on rank 0): the clock costs each expert by its tokens."""
    import torch.distributed as dist

    from course_lib.clock import AcceleratorClock
    from course_lib.expert_parallel import ExpertParallelMoE
    from course_lib.launch import device
    from course_lib.moe import expert_parts

    moe, x, _ = _layer_case()
    moe.moe = MoEConfig(num_experts=8, top_k=2, capacity_factor=None)
    with torch.no_grad():
        moe.router.weight[0, 0] += 20.0  # logit_0 ≥ 20 with x[:, 0] ≥ 1 (below): first choice
    ep = ExpertParallelMoE.from_moe(moe.to(device()))
    clock = AcceleratorClock(1e9, force=True)
    clock.apply(ep, parts=expert_parts(ep))
    x[:, 0] = x[:, 0].abs() + 1  # second choices stay the router's own
    xr = x.chunk(2)[dist.get_rank()].to(device())
    y, _, stats = ep(xr.requires_grad_(True))
    y.sum().backward()
    return {
        "slept": dict(clock.slept),
        "seconds": dict(clock.seconds),
        "kept": stats.kept_per_expert.cpu().tolist(),
        "experts": ep.expert_ids,
    }


def _bad_inputs() -> dict:
    import torch.distributed as dist
    import torch.nn as nn

    from course_lib.expert_parallel import (
        ExpertParallelMoE,
        expert_data_parallel_mesh,
        expert_parallel_gpt,
    )
    from course_lib.models import GPT

    e = dist.get_world_size()
    odd = MoEConfig(num_experts=2 * e - 1 if e > 2 else 3, top_k=1)
    ep = ExpertParallelMoE(MoE(CONFIG, MoEConfig(num_experts=2 * e)))
    return {
        "divisible": _error(lambda: ExpertParallelMoE(MoE(CONFIG, odd))),
        "mesh": _error(lambda: expert_data_parallel_mesh(3)),
        "not_moe": _error(lambda: ExpertParallelMoE.from_moe(nn.Linear(4, 4))),
        "dense_gpt": _error(lambda: expert_parallel_gpt(GPT(CONFIG))),
        "d_model": _error(lambda: ep(torch.randn(4, CONFIG.d_model + 1))),
    }


def _suite(world: int) -> dict:
    import torch.distributed as dist

    out = {"layer": _layer(), "gpt": _gpt_step(), "bad": _bad_inputs()}
    if world == 2:
        out["hot"] = _hot_expert()
    if world == 4:
        out["ep_dp"] = _ep_dp()
    dist.barrier()
    return out


@functools.lru_cache(maxsize=None)
def suite(world: int) -> list[dict]:
    from course_lib.launch import spawn

    return spawn(_suite, world, args=(world,), timeout=240)


# =========================================================================== one device


@functools.lru_cache(maxsize=None)
def one_device_layer():
    moe, x, w = _layer_case()
    x.requires_grad_(True)
    y, aux, stats = moe(x)
    loss = (y * w).sum() / TOKENS + COEF * aux
    loss.backward()
    _, _, experts = route(x.detach(), moe.router.weight, MOE.top_k, MOE.renormalize)
    return {
        "y": y.detach(),
        "aux": aux.item(),
        "loss": loss.item(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in moe.named_parameters()},
        "stats": stats,
        "experts": experts,
    }


def _kept_by_chunk(world: int) -> torch.Tensor:
    """(e × E) kept assignments per batch chunk and expert, from the one-device run alone."""
    ref = one_device_layer()
    keep = ~ref["stats"].dropped_mask
    rows = []
    for experts, kept in zip(ref["experts"].chunk(world), keep.chunk(world), strict=True):
        rows.append(torch.bincount(experts[kept], minlength=MOE.num_experts))
    return torch.stack(rows)


@functools.lru_cache(maxsize=None)
def one_device_gpt_step():
    model = MoEGPT(CONFIG, MOE, seed=0)
    logits, loss = model(*step_batch(0, CONFIG, BATCH))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return logits.detach(), loss.item(), grads, [s.dropped for s in model.routing_stats()]


@functools.lru_cache(maxsize=None)
def one_device_ep_dp(dp: int = 2):
    """One device: each step the mean of the dp shards' losses (each shard one EP group's tokens)."""
    from course_lib.configs import make_optimizer

    model = MoEGPT(CONFIG, MOE, seed=0)
    opt = make_optimizer("adamw", model.parameters())
    for step in range(STEPS):
        x, y = step_batch(step, CONFIG, BATCH)
        opt.zero_grad(set_to_none=True)
        loss = sum(model(xj, yj)[1] for xj, yj in zip(x.chunk(dp), y.chunk(dp), strict=True)) / dp
        loss.backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def _merged(results: list[dict], key: str = "grads") -> dict:
    merged = {}
    for r in results:
        merged.update(
            r[key]
        )  # dense names on every rank (equal after the all-reduce); experts once each
    return merged


# =========================================================================== no ranks


def test_kept_matrix_keeps_the_first_c_of_each_expert_in_rank_major_order():
    counts = torch.tensor([[3, 0, 5, 1], [2, 4, 0, 1], [4, 1, 2, 0]])
    kept = kept_matrix(counts, 4)
    assert kept.tolist() == [[3, 0, 4, 1], [1, 4, 0, 1], [0, 0, 0, 0]]
    assert split_sizes(kept[:2], 0) == ([3, 5], [3, 5])  # 2 ranks, experts {0, 1} and {2, 3}
    assert split_sizes(kept[:2], 1) == ([5, 1], [5, 1])


def test_all_to_all_bytes_formula_counts_other_ranks_only_and_the_padded_buffer():
    kept = torch.tensor([[3, 1, 2, 0], [1, 1, 4, 2]])  # 2 ranks; rank 0 holds experts 0, 1
    got = all_to_all_bytes(kept, d_model=8, element_size=4, capacity=5)
    assert got[0] == {"dispatch": 2 * 32, "combine": 2 * 32, "padded": 4 * 5 * 32}
    assert got[1] == {"dispatch": 2 * 32, "combine": 2 * 32, "padded": 4 * 5 * 32}
    lone = all_to_all_bytes(kept.sum(0, keepdim=True), d_model=8)  # e = 1: all local copies
    assert lone == [{"dispatch": 0, "combine": 0, "padded": None}]
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by ep_size=3"):
        all_to_all_bytes(torch.ones(3, 4, dtype=torch.long), d_model=8)


# =========================================================================== the EP layer


@pytest.mark.parametrize("world", WORLDS, ids=[f"ep={w}" for w in WORLDS])
def test_ep_layer_equals_one_device_outputs_loss_aux_and_gradients(world):
    ref, results = one_device_layer(), [r["layer"] for r in suite(world)]
    SGD.assert_close(torch.cat([r["y"] for r in results]), ref["y"], "y")
    SGD.assert_close(sum(r["aux"] for r in results) / world, ref["aux"], "aux (mean over ranks)")
    SGD.assert_close(sum(r["loss"] for r in results) / world, ref["loss"], "loss (mean over ranks)")
    # x.grad on a rank is ∂(its loss)/∂x; the model's loss is the mean over the ranks
    SGD.assert_close(torch.cat([r["x_grad"] for r in results]) / world, ref["x_grad"], "x.grad")
    merged = _merged(results)
    assert set(merged) == set(ref["grads"])  # router + every expert, each expert on one rank
    SGD.assert_close(merged, ref["grads"], "grads")
    for r in results:  # the router's gradient, all-reduced, is the same on every rank
        SGD.assert_close(r["grads"]["router.weight"], ref["grads"]["router.weight"], "router")
        assert r["grad_counts"] == {"dense": 1, "expert": 2 * MOE.num_experts // world}


@pytest.mark.parametrize("world", WORLDS, ids=[f"ep={w}" for w in WORLDS])
def test_ep_layer_drops_the_same_tokens_as_one_device(world):
    stats, results = one_device_layer()["stats"], [r["layer"] for r in suite(world)]
    assert stats.dropped > 0  # the capacity factor really drops
    assert torch.equal(torch.cat([r["dropped_mask"] for r in results]), stats.dropped_mask)
    for r in results:
        assert r["dropped"] == stats.dropped and r["capacity"] == stats.capacity
        assert torch.equal(r["tokens_per_expert"], stats.tokens_per_expert)
        assert torch.equal(r["kept_matrix"], _kept_by_chunk(world))


@pytest.mark.parametrize("world", WORLDS, ids=[f"ep={w}" for w in WORLDS])
def test_all_to_all_bytes_equal_the_formula_two_forward_two_backward(world):
    d = CONFIG.d_model
    kept = _kept_by_chunk(world)
    want = all_to_all_bytes(kept, d, 4, capacity=one_device_layer()["stats"].capacity)
    for rank, r in enumerate(suite(world)):
        a2a = r["layer"]["a2a_bytes"]
        w = want[rank]
        assert a2a["forward"] == [w["dispatch"], w["combine"]]  # dispatch, then combine
        assert a2a["backward"] == [w["dispatch"], w["combine"]]  # combine's backward, dispatch's
        assert 0 < w["dispatch"] < w["padded"]
        assert r["layer"]["splits"] == split_sizes(kept, rank)
        # CommLog sees the counts' all-gather (e × E int64), once, and nothing else of the layer
        assert r["layer"]["comm"] == [
            ("all_gather", "moe_counts", world * MOE.num_experts * 8, "int64")
        ]
        assert r["layer"]["grad_comm"] == [("all_reduce", "dense_grad", "default")]


# =========================================================================== the EP GPT, EP × DP


@pytest.mark.parametrize("world", WORLDS, ids=[f"ep={w}" for w in WORLDS])
def test_ep_gpt_forward_loss_and_grads_equal_one_device(world):
    logits, loss, grads, dropped = one_device_gpt_step()
    results = [r["gpt"] for r in suite(world)]
    assert all(d > 0 for d in dropped)
    SGD.assert_close(torch.cat([r["logits"] for r in results]), logits, "logits")
    SGD.assert_close(results[0]["loss"], loss, "loss")
    merged = _merged(results)
    assert set(merged) == set(grads)
    SGD.assert_close(merged, grads, "grads")
    assert all(r["dropped"] == dropped for r in results)


def test_ep2_x_dp2_adamw_steps_equal_one_device_and_grads_use_the_right_groups():
    results = [r["ep_dp"] for r in suite(4)]
    assert [(r["dp_rank"], r["ep_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    want = one_device_ep_dp()
    for dp in (0, 1):  # each DP replica of the EP group holds the whole model
        group = [r for r in results if r["dp_rank"] == dp]
        merged = _merged(group, "state")
        assert set(merged) == set(want)
        ADAMW.assert_close(merged, want, f"dp replica {dp}")
    for r in results:
        assert r["groups"] == [
            ("all_gather", "moe_counts", "ep"),
            ("all_reduce", "dense_grad", "default"),
            ("all_reduce", "expert_grad", "dp"),
        ]


# =========================================================================== cost and bad inputs


def test_a_hot_expert_costs_its_rank_the_modelled_time_of_its_tokens():
    from course_lib.moe import expert_flops

    r0, r1 = [r["hot"] for r in suite(2)]
    assert r0["kept"][0] == TOKENS  # every token chose expert 0
    for r in (r0, r1):
        for i in r["experts"]:
            want = expert_flops(r["kept"][i], CONFIG.d_model, 2 * CONFIG.d_model) / 1e9
            got = r["seconds"].get(f"experts.{i} fwd", 0.0)
            assert got == pytest.approx(want)
    assert r0["slept"]["forward"] > 2 * r1["slept"]["forward"]
    assert r0["slept"]["backward"] == pytest.approx(2 * r0["slept"]["forward"])


RULES = {
    "divisible": "is not divisible by ep_size=",
    "mesh": "dp · ep = world size",
    "not_moe": "needs a course_lib.moe.MoE",
    "dense_gpt": "has no MoE blocks",
    "d_model": "expected d_model=32",
}


@pytest.mark.parametrize("case", list(RULES))
@pytest.mark.parametrize("world", WORLDS, ids=[f"ep={w}" for w in WORLDS])
def test_bad_inputs_raise_errors_naming_the_rule(world, case):
    msg = suite(world)[0]["bad"][case]
    assert msg is not None and RULES[case] in msg, msg
    if case == "divisible":
        assert "num_experts=" in msg and f"ep_size={world}" in msg
