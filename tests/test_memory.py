"""Memory accounting: model states from real tensors, activations measured vs derived, ZeRO formulas."""

import pytest
import torch

from course_lib.data import make_batch
from course_lib.formulas import (
    activation_bytes_estimate,
    korthikanti_activation_bytes,
    zero_model_state_breakdown,
    zero_model_state_bytes,
)
from course_lib.memory import (
    SavedTensorMeter,
    format_bytes,
    model_state_bytes,
    saved_activation_bytes,
    saved_tensors_table,
    storage_bytes,
    tensors_in,
    unique_storage_bytes,
)
from course_lib.models import GPT, tiny_config


def adam_step(model, batch=(2, 8)):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, loss = model(*make_batch(*batch, model.config.vocab_size, seed=0))
    loss.backward()
    opt.step()
    return opt


# ----------------------------------------------------------------------------- model states


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_model_state_bytes_matches_hand_count_for_adamw(tie):
    model = GPT(tiny_config(tie_weights=tie))
    n, tensors = model.num_params(), len(list(model.parameters()))
    assert model_state_bytes(model) == dict(
        params=4 * n, grads=0, optimizer=0, extra=0, total=4 * n
    )

    opt = adam_step(model)
    got = model_state_bytes(model, opt)
    # fp32 param + grad, Adam exp_avg + exp_avg_sq, and one 0-d fp32 `step` per parameter tensor
    assert got["params"] == 4 * n
    assert got["grads"] == 4 * n
    assert got["optimizer"] == 2 * 4 * n + 4 * tensors
    assert got["total"] == 16 * n + 4 * tensors
    # the fp32 ZeRO formula for plain data parallel is the same count, minus the step scalars
    assert got["total"] - 4 * tensors == zero_model_state_bytes(n, 1, stage=0, precision="fp32")


def test_tied_weight_counted_once_even_under_two_names():
    model = GPT(tiny_config(tie_weights=True))
    named_twice = [p for _, p in model.named_parameters(remove_duplicate=False)]
    assert len(named_twice) == len(list(model.parameters())) + 1
    assert model_state_bytes(named_twice)["params"] == 4 * model.num_params()


def test_views_of_one_buffer_count_the_buffer_once():
    flat = torch.zeros(100)
    views = [flat[:30], flat[30:100]]
    assert model_state_bytes(views)["params"] == 400
    # a storage already charged as params is not charged again as extra
    assert model_state_bytes(views, extra=[flat, torch.zeros(5)]) == dict(
        params=400, grads=0, optimizer=0, extra=20, total=420
    )


def test_public_storage_helpers_count_each_storage_once():
    flat, other = torch.zeros(100), torch.zeros(5)
    nest = {"a": [flat[:30], {"b": (flat[30:], 3)}], "c": other, "d": "text"}
    assert [t.numel() for t in tensors_in(nest)] == [30, 70, 5]
    assert storage_bytes(tensors_in(nest)) == 420
    seen: set = set()
    assert unique_storage_bytes({"first": [flat[:10]], "second": [flat, other]}, seen) == dict(
        first=400, second=20
    )
    assert (
        storage_bytes([flat, other, torch.empty(0)], seen) == 0
    )  # already charged (or empty): nothing new


def test_model_state_bytes_rejects_a_non_optimizer():
    with pytest.raises(TypeError, match="optimizer must have a .state mapping"):
        model_state_bytes([torch.zeros(3)], optimizer=object())


def test_dtensor_counts_its_local_shard():
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "fake", store=fake_pg.FakeStore(), rank=0, world_size=2
    )  # 2 ranks, one process
    try:
        mesh = init_device_mesh("cpu", (2,))
        param = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        assert param.shape == (8, 4)
        assert (
            model_state_bytes([param])["params"] == 4 * 4 * 4
        )  # this rank's 4 x 4 rows, not 8 x 4
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- activations


CASES = [
    ("sdpa", 4, 32, {}),
    ("math", 4, 32, {}),
    ("sdpa", 3, 17, dict(n_layer=3, bias=False, tie_weights=False, mlp_ratio=2, n_head=2)),
    ("math", 3, 17, dict(n_layer=3, bias=False, tie_weights=False, mlp_ratio=2, n_head=2)),
]
IDS = [f"{attn}-b{b}-s{s}" + ("-variant" if kw else "") for attn, b, s, kw in CASES]


def measure(cfg, b, s, with_loss=True):
    model = GPT(cfg)
    x, y = make_batch(b, s, cfg.vocab_size, seed=0)
    with SavedTensorMeter(exclude=model) as meter:
        _, loss = model(x, y if with_loss else None)
    return meter.bytes


@pytest.mark.parametrize("attn, b, s, overrides", CASES, ids=IDS)
def test_activation_estimate_equals_saved_tensor_bytes(attn, b, s, overrides):
    cfg = tiny_config(attn=attn, **overrides)
    est = activation_bytes_estimate(cfg, b, s)
    assert measure(cfg, b, s) == est["total"]
    # the per-layer term alone: one more layer adds exactly est["per_layer"]
    deeper = tiny_config(attn=attn, **{**overrides, "n_layer": cfg.n_layer + 1})
    assert measure(deeper, b, s) - measure(cfg, b, s) == est["per_layer"]
    assert est["total"] == est["layers"] + est["embedding"] + est["head"]


def test_activation_estimate_without_loss():
    cfg = tiny_config()
    assert (
        measure(cfg, 2, 16, with_loss=False)
        == activation_bytes_estimate(cfg, 2, 16, with_loss=False)["total"]
    )


@pytest.mark.parametrize("attn", ["sdpa", "math"])
def test_per_layer_bytes_are_close_to_the_headline_formula(attn):
    """~64 sbh (SDPA) and ~sbh(64 + 4as/h) (explicit softmax), within 2%."""
    cfg = tiny_config(attn=attn)
    s, b, h, a = 32, 8, cfg.d_model, cfg.n_head
    headline = s * b * h * (64 + (4 * a * s / h if attn == "math" else 0))
    per_layer = activation_bytes_estimate(cfg, b, s)["per_layer"]
    assert abs(per_layer - headline) / headline < 0.02


def test_meter_excludes_parameters_and_table_agrees():
    model = GPT(tiny_config(attn="math"))
    x, y = make_batch(2, 8, 32, seed=0)
    with SavedTensorMeter() as everything:
        model(x, y)
    with SavedTensorMeter(exclude=model) as activations:
        _, loss = model(x, y)
    assert everything.bytes > activations.bytes  # Linear / LayerNorm weights are saved too
    rows = saved_tensors_table(loss, exclude=model)
    assert sum(r["bytes"] for r in rows if r["new"]) == activations.bytes
    ops = {r["op"] for r in rows}
    assert {"SoftmaxBackward0", "GeluBackward0", "NativeLayerNormBackward0"} <= ops
    assert saved_activation_bytes(model, x, y, exclude=model) == activations.bytes


def test_nothing_is_saved_without_grad():
    model = GPT(tiny_config())
    with torch.no_grad():
        assert saved_activation_bytes(model, *make_batch(2, 8, 32, seed=0), exclude=model) == 0


def test_activation_estimate_rejects_dropout_and_long_sequences():
    with pytest.raises(ValueError, match="assumes dropout=0.0"):
        activation_bytes_estimate(tiny_config(dropout=0.1), 2)
    with pytest.raises(ValueError, match="sequence length 40 exceeds block_size=32"):
        activation_bytes_estimate(tiny_config(), 2, 40)


def test_korthikanti_formula():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B shapes
    sbh = s * b * h
    assert korthikanti_activation_bytes(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert korthikanti_activation_bytes(s, b, h, a, n_layers=96) == pytest.approx(
        96 * sbh * (34 + 5 * a * s / h)
    )
    t = 8
    assert korthikanti_activation_bytes(s, b, h, a, tensor_parallel=t) == pytest.approx(
        sbh * (10 + 24 / t + 5 * a * s / (h * t))
    )
    assert korthikanti_activation_bytes(
        s, b, h, a, tensor_parallel=t, sequence_parallel=True
    ) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert korthikanti_activation_bytes(s, b, h, a, recompute="selective") == pytest.approx(
        34 * sbh
    )
    assert korthikanti_activation_bytes(s, b, h, a, recompute="full") == pytest.approx(2 * sbh)
    with pytest.raises(ValueError, match="recompute='some' must be"):
        korthikanti_activation_bytes(s, b, h, a, recompute="some")


# ----------------------------------------------------------------------------- ZeRO


# ZeRO paper, Figure 1: Psi = 7.5B, N = 64, K = 12. Decimal GB as in the paper; GiB to 2 decimals
# (ZeRO-1 is 31.41e9 B = 29.25 GiB, which rounds to 29.2 at one decimal, not 29.3).
@pytest.mark.parametrize(
    "stage, gb, gib", [(0, 120.0, 111.76), (1, 31.4, 29.25), (2, 16.6, 15.50), (3, 1.9, 1.75)]
)
def test_zero_paper_numbers_for_7_5b_params_on_64_gpus(stage, gb, gib):
    total = zero_model_state_bytes(7.5e9, 64, stage)
    assert round(total / 1e9, 1) == gb
    assert round(total / 2**30, 2) == gib


@pytest.mark.parametrize("n", [1, 2, 4, 64])
def test_zero_formulas(n):
    psi = 1000
    mixed = [16 * psi, 4 * psi + 12 * psi / n, 2 * psi + 14 * psi / n, 16 * psi / n]
    fp32 = [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
    for stage in range(4):
        assert zero_model_state_bytes(psi, n, stage) == pytest.approx(mixed[stage])
        assert zero_model_state_bytes(psi, n, stage, precision="fp32") == pytest.approx(fp32[stage])
    parts = zero_model_state_breakdown(psi, n, 2, k=12)
    assert parts == pytest.approx(
        dict(params=2 * psi, grads=2 * psi / n, optimizer=12 * psi / n, total=mixed[2])
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stage=4), "stage=4 must be one of 0, 1, 2, 3"),
        (dict(world_size=0), "world_size=0 must be an int >= 1"),
        (dict(precision="bf16"), "precision='bf16' must be 'mixed' or 'fp32'"),
        (dict(psi=-1), "psi=-1"),
    ],
    ids=["stage_4", "world_size_0", "precision_bf16", "psi_negative"],
)
def test_zero_formula_errors(kwargs, message):
    args = dict(psi=1000, world_size=2, stage=1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        zero_model_state_bytes(**args)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(999) == "999 B"
    assert format_bytes(1.2e11) == "120.0 GB"
    assert format_bytes(1.2e11, binary=True) == "111.8 GiB"
    assert format_bytes(999_960) == "1.0 MB"
    assert format_bytes(1536, binary=True, digits=2) == "1.50 KiB"


def test_live_bytes_drops_a_saved_storage_freed_after_forward():
    """ZeRO-3 frees gathered weights after forward: saved, but not held as activation memory."""
    from course_lib.memory import SavedTensorMeter

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    gathered = w.detach().clone().requires_grad_()  # stands in for an all-gathered weight
    with SavedTensorMeter(exclude=[w]) as meter:
        y = x @ gathered
        assert meter.live_bytes() == meter.bytes == (8 * 8 + 4 * 8) * 4
        gathered.data.untyped_storage().resize_(0)
        assert meter.live_bytes() == 4 * 8 * 4
    del y


def test_a_new_storage_at_a_freed_storages_address_is_still_counted():
    """After ``resize_(0)`` the allocator may hand the same address to the next tensor: it is a new storage."""
    from course_lib.memory import SavedTensorMeter

    x = torch.randn(64, 64, requires_grad=True)
    with SavedTensorMeter() as meter:
        w1 = torch.randn(64, 64, requires_grad=True) * 1.0  # non-leaf: saved by the matmul below
        y1 = x @ w1
        w1.data.untyped_storage().resize_(0)
        w2 = torch.randn(64, 64, requires_grad=True) * 1.0  # likely lands at w1's old address
        y2 = x @ w2
    assert meter.bytes == 3 * 64 * 64 * 4, "x, w1 and w2 are three different storages"
    del y1, y2


def test_training_flops_per_token_and_matmul_peak():
    from course_lib.formulas import training_flops_per_token
    from course_lib.train import matmul_peak_flops

    cfg = tiny_config()
    psi = GPT(cfg).num_params()
    assert (
        training_flops_per_token(psi, cfg.n_layer, cfg.block_size, cfg.d_model)
        == 6 * psi + 12 * cfg.n_layer * cfg.block_size * cfg.d_model
    )
    with pytest.raises(ValueError, match="must be > 0"):
        training_flops_per_token(0, 2, 32, 64)
    peak = matmul_peak_flops(n=128, repeats=3)
    assert peak["lo"] <= peak["flops_per_s"] <= peak["hi"] and peak["flops_per_s"] > 1e6
    with pytest.raises(ValueError, match="must be ≥ 1"):
        matmul_peak_flops(n=0)
