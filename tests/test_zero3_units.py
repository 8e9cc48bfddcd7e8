"""Zero3 per unit (FSDP2's design): one all-gather and one reduce-scatter per block + root, with and without prefetch.

One ``spawn`` per world size runs every case below on real gloo ranks; the single-device references
run in this process (``common.reference_run``). The model is chapter 03's (``common.zero_config()``:
Ψ = 128,835, odd sizes, tied embedding), with 4 blocks where "the root + the 2 largest blocks" must
be less than the whole model.
"""

from __future__ import annotations

import copy
import io
import math
from functools import lru_cache

import pytest
import torch
import torch.nn as nn

from course_lib import comm
from course_lib.experiments import common
from course_lib.launch import spawn
from course_lib.models import GPT
from course_lib.results import ADAMW, BF16, EXACT, SGD

WORLDS = [2, 4]
BATCH = 8  # global batch, divisible by 2 and 4
CLIP = 0.5  # below every step's gradient norm (~1.3): clipping really scales


def case(
    opt="adamw",
    steps=10,
    *,
    prefetch=False,
    dtype=None,
    clip=None,
    micro=1,
    resume_at=None,
    n_layer=2,
    tie=True,
    probe=False,
    sublayers=False,
):
    """One training configuration; ``sublayers``: units=[every block's attn and mlp] instead of the blocks."""
    return dict(
        opt=opt,
        steps=steps,
        prefetch=prefetch,
        dtype=dtype,
        clip=clip,
        micro=micro,
        resume_at=resume_at,
        n_layer=n_layer,
        tie=tie,
        probe=probe,
        sublayers=sublayers,
    )


CASES = {
    "sgd": case("sgd", 5),
    "sgd-prefetch": case("sgd", 5, prefetch=True),
    "sgd-sublayer-units-prefetch": case("sgd", 5, prefetch=True, sublayers=True),
    "adamw": case(),
    "adamw-prefetch": case(prefetch=True),
    "adamw-untied": case(tie=False, prefetch=True),
    "adamw-bf16": case(dtype="bf16"),
    "adamw-bf16-prefetch": case(dtype="bf16", prefetch=True),
    "adamw-clip-prefetch": case(clip=CLIP, prefetch=True),
    "adamw-accumulate-prefetch": case(micro=2, prefetch=True),
    "adamw-resume-prefetch": case(resume_at=5, prefetch=True),
    "probe-4-blocks": case("sgd", 2, n_layer=4, probe=True),
    "probe-4-blocks-prefetch": case("sgd", 2, n_layer=4, probe=True, prefetch=True),
}


def config(c):
    return common.zero_config(n_layer=c["n_layer"], tie_weights=c["tie"])


# ----------------------------------------------------------------------------- rank functions


def _probe(model, zero3) -> dict:
    """Gathered bytes sampled before every leaf module's forward and before its backward; collectives per pass."""
    peaks = {"forward": 0, "backward": 0}

    def sample(phase):
        peaks[phase] = max(peaks[phase], zero3.gathered_bytes())

    def after(module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(
                lambda grad: sample("backward")
            )  # runs just before this module's backward

    leaves = [m for m in model.modules() if not list(m.children())]
    handles = [m.register_forward_pre_hook(lambda m, a: sample("forward")) for m in leaves]
    handles += [m.register_forward_hook(after) for m in leaves]
    return peaks, handles


def _train(c) -> dict:
    from course_lib.experiments.zero import comm_accounting
    from course_lib.launch import device
    from course_lib.zero3 import Zero3

    cfg, dev = config(c), device()
    dtype = torch.bfloat16 if c["dtype"] == "bf16" else None

    def build(seed=0):
        gpt = GPT(cfg, seed=seed).to(dev)
        units = [m for b in gpt.blocks for m in (b.attn, b.mlp)] if c["sublayers"] else None
        z = Zero3(gpt, compute_dtype=dtype, unit="block", units=units, prefetch=c["prefetch"])
        return z, common.make_optimizer(c["opt"], z.parameters())

    model, opt = build()
    out = {"norms": [], "units": model.unit_table()}
    peaks, handles = _probe(model.module, model) if c["probe"] else (None, [])
    for step in range(c["steps"]):
        if (
            step == c["resume_at"]
        ):  # full weights + this rank's optimizer state, into a model built from other weights
            blob = io.BytesIO()
            torch.save({"model": model.full_state_dict(), "optim": opt.state_dict()}, blob)
            blob.seek(0)
            saved = torch.load(blob)
            model, opt = build(seed=1)
            model.load_full_state_dict(saved["model"])
            opt.load_state_dict(saved["optim"])
        x, y = common.shard_batch(*common.step_batch(step, cfg, BATCH, dev))
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(
            x.chunk(c["micro"]), y.chunk(c["micro"]), strict=True
        ):  # micro > 1: accumulate gradients
            with comm.CommLog() as log_f:
                _, loss = model(xm, ym)
            with comm.CommLog() as log_b:
                (loss / c["micro"]).backward()
        out["held_after_backward"] = model.gathered_bytes()
        if c["clip"]:
            out["norms"].append(model.clip_grad_norm_(c["clip"]).item())
        with comm.CommLog() as log_s:
            opt.step()
        if step == 1:
            out["forward"] = [(r.op, r.tag, r.numel) for r in log_f.records]
            out["backward"] = [(r.op, r.tag, r.numel) for r in log_b.records]
            out["step_records"] = len(log_s.records)
            log = comm.CommLog()
            log.records = log_f.records + log_b.records
            out["comm"] = comm_accounting(log, model)
    for h in handles:
        h.remove()
    out["peaks"] = peaks
    out["params"] = {k: v.detach().cpu().clone() for k, v in model.full_state_dict().items()}
    with torch.no_grad():  # an eval forward: gathered without autograd, prefetch dropped at the end
        x, y = common.step_batch(0, cfg, BATCH, dev)
        out["eval_loss"] = model(x, y)[1].item()
    out["held_after_eval"] = model.gathered_bytes()
    return out


def _errors() -> dict:
    from course_lib.launch import device
    from course_lib.zero3 import Zero3

    def catch(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return type(exc).__name__, str(exc)
        return None, ""

    def gpt():
        return GPT(common.zero_config(), seed=0)

    def tied(tie):
        m = gpt()
        tie(m)
        return m

    def blocks_share(m):
        m.blocks[1].ln_1.weight = m.blocks[0].ln_1.weight

    def block_and_root_share(m):
        m.ln_f.weight = m.blocks[0].ln_2.weight

    def recovers():  # an exception inside the wrapped forward (the root is gathered): shards back, memory freed
        z = Zero3(gpt(), unit="block", prefetch=True)
        kind = catch(lambda: z(torch.zeros(2, 2, 2, dtype=torch.long, device=device())))[0]
        back = all(a is b for a, b in zip(z.module.parameters(), z.parameters(), strict=True))
        return kind, f"shards back: {back}, gathered bytes: {z.gathered_bytes()}"

    nested = gpt()
    return {
        "recovers": recovers(),
        "shared-blocks": catch(lambda: Zero3(tied(blocks_share), unit="block")),
        "shared-root": catch(lambda: Zero3(tied(block_and_root_share), unit="block")),
        "unknown-unit": catch(lambda: Zero3(gpt(), unit="block", units=[nn.Linear(3, 3)])),
        "nested-units": catch(
            lambda: Zero3(nested, unit="block", units=[nested.blocks[0], nested.blocks[0].attn])
        ),
        "root-as-unit": catch(lambda: Zero3(nested, unit="block", units=[nested])),
        "bad-unit": catch(lambda: Zero3(gpt(), unit="layer")),
        "prefetch-per-param": catch(lambda: Zero3(gpt(), unit="param", prefetch=True)),
    }


class ToyModel(nn.Module):
    """Stanford CS336's ToyModel shape: a few layers as attributes, no ModuleList, no Sequential."""

    def __init__(self, d_in: int = 10, d_out: int = 5):
        super().__init__()
        self.fc1 = nn.Linear(d_in, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, d_out, bias=False)

    def forward(self, x):
        return self.fc2(self.ln(torch.relu(self.fc1(x))))


def any_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "sequential":
        return nn.Sequential(
            nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5)
        )
    return ToyModel()


def _any_models(steps: int = 4) -> dict:
    """Zero3(model) with default units on an nn.Sequential MLP and a CS336-style toy model: SGD vs one device."""
    import torch.distributed as dist

    from course_lib.fsdp_meters import Zero3Timeline, Zero3Waits
    from course_lib.launch import device
    from course_lib.zero3 import Zero3

    dev, out = device(), {}
    gen = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(BATCH, 10, generator=gen).to(dev),
        torch.randn(BATCH, 5, generator=gen).to(dev),
    )
    for kind in ("sequential", "toy"):
        z = Zero3(any_model(kind).to(dev))
        timeline, waits = Zero3Timeline(), Zero3Waits()
        handle = z.add_observer(timeline)
        z.add_observer(waits)
        opt = torch.optim.SGD(z.parameters(), lr=0.1)
        xs, ys = common.shard_batch(x, y)
        all_gathers = []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with comm.CommLog() as log:
                nn.functional.mse_loss(z(xs), ys).backward()
            all_gathers.append(log.count(op="all_gather"))
            opt.step()
        handle.remove()
        out[kind] = {
            "units": [u.name for u in z.units],
            "describe": z.describe(),
            "repr": repr(z),
            "gathers": timeline.count("gather"),
            "waits": dict(waits.calls),
            "all_gathers": all_gathers,  # per step, as CommLog saw them (prefetches included)
            "frees": timeline.count("free"),
            "freed_bytes": [e[2] for e in timeline.events if e[0] == "free"],
            "units_seen": sorted({e[1] for e in timeline.events}),
            "world": dist.get_world_size(),
            "params": {k: v.detach().cpu().clone() for k, v in z.full_state_dict().items()},
        }
    return out


def _recompute_grads_differ() -> float:
    """Max |Δgrad| of two steps with every block checkpointed (recomputed in backward) vs without."""
    import torch.distributed as dist

    from course_lib.experiments.fsdp_race import Recompute
    from course_lib.zero3 import Zero3

    cfg = common.zero_config(n_layer=2)
    x, y = common.shard_batch(*common.step_batch(0, cfg, 2 * dist.get_world_size(), "cpu"))
    grads = []
    for recompute in (False, True):
        model = GPT(cfg, seed=0)
        if recompute:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = Recompute(block)
        z = Zero3(model)
        for _ in range(2):
            z(x, y)[1].backward()
        grads.append([p.grad.clone() for p in z.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))


def run_all(names: list[str]) -> dict:
    out = {name: _train(CASES[name]) for name in names}
    out["errors"] = _errors()
    out["any_model"] = _any_models()
    out["recompute"] = _recompute_grads_differ()
    return out


_RESULTS: dict[int, dict] = {}


def results(world: int) -> dict:
    if world not in _RESULTS:
        per_rank = spawn(run_all, world, args=(list(CASES),), timeout=600)
        _RESULTS[world] = {
            name: dict(per_rank[0][name], all_ranks=[r[name] for r in per_rank]) for name in CASES
        }
        _RESULTS[world]["errors"] = per_rank[0]["errors"]
        _RESULTS[world]["any_model"] = per_rank[0]["any_model"]
        _RESULTS[world]["recompute"] = [r["recompute"] for r in per_rank]
    return _RESULTS[world]


@lru_cache(maxsize=None)
def reference(name: str) -> dict:
    """One device on the full batches; bf16: a bf16 working copy computes, fp32 master weights step."""
    c = CASES[name]
    cfg = config(c)
    if c["dtype"] is None:
        model, losses, norms = common.reference_run(
            cfg, c["steps"], BATCH, c["opt"], max_norm=c["clip"], dev="cpu"
        )
        return {"params": model.state_dict(), "norms": norms, "model": model}
    master = GPT(cfg, seed=0)
    work = copy.deepcopy(master).to(torch.bfloat16)
    opt = common.make_optimizer(c["opt"], master.parameters())
    for step in range(c["steps"]):
        _, loss = work(*common.step_batch(step, cfg, BATCH, "cpu"))
        loss.backward()
        for pm, pw in zip(master.parameters(), work.parameters(), strict=True):
            pm.grad, pw.grad = pw.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pw in zip(master.parameters(), work.parameters(), strict=True):
                pw.copy_(pm)
    return {"params": master.state_dict(), "norms": [], "model": master}


def grid(names):
    return pytest.mark.parametrize(
        "world,name",
        [(w, n) for w in WORLDS for n in names],
        ids=[f"world={w},{n}" for w in WORLDS for n in names],
    )


# ----------------------------------------------------------------------------- equality with one device


@grid(["sgd", "sgd-prefetch", "sgd-sublayer-units-prefetch"])
def test_per_unit_sgd_equals_one_device_after_5_steps(world, name):
    got, ref = results(world)[name], reference(name)
    SGD.assert_close(got["params"], ref["params"])


ADAMW_CASES = [
    "adamw",
    "adamw-prefetch",
    "adamw-untied",
    "adamw-accumulate-prefetch",
    "adamw-resume-prefetch",
]


@grid(ADAMW_CASES)
def test_per_unit_adamw_equals_one_device_after_10_steps(world, name):
    got, ref = results(world)[name], reference(name)
    assert list(got["params"]) == list(
        ref["params"]
    )  # the plain model's keys, the tied name included
    for k, v in ref["params"].items():
        ADAMW.assert_close(got["params"][k], v, msg=k)


@grid(["adamw-prefetch"])
def test_every_rank_ends_with_the_same_full_weights(world, name):
    ranks = results(world)[name]["all_ranks"]
    for r in ranks[1:]:
        EXACT.assert_close(r["params"], ranks[0]["params"])


@grid(["adamw", "adamw-prefetch"])
def test_tied_weight_lies_in_the_root_unit_and_stays_tied(world, name):
    got = results(world)[name]
    root = [u for u in got["units"] if u["root"]]
    assert len(root) == 1 and "wte.weight" in root[0]["params"]
    assert all("wte.weight" not in u["params"] for u in got["units"] if not u["root"])
    assert torch.equal(got["params"]["lm_head.weight"], got["params"]["wte.weight"])


@grid(["adamw-bf16", "adamw-bf16-prefetch"])
def test_bf16_compute_matches_bf16_single_device(world, name):
    got, ref = results(world)[name], reference(name)
    for k, v in ref["params"].items():
        BF16.assert_close(got["params"][k], v, msg=k)
    gathers = [r for r in got["forward"] + got["backward"] if r[0] == "all_gather"]
    assert gathers  # (their dtype is checked on the records in test_collectives_per_pass)


@grid(["adamw-clip-prefetch"])
def test_clip_grad_norm_is_the_single_device_norm(world, name):
    got, ref = results(world)[name], reference(name)
    assert min(ref["norms"]) > CLIP
    ADAMW.assert_close(got["norms"], ref["norms"])
    for k, v in ref["params"].items():
        ADAMW.assert_close(got["params"][k], v, msg=k)


@grid(["adamw", "adamw-prefetch"])
def test_eval_forward_without_autograd_gives_the_same_loss_and_frees_everything(world, name):
    got, ref = results(world)[name], reference(name)
    with torch.no_grad():
        want = ref["model"](*common.step_batch(0, config(CASES[name]), BATCH, "cpu"))[1].item()
    ADAMW.assert_close(got["eval_loss"], want)
    assert got["held_after_eval"] == 0 and got["held_after_backward"] == 0


# ----------------------------------------------------------------------------- collectives and bytes


@grid(
    [
        "adamw",
        "adamw-prefetch",
        "adamw-bf16-prefetch",
        "probe-4-blocks-prefetch",
        "sgd-sublayer-units-prefetch",
    ]
)
def test_one_all_gather_per_unit_per_pass_and_one_reduce_scatter_per_unit(world, name):
    got = results(world)[name]
    units = got["units"]
    assert len(units) == 1 + (2 if CASES[name]["sublayers"] else 1) * CASES[name]["n_layer"]
    sizes = sorted(u["padded"] for u in units)
    for phase in ("forward", "backward"):
        gathers = [r for r in got[phase] if r[0] == "all_gather"]
        assert len(gathers) == len(units) and all(r[1] == "param" for r in gathers)
        assert sorted(r[2] for r in gathers) == sizes  # each all-gather is one whole unit
    scatters = [r for r in got["backward"] if r[0] == "reduce_scatter"]
    assert len(scatters) == len(units) and sorted(r[2] for r in scatters) == sizes
    assert [r for r in got["forward"] if r[0] == "reduce_scatter"] == [] and got[
        "step_records"
    ] == 0


@grid(["adamw", "adamw-prefetch", "adamw-untied"])
def test_bytes_sent_per_step_are_exactly_3_psi_pad(world, name):
    got = results(world)[name]
    model = GPT(config(CASES[name]))
    psi_pad = sum(math.ceil(p.numel() / world) * world for p in model.parameters())
    assert got["comm"]["psi_pad"] == psi_pad == sum(u["padded"] for u in got["units"])
    EXACT.assert_close(got["comm"]["sent_per_step"], 3 * psi_pad * 4 * (world - 1) / world)
    EXACT.assert_close(got["comm"]["ratio"], 1.0)  # the tied weight: once per unit, no extra


@grid(["probe-4-blocks", "probe-4-blocks-prefetch"])
def test_gathered_weights_peak_is_at_most_root_plus_two_largest_blocks(world, name):
    got = results(world)[name]
    model = GPT(config(CASES[name]))
    nbytes = {id(p): math.ceil(p.numel() / world) * world * 4 for p in model.parameters()}
    blocks = sorted(
        (sum(nbytes[id(p)] for p in b.parameters()) for b in model.blocks), reverse=True
    )
    root = sum(nbytes.values()) - sum(blocks)
    bound = root + blocks[0] + blocks[1]
    assert bound < sum(
        nbytes.values()
    )  # the bound says something: 4 blocks, 2 of them never gathered at once
    expected = root + (blocks[0] + blocks[1] if CASES[name]["prefetch"] else blocks[0])
    for r in got["all_ranks"]:
        for phase in ("forward", "backward"):
            assert root + blocks[0] <= r["peaks"][phase] <= bound, (phase, r["peaks"], bound)
            assert r["peaks"][phase] == expected, phase  # prefetch holds exactly one more block


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize(
    "label,exc_type,words",
    [
        (
            "shared-blocks",
            "ValueError",
            ["blocks.1.ln_1.weight", "unit blocks.0", "unit blocks.1", "one unit"],
        ),
        ("shared-root", "ValueError", ["ln_f.weight", "the root unit", "unit blocks.0"]),
        ("unknown-unit", "ValueError", ["units[0] (Linear) is not a submodule of the wrapped GPT"]),
        ("nested-units", "ValueError", ["blocks.0.attn", "blocks.0", "nested"]),
        ("root-as-unit", "ValueError", ["wrapped module itself"]),
        ("bad-unit", "ValueError", ["unit='layer'", "'param'", "'block'"]),
        ("prefetch-per-param", "ValueError", ["unit='block'"]),
        ("recovers", "ValueError", ["shards back: True, gathered bytes: 0"]),
    ],
)
def test_bad_inputs_give_clear_errors(label, exc_type, words):
    got_type, message = results(2)["errors"][label]
    assert got_type == exc_type, message
    for w in words:
        assert w in message, message


# ----------------------------------------------------------------------------- any model, default units


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind,units", [("sequential", ["0", "2", "4"]), ("toy", ["(root)"])])
def test_default_units_wrap_any_model_and_train_like_one_device(world, kind, units):
    """A Sequential's layers are the units; a model without ModuleList/Sequential is one root unit."""
    got = results(world)["any_model"][kind]
    assert got["units"] == units
    assert "unit='block'" in got["repr"] and all(u in got["describe"] for u in units)
    # the observer saw each unit gathered twice per step (forward, backward) and freed as often, to 0 bytes
    assert got["gathers"] == got["frees"] == 2 * 4 * len(units) and set(got["freed_bytes"]) == {0}
    # one wait per landed all-gather, one per unit's reduce-scatter
    assert got["waits"] == {"all_gather": 2 * 4 * len(units), "reduce_scatter": 4 * len(units)}
    assert got["units_seen"] == sorted(units)
    # no root unit (the Sequential): the first step too issues no extra all-gather (none prefetches itself)
    assert got["all_gathers"] == [2 * len(units)] * 4
    model = any_model(kind)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 10, generator=gen), torch.randn(BATCH, 5, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert list(got["params"]) == list(model.state_dict())
    SGD.assert_close(got["params"], model.state_dict())


@pytest.mark.parametrize("world", WORLDS)
def test_activation_checkpointing_inside_units_gives_bit_identical_gradients(world):
    """Recompute in backward must see the re-gathered full weights, not the shards."""
    assert results(world)["recompute"] == [0.0] * world
