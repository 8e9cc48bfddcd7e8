"""The modelled accelerator clock (course_lib/clock.py): it sleeps what the model costs, no more.

* calibrated, each block sleeps ≥ 10× its real forward+backward (as it runs under the clock);
* sleeps keep a deadline: 200 sleeps of 1 ms take 0.2 s ± 2 % (plain ``time.sleep``: +15 %);
* a checkpointed block (``use_reentrant=False``) sleeps its forward twice, its backward once;
* the cost follows the local shapes: a block whose Linears are half as wide sleeps half as long;
* numerics: losses and gradients bit for bit the same with the clock on and off;
* our DDP and torch DDP on 2 gloo ranks run the same clocked model: equal results, equal modelled
  compute, and every step takes at least that long; under Zero3, FSDP2 and TP (± sequence
  parallelism) a rank is costed for the block it really computes;
* off on CUDA unless forced (tested with a device type string); paused; profiler labels.
"""

import copy
import statistics
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from course_lib.clock import AcceleratorClock, calibrate, count_flops, models_time
from course_lib.configs import make_optimizer, small_config
from course_lib.launch import spawn
from course_lib.models import GPT, Block
from course_lib.results import EXACT, REORDERED, SGD
from course_lib.train import shard_batch, step_batch, train_step

CFG = small_config()  # d_model 32, 2 heads, 2 layers, s = 16
BATCH = 8


def batch(step: int = 0, size: int = BATCH):
    return step_batch(step, CFG, size, "cpu")


def block_inputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Each block's input in ``model(x)`` (detached)."""
    seen = []

    def keep(module, args):
        seen.append(args[0].detach())

    handles = [b.register_forward_pre_hook(keep) for b in model.blocks]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


def fwd_bwd_seconds(module: nn.Module, x: torch.Tensor, repeats: int = 7) -> float:
    """Median wall time of ``module(x)`` forward + backward (one warm-up first)."""
    times = []
    for i in range(repeats + 1):
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        module(xi).sum().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --------------------------------------------------------------------------- calibration


def test_calibrated_blocks_sleep_at_least_ten_times_their_real_compute():
    model = GPT(CFG)
    x, y = batch()
    cal = calibrate(model, x, y)
    clock = AcceleratorClock(cal.rate, device="cpu")
    clock.apply(model)
    _, loss = model(x, y)
    loss.backward()
    for i, (block, h) in enumerate(zip(model.blocks, block_inputs(model, x), strict=True)):
        modelled = clock.seconds[f"blocks.{i} fwd"] + clock.seconds[f"blocks.{i} bwd"]
        clock.rate = float("inf")  # the clocked path (FLOP counter, Function), sleeping 0 s
        real = fwd_bwd_seconds(block, h)
        clock.rate = cal.rate
        assert modelled >= 10 * real, f"block {i}: sleeps {modelled:.5f} s, computes {real:.5f} s"
    assert cal.ratio >= 10 and cal.rate > 0
    calls = dict(clock.calls)
    again = calibrate(model, x, y)  # under the clock now: it is paused while calibrating
    assert dict(clock.calls) == calls and clock.enabled
    assert 0.5 <= again.rate / cal.rate <= 2, f"{again} vs {cal}"


def test_counted_flops_are_the_matmul_formula():
    """2·tokens·(12·d²) for the Linears (qkv 3d², proj d², MLP 8d²) + 2·2·B·T²·d for attention."""
    block, (b, t, d) = Block(CFG), (BATCH, CFG.block_size, CFG.d_model)
    want = 2 * b * t * 12 * d * d + 2 * 2 * b * t * t * d
    for attn in ("sdpa", "math"):  # the fused kernel and the written-out softmax cost the same
        block = Block(small_config(attn=attn))
        _, flops = count_flops(block, torch.randn(b, t, d))
        assert flops == want, attn


# --------------------------------------------------------------------------- sleeping


def test_sleeps_keep_a_deadline_without_drift():
    clock = AcceleratorClock(1e9, device="cpu")  # 1e6 FLOPs = 1 ms
    t0 = time.perf_counter()
    for _ in range(200):
        clock.spend(1e6, "ring step")
    wall = time.perf_counter() - t0 - clock.late  # the last overrun has no next sleep to pay it
    assert abs(wall - 0.2) <= 0.02 * 0.2, f"200 × 1 ms took {wall * 1e3:.1f} ms"
    assert clock.calls["ring step"] == 200
    assert clock.slept["forward"] == clock.slept["backward"] == 0.0
    REORDERED.assert_close(clock.slept["spent"], 0.2)


def test_checkpointed_block_sleeps_its_forward_twice():
    plain, ckpt = nn.Sequential(Block(CFG)), nn.Sequential(Block(CFG))
    clocks = [AcceleratorClock(1e10, device="cpu") for _ in range(2)]
    clocks[0].apply(plain)
    clocks[1].apply(ckpt)
    h = torch.randn(BATCH, CFG.block_size, CFG.d_model, requires_grad=True)
    plain(h).sum().backward()
    checkpoint(ckpt, h, use_reentrant=False).sum().backward()
    assert dict(clocks[0].calls) == {"0 fwd": 1, "0 bwd": 1}
    assert dict(clocks[1].calls) == {"0 fwd": 2, "0 bwd": 1}
    EXACT.assert_close(clocks[1].slept["forward"], 2 * clocks[0].slept["forward"])
    EXACT.assert_close(clocks[1].slept["backward"], clocks[0].slept["backward"])


def half_width(block: Block) -> Block:
    """The block as one of two tensor-parallel ranks holds it: half the heads, half the MLP."""
    d, half = CFG.d_model, copy.deepcopy(block)
    half.attn.c_attn = nn.Linear(d, 3 * d // 2, bias=False)  # half the heads (head by head)
    half.attn.c_proj = nn.Linear(d // 2, d, bias=False)
    half.mlp.c_fc = nn.Linear(d, CFG.mlp_ratio * d // 2, bias=False)
    half.mlp.c_proj = nn.Linear(CFG.mlp_ratio * d // 2, d, bias=False)
    return half


def test_a_block_half_as_wide_sleeps_half_as_long():
    full = nn.Sequential(Block(CFG))
    half = nn.Sequential(half_width(full[0]))
    clocks = [AcceleratorClock(2.5e8, device="cpu") for _ in range(2)]  # 41 ms fwd+bwd, full block
    clocks[0].apply(full)
    clocks[1].apply(half)
    h = torch.randn(BATCH, CFG.block_size, CFG.d_model)
    wall_full, wall_half = fwd_bwd_seconds(full, h, 5), fwd_bwd_seconds(half, h, 5)
    EXACT.assert_close(2 * clocks[1].seconds["0 fwd"], clocks[0].seconds["0 fwd"])
    EXACT.assert_close(2 * clocks[1].seconds["0 bwd"], clocks[0].seconds["0 bwd"])
    assert clocks[0].calls["0 fwd"] == clocks[1].calls["0 fwd"] == 6
    assert 0.45 <= wall_half / wall_full <= 0.55, f"{wall_half:.4f} s vs {wall_full:.4f} s"


# --------------------------------------------------------------------------- numerics


def run_steps(model: nn.Module, steps: int = 3) -> tuple[list, list]:
    opt = make_optimizer("sgd", model.parameters())
    losses, grads = [], []
    for step in range(steps):
        losses.append(
            train_step(
                model,
                opt,
                *batch(step),
                after_backward=lambda: grads.append([p.grad.clone() for p in model.parameters()]),
            )
        )
    return losses, grads


def test_clock_on_and_off_give_bit_identical_losses_and_gradients():
    clock = AcceleratorClock(1e11, device="cpu")
    on = clock.apply(GPT(CFG))
    losses_on, grads_on = run_steps(on)
    losses_off, grads_off = run_steps(GPT(CFG))
    assert clock.calls["blocks.1 bwd"] == 3  # the clock did run
    EXACT.assert_close(losses_on, losses_off)
    for g_on, g_off in zip(grads_on, grads_off, strict=True):
        EXACT.assert_close(dict(enumerate(g_on)), dict(enumerate(g_off)))


# --------------------------------------------------------------------------- distributed


def _ddp_under_the_clock(rate: float, steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from course_lib.ddp import DDP

    out = {}
    for name, wrap in (("ours", DDP), ("torch", DistributedDataParallel)):
        clock = AcceleratorClock(rate)
        model = wrap(clock.apply(GPT(CFG)))
        opt = make_optimizer("sgd", model.parameters())
        losses, times, modelled = [], [], []
        for step in range(steps):
            x, y = shard_batch(*batch(step, 2 * BATCH))
            before = sum(clock.slept.values())
            torch.distributed.barrier()
            t0 = time.perf_counter()
            losses.append(train_step(model, opt, x, y))
            times.append(time.perf_counter() - t0)
            modelled.append(sum(clock.slept.values()) - before)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        params = {n.removeprefix("module."): p for n, p in params.items()}
        out[name] = {
            "losses": losses,
            "times": times,
            "modelled": modelled,
            "params": params,
            "clock": clock.name,
        }
    return out


def _block_flops_under_techniques() -> dict:
    """blocks.0's counted forward FLOPs, per technique, each on the same global batch of 2·BATCH."""
    from torch.distributed.fsdp import fully_shard

    from course_lib.tensor_parallel import tensor_parallel_gpt
    from course_lib.zero3 import Zero3

    rate = 1e15  # the clock's path, sleeping ~0 s: only the counts matter here
    local, full = shard_batch(*batch(0, 2 * BATCH)), batch(0, 2 * BATCH)

    def fsdp2(model):
        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)

    runs = {
        "zero3": (Zero3, local),
        "zero3 per param": (lambda m: Zero3(m, unit="param"), local),
        "fsdp2": (fsdp2, local),
        "tp": (tensor_parallel_gpt, full),
        "tp + sp": (lambda m: tensor_parallel_gpt(m, sequence_parallel=True), full),
    }
    flops = {}
    for name, (technique, (x, y)) in runs.items():
        clock = AcceleratorClock(rate)
        if name.startswith("tp"):  # TP replaces the embedding and the head: clock the TP model
            model = clock.apply(technique(GPT(CFG)))
        else:  # the others wrap the model: clock it first
            model = technique(clock.apply(GPT(CFG)))
        model(x, y)[1].backward()
        flops[name] = clock.seconds["blocks.0 fwd"] * rate
    return flops


def _suite(rate: float, steps: int) -> dict:
    return {"ddp": _ddp_under_the_clock(rate, steps), "flops": _block_flops_under_techniques()}


@pytest.fixture(scope="module")
def two_ranks():
    """One spawn of 2 gloo ranks for every distributed check below."""
    return spawn(_suite, 2, args=(5e8, 3), backend="gloo", timeout=180)  # ~20 ms modelled per step


def test_our_ddp_and_torch_ddp_run_under_the_same_clock(two_ranks):
    for rank, res in enumerate(two_ranks):
        ours, theirs = res["ddp"]["ours"], res["ddp"]["torch"]
        assert ours["clock"] == "modelled accelerator clock, 0.5 GFLOP/s"
        EXACT.assert_close(ours["modelled"], theirs["modelled"])  # the same model, the same costs
        for r in (ours, theirs):
            assert min(r["modelled"]) > 0.01
            for t, m in zip(r["times"], r["modelled"], strict=True):
                assert t >= m, f"rank {rank}: a step took {t:.4f} s < modelled {m:.4f} s"
        SGD.assert_close(ours["losses"], theirs["losses"], f"rank {rank} losses")
        SGD.assert_close(ours["params"], theirs["params"], f"rank {rank} parameters")


def test_a_rank_costs_what_it_computes_under_zero3_fsdp2_and_tensor_parallelism(two_ranks):
    """Data parallel: the whole block on half the batch (weights whole while it runs); TP: half
    the block on the whole batch (also with sequence parallelism: the Linears see all s)."""
    b, t, d = BATCH, CFG.block_size, CFG.d_model  # BATCH = this rank's half of the global batch
    whole_block_half_batch = 2 * b * t * 12 * d * d + 2 * 2 * b * t * t * d
    for res in two_ranks:
        EXACT.assert_close(res["flops"], dict.fromkeys(res["flops"], float(whole_block_half_batch)))


# --------------------------------------------------------------------------- the switch


def test_off_on_cuda_unless_forced():
    assert models_time("cpu") and not models_time("cuda") and models_time("cuda", force=True)
    real = AcceleratorClock(1e9, device="cuda")  # a device type only: no GPU needed
    assert not real.enabled and real.name == "real clock"
    assert AcceleratorClock(1e9, device="cuda", force=True).enabled
    model = real.apply(GPT(CFG))
    _, loss = model(*batch())
    loss.backward()
    assert not real.calls and sum(real.slept.values()) == 0.0


def test_paused_and_disabled_clocks_do_not_sleep():
    clock = AcceleratorClock(1e9, device="cpu")
    assert clock.name == "modelled accelerator clock, 1.0 GFLOP/s"
    model = clock.apply(GPT(CFG))
    with clock.paused():
        model(*batch())[1].backward()
    assert not clock.calls and clock.enabled
    clock.enabled = False
    model(*batch())[1].backward()
    assert not clock.calls
    clock.enabled = True
    model(*batch())[1].backward()
    assert clock.calls["blocks.0 fwd"] == 1 and clock.calls["lm_head bwd"] == 1
    with pytest.raises(ValueError, match="already under a clock"):
        AcceleratorClock(1e9, device="cpu").apply(model)
    clock.remove()
    clock.reset()
    model(*batch())[1].backward()
    assert not clock.calls


def test_sleeps_are_labelled_for_the_profiler():
    clock = AcceleratorClock(1e10, device="cpu")
    model = clock.apply(GPT(CFG))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(*batch())[1].backward()
    names = {e.name for e in prof.events()}
    assert {"clock: blocks.0 fwd", "clock: blocks.0 bwd", "clock: lm_head fwd"} <= names


def test_format_rate_names_tiny_and_huge_rates_in_readable_units():
    from course_lib.clock import format_rate

    assert format_rate(2e9) == "2.0 GFLOP/s"
    assert format_rate(5e8) == "0.5 GFLOP/s"
    assert format_rate(3e13) == "30.0 TFLOP/s"
    assert format_rate(2.5e6) == "2.5 MFLOP/s"
    assert format_rate(6.4e3) == "6.4 kFLOP/s"
