"""ZeRO-1/2/3 from scratch: every stage trains like one device, and holds / sends what the formulas say.

One ``spawn`` per world size runs every training configuration below on real gloo ranks (a
spawn costs seconds, a configuration well under one), and chapter 03's experiments, whose result
rows must all pass; the single-device references run in this process. The model is
``configs.zero_config()``: bias-free, without dropout, at fixed length, with tied embeddings,
Ψ = 128,835 parameters (≥ 1e5), many of them in tensors of odd size, so padding to a multiple of
N is exercised. Equality uses the named tolerances of ``course_lib.results`` (SGD, ADAMW, EXACT,
BF16).
"""

from __future__ import annotations

import copy
import io
import math
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import comm
from course_lib.configs import OPTIMIZERS, zero_config
from course_lib.data import make_batch
from course_lib.launch import spawn
from course_lib.memory import saved_tensors_table
from course_lib.models import GPT
from course_lib.results import ADAMW, BF16, EXACT, SGD, for_optimizer

# zero_config: d_model = 63 (3 heads of 21) makes many parameter sizes odd, so every padding
# path runs at N = 2 and 4. OPTIMIZERS["adamw"] has eps = 1e-6 (see course_lib.configs for why).
CONFIG = zero_config()
GLOBAL_BATCH, SEQ, STEPS = 8, CONFIG.block_size, 10  # global batch divisible by N = 2 and 4
SMALL_BUCKETS = 0.05  # MiB: ~13k fp32 elements per bucket, so stage 2 reduces in several buckets during backward
CLIP = 0.5  # below the gradient norm of every step (~1.3), so clipping really scales
CLIP_INF = (
    0.02  # below the largest |gradient element| of every step (~0.05): the inf-norm clips too
)


def case(
    stage,
    opt="adamw",
    *,
    cap=None,
    clip=None,
    norm_type=2.0,
    resume_at=None,
    tie=True,
    dtype=None,
    probe=False,
    groups=False,
    micro=1,
    unit="block",
):
    """One training configuration; ``micro`` > 1 accumulates gradients over that many backward passes per step."""
    return dict(
        stage=stage,
        opt=opt,
        cap=cap,
        clip=clip,
        norm_type=norm_type,
        resume_at=resume_at,
        tie=tie,
        dtype=dtype,
        probe=probe,
        groups=groups,
        micro=micro,
        unit=unit,
    )


CASES = {
    "stage1-sgd": case(1, "sgd"),
    "stage2-sgd": case(2, "sgd", cap=SMALL_BUCKETS),
    "stage1-adamw": case(1, groups=True),
    "stage2-adamw": case(2, cap=SMALL_BUCKETS, groups=True),
    "stage2-adamw-one-bucket": case(2),
    "stage1-adamw-clip": case(1, clip=CLIP),
    "stage2-adamw-clip": case(2, cap=SMALL_BUCKETS, clip=CLIP),
    "stage1-adamw-resume": case(1, groups=True, resume_at=5),
    "stage2-adamw-resume": case(2, cap=SMALL_BUCKETS, groups=True, resume_at=5),
    "stage1-adamw-accumulate": case(1, micro=2),
    "stage2-adamw-accumulate": case(2, cap=SMALL_BUCKETS, micro=2),
    "stage3-adamw-accumulate": case(3, micro=2),
    "stage1-adamw-unused": case(1, probe=True),
    "stage2-adamw-unused": case(2, cap=SMALL_BUCKETS, probe=True),
    "stage3-adamw": case(3, groups=True),
    "stage3-adamw-per-param": case(3, groups=True, unit="param"),
    "stage3-adamw-untied": case(3, tie=False),
    "stage3-sgd": case(3, "sgd"),
    "stage3-adamw-bf16": case(3, dtype="bf16"),
    "stage3-sgd-clip": case(3, "sgd", clip=CLIP),
    "stage3-sgd-clip-inf": case(3, "sgd", clip=CLIP_INF, norm_type=math.inf),
    "stage3-adamw-clip": case(3, clip=CLIP),
    "stage3-adamw-resume": case(3, groups=True, resume_at=5),
}
WORLDS = [2, 4]


# ----------------------------------------------------------------------------- models and training loops


class Probe(nn.Module):
    """The equality GPT plus two extra (odd-sized) weights: one no rank ever uses, one only rank 0 uses."""

    def __init__(self, config):
        super().__init__()
        self.gpt = GPT(config)
        gen = torch.Generator().manual_seed(1)
        self.unused = nn.Parameter(torch.randn(3, 5, generator=gen) * 0.1)
        self.sometimes = nn.Parameter(torch.randn(7, generator=gen) * 0.1)

    def forward(self, x, y, sometimes_weight: float):
        _, loss = self.gpt(x, y)
        if sometimes_weight:
            loss = loss + sometimes_weight * self.sometimes.square().sum()
        return None, loss


def make_model(c, seed=0):
    config = zero_config(tie_weights=c["tie"])
    return Probe(config) if c["probe"] else GPT(config, seed=seed)


def param_groups(named):
    """Two groups when asked: no weight decay on LayerNorm weights (named by the original names)."""
    named = list(named)
    decay = [p for n, p in named if ".ln_" not in n and not n.startswith("ln_")]
    no_decay = [p for n, p in named if ".ln_" in n or n.startswith("ln_")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step, world, rank):
    x, y = make_batch(GLOBAL_BATCH, SEQ, CONFIG.vocab_size, seed=step)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def full_params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_zero_optimizer(c) -> dict:
    from course_lib.experiments.zero import comm_accounting, model_state_accounting
    from course_lib.zero import ZeroOptimizer

    world, rank = dist.get_world_size(), dist.get_rank()
    opt_cls, kwargs = OPTIMIZERS[c["opt"]]

    def build(model):
        params = param_groups(model.named_parameters()) if c["groups"] else model.parameters()
        return ZeroOptimizer(params, opt_cls, stage=c["stage"], bucket_cap_mb=c["cap"], **kwargs)

    model = make_model(c)
    opt = build(model)
    out = {"norms": [], "unused_grad_none": True}
    for step in range(STEPS):
        if step == c["resume_at"]:  # save, rebuild from other weights, load, go on
            blob = io.BytesIO()
            torch.save({"model": full_params(model), "optim": opt.state_dict()}, blob)
            blob.seek(0)
            saved = torch.load(blob)
            model = make_model(c, seed=1)
            model.load_state_dict(saved["model"])
            opt = build(model)
            opt.load_state_dict(saved["optim"])
        x, y = batch(step, world, rank)
        with comm.CommLog() as log:
            if c["probe"]:
                _, loss = model(x, y, 0.1 if rank == 0 else 0.0)
                loss.backward()
            else:
                for xm, ym in zip(x.chunk(c["micro"]), y.chunk(c["micro"]), strict=True):
                    _, loss = model(xm, ym)
                    (loss / c["micro"]).backward()
            if c["clip"]:
                out["norms"].append(opt.clip_grad_norm_(c["clip"]).item())
            opt.step()
        if c["probe"]:
            out["unused_grad_none"] &= model.unused.grad is None
        if step == 1:
            out["memory"] = model_state_accounting(model, opt)
            out["comm"] = comm_accounting(log, opt)
            out["calls"] = [(r.op, r.tag, r.numel) for r in log.records]
        opt.zero_grad()
    out["params"] = full_params(model)
    return out


def _train_zero3(c) -> dict:
    from course_lib.experiments.zero import comm_accounting, model_state_accounting
    from course_lib.zero3 import Zero3

    world, rank = dist.get_world_size(), dist.get_rank()
    opt_cls, kwargs = OPTIMIZERS[c["opt"]]
    plain = make_model(c)

    def build(seed=0):
        model = Zero3(
            make_model(c, seed=seed),
            compute_dtype=torch.bfloat16 if c["dtype"] == "bf16" else None,
            unit=c["unit"],
        )
        params = param_groups(model.named_parameters()) if c["groups"] else model.parameters()
        return model, opt_cls(params, **kwargs)

    model, opt = build()
    out = {
        "names": [n for n, _ in model.named_parameters()],
        "shards": [(p.dtype, p.numel()) for p in model.parameters()],
        "module_params_are_shards": [
            a is b for a, b in zip(model.module.parameters(), model.parameters(), strict=False)
        ]  # the lengths are compared next
        + [len(list(model.module.parameters())) == len(list(model.parameters()))],
        "overrides_named_parameters": "named_parameters" in type(model).__dict__,
        "records": [],
        "norms": [],
    }
    for step in range(STEPS):
        if (
            step == c["resume_at"]
        ):  # full weights (same on every rank) + this rank's optimizer state, as documented
            blob = io.BytesIO()
            torch.save({"model": model.full_state_dict(), "optim": opt.state_dict()}, blob)
            blob.seek(0)
            saved = torch.load(blob)
            model, opt = build(
                seed=1
            )  # other weights, fresh optimizer: everything must come from the checkpoint
            model.load_full_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        x, y = batch(step, world, rank)
        with comm.CommLog() as log:
            for xm, ym in zip(x.chunk(c["micro"]), y.chunk(c["micro"]), strict=True):
                _, loss = model(xm, ym)
                if (
                    step == 0
                ):  # the weights autograd saved for backward were freed after each layer's forward
                    out["saved_bytes"] = sum(
                        r["bytes"] for r in saved_tensors_table(loss) if r["new"]
                    )
                    _, plain_loss = plain(xm, ym)
                    out["saved_bytes_plain"] = sum(
                        r["bytes"]
                        for r in saved_tensors_table(plain_loss, exclude=plain)
                        if r["new"]
                    )
                (loss / c["micro"]).backward()
            if c["clip"]:
                out["norms"].append(model.clip_grad_norm_(c["clip"], c["norm_type"]).item())
            opt.step()
        if step == 1:
            out["memory"] = model_state_accounting(model, opt)
            out["comm"] = comm_accounting(log, model)
            out["records"] = log.as_dicts()
            out["grad_dtypes"] = {p.grad.dtype for p in model.parameters()}
            out["state_dtypes"] = {
                t.dtype for s in opt.state.values() for t in s.values() if t.dim() > 0
            }
        opt.zero_grad()
    sd = model.full_state_dict()
    out["params"] = {k: v.clone() for k, v in sd.items()}
    return out


def run_cases(names: list[str]) -> dict:
    """Rank function: every named configuration, one after the other, on this process group; then
    chapter 03's experiments (``reports``: each stage's report; clipping and resume at stages 1-3)
    and the LR-scheduler runs (``schedulers``); at N = 2 also ``zero_step_times``, one round per
    clock at a fast clock (``step_times``: its shape and α, not its timings, are tested)."""
    from course_lib.experiments.zero import (
        zero_clip_and_resume,
        zero_stage_report,
        zero_step_times,
    )

    out = {
        name: (_train_zero3 if CASES[name]["stage"] == 3 else _train_zero_optimizer)(CASES[name])
        for name in names
    }
    out["reports"] = [zero_stage_report(stage) for stage in range(4)]
    out["reports"] += [zero_stage_report(3, zero3_unit="param")]
    out["reports"] += [zero_clip_and_resume(stage=stage) for stage in (1, 2, 3)]
    out["schedulers"] = {stage: _zero_with_lr_scheduler(stage) for stage in (1, 2)}
    if dist.get_world_size() == 2:
        out["step_times"] = zero_step_times(rounds=1, ratio=2.0, real_rounds=1, real_steps=1)
    return out


_RESULTS: dict[int, dict] = {}
_REPORTS: dict[int, list] = {}
_SCHEDULERS: dict[int, dict] = {}
_STEP_TIMES: dict[int, object] = {}


def results(world: int) -> dict:
    """Rank 0's results of every configuration at this world size (one spawn, cached)."""
    if world not in _RESULTS:
        per_rank = spawn(run_cases, world, args=(list(CASES),), timeout=600)
        _RESULTS[world] = {
            name: dict(per_rank[0][name], all_ranks=[r[name] for r in per_rank]) for name in CASES
        }
        _REPORTS[world] = [report for r in per_rank for report in r["reports"]]
        _SCHEDULERS[world] = per_rank[0]["schedulers"]
        _STEP_TIMES[world] = per_rank[0].get("step_times")
    return _RESULTS[world]


@lru_cache(maxsize=None)
def reference(name: str, world: int) -> dict:
    """The same configuration on one device, full global batch (``world`` matters only for the probe)."""
    c = CASES[name]
    opt_cls, kwargs = OPTIMIZERS[c["opt"]]
    master = make_model(c)
    work = copy.deepcopy(master).to(torch.bfloat16) if c["dtype"] == "bf16" else master
    params = param_groups(master.named_parameters()) if c["groups"] else master.parameters()
    opt = opt_cls(params, **kwargs)
    norms = []
    for step in range(STEPS):
        x, y = make_batch(GLOBAL_BATCH, SEQ, CONFIG.vocab_size, seed=step)
        if c["probe"]:  # rank 0's extra term, averaged over N ranks, is 1/N of it
            _, loss = work(x, y, 0.1 / world)
        else:
            _, loss = work(x, y)
        loss.backward()
        if work is not master:  # bf16 compute, fp32 master weights and gradients
            for pm, pw in zip(master.parameters(), work.parameters(), strict=True):
                pm.grad, pw.grad = pw.grad.float(), None
        if c["clip"]:
            norms.append(
                torch.nn.utils.clip_grad_norm_(
                    master.parameters(), c["clip"], c["norm_type"]
                ).item()
            )
        opt.step()
        opt.zero_grad()
        if work is not master:
            with torch.no_grad():
                for pm, pw in zip(master.parameters(), work.parameters(), strict=True):
                    pw.copy_(pm)
    return {"params": full_params(master), "norms": norms}


def ids(names):
    return [f"world={w},{n}" for w in WORLDS for n in names]


def grid(names):
    return [(w, n) for w in WORLDS for n in names]


# ----------------------------------------------------------------------------- equality with one device


def test_equality_model_is_big_enough():
    model = GPT(CONFIG)
    assert model.num_params() >= 1e5
    assert model.lm_head.weight is model.wte.weight
    assert GLOBAL_BATCH % max(WORLDS) == 0


SGD_CASES = ["stage1-sgd", "stage2-sgd", "stage3-sgd", "stage3-sgd-clip", "stage3-sgd-clip-inf"]


@pytest.mark.parametrize("world,name", grid(SGD_CASES), ids=ids(SGD_CASES))
def test_zero_with_sgd_matches_single_device_with_tied_weights(world, name):
    got, ref = results(world)[name], reference(name, world)
    assert list(got["params"]) == list(ref["params"])
    SGD.assert_close(got["params"], ref["params"])


ADAMW_CASES = [
    "stage1-adamw",
    "stage2-adamw",
    "stage2-adamw-one-bucket",
    "stage3-adamw",
    "stage3-adamw-untied",
]
ACCUMULATE_CASES = ["stage1-adamw-accumulate", "stage2-adamw-accumulate", "stage3-adamw-accumulate"]


@pytest.mark.parametrize("world,name", grid(ADAMW_CASES), ids=ids(ADAMW_CASES))
def test_zero_with_adamw_weight_decay_matches_single_device_after_10_steps(world, name):
    got, ref = results(world)[name], reference(name, world)
    ADAMW.assert_close(got["params"], ref["params"])


@pytest.mark.parametrize(
    "world,name", grid(["stage1-adamw", "stage3-adamw"]), ids=ids(["stage1-adamw", "stage3-adamw"])
)
def test_every_rank_ends_with_the_same_full_weights(world, name):
    ranks = results(world)[name]["all_ranks"]
    for other in ranks[1:]:
        EXACT.assert_close(other["params"], ranks[0]["params"])


@pytest.mark.parametrize("world,name", grid(ACCUMULATE_CASES), ids=ids(ACCUMULATE_CASES))
def test_gradient_accumulation_over_two_backwards_matches_single_device(world, name):
    got, ref = results(world)[name], reference(name, world)
    ADAMW.assert_close(got["params"], ref["params"])


CLIP_CASES = [
    "stage1-adamw-clip",
    "stage2-adamw-clip",
    "stage3-adamw-clip",
    "stage3-sgd-clip",
    "stage3-sgd-clip-inf",
]


@pytest.mark.parametrize("world,name", grid(CLIP_CASES), ids=ids(CLIP_CASES))
def test_clip_grad_norm_uses_the_global_norm_like_single_device(world, name):
    got, ref = results(world)[name], reference(name, world)
    assert min(ref["norms"]) > CASES[name]["clip"]  # clipping really happened on every step
    assert all(
        r["norms"] == got["norms"] for r in got["all_ranks"]
    )  # every rank scaled by the same factor
    tol = for_optimizer(CASES[name]["opt"])
    tol.assert_close(got["norms"], ref["norms"], "gradient norms")
    tol.assert_close(got["params"], ref["params"])


RESUME = [
    ("stage1-adamw-resume", "stage1-adamw"),
    ("stage2-adamw-resume", "stage2-adamw"),
    ("stage3-adamw-resume", "stage3-adamw"),
]


@pytest.mark.parametrize(
    "world,resumed,uninterrupted",
    [(w, a, b) for w in WORLDS for a, b in RESUME],
    ids=[f"world={w},{a}" for w in WORLDS for a, _ in RESUME],
)
def test_resume_from_checkpoint_equals_uninterrupted_run(world, resumed, uninterrupted):
    got = results(world)[resumed]["params"]
    assert dict(CASES[resumed], resume_at=None) == CASES[uninterrupted]
    EXACT.assert_close(got, results(world)[uninterrupted]["params"])
    ADAMW.assert_close(got, reference(resumed, world)["params"])


UNUSED_CASES = ["stage1-adamw-unused", "stage2-adamw-unused"]


@pytest.mark.parametrize("world,name", grid(UNUSED_CASES), ids=ids(UNUSED_CASES))
def test_unused_parameters_none_everywhere_are_skipped_and_some_ranks_send_zeros(world, name):
    got, ref = results(world)[name], reference(name, world)
    init = Probe(CONFIG).unused.detach()
    # no rank has a gradient for `unused`: it stays None and AdamW's weight decay never touches it
    assert all(r["unused_grad_none"] for r in got["all_ranks"])
    EXACT.assert_close(got["params"]["unused"], init)
    # `sometimes` has a gradient on rank 0 only; the others contribute zeros, so its average is 1/N of it
    ADAMW.assert_close(got["params"], ref["params"])


@pytest.mark.parametrize("world,name", grid(UNUSED_CASES), ids=ids(UNUSED_CASES))
def test_every_rank_issues_identical_collectives_even_when_gradients_differ(world, name):
    calls = [r["calls"] for r in results(world)[name]["all_ranks"]]
    assert calls[0] and all(c == calls[0] for c in calls[1:])


# ----------------------------------------------------------------------------- ZeRO-3 specifics


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_zero3_parameters_are_one_fp32_shard_per_unique_parameter_under_original_names(world):
    got = results(world)["stage3-adamw"]
    model = GPT(CONFIG)
    named = list(model.named_parameters())  # the tied weight once, under its first name
    assert got["names"] == [
        f"module.{n}" for n, _ in named
    ]  # registered on the original submodules
    assert got["shards"] == [(torch.float32, math.ceil(p.numel() / world)) for _, p in named]
    assert all(got["module_params_are_shards"])  # the wrapped module holds exactly the shards
    assert not got[
        "overrides_named_parameters"
    ]  # nn.Module's own named_parameters(), not an override


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_zero3_full_state_dict_has_module_keys_and_full_shapes(world):
    got = results(world)["stage3-adamw"]["params"]
    expected = GPT(CONFIG).state_dict()
    assert list(got) == list(expected)  # includes lm_head.weight, the tied name
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in expected.items()}
    assert torch.equal(got["lm_head.weight"], got["wte.weight"])


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_zero3_frees_gathered_weights_after_each_layer_forward(world):
    got = results(world)["stage3-adamw"]
    # what autograd keeps for backward is the plain model's activations, not one byte of weights
    assert got["saved_bytes"] == got["saved_bytes_plain"] > 0


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_zero3_bf16_compute_matches_bf16_single_device_with_fp32_master_weights(world):
    got, ref = results(world)["stage3-adamw-bf16"], reference("stage3-adamw-bf16", world)
    init = full_params(make_model(CASES["stage3-adamw-bf16"]))

    def relative(a, b):
        return ((a - b).norm() / b.norm()).item()

    # bf16 keeps ~3 significant digits and the ranks' half batches round differently from the full
    # batch, so elements near zero differ relatively by more. Element-wise, BF16's atol (1e-2) would
    # not tell 10 AdamW steps at lr 1e-3 (≤ 1e-2 per weight) from no training, so each tensor is
    # compared as a whole: ‖Δ‖ ≤ BF16.atol · ‖w‖, while training moved some tensor by more than that
    for k, v in ref["params"].items():
        assert relative(got["params"][k], v) <= BF16.atol, f"{k}: relative error beyond {BF16}"
    assert max(relative(got["params"][k], init[k]) for k in init) > BF16.atol
    assert got["grad_dtypes"] == {torch.float32} and got["state_dtypes"] == {torch.float32}
    gathers = [r for r in got["records"] if r["op"] == "all_gather" and r["tag"] == "param"]
    assert gathers and all(
        r["dtype"] == "bfloat16" and r["tensor_bytes"] == 2 * r["numel"] for r in gathers
    )
    scatters = [r for r in got["records"] if r["tag"] == "grad"]
    assert scatters and all(
        r["op"] == "reduce_scatter" and r["dtype"] == "float32" for r in scatters
    )


# ----------------------------------------------------------------------------- bytes held, bytes sent

MEMORY_CASES = [
    "stage1-adamw",
    "stage2-adamw",
    "stage2-adamw-one-bucket",
    "stage3-adamw",
    "stage3-adamw-untied",
]


def test_ddp_model_state_bytes_match_16_psi():
    from course_lib.experiments.zero import model_state_accounting

    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*make_batch(2, SEQ, CONFIG.vocab_size, seed=0))[1].backward()
    opt.step()
    acc = model_state_accounting(model, opt)
    assert acc["stage"] == 0 and acc["formula"] == 16 * model.num_params()
    n_tensors = len(list(model.parameters()))
    # 16Ψ + AdamW's 4-byte step counter per tensor
    assert acc["measured"]["total"] == 16 * model.num_params() + 4 * n_tensors


@pytest.mark.parametrize("world,name", grid(MEMORY_CASES), ids=ids(MEMORY_CASES))
def test_measured_model_state_bytes_match_zero_formula(world, name):
    for rank_result in results(world)[name]["all_ranks"]:
        acc = rank_result["memory"]
        assert acc["stage"] == CASES[name]["stage"] and acc["world_size"] == world
        assert acc["psi_pad"] % world == 0 and acc["psi_pad"] - acc["psi"] < world * 20
        assert acc["ratio"] == pytest.approx(1.0, abs=0.01), acc


COMM_CASES = ["stage1-adamw", "stage2-adamw", "stage2-adamw-one-bucket", "stage3-adamw-untied"]


@pytest.mark.parametrize("world,name", grid(COMM_CASES), ids=ids(COMM_CASES))
def test_bytes_sent_per_step_match_2psi_for_stages_1_2_and_3psi_for_stage_3(world, name):
    comm = results(world)[name]["comm"]
    assert comm["sent_per_step"] == comm["formula"]  # (N−1)/N is exact in binary at N = 2 and 4


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_zero3_per_param_gathers_the_tied_weight_per_use_and_reduces_it_once(world):
    got = results(world)["stage3-adamw-per-param"]
    vocab, d = CONFIG.vocab_size, CONFIG.d_model
    tied_pad = math.ceil(vocab * d / world) * world
    # two uses (embedding, output layer) → gathered twice in forward and twice in backward
    gathers = [r for r in got["records"] if r["op"] == "all_gather" and r["numel"] == tied_pad]
    scatters = [r for r in got["records"] if r["op"] == "reduce_scatter" and r["numel"] == tied_pad]
    assert len(gathers) == 4 and len(scatters) == 1
    psi_pad = got["comm"]["psi_pad"]
    assert got["comm"]["sent_per_step"] == (world - 1) / world * (3 * psi_pad + 2 * tied_pad) * 4


# ----------------------------------------------------------------------------- clear errors


def _error_cases() -> dict:
    """Rank function: build every misuse, return {label: (exception type, message)}."""
    from course_lib.ddp import DDP, torch_ddp
    from course_lib.zero import ZeroOptimizer
    from course_lib.zero3 import Zero3

    def model():
        return GPT(CONFIG)

    def catch(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return type(exc).__name__, str(exc)
        return None, ""

    adamw = torch.optim.AdamW
    mixed = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, device="meta"))]
    out = {
        "stage4": catch(lambda: ZeroOptimizer(model().parameters(), adamw, stage=4)),
        "stage3": catch(lambda: ZeroOptimizer(model().parameters(), adamw, stage=3)),
        "lbfgs": catch(lambda: ZeroOptimizer(model().parameters(), torch.optim.LBFGS)),
        "not-an-optimizer": catch(lambda: ZeroOptimizer(model().parameters(), nn.Linear)),
        "mixed-devices": catch(lambda: ZeroOptimizer(mixed, adamw)),
        "bf16-params": catch(lambda: ZeroOptimizer(model().to(torch.bfloat16).parameters(), adamw)),
        "duplicate": catch(lambda: ZeroOptimizer([mixed[0], mixed[0]], adamw)),
        "zero3-dtype": catch(lambda: Zero3(model(), compute_dtype=torch.int8)),
        "zero3-mixed-devices": catch(lambda: Zero3(nn.ParameterList(mixed))),
    }
    if hasattr(torch.optim, "Adafactor"):
        out["adafactor"] = catch(lambda: ZeroOptimizer(model().parameters(), torch.optim.Adafactor))
    ours = DDP(model())
    out["course-ddp"] = catch(lambda: ZeroOptimizer(ours.module.parameters(), adamw))
    theirs = torch_ddp(model())  # torch's DistributedDataParallel, marked by the course's helper
    out["torch-ddp"] = catch(lambda: ZeroOptimizer(theirs.module.parameters(), adamw))
    out["zero3-of-ddp"] = catch(lambda: Zero3(theirs))
    ours = theirs = None  # drop the wrappers (and their hooks) before the next cases
    z = ZeroOptimizer(model().parameters(), adamw)
    out["resume-other-world"] = catch(lambda: z.load_state_dict(dict(z.state_dict(), world_size=3)))
    z3 = Zero3(model())
    out["zero3-inner-call"] = catch(
        lambda: z3.module(*make_batch(2, SEQ, CONFIG.vocab_size, seed=0))
    )
    sd = z3.full_state_dict()
    out["zero3-load-missing"] = catch(
        lambda: z3.load_full_state_dict({k: v for k, v in sd.items() if k != "wte.weight"})
    )
    out["zero3-load-shape"] = catch(
        lambda: z3.load_full_state_dict(dict(sd, **{"ln_f.weight": torch.ones(3)}))
    )
    out["zero3-clip-norm-type"] = catch(lambda: z3.clip_grad_norm_(1.0, norm_type=0))
    return out


@pytest.fixture(scope="module")
def errors():
    return spawn(_error_cases, 2, timeout=300)[0]


@pytest.mark.parametrize(
    "label,exc_type,words",
    [
        ("stage4", "ValueError", ["stage=4 is not one of 1, 2 (use Zero3 for stage 3)"]),
        ("stage3", "ValueError", ["stage=3 is not one of 1, 2 (use Zero3 for stage 3)"]),
        ("lbfgs", "ValueError", ["LBFGS", "element-wise"]),
        ("adafactor", "ValueError", ["Adafactor", "element-wise"]),
        ("not-an-optimizer", "TypeError", ["element-wise torch.optim.Optimizer", "Linear"]),
        ("mixed-devices", "ValueError", ["several devices"]),
        ("zero3-mixed-devices", "ValueError", ["several devices"]),
        ("bf16-params", "ValueError", ["fp32"]),
        ("duplicate", "ValueError", ["twice"]),
        ("zero3-dtype", "ValueError", ["compute_dtype"]),
        ("course-ddp", "ValueError", ["course_lib.ddp.DDP", "its own reduce-scatter"]),
        ("torch-ddp", "ValueError", ["DistributedDataParallel", "its own reduce-scatter"]),
        ("zero3-of-ddp", "ValueError", ["plain module"]),
        ("resume-other-world", "ValueError", ["world_size=3"]),
        ("zero3-inner-call", "RuntimeError", ["call the wrapper"]),
        ("zero3-load-missing", "RuntimeError", ["missing keys ['wte.weight']"]),
        ("zero3-load-shape", "ValueError", ["ln_f.weight has shape (3,)"]),
        ("zero3-clip-norm-type", "ValueError", ["norm_type=0.0"]),
    ],
)
def test_misuse_gives_a_clear_error(errors, label, exc_type, words):
    if label not in errors:
        pytest.skip(f"{label} not available in this torch")
    got_type, message = errors[label]
    assert got_type == exc_type, message
    for w in words:
        assert w in message


def _zero_with_lr_scheduler(stage: int) -> dict:
    from course_lib.zero import ZeroOptimizer

    world, rank = dist.get_world_size(), dist.get_rank()
    model, reference = GPT(CONFIG, seed=0), GPT(CONFIG, seed=0)
    opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=4)
    lrs, ref_lrs = [], []
    for step in range(4):
        x, y = make_batch(8, SEQ, CONFIG.vocab_size, seed=step)
        opt.zero_grad()
        model(x.chunk(world)[rank], y.chunk(world)[rank])[1].backward()
        opt.step()
        sched.step()
        ref_opt.zero_grad()
        reference(x, y)[1].backward()
        ref_opt.step()
        ref_sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
    return {
        "is_optimizer": isinstance(opt, torch.optim.Optimizer),
        "lrs": lrs,
        "ref_lrs": ref_lrs,
        "inner_lr": opt.optimizer.param_groups[0]["lr"],
        "params": full_params(model),
        "ref_params": full_params(reference),
    }


@pytest.mark.parametrize(
    "world,stage",
    [(w, s) for w in WORLDS for s in (1, 2)],
    ids=[f"world={w},stage={s}" for w in WORLDS for s in (1, 2)],
)
def test_zero_optimizer_is_a_torch_optimizer_that_lr_schedulers_drive(world, stage):
    results(world)
    got = _SCHEDULERS[world][stage]
    assert got["is_optimizer"]
    # the same formula on the same numbers
    EXACT.assert_close(got["lrs"], got["ref_lrs"], "learning rates")
    assert (
        got["inner_lr"] == got["lrs"][-1]
    )  # the scheduler drives the optimizer that steps the shards
    ADAMW.assert_close(got["params"], got["ref_params"])


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_chapter_03_experiments_pass_every_row_on_every_rank(world):
    """zero_stage_report (stages 0-3, per-parameter ZeRO-3) and zero_clip_and_resume (stages 1-3):
    bytes held and sent vs the formulas, weights vs one device, resume bit for bit."""
    results(world)
    reports = _REPORTS[world]
    assert len(reports) == 8 * world
    for report in reports:
        report.assert_passed()


def test_zero_step_times_prices_with_the_larger_alpha_and_reruns_the_same_steps_on_the_real_clock():
    from course_lib.experiments.zero import TIMED_STAGES

    results(2)
    got = _STEP_TIMES[2]
    assert got.clocked.clock.startswith("modelled accelerator clock")
    assert list(got.clocked) == list(TIMED_STAGES) == list(got.predicted)
    assert got.real.clock == "real clock" and got.real.rounds == 1
    assert list(got.real) == [*TIMED_STAGES, "no communication"]
    assert all(t.median > 0 for t in got.real.timings.values())
    for op, used in got.links.alpha_s.items():  # back to back (chapter 00's), or after a sleep
        assert used == max(got.alpha_back_to_back[op], got.alpha_after_idle[op])


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_zero3_default_gathers_each_unit_once_so_a_tied_weight_costs_nothing_extra(world):
    got = results(world)["stage3-adamw"]
    # 3Ψ_pad·(N−1)/N, tied weight included
    assert got["comm"]["sent_per_step"] == got["comm"]["formula"]
