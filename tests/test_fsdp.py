"""FSDP2 (torch ``fully_shard``): trains like one device, holds 16Ψ/N, talks once per unit, checkpoints exactly.

Every configuration of one world size runs inside ONE spawn (a spawn costs ~2 s on 2 cores): the
rank function ``_suite`` runs the notebook's rank functions (``course_lib.experiments.fsdp``)
one after the other, each under its own ``try``, and returns ``{case: {"ok": result} or {"error":
traceback}}``; each test reads the case it names (:func:`case`), so a failing case fails its own
tests with its own traceback and nothing else.

Equality with one device is judged **here, in the test process**: the ranks return the trained
weights (full tensors) and each step's loss on their own slice; the test trains a plain ``GPT`` on
the full batches (``common.reference_run``, on CPU) and replays what each slice's loss must have
been. A run where every rank trained on the full batch ends with the same weights (FSDP2 averages N
identical gradients) — only the per-slice losses give it away, and
``test_the_equality_check_rejects_every_rank_training_on_the_full_batch`` proves the check sees it.

The model is the ZeRO chapter's (``common.zero_config``: bias-free, tied, Ψ = 128,835, odd sizes),
so FSDP2's row padding and our ``Zero3``'s element padding both happen at N = 2 and 4.
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import fsdp
from course_lib.experiments import fsdp as fsdp_lab
from course_lib.experiments.common import (
    make_optimizer,
    reference_run,
    step_batch,
    train_step,
    zero_config,
)
from course_lib.launch import device, spawn
from course_lib.models import GPT
from course_lib.results import ADAMW, BF16, EXACT, REORDERED, for_optimizer

CPU = torch.device("cpu")
WORLDS = [2, 4]
STEPS, GLOBAL_BATCH = 10, 8  # the equality runs (GLOBAL_BATCH is fsdp's default)
EQUALITY = {  # name: (optimizer, reshard_after_forward, worlds)
    "sgd": ("sgd", True, [2, 4]),
    "sgd-keep-gathered": ("sgd", False, [2, 4]),
    "adamw": ("adamw", True, [2, 4]),
    "adamw-keep-gathered": ("adamw", False, [2, 4]),
}
ZERO3 = {
    "reshard": (True, [2, 4]),
    "keep-gathered": (False, [2, 4]),
}  # name: (reshard_after_forward, worlds)


# ----------------------------------------------------------------------------- the runs (on the ranks)


def _error_cases() -> dict:
    """Every misuse, on live ranks: {label: (exception type name, message)}."""
    from torch.distributed.device_mesh import DeviceMesh

    def catch(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return type(exc).__name__, str(exc)
        return None, ""

    class NoBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

    dev = device()

    def gpt():
        return GPT(zero_config()).to(dev)

    def empty_blocks():
        m = gpt()
        m.blocks = nn.ModuleList()
        return m

    wrapped = fsdp.fsdp2_wrap(gpt())
    world = dist.get_world_size()
    return {
        "no-blocks": catch(lambda: fsdp.fsdp2_wrap(NoBlocks().to(dev))),
        "empty-blocks": catch(lambda: fsdp.fsdp2_wrap(empty_blocks())),
        "not-a-module": catch(lambda: fsdp.fsdp2_wrap("gpt")),
        "mesh-smaller-than-world": catch(
            lambda: fsdp.fsdp2_wrap(gpt(), mesh=DeviceMesh(dev.type, list(range(world - 1))))
        ),
        "mesh-not-a-mesh": catch(lambda: fsdp.fsdp2_wrap(gpt(), mesh=(world,))),
        "reshard-int": catch(lambda: fsdp.fsdp2_wrap(gpt(), reshard_after_forward=2)),
        "mp-policy-type": catch(lambda: fsdp.fsdp2_wrap(gpt(), mp_policy=torch.bfloat16)),
        "wrapped-twice": catch(lambda: fsdp.fsdp2_wrap(wrapped)),
        "bad-optimizer": catch(lambda: fsdp_lab.fsdp2_vs_single_device(steps=1, optimizer="lbfgs")),
        "batch-not-divisible": catch(
            lambda: fsdp_lab.fsdp2_vs_single_device(steps=1, global_batch=world + 1)
        ),
        "resume-at-0": catch(
            lambda: fsdp_lab.fsdp2_checkpoint_roundtrip("/nonexistent", resume_at=0)
        ),
    }


def _every_rank_on_the_full_batch(optimizer: str) -> dict:
    """A wrong data-parallel run: each rank trains on the *whole* batch instead of its slice."""
    model, local = fsdp_lab.fsdp2_train(STEPS, optimizer, shard=lambda x, y: (x, y))
    return {
        "full_state": {k: v.cpu() for k, v in fsdp.full_state_dict(model).items()},
        "local_losses": local,
    }


def _run_cases(cases: dict) -> dict:
    """Run each case; a case's exception is returned as its traceback, and the next case still runs."""
    out = {}
    for name, fn in cases.items():
        try:
            out[name] = {"ok": fn()}
        except Exception:  # noqa: BLE001 - reported by the tests that read this case
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def _suite(tmp_dir: str | None, load_from: tuple | None) -> dict:
    """Rank function: every case for this world size, one after the other."""
    world = dist.get_world_size()
    cases = {}
    for name, (opt, reshard, worlds) in EQUALITY.items():
        if world in worlds:
            cases[f"equality/{name}"] = functools.partial(
                fsdp_lab.fsdp2_vs_single_device,
                steps=STEPS,
                optimizer=opt,
                reshard_after_forward=reshard,
            )
    if world == 2:
        cases["equality/full-batch-on-every-rank"] = functools.partial(
            _every_rank_on_the_full_batch, "sgd"
        )
    for name, (reshard, worlds) in ZERO3.items():
        if world in worlds:
            cases[f"zero3/{name}"] = functools.partial(
                fsdp_lab.fsdp2_vs_zero3, steps=3, reshard_after_forward=reshard
            )
    cases["mixed"] = functools.partial(fsdp_lab.fsdp2_mixed_precision, steps=5)
    if tmp_dir is not None:
        cases["checkpoint"] = functools.partial(
            fsdp_lab.fsdp2_checkpoint_roundtrip, tmp_dir, steps=4, resume_at=2
        )
    if world == 2:
        cases["errors"] = _error_cases
    if load_from is not None:
        path, digest = load_from
        cases["reshard_on_load"] = functools.partial(
            fsdp_lab.fsdp2_load_checkpoint, path, saved_digest=digest
        )
    return _run_cases(cases)


def _ranks(outputs: list, name: str, world: int) -> list:
    ranks = [o.get(name) for o in outputs]
    if any(r is None for r in ranks):
        pytest.fail(f"case {name!r} did not run at world {world}", pytrace=False)
    errors = [f"--- rank {i} ---\n{r['error']}" for i, r in enumerate(ranks) if "error" in r]
    if errors:
        pytest.fail(f"case {name!r} raised at world {world}:\n" + "\n".join(errors), pytrace=False)
    return [r["ok"] for r in ranks]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """``case(world, name)`` → every rank's result of that case (one spawn per world size, cached).

    World 2's suite also writes the checkpoint that world 4's suite loads (so world 2 runs first)."""
    outputs: dict[int, list] = {}

    def run(world: int) -> list:
        if world not in outputs:
            tmp, load_from = str(tmp_path_factory.mktemp(f"fsdp_w{world}")), None
            if world != 2:
                saved = run(2)[0]["checkpoint"]  # else: the load case fails alone
                load_from = (
                    (saved["ok"]["path"], saved["ok"]["saved_digest"]) if "ok" in saved else None
                )
            outputs[world] = spawn(_suite, world, args=(tmp, load_from), timeout=400)
        return outputs[world]

    return lambda world, name: _ranks(run(world), name, world)


def grid(cases: dict, worlds_of=lambda v: v[-1]):
    return [
        pytest.param(w, name, id=f"world={w},{name}")
        for w in WORLDS
        for name, v in cases.items()
        if w in worlds_of(v)
    ]


# ----------------------------------------------------------------------------- the reference (in this process)


@functools.lru_cache(maxsize=None)
def _reference(optimizer: str, world: int):
    """One device on the full batches (``common.reference_run``, CPU), and each step's loss on each rank's slice.

    Returns ``(state_dict, full-batch losses, slice_losses[step][rank])``. The slice losses come from
    a replay of the same training, evaluated on slice r of step k's batch just before step k.
    """
    config = zero_config()
    model, losses, _ = reference_run(config, STEPS, GLOBAL_BATCH, optimizer, dev=CPU)
    replay = GPT(config, seed=0)
    opt = make_optimizer(optimizer, replay.parameters())
    slices = []

    def record_slices():  # after backward, before the step: the weights this step's losses were taken at
        with torch.no_grad():
            slices.append(
                [
                    replay(xs, ys)[1].item()
                    for xs, ys in zip(x.chunk(world), y.chunk(world), strict=True)
                ]
            )

    for step in range(STEPS):
        x, y = step_batch(step, config, GLOBAL_BATCH, CPU)
        train_step(replay, opt, x, y, after_backward=record_slices)
    state = model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in replay.state_dict().items()), (
        "the replay is not the reference"
    )
    return state, losses, slices


def _equality_problems(ranks: list, optimizer: str) -> list[str]:
    """What differs between the ranks' run and one device on the full batch, judged in this process."""
    world = len(ranks)
    want, want_losses, want_slices = _reference(optimizer, world)
    problems = []
    for r, got in enumerate(ranks):
        state = got["full_state"]
        if sorted(state) != sorted(want):
            problems.append(f"rank {r}: state dict keys {sorted(set(state) ^ set(want))} differ")
            continue
        err = {k: (state[k] - want[k]).abs().max().item() for k in want}
        worst = max(err, key=err.get)
        tol = for_optimizer(optimizer)
        if not tol.ok(state, want):
            problems.append(
                f"rank {r}: after {STEPS} {optimizer} steps the weights differ from one device's by "
                f"max |Δ| {err[worst]:.3g} ({worst})"
            )
        slice_losses = [s[r] for s in want_slices]
        if not tol.ok(got["local_losses"], slice_losses):
            problems.append(
                f"rank {r}: its per-step losses {got['local_losses'][:3]}… are not the losses of its "
                f"slice {r}/{world} of each batch {slice_losses[:3]}… (full batch: {want_losses[:3]}…)"
            )
    means = [sum(g["local_losses"][k] for g in ranks) / world for k in range(STEPS)]
    if not for_optimizer(optimizer).ok(means, want_losses):
        problems.append(
            f"the mean of the ranks' losses {means[:3]}… is not the full-batch loss {want_losses[:3]}…"
        )
    return problems


# ----------------------------------------------------------------------------- wrapping (no ranks needed)


def test_padded_numel_rounds_every_dim0_up_to_a_multiple_of_n():
    model = GPT(zero_config())
    psi = model.num_params()
    assert psi == 128_835
    # (189, 63) c_attn → 190 rows at N=2; (63,) LayerNorm → 64; 512-row embedding unpadded
    assert fsdp.padded_numel(model, 1) == psi
    assert fsdp.padded_numel(model, 2) == psi + 2 * (63 + 63 + 1 + 1 + 252) + 1
    for n in (2, 4, 8):
        assert fsdp.padded_numel(model, n) % n == 0  # a sum of (multiples of n rows) × row size
        assert psi <= fsdp.padded_numel(model, n) < psi * 1.05


# ----------------------------------------------------------------------------- equality with one device


@pytest.mark.parametrize("world,name", grid(EQUALITY))
def test_fsdp2_trains_like_one_device_on_the_full_batch(case, world, name):
    ranks = case(world, f"equality/{name}")
    optimizer = EQUALITY[name][0]
    assert _equality_problems(ranks, optimizer) == []
    for got in ranks:
        assert got["all_dtensor"] and got["placements"] == ["(Shard(dim=0),)"]
        # the rows judged on the ranks (named tolerances) agree, and the keys are the plain model's
        assert got["keys_match"] and got.passed, str(got)


def test_the_equality_check_rejects_every_rank_training_on_the_full_batch(case):
    ranks = case(2, "equality/full-batch-on-every-rank")
    problems = _equality_problems(ranks, "sgd")
    # N identical full-batch gradients average to the full-batch gradient: the weights agree…
    assert not any("weights differ" in p for p in problems), problems
    # …but no rank's losses are its slice's
    assert [p.split(":")[0] for p in problems if "are not the losses of its slice" in p] == [
        "rank 0",
        "rank 1",
    ]


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_every_rank_holds_its_dim0_chunk_of_each_parameter(case, world):
    ranks = case(world, "equality/sgd")
    shapes = GPT(zero_config()).state_dict()
    for name in ranks[0]["local_shapes"]:
        rows = [r["local_shapes"][name][0] for r in ranks]
        chunks = [
            c.shape[0] for c in shapes[name].chunk(world)
        ]  # torch.chunk may return fewer than N
        assert rows == chunks + [0] * (world - len(chunks))
        assert sum(rows) == shapes[name].shape[0]


# ----------------------------------------------------------------------------- memory: 16Ψ/N


@pytest.mark.parametrize("world,name", grid(ZERO3))
def test_model_state_bytes_per_rank_are_16_psi_over_n_for_fsdp2_and_zero3(case, world, name):
    for got in case(world, f"zero3/{name}"):
        psi = got["psi"]
        for side in ("fsdp2", "zero3"):
            s = got[side]
            assert s["psi_pad"] % world == 0 and psi <= s["psi_pad"] < psi * 1.02
            assert s["memory_ratio"] == pytest.approx(1.0, abs=0.03), (
                side,
                s["memory"],
                s["memory_formula"],
            )
            assert s["memory"]["total"] == pytest.approx(16 * psi / world, rel=0.03)
        # params and grads are stored padded: exactly 4Ψ_pad/N each
        assert got["fsdp2"]["memory"]["params"] == 4 * got["fsdp2"]["psi_pad"] // world
        assert got["fsdp2"]["memory"]["grads"] == 4 * got["fsdp2"]["psi_pad"] // world
        assert got["memory_ratio_fsdp2_over_zero3"] == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_fsdp2_pads_rows_so_its_psi_pad_is_at_least_zero3s(case, world):
    got = case(world, "zero3/reshard")[0]
    assert got["fsdp2"]["psi_pad"] == fsdp.padded_numel(GPT(zero_config()), world)
    assert got["fsdp2"]["psi_pad"] >= got["zero3"]["psi_pad"]


# ----------------------------------------------------------------------------- collectives per step


@pytest.mark.parametrize("world,name", grid(ZERO3))
def test_fsdp2_issues_one_all_gather_per_unit_per_pass_and_one_reduce_scatter_per_unit(
    case, world, name
):
    for got in case(world, f"zero3/{name}"):
        units = got["units"]
        assert units == zero_config().n_layer + 1  # every block, plus the root
        c = got["fsdp2"]["collectives"]
        assert c["all_gather"]["forward"] == units
        assert c["all_gather"]["backward"] == (units if got["reshard_after_forward"] else 0)
        assert c["reduce_scatter"]["forward"] == 0 and c["reduce_scatter"]["backward"] == units
        # CommDebugMode's own counts agree with ours; nothing else was communicated, all on the default group
        counts = got["fsdp2_comm_debug_counts"]
        assert counts == {
            "c10d._allgather_base_": c["all_gather"]["forward"] + c["all_gather"]["backward"],
            "c10d._reduce_scatter_base_": units,
        }
        assert got["fsdp2_other_collectives"] == []
        assert got["fsdp2_collective_groups"] == [("default", world)]


@pytest.mark.parametrize("world,name", grid(ZERO3))
def test_fsdp2_sends_exactly_3_psi_pad_per_step_or_2_when_keeping_gathered_weights(
    case, world, name
):
    for got in case(world, f"zero3/{name}"):
        f = got["fsdp2"]
        passes = 2 if got["reshard_after_forward"] else 1
        assert f["collectives"]["all_gather"]["tensor_bytes"] == passes * 4 * f["psi_pad"]
        assert f["collectives"]["reduce_scatter"]["tensor_bytes"] == 4 * f["psi_pad"]
        EXACT.assert_close(f["comm_ratio"], 1.0)
        assert got.passed, str(
            got
        )  # the rows: counts and bytes exact, model states within 3 % of 16Ψ_pad/N


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_zero3_gathers_by_unit_like_fsdp2_so_it_sends_exactly_3_psi(case, world):
    got = case(world, "zero3/reshard")[0]
    z, f = got["zero3"], got["fsdp2"]
    units = zero_config().n_layer + 1  # one per block + the root (embeddings, tied head, ln_f)
    for phase in ("forward", "backward"):
        assert (
            z["collectives"]["all_gather"][phase] == f["collectives"]["all_gather"][phase] == units
        )
    assert (
        z["collectives"]["reduce_scatter"]["backward"] == units
    )  # the tied weight reduced once, in the root
    EXACT.assert_close(z["comm_ratio"], 1.0)
    assert (
        z["sent_per_step"] <= f["sent_per_step"]
    )  # same 3 passes; FSDP2 pads whole rows, we pad elements


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_step_times_are_measured_on_every_rank_alike(case, world):
    ranks = case(world, "zero3/reshard")
    got = ranks[0]
    for side in ("fsdp2", "zero3"):
        assert len(got[side]["step_s_rounds"]) == 3 and all(
            t > 0 for t in got[side]["step_s_rounds"]
        )
    # max over ranks: every rank reports the same numbers
    assert all(r["fsdp2"]["step_s_rounds"] == got["fsdp2"]["step_s_rounds"] for r in ranks)
    assert got["step_time_ratio_fsdp2_over_zero3"] > 0


# ----------------------------------------------------------------------------- mixed precision


@pytest.fixture(params=WORLDS, ids=[f"world={w}" for w in WORLDS])
def mixed(case, request):
    return case(request.param, "mixed")


def test_mixed_precision_keeps_fp32_sharded_params_grads_and_optimizer_state(mixed):
    for m in mixed:
        assert m["all_dtensor"] and m["sharded_param_dtypes"] == ["torch.float32"]
        assert m["local_shard_dtypes"] == ["torch.float32"]
        assert m["grad_dtypes"] == {"bf16": ["torch.float32"], "fp32": ["torch.float32"]}
        assert m["optimizer_state_dtypes"] == ["torch.float32"]


def test_mixed_precision_computes_in_bf16_on_gathered_plain_parameters(mixed):
    m = mixed[0]
    assert m["compute"] == {
        "weight_type": "Parameter",
        "weight_dtype": "torch.bfloat16",
        "input_dtype": "torch.bfloat16",
    }
    assert m["logits_dtype"] == {"bf16": "torch.bfloat16", "fp32": "torch.float32"}


def test_mixed_precision_halves_gathered_bytes_but_reduces_in_fp32(mixed):
    for m in mixed:
        assert m["comm"]["bf16"]["all_gather"]["dtypes"] == ["bfloat16"]
        assert m["comm"]["bf16"]["reduce_scatter"]["dtypes"] == ["float32"]
        assert m["gather_bytes_ratio_bf16_over_fp32"] == 0.5
        assert m["reduce_bytes_ratio_bf16_over_fp32"] == 1.0
        assert m["peak_gathered_ratio_bf16_over_fp32"] == 0.5
        # the forward peak is the root unit plus one block, never the whole model
        assert (
            0
            < m["peak_gathered_bytes"]["fp32"]
            < 4 * fsdp.padded_numel(GPT(zero_config()), m["world_size"])
        )


def test_mixed_precision_stays_close_to_fp32_and_fp32_fsdp2_is_exact(mixed):
    m = mixed[0]
    assert m.passed, str(
        m
    )  # fp32 weights within ADAMW of one device; bf16 within BF16's rtol per tensor
    assert m["max_rel_err"]["fp32"] < ADAMW.rtol
    assert 1e-4 < m["max_rel_err"]["bf16"] < BF16.rtol  # bf16 rounding shows, but stays small
    # the fp32 reference losses, recomputed here: one device on the full batches
    _, want, _ = reference_run(zero_config(), m["steps"], GLOBAL_BATCH, "adamw", dev=CPU)
    REORDERED.assert_close(m["losses"]["reference"], want)
    ADAMW.assert_close(m["losses"]["fp32"], want)
    BF16.assert_close(m["losses"]["bf16"], want)


# ----------------------------------------------------------------------------- sharded checkpoint


@pytest.fixture(params=WORLDS, ids=[f"world={w}" for w in WORLDS])
def checkpoint(case, request):
    return case(request.param, "checkpoint")


def test_resume_from_a_sharded_dcp_checkpoint_equals_uninterrupted_training_bit_for_bit(checkpoint):
    for c in checkpoint:
        assert c["fresh_model_differed"] and c["restored_equals_saved"]
        assert c["resumed_equals_uninterrupted"] and c["max_abs_diff"] == 0.0
        assert c.passed, str(c)


def test_every_rank_writes_its_own_shard_file(checkpoint):
    c = checkpoint[0]
    n = c["world_size"]
    rank_files = [f"__{r}_0.distcp" for r in range(n)]
    assert c["files"] == [".metadata"] + rank_files
    twelve_psi_over_n = 12 * c["psi"] / n  # fp32 weights + exp_avg + exp_avg_sq, this rank's 1/N
    for f in rank_files:  # + the tied weight's second key and per-tensor framing
        assert 0.9 < c["file_bytes"][f] / twelve_psi_over_n < 1.6, c["file_bytes"]
    rows = -(-189 // n)  # FSDP2's chunk of dim 0, as DCP records it: (offsets, sizes) per rank
    assert c["example_chunks"] == {
        "key": "model.blocks.0.attn.c_attn.weight",
        "global_shape": (189, 63),
        "chunks": [((r * rows, 0), (min(rows, 189 - r * rows), 63)) for r in range(n)],
    }
    assert (
        c["checkpoint_key_counts"]["model"] == 16
        and c["checkpoint_key_counts"]["optim.state"] == 45
    )
    assert c["tied_weight_keys"] == ["model.lm_head.weight", "model.wte.weight"]


def test_a_full_state_dict_loads_into_a_plain_single_device_model(checkpoint):
    c = checkpoint[0]
    assert (
        c["rank0_full_state_dict_keys"] == 16
    )  # cpu_offload=True: only rank 0 gets the full tensors
    assert all(r["rank0_full_state_dict_keys"] == 0 for r in checkpoint[1:])
    assert c["load_state_dict_ok"] and c["rank0_full_equals_fsdp"]
    REORDERED.assert_close(c["single_device_loss"], c["fsdp_loss"])
    assert c["torch_save_keys"] == ["model", "optim"] and c["torch_save_model_equals_saved"]


def test_a_checkpoint_saved_at_world_2_loads_at_world_4(case):
    saved = case(2, "checkpoint")[0]["saved_digest"]
    loaded = case(4, "reshard_on_load")
    assert len(saved) == 16 + 45
    for r in loaded:
        assert r["world_size"] == 4 and r.passed, str(r)  # the rank compared the digest too
        assert r["digest"] == saved
    assert loaded[0]["local_shapes"]["blocks.0.attn.c_attn.weight"] == (48, 63)


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize(
    "label,exc_type,words",
    [
        ("no-blocks", "TypeError", ["model.blocks", "NoBlocks has no .blocks", "fully_shard"]),
        ("empty-blocks", "TypeError", ["non-empty", "length 0"]),
        ("not-a-module", "TypeError", ["nn.Module", "str"]),
        ("mesh-smaller-than-world", "ValueError", ["world_size=2", "shape (1,)"]),
        ("mesh-not-a-mesh", "TypeError", ["DeviceMesh", "tuple"]),
        ("reshard-int", "TypeError", ["reshard_after_forward", "2"]),
        ("mp-policy-type", "TypeError", ["MixedPrecisionPolicy", "dtype"]),
        ("wrapped-twice", "ValueError", ["already sharded"]),
        ("bad-optimizer", "ValueError", ["lbfgs", "adamw", "sgd"]),
        ("batch-not-divisible", "ValueError", ["global_batch=3", "world_size = 2"]),
        ("resume-at-0", "ValueError", ["resume_at=0"]),
    ],
)
def test_misuse_gives_a_clear_error(case, label, exc_type, words):
    got_type, message = case(2, "errors")[0][label]
    assert got_type == exc_type, message
    for w in words:
        assert w in message, message
