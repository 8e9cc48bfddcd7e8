"""Context parallelism: ring attention, all-gather CP and Ulysses equal one device; traffic and memory.

Every distributed case runs inside ONE spawn per CP size (c = 2 and c = 4; four processes on two
cores is fine at these shapes): ``_suite`` runs every case and returns this rank's output rows,
gradients, communication records, saved bytes and error messages; the tests below un-shard them and
compare with ``F.scaled_dot_product_attention`` / the tiny GPT on one device, computed here in the
test process. Equality is the named tolerance of :mod:`course_lib.results`: ``SGD`` for outputs and
gradients (no update yet, only fp32 reordering), ``ADAMW`` after AdamW steps.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from course_lib import context_parallel as cp
from course_lib.configs import small_config
from course_lib.formulas import activation_bytes_estimate
from course_lib.memory import SavedTensorMeter
from course_lib.models import GPT
from course_lib.results import ADAMW, EXACT, SGD
from course_lib.train import reference_run, step_batch

WORLDS = [2, 4]
B, H, D = 2, 4, 8  # attention shapes; S = 8·c so that zig-zag chunks hold 4 tokens
STEPS, BATCH = 3, 4
CASES = [
    (name, layout, causal)
    for name in ("ring", "allgather", "ulysses")
    for layout in cp.LAYOUTS
    for causal in (True, False)
    if not (name == "ulysses" and layout == "zigzag")
]
GPT_RUNS = [
    ("ring", "contiguous"),
    ("ring", "zigzag"),
    ("allgather", "zigzag"),
    ("ulysses", "contiguous"),
]


def _qkvw(c: int):
    """The full-sequence q, k, v and output weights every rank and the test draw from one seed."""
    gen = torch.Generator().manual_seed(c)
    return [torch.randn(B, H, 8 * c, D, generator=gen) for _ in range(4)]


def _error(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


# =========================================================================== rank functions


def _attention_cases() -> dict:
    """Rank function part: every (variant, layout, causal) on this rank's chunk; output, grads, traffic."""
    import torch.distributed as dist

    from course_lib.comm import CommLog
    from course_lib.launch import device

    c, r = dist.get_world_size(), dist.get_rank()
    full = [t.to(device()) for t in _qkvw(c)]
    sent = []  # Ulysses: comm has no all-to-all wrapper, so watch dist.all_to_all_single (it still runs)
    real = dist.all_to_all_single

    def watched(output, input, *args, **kwargs):
        sent.append(input.numel() * input.element_size() * (c - 1) // c)
        return real(output, input, *args, **kwargs)

    out = {}
    dist.all_to_all_single = watched
    try:
        for name, layout, causal in CASES:
            q, k, v, w = (cp.shard_sequence(t, r, c, layout) for t in full)
            q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
            kw = {} if name == "ulysses" else {"layout": layout}
            sent.clear()
            with CommLog() as fwd:
                y = cp.ATTENTIONS[name](q, k, v, causal=causal, **kw)
            a2a_fwd = list(sent)
            sent.clear()
            with CommLog() as bwd:
                (y * w).sum().backward()
            out[(name, layout, causal)] = {
                "y": y.detach().cpu(),
                "grads": [t.grad.cpu() for t in (q, k, v)],
                "forward": fwd.summary(),
                "backward": bwd.summary(),
                "a2a": {"forward": a2a_fwd, "backward": list(sent)},
            }
    finally:
        dist.all_to_all_single = real
    return out


def _memory() -> dict:
    """Rank function part: bytes saved for backward by each variant, and by the CP GPT's forward."""
    import torch.distributed as dist

    from course_lib.launch import device

    c, r = dist.get_world_size(), dist.get_rank()
    q, k, v, _ = (cp.shard_sequence(t, r, c).to(device()).requires_grad_(True) for t in _qkvw(c))
    out = {}
    for name, fn in cp.ATTENTIONS.items():
        with SavedTensorMeter() as meter:
            y = fn(q, k, v)
        out[name] = meter.bytes
        y.sum().backward()
    config = small_config()
    model = cp.context_parallel_gpt(GPT(config, seed=0).to(device()))
    x, y = (cp.shard_sequence(t, r, c, dim=1) for t in step_batch(0, config, BATCH, device()))
    with SavedTensorMeter(exclude=model) as meter:
        _, loss = model(x, y)
    out["gpt"] = meter.bytes
    loss.backward()
    return out


def _gpt_training(attention: str, layout: str) -> dict:
    """Rank function part: the CP GPT, STEPS AdamW steps, replicated grads summed over the group."""
    import torch.distributed as dist

    from course_lib.configs import make_optimizer
    from course_lib.launch import device
    from course_lib.train import train_step

    c, r = dist.get_world_size(), dist.get_rank()
    config = small_config()
    model = cp.context_parallel_gpt(GPT(config, seed=0).to(device()), None, attention, layout)
    opt = make_optimizer("adamw", model.parameters())
    losses, partial = [], None

    def after_backward():
        nonlocal partial
        if partial is None:  # step 0: this rank's partial gradients, before the sum
            partial = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        cp.allreduce_cp_grads(model)

    for step in range(STEPS):
        x, y = (
            cp.shard_sequence(t, r, c, layout, dim=1)
            for t in step_batch(step, config, BATCH, device())
        )
        losses.append(train_step(model, opt, x, y, after_backward=after_backward))
    return {
        "state": {n: t.cpu() for n, t in model.state_dict().items()},
        "losses": losses,
        "partial": partial,
    }


def _bad_inputs() -> dict:
    """Rank function part: each broken rule's error message (None if nothing was raised)."""
    import torch.distributed as dist

    c = dist.get_world_size()
    t = torch.randn(1, c, 3, 4)  # 3 tokens per rank: S = 3c, not divisible by 2c
    heads = torch.randn(1, c + 2 if c > 2 else 3, 4, 4)
    gpt = GPT(small_config(n_head=2 * c - 1, d_model=8 * (2 * c - 1)), seed=0)
    return {
        "ring_zigzag": _error(lambda: cp.ring_attention(t, t, t, layout="zigzag")),
        "allgather_zigzag": _error(lambda: cp.allgather_attention(t, t, t, layout="zigzag")),
        "ulysses_heads": _error(lambda: cp.ulysses_attention(heads, heads, heads)),
        "shapes": _error(lambda: cp.ring_attention(t, t, t[..., :2])),
        "layout": _error(lambda: cp.ring_attention(t, t, t, layout="striped")),
        "gpt_heads": _error(lambda: cp.context_parallel_gpt(gpt, attention="ulysses")),
        "gpt_ulysses_zigzag": _error(
            lambda: cp.context_parallel_gpt(
                GPT(small_config()), attention="ulysses", layout="zigzag"
            )
        ),
        "gpt_dropout": _error(lambda: cp.context_parallel_gpt(GPT(small_config(dropout=0.1)))),
    }


def _torch_context_parallel() -> str:
    """Rank function part: torch's own ``context_parallel`` around SDPA on CPU (what happens)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    q, k, v, _ = _qkvw(dist.get_world_size())
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # noqa: BLE001 — the probe reports whatever torch raises
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def _averaged(out_a, lse_a, out_b, lse_b):
    """A wrong merge: the two blocks' outputs averaged, whatever their softmax mass."""
    return (out_a + out_b) / 2, torch.maximum(lse_a, lse_b)


def _overflowing(out_a, lse_a, out_b, lse_b):
    """The right weights computed with raw exponentials: inf / inf once the scores are large."""
    ea, eb = lse_a.exp().unsqueeze(-1), lse_b.exp().unsqueeze(-1)
    return (ea * out_a + eb * out_b) / (ea + eb), (ea + eb).log().squeeze(-1)


def _merge_checker() -> dict:
    """Rank function part: the exercise checker on our merge and on two wrong ones."""
    from course_lib.checks.context_expert_parallel import check_merge

    return {
        "ours": check_merge(cp.merge),
        "averaged": check_merge(_averaged),
        "overflowing": check_merge(_overflowing),
    }


def _suite(c: int) -> dict:
    """Rank function: every case of this CP size; returns {case: result}."""
    out = {"attention": _attention_cases(), "memory": _memory(), "bad": _bad_inputs()}
    if c == 2:
        out["gpt"] = {run: _gpt_training(*run) for run in GPT_RUNS}
        out["torch_cp"] = _torch_context_parallel()
        out["checker"] = _merge_checker()
    return out


@functools.lru_cache(maxsize=None)
def suite(c: int) -> list[dict]:
    from course_lib.launch import spawn

    return spawn(_suite, c, args=(c,), timeout=240)


# =========================================================================== one device


@functools.lru_cache(maxsize=None)
def one_device_attention(c: int, causal: bool):
    q, k, v, w = _qkvw(c)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (y * w).sum().backward()
    return y.detach(), [t.grad for t in (q, k, v)]


@functools.lru_cache(maxsize=None)
def reference():
    model, losses, _ = reference_run(small_config(), STEPS, BATCH, "adamw")
    return model.state_dict(), losses


def _rows(summary, op, tag, field="ring_bytes"):
    return sum(r[field] for r in summary if r["op"] == op and r["tag"] == tag)


def _calls(summary, op, tag):
    return sum(r["calls"] for r in summary if r["op"] == op and r["tag"] == tag)


# =========================================================================== no ranks: layouts, work, merge


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("c", [1, 2, 4])
def test_shard_then_unshard_is_the_identity_and_positions_follow_the_layout(c, layout):
    s = 8 * c
    x = torch.arange(s).view(1, 1, s, 1).expand(2, 3, s, 4)
    shards = [cp.shard_sequence(x, r, c, layout) for r in range(c)]
    assert torch.equal(cp.unshard_sequence(shards, c, layout), x)
    for r, shard in enumerate(shards):
        assert torch.equal(shard[0, 0, :, 0], cp.positions(r, c, s, layout))  # the ids it holds
    tokens = torch.arange(s).expand(2, s)
    assert torch.equal(
        cp.unshard_sequence(
            [cp.shard_sequence(tokens, r, c, layout, dim=1) for r in range(c)], c, layout, dim=1
        ),
        tokens,
    )


def test_zigzag_rank_i_holds_chunks_i_and_2c_minus_1_minus_i():
    m = 2  # S = 16, c = 4: 8 chunks of 2
    for r in range(4):
        want = list(range(r * m, (r + 1) * m)) + list(range((7 - r) * m, (8 - r) * m))
        assert cp.positions(r, 4, 16, "zigzag").tolist() == want
    assert cp.positions(1, 4, 16, "contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize(
    "layout, seq_len, rule",
    [
        ("zigzag", 12, "seq_len=12 is not divisible by 2·cp_size=8"),
        ("contiguous", 10, "seq_len=10 is not divisible by cp_size=4"),
        ("striped", 16, "layout='striped' must be one of"),
    ],
)
def test_sequence_that_does_not_split_raises_naming_the_rule(layout, seq_len, rule):
    with pytest.raises(ValueError, match=rule):
        cp.shard_sequence(torch.zeros(1, 1, seq_len, 2), 0, 4, layout)
    with pytest.raises(ValueError, match=rule):
        cp.positions(0, 4, seq_len, layout)
    with pytest.raises(ValueError, match="expected one per rank"):
        cp.unshard_sequence([torch.zeros(1, 1, 4, 2)], 2)


@pytest.mark.parametrize("c", [2, 4, 8])
def test_contiguous_causal_work_grows_c_fold_and_zigzag_balances_it(c):
    s = 16 * c
    n, m = s // c, s // (2 * c)
    contiguous = [cp.attention_work(r, c, s, "contiguous") for r in range(c)]
    zigzag = [cp.attention_work(r, c, s, "zigzag") for r in range(c)]
    assert contiguous == [(r + 1) * n * n for r in range(c)]  # diagonal block computed in full
    assert contiguous[-1] == c * contiguous[0]  # not (2c−1)×: the masked half is not skipped
    assert zigzag == [(2 * c + 1) * m * m] * c  # every rank the same
    assert all(cp.attention_work(r, c, s, "zigzag", causal=False) == n * s for r in range(c))


def test_merge_of_two_blocks_equals_attention_over_both_and_is_associative():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=gen) for _ in range(3))
    k, v = torch.cat([k, k * 2]), torch.cat([v, -v])  # 10 keys per query, split in blocks below
    k, v = k.view(2, 3, 10, 4), v.view(2, 3, 10, 4)
    want = F.scaled_dot_product_attention(q, k, v)
    blocks = [
        cp.block_attention(q, k[..., i : i + 2, :], v[..., i : i + 2, :]) for i in range(0, 10, 2)
    ]
    left = blocks[0]
    for b in blocks[1:]:  # left to right, as the ring does
        left = cp.merge(*left, *b)
    right = blocks[-1]
    for b in reversed(blocks[:-1]):  # another order
        right = cp.merge(*b, *right)
    SGD.assert_close(left[0], want, "merged left to right")
    SGD.assert_close(right[0], want, "merged right to left")
    SGD.assert_close(left[1], torch.logsumexp((q @ k.transpose(-2, -1)) / 2.0, -1), "lse")


def test_traffic_formulas():
    t = cp.ring_attention_traffic(2, 4, 16, 8, 2)
    kv = 2 * 2 * 4 * 16 * 8 * 4  # full K and V in bytes
    assert t == {"forward": kv // 2, "backward": kv}  # (c−1)/c of K/V, then again + dK/dV
    assert cp.allgather_attention_traffic(2, 4, 16, 8, 2) == {
        "forward": kv // 2,
        "backward": kv // 2,
    }
    assert cp.ring_attention_traffic(2, 4, 32, 8, 4)["forward"] == 3 * 2 * 2 * 4 * 8 * 8 * 4
    one = 2 * 4 * 32 * 8 * 4 // 4  # B·H·(S/c)·D bytes at c = 4
    assert cp.ulysses_attention_traffic(2, 4, 32, 8, 4) == {
        "forward": 4 * one * 3 // 4,  # four all-to-alls, (c−1)/c of each leaves the rank
        "backward": 4 * one * 3 // 4,
    }
    big = [cp.ulysses_attention_traffic(1, 8, 64, 8, c)["forward"] for c in (2, 4, 8)]
    assert big[0] > big[1] > big[2]  # Ulysses' per-rank bytes fall with c; the ring's do not
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by cp_size=4"):
        cp.ulysses_attention_traffic(1, 6, 16, 8, 4)
    with pytest.raises(ValueError, match="seq_len=10 is not divisible by cp_size=4"):
        cp.ring_attention_traffic(1, 4, 10, 8, 4)


# =========================================================================== attention on ranks


@pytest.mark.parametrize(
    "name, layout, causal",
    CASES,
    ids=[f"{n}-{lay}-{'causal' if c else 'full'}" for n, lay, c in CASES],
)
@pytest.mark.parametrize("c", WORLDS, ids=[f"cp={w}" for w in WORLDS])
def test_cp_attention_outputs_and_grads_equal_one_device(c, name, layout, causal):
    y, grads = one_device_attention(c, causal)
    results = [r["attention"][(name, layout, causal)] for r in suite(c)]
    SGD.assert_close(cp.unshard_sequence([r["y"] for r in results], c, layout), y, "output")
    for i, what in enumerate("qkv"):
        got = cp.unshard_sequence([r["grads"][i] for r in results], c, layout)
        SGD.assert_close(got, grads[i], f"d{what}")


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("c", WORLDS, ids=[f"cp={w}" for w in WORLDS])
def test_ring_traffic_equals_the_formula_kv_forward_kv_and_dkv_backward(c, layout):
    want = cp.ring_attention_traffic(B, H, 8 * c, D, c)
    for causal in (True, False):
        for r in suite(c):
            res = r["attention"][("ring", layout, causal)]
            fwd, bwd = res["forward"], res["backward"]
            assert {row["op"] for row in fwd + bwd} == {"send", "recv"}  # point to point only
            EXACT.assert_close(_rows(fwd, "send", "cp_kv"), want["forward"], "forward K/V")
            EXACT.assert_close(_rows(bwd, "send", "cp_kv"), want["backward"] // 2, "backward K/V")
            EXACT.assert_close(
                _rows(bwd, "send", "cp_dkv"), want["backward"] // 2, "backward dK/dV"
            )
            assert _calls(fwd, "send", "cp_kv") == c - 1 and _calls(bwd, "send", "cp_dkv") == c - 1


@pytest.mark.parametrize("c", WORLDS, ids=[f"cp={w}" for w in WORLDS])
def test_allgather_traffic_is_the_rings_bytes_in_one_collective(c):
    want = cp.allgather_attention_traffic(B, H, 8 * c, D, c)
    ring = cp.ring_attention_traffic(B, H, 8 * c, D, c)
    for r in suite(c):
        res = r["attention"][("allgather", "zigzag", True)]
        assert _calls(res["forward"], "all_gather", "cp_kv") == 1
        assert _calls(res["backward"], "reduce_scatter", "cp_kv") == 1
        assert _rows(res["forward"], "all_gather", "cp_kv") == want["forward"] == ring["forward"]
        assert _rows(res["backward"], "reduce_scatter", "cp_kv") == want["backward"]
    # the ring's backward sends K/V round again (it did not keep them) and then the same dK/dV bytes
    assert want["backward"] == ring["backward"] - ring["forward"]


@pytest.mark.parametrize("c", WORLDS, ids=[f"cp={w}" for w in WORLDS])
def test_ulysses_four_all_to_alls_each_way_equal_the_formula(c):
    want = cp.ulysses_attention_traffic(B, H, 8 * c, D, c)
    for r in suite(c):
        res = r["attention"][("ulysses", "contiguous", True)]
        assert len(res["a2a"]["forward"]) == 4 and len(res["a2a"]["backward"]) == 4
        assert sum(res["a2a"]["forward"]) == want["forward"]
        assert sum(res["a2a"]["backward"]) == want["backward"]
        assert res["forward"] == [] and res["backward"] == []  # nothing through comm: no wrapper


# =========================================================================== memory


@pytest.mark.parametrize("c", WORLDS, ids=[f"cp={w}" for w in WORLDS])
def test_ring_attention_saves_only_s_over_c_rows_per_rank(c):
    want = cp.ring_attention_saved_bytes(B, H, 8 * c, D, c)
    for r in suite(c):
        assert r["memory"]["ring"] == want  # q, k, v, out, lse of my S/c tokens
    # all-gather keeps the gathered K and V (∝ S) for backward: more than the ring
    assert suite(c)[0]["memory"]["allgather"] > want


def test_cp_gpt_activation_memory_per_rank_is_the_one_device_formula_at_s_over_c():
    """Every saved tensor of the GPT is per token (ring attention included): S/c tokens per rank."""
    config = small_config()
    model = GPT(config, seed=0)
    with SavedTensorMeter(exclude=model) as meter:
        model(*step_batch(0, config, BATCH))
    assert meter.bytes == activation_bytes_estimate(config, BATCH)["total"]  # one device, S tokens
    for c in WORLDS:
        want = activation_bytes_estimate(config, BATCH, config.block_size // c)["total"]
        for r in suite(c):
            assert r["memory"]["gpt"] == want, (c, r["memory"]["gpt"], want)
        # ∝ S/c up to the loss's one 0-d total weight (4 bytes), which every rank keeps
        assert (want - 4) * c == meter.bytes - 4


# =========================================================================== the CP GPT


@pytest.mark.parametrize("run", GPT_RUNS, ids=[f"{a}-{lay}" for a, lay in GPT_RUNS])
def test_cp_gpt_adamw_steps_equal_one_device(run):
    state, losses = reference()
    for r in suite(2):
        res = r["gpt"][run]
        ADAMW.assert_close(res["state"], state)
        ADAMW.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), "losses")


def test_cp_gpt_replicated_grads_are_partial_until_summed_over_the_cp_group():
    config = small_config()
    model = GPT(config, seed=0)
    model(*step_batch(0, config, BATCH))[1].backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    partial = [r["gpt"][("ring", "zigzag")]["partial"] for r in suite(2)]
    SGD.assert_close({n: partial[0][n] + partial[1][n] for n in want}, want)
    assert not ADAMW.ok(
        partial[0]["blocks.0.attn.c_attn.weight"], want["blocks.0.attn.c_attn.weight"]
    )


def test_merge_checker_passes_our_merge_and_names_what_is_wrong_in_others():
    res = suite(2)
    for r in res:
        assert r["checker"]["ours"] == []
    averaged, overflowing = res[0]["checker"]["averaged"], res[0]["checker"]["overflowing"]
    assert averaged and "differs from attention over all keys" in averaged[0], averaged
    assert overflowing and "inf or nan" in overflowing[0], overflowing


# =========================================================================== bad inputs, torch's own CP


RULES = {
    "ring_zigzag": "is not divisible by 2·cp_size",
    "allgather_zigzag": "is not divisible by 2·cp_size",
    "ulysses_heads": "is not divisible by cp_size=",
    "shapes": "must have one shape",
    "layout": "must be one of",
    "gpt_heads": "is not divisible by cp_size=",
    "gpt_ulysses_zigzag": "contiguous layout only",
    "gpt_dropout": "dropout=0.1 > 0 is refused",
}


@pytest.mark.parametrize("case", list(RULES))
@pytest.mark.parametrize("c", WORLDS, ids=[f"cp={w}" for w in WORLDS])
def test_bad_inputs_raise_errors_naming_the_rule(c, case):
    msg = suite(c)[0]["bad"][case]
    assert msg is not None and RULES[case] in msg, msg


def test_ulysses_heads_message_names_both_numbers():
    assert suite(4)[0]["bad"]["ulysses_heads"].startswith(
        "num_heads=6 is not divisible by cp_size=4"
    )


def test_torch_context_parallel_has_no_cpu_attention_kernel():
    """torch's ``context_parallel`` dispatches only the CUDA SDPA kernels (flash / efficient / cuDNN)."""
    msg = suite(2)[0]["torch_cp"]
    assert "_scaled_dot_product_flash_attention_for_cpu" in msg and "sharding strategy" in msg, msg
