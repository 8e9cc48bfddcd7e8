"""The one-device MoE layer and the MoE GPT: router, capacity and drop rule, auxiliary loss, cost.

No ranks here. The layer is checked against a plain loop over tokens written in this file (every
token in order, each of its k choices kept while its expert has room), so the vectorised drop rule
(positions by cumulative counts) and the dispatch/combine by sorting are tested against the rule
as the docstring states it. Outputs within :data:`~course_lib.results.SGD` (summation order only);
drops, counts and capacities exactly.
"""

import math

import pytest
import torch

from course_lib.clock import AcceleratorClock, count_flops
from course_lib.configs import small_config
from course_lib.models import GPT
from course_lib.moe import (
    MoE,
    MoEConfig,
    MoEGPT,
    expert_capacity,
    expert_flops,
    expert_parts,
    load_balancing_loss,
    route,
    routing_history,
)
from course_lib.results import SGD
from course_lib.train import step_batch

CONFIG = small_config(mlp_ratio=2)
TOKENS = 48


def _layer(**moe):
    torch.manual_seed(0)
    layer = MoE(CONFIG, MoEConfig(**{"num_experts": 4, "top_k": 2, **moe}))
    x = torch.randn(TOKENS, CONFIG.d_model, generator=torch.Generator().manual_seed(1))
    return layer, x


def _loop_reference(layer: MoE, x: torch.Tensor):
    """The drop rule as stated: tokens in order, a choice kept while its expert has < C."""
    m = layer.moe
    probs, gates, experts = route(x, layer.router.weight, m.top_k, m.renormalize)
    C = expert_capacity(x.shape[0], m.num_experts, m.top_k, m.capacity_factor)
    taken = [0] * m.num_experts
    y = torch.zeros_like(x)
    dropped = torch.zeros(experts.shape, dtype=torch.bool)
    for t in range(x.shape[0]):
        for j in range(m.top_k):
            e = int(experts[t, j])
            if taken[e] < C:
                taken[e] += 1
                y[t] += gates[t, j] * layer.experts[e](x[t : t + 1])[0]
            else:
                dropped[t, j] = True
    return y, dropped, C, taken


@pytest.mark.parametrize(
    "moe",
    [
        dict(capacity_factor=0.75),
        dict(capacity_factor=1.25, top_k=1, renormalize=False),
        dict(capacity_factor=None, num_experts=8, top_k=3),
    ],
    ids=["drops", "switch_k1", "no_capacity"],
)
def test_moe_layer_equals_the_token_by_token_rule(moe):
    layer, x = _layer(**moe)
    with torch.no_grad():
        y, _, stats = layer(x)
        want_y, want_dropped, C, taken = _loop_reference(layer, x)
    SGD.assert_close(y, want_y, "y")
    assert torch.equal(stats.dropped_mask, want_dropped)
    assert stats.capacity == C and stats.kept_per_expert.tolist() == taken
    assert stats.dropped == int(want_dropped.sum())
    assert int(stats.tokens_per_expert.sum()) == TOKENS * layer.moe.top_k
    if moe["capacity_factor"] == 0.75:
        assert stats.dropped > 0 and max(taken) == C
    if moe["capacity_factor"] is None:
        assert stats.dropped == 0


def test_capacity_is_ceil_of_factor_times_tokens_times_k_over_experts():
    assert expert_capacity(64, 8, 2, 0.75) == 12
    assert expert_capacity(10, 3, 1, 1.25) == math.ceil(1.25 * 10 / 3) == 5
    assert expert_capacity(64, 8, 2, None) == 64
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        expert_capacity(64, 8, 2, 0)


def test_gates_renormalised_to_one_or_kept_as_router_probabilities():
    layer, x = _layer()
    probs, gates, experts = route(x, layer.router.weight, 2, renormalize=True)
    SGD.assert_close(gates.sum(-1), torch.ones(TOKENS), "Σ gates")
    _, raw, _ = route(x, layer.router.weight, 2, renormalize=False)
    SGD.assert_close(raw, probs.gather(1, experts), "raw gates")
    assert bool((raw.sum(-1) < 1).all())


def test_aux_loss_is_E_sum_f_P_one_when_uniform_E_when_collapsed():
    layer, x = _layer(capacity_factor=None)
    _, aux, stats = layer(x)
    probs, _, _ = route(x, layer.router.weight, 2)
    f = stats.tokens_per_expert / (TOKENS * 2)
    SGD.assert_close(aux, 4 * (f * probs.mean(0)).sum(), "aux")
    assert aux.requires_grad  # through P
    uniform = torch.full((4,), 0.25)
    SGD.assert_close(load_balancing_loss(uniform, uniform), torch.tensor(1.0), "uniform")
    one = torch.tensor([1.0, 0, 0, 0])
    SGD.assert_close(load_balancing_loss(one, one), torch.tensor(4.0), "collapsed")
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform P: aux = Σ f = 1 whatever the top-k picks
    SGD.assert_close(layer(x)[1], torch.tensor(1.0), "uniform router")


def test_moe_gpt_names_seed_tie_and_loss_with_aux():
    model = MoEGPT(CONFIG, MoEConfig(num_experts=4, aux_loss_coef=0.1), seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.1.mlp.router.weight" in names and "blocks.0.mlp.experts.3.c_proj.weight" in names
    assert not any(".mlp.c_fc" in n for n in names)  # no dense MLP left
    assert model.lm_head.weight is model.wte.weight
    state = MoEGPT(CONFIG, MoEConfig(num_experts=4), seed=0).state_dict()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    std = model.blocks[0].mlp.experts[0].c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * CONFIG.n_layer), rel=0.2)
    rng = torch.get_rng_state()
    MoEGPT(CONFIG, MoEConfig(), seed=1)
    assert torch.equal(rng, torch.get_rng_state())  # the caller's RNG untouched
    x, y = step_batch(0, CONFIG, 4)
    logits, loss = model(x, y)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    aux = sum(b.aux_loss for b in model.blocks)
    SGD.assert_close(loss, ce + 0.1 * aux, "loss")
    loss.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    assert len(model.routing_stats()) == CONFIG.n_layer


def test_routing_history_records_counts_and_the_aux_loss_changes_them():
    moe = dict(num_experts=4, top_k=2, capacity_factor=1.0)
    off = routing_history(CONFIG, MoEConfig(aux_loss_coef=0.0, **moe), 6, 4, lr=1e-2)
    on = routing_history(CONFIG, MoEConfig(aux_loss_coef=0.5, **moe), 6, 4, lr=1e-2)
    n = 4 * CONFIG.block_size
    assert off["tokens_per_expert"].shape == (6, CONFIG.n_layer, 4)
    assert bool((off["tokens_per_expert"].sum(-1) == n * 2).all())
    assert off["dropped"].shape == (6, CONFIG.n_layer) and off["capacity"] == n * 2 // 4
    assert torch.equal(off["tokens_per_expert"][0], on["tokens_per_expert"][0])  # same start
    assert not torch.equal(off["tokens_per_expert"], on["tokens_per_expert"])
    assert len(on["loss"]) == 6


def test_clock_costs_each_expert_by_the_tokens_routed_to_it():
    layer, x = _layer(capacity_factor=0.75)
    _, flops = count_flops(layer.experts[0], x[:5])
    assert flops == expert_flops(5, CONFIG.d_model, 2 * CONFIG.d_model)
    clock = AcceleratorClock(1e9, force=True)
    clock.apply(layer, parts=expert_parts(layer))
    _, _, stats = layer(x)
    for i, kept in enumerate(stats.kept_per_expert.tolist()):
        want = expert_flops(kept, CONFIG.d_model, 2 * CONFIG.d_model) / 1e9
        assert clock.seconds.get(f"experts.{i} fwd", 0.0) == pytest.approx(want)
    assert [name for name, _, _ in expert_parts(layer)] == [f"experts.{i}" for i in range(4)]


@pytest.mark.parametrize(
    "make, rule",
    [
        (lambda: MoEConfig(num_experts=4, top_k=5), "top_k=5 exceeds num_experts=4"),
        (lambda: MoEConfig(num_experts=0), "num_experts=0 must be an int >= 1"),
        (lambda: MoEConfig(capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
        (lambda: MoEConfig(aux_loss_coef=-1.0), "aux_loss_coef=-1.0 must be >= 0"),
        (lambda: _layer()[0](torch.randn(3, 7)), "expected d_model=32"),
        (lambda: expert_parts(GPT(CONFIG)), "holds no MoE experts"),
    ],
    ids=["top_k", "experts", "capacity", "aux_coef", "d_model", "dense_model"],
)
def test_bad_inputs_raise_errors_naming_the_rule(make, rule):
    with pytest.raises(ValueError, match=rule.replace("(", r"\(")):
        make()
