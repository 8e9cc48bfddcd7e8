"""Tensor parallelism: our Megatron layers, the TP GPT, DTensor's version and DP×TP equal one device.

Every distributed case runs inside ONE spawn per world size (each spawn costs seconds on 2 cores):
``_suite`` runs every case and returns shards, counts and error messages; the tests below check the
results' own rows (where a rank compared itself with one device) and compare them with a
single-device run computed here, in the test process. Equality is the named tolerance of
:mod:`course_lib.results`: ``SGD`` for outputs and gradients of a technique against one device (no
update yet, only fp32 reordering), ``ADAMW`` after AdamW steps.
"""

import functools

import pytest
import torch
import torch.nn as nn

from course_lib.configs import parallel_config
from course_lib.experiments import tensor_parallel as E
from course_lib.models import GPT, MLP, CausalSelfAttention
from course_lib.results import ADAMW, SGD
from course_lib.tensor_parallel import parallelize_gpt, qkv_rows
from course_lib.train import reference_run, step_batch

WORLDS = [2, 4]
STEPS, BATCH = 10, 8


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _modules(config) -> dict:
    """Rank function part: TP attention and TP MLP alone (bias-free, from seed-0 weights) on a fixed input."""
    import torch.distributed as dist

    from course_lib.launch import device
    from course_lib.tensor_parallel import parallelize_attention, parallelize_mlp

    torch.manual_seed(0)
    attn, mlp = CausalSelfAttention(config), MLP(config)
    x = torch.randn(2, config.block_size, config.d_model).to(device())
    out = {}
    for name, m in (
        ("attention", parallelize_attention(attn.to(device()), config.n_head)),
        ("mlp", parallelize_mlp(mlp.to(device()))),
    ):
        xi = x.clone().requires_grad_(True)
        m(xi).pow(2).sum().backward()
        out[name] = {
            "y": m(x).detach().cpu(),
            "x_grad": xi.grad.cpu(),
            "grads": {n: p.grad.cpu() for n, p in m.named_parameters()},
        }
    dist.barrier()
    return out


def _bad_inputs() -> dict:
    """Rank function part: each broken rule's error message (None if nothing was raised)."""
    import torch.distributed as dist

    from course_lib.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        parallelize_attention,
        tensor_parallel_gpt,
    )

    t = dist.get_world_size()
    odd = 4 * t + 1  # not divisible by t
    attn = CausalSelfAttention(parallel_config())
    attn.c_attn = nn.Linear(64, 128, bias=False)
    return {
        "heads": _error(
            lambda: tensor_parallel_gpt(
                GPT(
                    parallel_config(
                        n_head=2 * t + 1 if t > 2 else 1, d_model=16 * (2 * t + 1) if t > 2 else 16
                    )
                )
            )
        ),
        "hidden": _error(lambda: ColumnParallelLinear(16, odd)),
        "row_hidden": _error(lambda: RowParallelLinear(odd, 16)),
        "vocab": _error(lambda: VocabParallelEmbedding(odd, 16)),
        "vocab_gpt": _error(lambda: tensor_parallel_gpt(GPT(parallel_config(vocab_size=odd)))),
        "from_linear_shape": _error(lambda: ColumnParallelLinear.from_linear(nn.Linear(16, odd))),
        "from_linear_type": _error(lambda: RowParallelLinear.from_linear(nn.Conv1d(16, 16, 1))),
        "attention_shape": _error(lambda: parallelize_attention(attn, 4)),
        "mesh": _error(lambda: E.dp_tp_training(steps=1, mesh_shape=(t, t))),
    }


def _suite(world: int) -> dict:
    """Rank function: every case of this world size; returns {case: result}."""
    config = parallel_config()
    out = {
        "layers": E.linear_layers(bias=True),
        "layers_nobias": E.linear_layers(bias=False),
        "modules": _modules(config),
        "tp": E.tp_step(config, BATCH),
        "sp": E.tp_step(config, BATCH, sequence_parallel=True),
        "tied": E.tp_step(parallel_config(tie_weights=True), BATCH),
        "train": E.tp_training(STEPS, "adamw", BATCH, config),
        "dtensor": E.dtensor_step(config, BATCH),
        "dtensor_sp": E.dtensor_sequence_parallel_blocks(config),
        "bad": _bad_inputs(),
    }
    # sequence parallelism without the LayerNorm-gradient all-reduce: the partial gradients
    from course_lib.launch import device
    from course_lib.tensor_parallel import tensor_parallel_gpt

    m = tensor_parallel_gpt(GPT(config, seed=0).to(device()), sequence_parallel=True)
    m(*step_batch(0, config, BATCH, device()))[1].backward()
    out["sp_partial"] = {
        n: p.grad.cpu() for n, p in m.named_parameters() if ".ln_" in n or n.startswith("ln_")
    }
    if world == 2:
        out["train_sp"] = E.tp_training(STEPS, "adamw", BATCH, config, sequence_parallel=True)
    if world == 4:
        out["dp_tp"] = E.dp_tp_training(5, "adamw", BATCH, config)
        out["fsdp_tp"] = E.fsdp_tp_step(config, BATCH)
    return out


@functools.lru_cache(maxsize=None)
def suite(world: int) -> list[dict]:
    from course_lib.launch import spawn

    return spawn(_suite, world, args=(world,), timeout=240)


@functools.lru_cache(maxsize=None)
def one_device_step():
    config = parallel_config()
    model = GPT(config, seed=0)
    logits, loss = model(*step_batch(0, config, BATCH))
    loss.backward()
    return logits.detach(), loss.item(), {n: p.grad for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def reference(steps: int):
    return reference_run(parallel_config(), steps, BATCH, "adamw")[0].state_dict()


def _assert_all_close(got: dict, want: dict, tol=SGD):
    assert set(got) == set(want)
    tol.assert_close(got, want)


# =========================================================================== no ranks


@pytest.mark.parametrize("t", [1, 2, 4])
def test_qkv_rows_give_each_rank_whole_heads_of_q_k_and_v(t):
    a, hd = 4, 16
    seen = []
    for r in range(t):
        rows = qkv_rows(a, hd, t, r)
        heads = range(r * a // t, (r + 1) * a // t)
        for j, w in enumerate("qkv"):  # layout [q_0 k_0 v_0 | q_1 k_1 v_1 | …]
            assert rows[w] == [(3 * h + j) * hd + d for h in heads for d in range(hd)]
        block = sorted(rows["q"] + rows["k"] + rows["v"])
        assert block == list(
            range(r * 3 * a * hd // t, (r + 1) * 3 * a * hd // t)
        )  # a contiguous block
        seen += block
    assert sorted(seen) == list(range(3 * a * hd))


def test_tp_and_dp_traffic_formulas():
    from course_lib.formulas import (
        dp_ring_bytes_per_token,
        tp_allreduce_bytes_per_layer,
        tp_ring_bytes_per_token,
    )

    assert tp_allreduce_bytes_per_layer(2, 16, 64) == {
        "calls": 4,
        "tensor_bytes": 4 * 2 * 16 * 64 * 4,
    }
    assert tp_ring_bytes_per_token(4, 64, 2) == 4 * 4 * 64 * 4 * 1.0  # 2(t−1)/t = 1 at t = 2
    assert tp_ring_bytes_per_token(4, 64, 4) == pytest.approx(4 * 4 * 64 * 4 * 1.5)
    assert dp_ring_bytes_per_token(1000, 2, 10) == 1000 * 4 / 10
    assert (
        dp_ring_bytes_per_token(1000, 2, 20) == dp_ring_bytes_per_token(1000, 2, 10) / 2
    )  # falls with the batch
    for bad in (
        lambda: tp_ring_bytes_per_token(0, 64, 2),
        lambda: dp_ring_bytes_per_token(1000, 2, 0),
        lambda: tp_allreduce_bytes_per_layer(0, 16, 64),
    ):
        with pytest.raises(ValueError, match=r"must be|>= 1|> 0"):
            bad()


def test_mesh_whose_product_is_not_the_world_size_is_refused():
    with pytest.raises(
        ValueError, match="product of the mesh dimensions must equal the number of ranks"
    ):
        E.check_mesh((2, 3), 4)
    E.check_mesh((2, 2), 4)


# =========================================================================== layers


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_parallel_linear_equals_nn_linear_outputs_and_grads(world, kind, bias):
    for r in suite(world):  # each rank compared its layers with nn.Linear
        r["layers" if bias else "layers_nobias"].assert_passed()
    results = [r["layers" if bias else "layers_nobias"].layers[kind] for r in suite(world)]
    gen = torch.Generator().manual_seed(0)
    full = nn.Linear(16, 24, bias=bias)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(4, 16, generator=gen).requires_grad_(True)
    w = torch.randn(4, 24, generator=gen)
    y = full(x)
    (y * w).sum().backward()
    dim = 0 if kind == "column" else 1
    for r in results:
        SGD.assert_close(r["y"], y.detach(), "y")
        SGD.assert_close(r["x_grad"], x.grad, "x.grad")
    SGD.assert_close(
        torch.cat([r["weight_grad"] for r in results], dim), full.weight.grad, "weight.grad"
    )
    if bias:  # column: each rank its slice; row: the full bias, added once (not t times)
        got = (
            torch.cat([r["bias_grad"] for r in results])
            if kind == "column"
            else results[0]["bias_grad"]
        )
        SGD.assert_close(got, full.bias.grad, "bias.grad")


@pytest.mark.parametrize("name", ["attention", "mlp"])
@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_tp_attention_and_mlp_equal_single_device(world, name):
    config = parallel_config()
    torch.manual_seed(0)
    modules = {"attention": CausalSelfAttention(config), "mlp": MLP(config)}
    x = torch.randn(2, config.block_size, config.d_model).requires_grad_(True)
    m = modules[name]
    m(x).pow(2).sum().backward()
    results = [r["modules"][name] for r in suite(world)]
    for r in results:
        SGD.assert_close(r["y"], m(x).detach(), "y")
        SGD.assert_close(r["x_grad"], x.grad, "x.grad")
    for n, p in m.named_parameters():
        dim = 1 if n.endswith("c_proj.weight") else 0
        SGD.assert_close(torch.cat([r["grads"][n] for r in results], dim), p.grad, n)


# =========================================================================== the TP GPT


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_tp_gpt_forward_and_grads_equal_single_device(world, sp):
    results = [r["sp" if sp else "tp"] for r in suite(world)]
    logits, loss, grads = one_device_step()
    SGD.assert_close(
        torch.cat([r["logits"] for r in results], -1), logits, "logits"
    )  # V/t columns each
    for r in results:
        SGD.assert_close(r["loss"], loss, "loss")
    _assert_all_close(E.merge_shards(results), grads)


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_tied_embedding_and_head_stay_tied_as_one_vocab_shard_and_equal_single_device(world):
    config = parallel_config(tie_weights=True)
    model = GPT(config, seed=0)
    logits, loss = model(*step_batch(0, config, BATCH))
    loss.backward()
    results = [r["tied"] for r in suite(world)]
    assert "lm_head.weight" not in results[0]["grads"]  # one parameter (wte.weight), used twice
    SGD.assert_close(torch.cat([r["logits"] for r in results], -1), logits.detach(), "logits")
    _assert_all_close(E.merge_shards(results), {n: p.grad for n, p in model.named_parameters()})


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_tp_gpt_10_adamw_steps_equal_single_device(world):
    results = [r["train"] for r in suite(world)]
    for r in results:  # each rank's shards against its slices of one device
        r.assert_passed()
    _assert_all_close(E.merge_shards(results, "state"), reference(STEPS), ADAMW)


def test_tp_gpt_with_sequence_parallelism_10_adamw_steps_equal_single_device():
    results = [r["train_sp"] for r in suite(2)]
    for r in results:
        r.assert_passed()
    _assert_all_close(E.merge_shards(results, "state"), reference(STEPS), ADAMW)


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_two_all_reduces_forward_and_two_backward_per_transformer_block(world):
    L = parallel_config().n_layer
    for r in suite(world):
        tp = r["tp"]
        assert tp["forward"] == {
            "all_reduce:tp": 2 * L,
            "all_reduce:embed": 1,
            "all_reduce:loss": 3,
        }
        assert tp["backward"] == {"all_reduce:tp": 2 * L, "all_reduce:head": 1}


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_sequence_parallel_turns_each_all_reduce_into_reduce_scatter_plus_all_gather(world):
    L = parallel_config().n_layer
    for r in suite(world):
        sp, tp = r["sp"], r["tp"]
        assert sp["forward"] == {
            "all_gather:tp": 2 * L,
            "reduce_scatter:tp": 2 * L,
            "reduce_scatter:embed": 1,
            "all_gather:head": 1,
            "all_reduce:loss": 3,
        }
        assert sp["backward"] == {
            "all_gather:tp": 2 * L,
            "reduce_scatter:tp": 2 * L,
            "all_gather:embed": 1,
            "reduce_scatter:head": 1,
            "all_reduce:sp_grad": 1,
        }
        assert sp["block_tp_ring_bytes"] == pytest.approx(tp["block_tp_ring_bytes"])  # same volume
        assert sp["activation_bytes"] < tp["activation_bytes"]


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_sequence_parallel_layernorm_grads_are_partial_until_all_reduced_over_tp(world):
    _, _, grads = one_device_step()
    partial = [r["sp_partial"] for r in suite(world)]
    for name in partial[0]:
        total = sum(p[name] for p in partial)
        SGD.assert_close(total, grads[name], name)  # the sum over the TP group is the gradient
        assert not ADAMW.ok(partial[0][name], grads[name])  # one shard's alone is not, even loosely


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_block_linear_weights_are_one_tth_per_rank_the_rest_replicated(world):
    model = GPT(parallel_config(), seed=0)
    block = sum(
        p.numel() * 4
        for n, p in model.named_parameters()
        if n.startswith("blocks.") and ".ln_" not in n
    )
    for r in suite(world):
        assert r["tp"]["block_linear_bytes"] * world == block


# =========================================================================== DTensor


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_dtensor_parallelize_module_equals_single_device_and_ours(world):
    logits, loss, grads = one_device_step()
    L = parallel_config().n_layer
    for r in suite(world):
        d = r["dtensor"]
        d.assert_passed()  # against one device on the rank, our collective counts, both traps sprung
        SGD.assert_close(d.logits, logits, "logits")
        SGD.assert_close(d.loss, loss, "loss")
        _assert_all_close(d.grads, grads)
        assert d.collectives == {
            "all_reduce:forward": 2 * L + 1 + 3,
            "all_reduce:backward": 2 * L + 1,
        }


@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_dtensor_sequence_parallel_layernorm_grads_are_partial_and_sum_to_one_device(world):
    config = parallel_config()
    blocks = GPT(config, seed=0).blocks
    x = torch.randn(
        2, config.block_size, config.d_model, generator=torch.Generator().manual_seed(1)
    )
    x.requires_grad_(True)
    h = x
    for block in blocks:
        h = block(h)
    h.pow(2).sum().backward()
    results = [r["dtensor_sp"] for r in suite(world)]
    want = {n: p.grad for n, p in blocks.named_parameters()}
    for rank, r in enumerate(results):
        r.assert_passed()  # the same comparisons, made on the rank
        _assert_all_close(r.grads, want)  # full_tensor() sums the Partial LayerNorm grads over TP
        SGD.assert_close(r.x_grad, x.grad.chunk(world, 1)[rank], "x.grad")
        assert (
            set(r.ln_placements.values()) == {"Partial"}
            and len(r.ln_placements) == 2 * config.n_layer
        )
    for name in results[0].ln_local:
        SGD.assert_close(sum(r.ln_local[name] for r in results), want[name], name)
        assert not ADAMW.ok(results[0].ln_local[name], want[name])


def test_dtensor_traps_tied_weights_untie_and_local_logits_break_the_loss():
    d = suite(2)[0]["dtensor"]
    assert d.tied_after_parallelize is False
    assert d.local_logits_error is not None and "out of bounds" in d.local_logits_error
    with pytest.raises(ValueError, match="silently unties"):
        parallelize_gpt(GPT(parallel_config(tie_weights=True)), tp_mesh=None)


# =========================================================================== 2-D meshes


def test_dp_2_x_tp_2_training_equals_single_device_with_collectives_per_mesh_dimension():
    results = [r["dp_tp"] for r in suite(4)]
    for (
        r
    ) in results:  # its shards vs one device; step 0's collectives per mesh dimension vs the count
        r.assert_passed()
    dp0 = sorted((r for r in results if r.dp_rank == 0), key=lambda r: r.tp_rank)
    assert [r.tp_rank for r in dp0] == [0, 1]
    _assert_all_close(E.merge_shards(dp0, "state"), reference(5), ADAMW)
    L = parallel_config().n_layer
    for (
        r
    ) in results:  # TP: 4 per block + embed + head + 3 for the loss; DP: one gradient all-reduce
        assert r.collectives_step0 == {"all_reduce@tp": 4 * L + 1 + 1 + 3, "all_reduce@dp": 1}


def test_fsdp2_on_dp_of_a_dtensor_tp_model_equals_single_device():
    _, _, grads = one_device_step()
    for r in suite(4):
        r["fsdp_tp"].assert_passed()
        _assert_all_close(r["fsdp_tp"].grads, grads)
        kinds = r["fsdp_tp"].collectives
        assert (
            kinds["all_reduce@tp"] > 0
            and kinds["all_gather@dp"] > 0
            and kinds["reduce_scatter@dp"] > 0
        )
        assert not any(k.endswith("@default") for k in kinds)


# =========================================================================== bad inputs


RULES = {
    "heads": "n_head=",
    "hidden": "out_features=",
    "row_hidden": "in_features=",
    "vocab": "vocab_size=",
    "vocab_gpt": "vocab_size=",
    "from_linear_shape": "out_features of",
    "from_linear_type": "needs an nn.Linear",
    "attention_shape": "expected (3h, h)",
    "mesh": "product of the mesh dimensions",
}


@pytest.mark.parametrize("case", list(RULES))
@pytest.mark.parametrize("world", WORLDS, ids=[f"tp={w}" for w in WORLDS])
def test_bad_inputs_raise_errors_naming_the_rule(world, case):
    msg = suite(world)[0]["bad"][case]
    assert msg is not None and RULES[case] in msg, msg
    if case not in ("from_linear_type", "attention_shape", "mesh"):
        assert "not divisible by the tensor-parallel size" in msg


@pytest.mark.parametrize("build", ["ours", "dtensor"])
def test_dropout_is_refused_naming_the_model_parallel_rng_rule(build):
    from course_lib.tensor_parallel import tensor_parallel_gpt

    gpt = GPT(parallel_config(dropout=0.1), seed=0)
    make = tensor_parallel_gpt if build == "ours" else (lambda g: parallelize_gpt(g, None))
    with pytest.raises(ValueError, match=r"dropout=0.1 > 0 is refused .*model-parallel RNG"):
        make(gpt)
