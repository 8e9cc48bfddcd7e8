"""The tiny GPT and its synthetic task: shapes, names, config errors, determinism, and that it learns."""

import math

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from course_lib.data import SyntheticDataset, loss_floor, make_batch
from course_lib.models import GPT, GPTConfig, equality_config, tiny_config
from course_lib.results import REORDERED


def expected_num_params(cfg: GPTConfig, unique: bool = True) -> int:
    """Hand count: embeddings + L blocks + ln_f (+ lm_head when untied or counted per name)."""
    h, r, V, T, L = cfg.d_model, cfg.mlp_ratio, cfg.vocab_size, cfg.block_size, cfg.n_layer
    linear = (
        (3 * h * h) + (h * h) + (r * h * h) + (r * h * h)
    )  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    if cfg.bias:
        linear += 3 * h + h + r * h + h
    ln = 2 * h if cfg.bias else h
    n = V * h + T * h + L * (linear + 2 * ln) + ln
    if not cfg.tie_weights or not unique:
        n += V * h
    return n


# ----------------------------------------------------------------------------- shapes and names


@pytest.mark.parametrize("attn", ["sdpa", "math"])
def test_forward_returns_logits_and_mean_cross_entropy(attn):
    model = GPT(tiny_config(attn=attn))
    x, y = make_batch(3, 20, 32, seed=0)
    logits, loss = model(x, y)
    assert logits.shape == (3, 20, 32)
    assert loss.shape == ()
    REORDERED.assert_close(
        loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))
    )
    logits_only, no_loss = model(x)
    assert no_loss is None and torch.equal(logits_only, logits)


def test_untrained_loss_is_about_ln_vocab():
    _, loss = GPT(tiny_config())(*make_batch(64, 32, 32, seed=0))
    assert abs(loss.item() - math.log(32)) < 0.1


def test_module_names_are_the_sharding_contract():
    names = {n for n, _ in GPT(tiny_config(n_layer=2)).named_parameters()}
    for i in range(2):
        for sub in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            assert f"blocks.{i}.{sub}.weight" in names
            assert f"blocks.{i}.{sub}.bias" in names
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"} <= names


@pytest.mark.parametrize("attn", ["sdpa", "math"])
def test_attention_is_causal(attn):
    model = GPT(tiny_config(attn=attn))
    x, _ = make_batch(2, 16, 32, seed=1)
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % 32
    logits, _ = model(x)
    logits_changed, _ = model(changed)
    REORDERED.assert_close(logits[:, :10], logits_changed[:, :10])
    assert not REORDERED.ok(logits[:, 10:], logits_changed[:, 10:])


def test_sdpa_and_explicit_softmax_attention_agree():
    x, _ = make_batch(2, 32, 32, seed=2)
    sdpa, _ = GPT(tiny_config(attn="sdpa"))(x)
    math_, _ = GPT(tiny_config(attn="math"))(x)
    REORDERED.assert_close(
        sdpa, math_
    )  # one fused kernel vs explicit softmax: the same sums, reordered


def test_attention_splits_by_heads_for_tensor_parallel():
    """c_attn's output is laid out head by head, so halving its rows (and c_proj's columns) halves the heads."""
    full = GPT(tiny_config()).blocks[0].attn
    x = torch.randn(2, 16, 64)
    h = 64
    out = 0
    for r in range(2):
        part = GPT(tiny_config()).blocks[0].attn
        with torch.no_grad():
            rows = slice(r * 3 * h // 2, (r + 1) * 3 * h // 2)
            cols = slice(r * h // 2, (r + 1) * h // 2)
            part.c_attn.weight = torch.nn.Parameter(full.c_attn.weight[rows].clone())
            part.c_attn.bias = torch.nn.Parameter(full.c_attn.bias[rows].clone())
            part.c_proj.weight = torch.nn.Parameter(full.c_proj.weight[:, cols].clone())
            part.c_proj.bias.copy_(full.c_proj.bias if r == 0 else torch.zeros(h))
        out = out + part(x)  # the all-reduce of Megatron's row-parallel c_proj
    REORDERED.assert_close(out, full(x))


def test_dropout_is_active_only_in_training():
    model = GPT(tiny_config(dropout=0.5))
    x, _ = make_batch(2, 16, 32, seed=0)
    assert not torch.equal(model(x)[0], model(x)[0])
    model.eval()
    assert torch.equal(model(x)[0], model(x)[0])


# ----------------------------------------------------------------------------- parameters


def test_tied_weight_is_one_tensor_counted_once():
    cfg = tiny_config()
    model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight
    assert (
        model.num_params() == expected_num_params(cfg) == sum(p.numel() for p in model.parameters())
    )
    assert model.num_params(unique=False) == model.num_params() + cfg.vocab_size * cfg.d_model
    assert "lm_head.weight" in model.state_dict()


@pytest.mark.parametrize(
    "overrides",
    [dict(tie_weights=False), dict(bias=False), dict(mlp_ratio=2, n_layer=3)],
    ids=["untied", "no_bias", "mlp_ratio=2,n_layer=3"],
)
def test_num_params_matches_hand_count(overrides):
    cfg = tiny_config(**overrides)
    model = GPT(cfg)
    assert model.num_params() == expected_num_params(cfg)
    assert model.num_params(unique=False) == expected_num_params(cfg, unique=False)


def test_equality_config_has_no_biases_and_no_dropout():
    cfg = equality_config()
    assert cfg.bias is False and cfg.dropout == 0.0
    names = [n for n, _ in GPT(cfg).named_parameters()]
    assert not [n for n in names if n.endswith("bias")]
    assert equality_config(n_layer=3).n_layer == 3


def test_init_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = GPT(tiny_config()), GPT(tiny_config())
    assert torch.rand(1) == before  # model construction drew nothing from the global RNG
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    c = GPT(tiny_config(), seed=1)
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_init_scheme():
    cfg = tiny_config(n_layer=8)
    model = GPT(cfg, seed=0)
    assert abs(model.wte.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(2 * 8)) < 0.001
    assert torch.all(model.blocks[0].attn.c_attn.bias == 0)
    assert torch.all(model.blocks[0].ln_1.weight == 1)


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(d_model=66), "d_model=66 is not divisible by n_head=4"),
        (dict(block_size=0), "block_size=0 must be >= 1"),
        (dict(vocab_size=0), "vocab_size=0 must be >= 1"),
        (dict(n_head=0), "n_head=0 must be >= 1"),
        (dict(dropout=1.0), "dropout=1.0 must be in [0, 1)"),
        (dict(attn="flash"), "attn='flash' must be 'sdpa' or 'math'"),
        (dict(n_layer=2.0), "n_layer=2.0 must be an int"),
    ],
    ids=[
        "d_model_not_divisible",
        "block_size_0",
        "vocab_size_0",
        "n_head_0",
        "dropout_1",
        "attn_unknown",
        "n_layer_float",
    ],
)
def test_config_error_names_the_rule(overrides, message):
    with pytest.raises(
        ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        tiny_config(**overrides)


def test_config_mutated_after_creation_is_checked_by_the_model():
    cfg = tiny_config()
    cfg.n_head = 5
    with pytest.raises(ValueError, match="d_model=64 is not divisible by n_head=5"):
        GPT(cfg)


def test_sequence_longer_than_block_size_is_an_error():
    model = GPT(tiny_config())
    with pytest.raises(ValueError, match="sequence length 40 exceeds block_size=32"):
        model(torch.zeros(1, 40, dtype=torch.long))
    with pytest.raises(ValueError, match=r"idx must have shape \(batch, sequence\)"):
        model(torch.zeros(40, dtype=torch.long))


# ----------------------------------------------------------------------------- data


def test_sequences_follow_the_counter_rule():
    x, y = make_batch(8, 32, 32, seed=3)
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    full = torch.cat([x, y[:, -1:]], dim=1)
    assert torch.equal(full[:, 2:], (full[:, :-2] + 1) % 32)
    assert int(x.min()) >= 0 and int(x.max()) < 32


def test_data_is_deterministic_and_seed_dependent():
    a, b, c = (
        make_batch(4, 16, 32, seed=5),
        make_batch(4, 16, 32, seed=5),
        make_batch(4, 16, 32, seed=6),
    )
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    d1, d2 = SyntheticDataset(10, 16, 32, seed=7), SyntheticDataset(10, 16, 32, seed=7)
    assert len(d1) == 10
    assert all(
        torch.equal(d1[i][0], d2[i][0]) and torch.equal(d1[i][1], d2[i][1]) for i in range(10)
    )


def test_loss_floor_is_ln_vocab_over_seq_len():
    assert loss_floor(32, 32) == pytest.approx(math.log(32) / 32)
    assert loss_floor(1, 7) == pytest.approx(math.log(7))
    with pytest.raises(ValueError, match="seq_len=0 must be >= 1"):
        loss_floor(0, 32)


def test_dataset_shards_with_distributed_sampler():
    ds = SyntheticDataset(10, 8, 32, seed=0)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=0)
        for x, y in DataLoader(ds, batch_size=5, sampler=sampler):
            assert x.shape == y.shape == (5, 8)
            seen.extend(tuple(row.tolist()) for row in x)
    assert sorted(seen) == sorted(tuple(ds[i][0].tolist()) for i in range(10))


# ----------------------------------------------------------------------------- learning


def test_model_learns_the_synthetic_task_in_200_steps():
    cfg = tiny_config()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(200):
        _, loss = model(*make_batch(32, cfg.block_size, cfg.vocab_size, seed=step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ln_v = math.log(cfg.vocab_size)
    assert abs(losses[0] - ln_v) < 0.15
    final = sum(losses[-10:]) / 10
    assert final < 0.25 * ln_v, f"loss after 200 steps {final:.3f} (ln V = {ln_v:.3f})"
    assert (
        final > loss_floor(cfg.block_size, cfg.vocab_size) - 0.02
    )  # cannot beat the floor (small slack: batch noise)
