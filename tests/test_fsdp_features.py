"""FSDP2's features, each on real ranks: reshard True/False, accumulation, HSDP, prefetch, clipping,
activation checkpointing, meta-device init, checkpoints across world sizes, clear errors.

Three spawns serve every case (a spawn costs seconds on 2 cores): world 2 runs most rank functions
and saves a checkpoint; world 4 runs HSDP, ``reshard_after_forward=2`` and loads that checkpoint;
world 1 loads it too. Each case runs under its own ``try`` and is read by the tests that name it
(:func:`case`), so a failing case fails only its own tests, with its traceback.

Equality with one device is judged here, in the test process, against references computed here
on CPU (``common.reference_run``, a plain ``GPT``); the numbers the ranks computed for the notebook
(``claims()``) are asserted as well.
"""

from __future__ import annotations

import functools
import os
import traceback

import pytest
import torch
import torch.distributed as dist

from course_lib import fsdp
from course_lib.experiments import fsdp_features as F
from course_lib.experiments import fsdp_practice as P
from course_lib.experiments.common import reference_run
from course_lib.launch import device, spawn
from course_lib.models import GPT
from course_lib.results import ADAMW, EXACT, REORDERED, SGD

CPU = torch.device("cpu")
CONFIG = (
    F.features_config()
)  # zero_config with 4 blocks: 189-row c_attn, 63-row LayerNorms (indivisible by 2 and 4)


# ----------------------------------------------------------------------------- on the ranks


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None, ""


def _error_cases(ckpt: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    from course_lib.experiments.common import make_optimizer

    dev = device()

    def fresh(**overrides):
        return GPT(F.features_config(**overrides), seed=0).to(dev)

    def load_into(**overrides):
        model = fsdp.fsdp2_wrap(fresh(**overrides))
        fsdp.load_sharded_checkpoint(model, make_optimizer("adamw", model.parameters()), ckpt)

    wrapped = fsdp.fsdp2_wrap(fresh())
    one_block = fresh()
    fully_shard(one_block.blocks[1])
    other = fsdp.fsdp2_wrap(fresh())
    return {
        "wrap-twice": _catch(lambda: fsdp.fsdp2_wrap(wrapped)),
        "wrap-after-a-block-was-sharded": _catch(lambda: fsdp.fsdp2_wrap(one_block)),
        "prefetch-module-of-another-model": _catch(
            lambda: fsdp.set_prefetch(wrapped, forward={wrapped.blocks[0]: [other.blocks[1]]})
        ),
        "prefetch-key-of-another-model": _catch(
            lambda: fsdp.set_prefetch(wrapped, backward={other.blocks[1]: [wrapped.blocks[0]]})
        ),
        "prefetch-not-a-unit": _catch(
            lambda: fsdp.set_prefetch(
                wrapped, forward={wrapped.blocks[0]: [wrapped.blocks[1].attn]}
            )
        ),
        "prefetch-plan-not-a-dict": _catch(
            lambda: fsdp.set_prefetch(wrapped, forward=[wrapped.blocks[0]])
        ),
        "load-fewer-layers": _catch(lambda: load_into(n_layer=3)),
        "load-more-layers": _catch(lambda: load_into(n_layer=5)),
        "load-other-width": _catch(lambda: load_into(d_model=66)),
        "load-not-a-checkpoint": _catch(
            lambda: fsdp.load_sharded_checkpoint(wrapped, None, os.path.dirname(ckpt))
        ),
        "hsdp-at-world-2": _catch(lambda: F.hsdp(steps=1)),
        "accumulation-indivisible": _catch(
            lambda: F.accumulation_without_sync(micro_batches=3, global_batch=8)
        ),
    }


def _run_cases(cases: dict) -> dict:
    out = {}
    for name, fn in cases.items():
        try:
            out[name] = {"ok": fn()}
        except Exception:  # noqa: BLE001 - reported by the tests that read this case
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def _suite(world: int, tmp_dir: str, load_from: str | None) -> dict:
    cases = {}
    if world == 2:
        cases = {
            "reshard": F.reshard_memory_and_traffic,
            "accumulation": F.accumulation_without_sync,
            "prefetch": F.prefetch_timeline,
            "clip": P.clip_grad_norm,
            "checkpointing": P.activation_checkpointing,
            "meta": P.meta_device_init,
            "save": functools.partial(P.checkpoint_save, tmp_dir),
            "flat": P.flat_vs_per_parameter,
            "errors": functools.partial(_error_cases, os.path.join(tmp_dir, "dcp_w2")),
        }
    if world == 4:
        cases = {"hsdp": F.hsdp, "reshard-int": F.reshard_to_smaller_mesh}
    if load_from is not None:
        cases["load"] = functools.partial(P.checkpoint_load, load_from)
    return _run_cases(cases)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """``case(world, name)`` → every rank's result of that case (one spawn per world size, cached)."""
    outputs: dict[int, list] = {}

    def run(world: int) -> list:
        if world not in outputs:
            load_from = None
            if world != 2:
                saved = run(2)[0]["save"]
                load_from = (
                    saved["ok"].path if "ok" in saved else None
                )  # else: the load cases fail alone
            tmp = str(tmp_path_factory.mktemp(f"features_w{world}"))
            outputs[world] = spawn(_suite, world, args=(world, tmp, load_from), timeout=400)
        return outputs[world]

    def get(world: int, name: str) -> list:
        ranks = [o.get(name) for o in run(world)]
        if any(r is None for r in ranks):
            pytest.fail(f"case {name!r} did not run at world {world}", pytrace=False)
        errors = [f"--- rank {i} ---\n{r['error']}" for i, r in enumerate(ranks) if "error" in r]
        if errors:
            pytest.fail(
                f"case {name!r} raised at world {world}:\n" + "\n".join(errors), pytrace=False
            )
        return [r["ok"] for r in ranks]

    return get


def _assert_claims(result) -> None:
    assert result.checks(), "the result carries no checked rows"
    failed = [c for c, ok in result.claims().items() if not ok]
    assert failed == [], (failed, str(result))


@functools.lru_cache(maxsize=None)
def _reference(steps: int, global_batch: int, optimizer: str, max_norm: float | None = None):
    model, losses, norms = reference_run(
        CONFIG, steps, global_batch, optimizer, max_norm=max_norm, dev=CPU
    )
    return model.state_dict(), losses, norms


def _assert_equal(state: dict, want: dict, tol) -> None:
    assert sorted(state) == sorted(want)
    tol.assert_close(state, want)


# ----------------------------------------------------------------------------- reshard_after_forward


def test_reshard_false_sends_two_thirds_of_true_and_peaks_higher_by_at_least_a_block(case):
    for r in case(2, "reshard"):
        _assert_claims(r)
        psi_pad = fsdp.padded_numel(GPT(CONFIG), 2)
        block = 4 * fsdp.padded_numel(
            GPT(CONFIG).blocks[0], 2
        )  # recomputed here, not taken from the rank
        assert r.psi_pad == psi_pad and r.block_param_bytes == block
        EXACT.assert_close(r.sent["True"], 3 * 0.5 * 4 * psi_pad)
        EXACT.assert_close(r.sent["False"], 2 * 0.5 * 4 * psi_pad)
        assert r.collectives["False"]["all_gather"] == {"forward": 5, "backward": 0}
        assert r.collectives["True"]["all_gather"] == {"forward": 5, "backward": 5}
        assert r.peak["False"] - r.peak["True"] >= block
        assert (
            r.peak_breakdown["False"]["Unsharded Param"] >= 4 * psi_pad
        )  # every unit gathered at the peak
        # the trace covers the whole step, phase by phase, and its maximum is the tracker's peak
        for mode in ("True", "False"):
            phases = [p for p, _, _ in r.trace[mode]]
            assert phases[0] == "forward" and "backward" in phases and phases[-1] == "step"
            assert max(t for _, t, _ in r.trace[mode]) == r.peak[mode]


# ----------------------------------------------------------------------------- accumulation


def test_accumulation_without_sync_reduce_scatters_once_and_equals_the_big_batch(case):
    want, _, _ = _reference(3, 16, "sgd")
    for r in case(2, "accumulation"):
        _assert_claims(r)
        assert r.reduce_scatters == {"sync_each": 4 * 5, "no_sync": 5}
        # sync off: the whole gradient, unsharded, and no shard yet; syncing: shards only
        assert r.held["no_sync"] == {"sharded": 0, "unsharded": r.param_bytes["full"]}
        assert r.held["sync_each"] == {"sharded": r.param_bytes["shard"], "unsharded": 0}
        for variant in ("sync_each", "no_sync"):
            _assert_equal(r.full_state[variant], want, SGD)


# ----------------------------------------------------------------------------- HSDP and reshard to 2


def test_hsdp_on_a_2x2_mesh_equals_one_device_and_uses_each_dimension_for_its_collective(case):
    ranks = case(4, "hsdp")
    want, want_losses, _ = _reference(4, 8, "adamw")
    for r in ranks:
        _assert_claims(r)
        _assert_equal(r.full_state, want, ADAMW)
        assert r.per_group["shard"]["all_gather"]["calls"] == 2 * 5
        assert r.per_group["replicate"]["all_reduce"]["calls"] == 5
        assert r.local_shapes["blocks.0.attn.c_attn.weight"][0] in (95, 94)  # sharded over 2, not 4
    means = [sum(r.local_losses[k] for r in ranks) / 4 for k in range(4)]
    ADAMW.assert_close(means, want_losses)
    # the two ranks of a shard group hold different halves; the replicate pairs hold the same half
    assert ranks[0].local_shapes == ranks[2].local_shapes


def test_reshard_after_forward_2_regathers_in_backward_over_groups_of_2(case):
    for r in case(4, "reshard-int"):
        _assert_claims(r)
        assert r.all_gathers == {"forward": {4: 5}, "backward": {2: 5}}


# ----------------------------------------------------------------------------- prefetch, clipping


def test_explicit_prefetch_issues_the_next_blocks_all_gather_before_the_block_runs(case):
    for r in case(2, "prefetch"):
        _assert_claims(r)
        for variant in ("implicit", "explicit"):
            kinds = [e[0] for e in r.events[variant]]
            assert kinds.count("F") == 4 and kinds.count("B") == 4
            assert (
                kinds.count("AG") == 10 and kinds.count("RS") == 5
            )  # root + 4 blocks, forward and backward
            assert all(e[2] <= e[3] for e in r.events[variant])


def test_clip_grad_norm_on_dtensor_gradients_equals_one_device(case):
    want, _, norms = _reference(3, 8, "sgd", 0.05)
    for r in case(2, "clip"):
        _assert_claims(r)
        SGD.assert_close(r.norms, norms)
        _assert_equal(r.full_state, want, SGD)


# ----------------------------------------------------------------------------- activation checkpointing


def test_activation_checkpointing_keeps_only_block_inputs_as_the_formula_says(case):
    for r in case(2, "checkpointing"):
        _assert_claims(r)
        local_batch, seq = 8 // 2, CONFIG.block_size
        formula = CONFIG.n_layer * local_batch * seq * CONFIG.d_model * 4
        assert r.formula_bytes == formula
        assert r.block_stack_activation_bytes["per_block"] == pytest.approx(formula, rel=0.05)
        assert r.block_stack_activation_bytes["none"] > 5 * formula  # every intermediate was kept
        assert r.activation_after_forward["per_block"] < r.activation_after_forward["none"]


# ----------------------------------------------------------------------------- meta-device init


def test_meta_device_init_broadcast_from_rank0_equals_the_one_device_init(case):
    want = GPT(CONFIG, seed=0).state_dict()
    for r in case(2, "meta"):
        _assert_claims(r)
        _assert_equal(r.full_state, want, EXACT)
        assert r.construction_peak < r.full_model_bytes == 4 * GPT(CONFIG).num_params()


# ----------------------------------------------------------------------------- FSDP1 vs FSDP2, CPU offload


def test_fsdp1_flattens_each_unit_fsdp2_keeps_parameter_shapes(case):
    ranks = case(2, "flat")
    plain = {k: tuple(v.shape) for k, v in GPT(F.features_config(n_layer=2)).named_parameters()}
    for r in ranks:
        _assert_claims(r)
        assert sorted(r.fsdp1_flat_params) == ["<root>", "blocks.0", "blocks.1"]
        assert {k: g for k, (g, _) in r.fsdp2_param_shapes.items()} == plain
        assert all(
            len(s) == 1 for s in r.fsdp1_param_shapes.values()
        )  # 1-D views into the flat shard
    # the two ranks' slices of each flat parameter cover it: some weights live on one rank only
    for name, shape in plain.items():
        assert sum(r.fsdp1_param_shapes[name][0] for r in ranks) == torch.Size(shape).numel(), name
    assert any(r.fsdp1_param_shapes[n] == (0,) for r in ranks for n in plain)
    if not torch.accelerator.is_available():
        assert "accelerator" in ranks[0].cpu_offload_error


# ----------------------------------------------------------------------------- sharded checkpoints


def test_a_checkpoint_saved_at_world_2_loads_at_world_1_and_4(case):
    saved = case(2, "save")[0]
    assert len(saved.digest) > 2 * len(
        GPT(CONFIG).state_dict()
    )  # model + exp_avg + exp_avg_sq (+ step)
    for world in (1, 4):
        for r in case(world, "load"):
            assert r.world_size == world
            assert r.digest == saved.digest
            assert torch.equal(r.logits, saved.logits)
    shapes = {w: [r.local_shapes for r in case(w, "load")] for w in (1, 4)}
    # 189 and 63 rows are not divisible by 4: torch.chunk rows, the last rank short
    assert [s["blocks.0.attn.c_attn.weight"] for s in shapes[4]] == [(48, 63)] * 3 + [(45, 63)]
    assert [s["ln_f.weight"] for s in shapes[4]] == [(16,)] * 3 + [(15,)]
    assert shapes[1][0]["blocks.0.attn.c_attn.weight"] == (189, 63)


def test_a_full_state_dict_exported_for_inference_gives_the_same_logits_in_a_plain_gpt(case):
    saved = case(2, "save")[0]
    plain = GPT(CONFIG, seed=7)
    result = plain.load_state_dict(torch.load(saved.inference_path, weights_only=True), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x, _ = P.eval_batch(CONFIG, CPU)
    with torch.no_grad():
        logits = plain(x)[0]
    REORDERED.assert_close(logits, saved.logits)


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize(
    "label,exc_type,words",
    [
        ("wrap-twice", "ValueError", ["already sharded", "<root>"]),
        ("wrap-after-a-block-was-sharded", "ValueError", ["already sharded", "blocks.1"]),
        (
            "prefetch-module-of-another-model",
            "ValueError",
            ["prefetch target", "'blocks.0'", "not a module of this model"],
        ),
        ("prefetch-key-of-another-model", "ValueError", ["unit", "not a module of this model"]),
        ("prefetch-not-a-unit", "ValueError", ["'blocks.1.attn'", "not a fully_shard unit"]),
        ("prefetch-plan-not-a-dict", "TypeError", ["dict", "list"]),
        ("load-fewer-layers", "KeyError", ["'blocks.3.", "does not have"]),
        ("load-more-layers", "KeyError", ["'blocks.4.", "no entry"]),
        ("load-other-width", "ValueError", ["'wte.weight'", "(512, 63)", "(512, 66)"]),
        ("load-not-a-checkpoint", "FileNotFoundError", ["no .metadata"]),
        ("hsdp-at-world-2", "ValueError", ["world_size must be 4", "got 2"]),
        ("accumulation-indivisible", "ValueError", ["global_batch=8", "micro_batches"]),
    ],
)
def test_misuse_gives_a_clear_error(case, label, exc_type, words):
    got_type, message = case(2, "errors")[0][label]
    assert got_type == exc_type, message
    for w in words:
        assert w in message, message


def test_checkpointed_block_formula_rejects_bad_sizes():
    from course_lib.formulas import checkpointed_block_activation_bytes

    assert checkpointed_block_activation_bytes(4, 2, 16, 63) == 4 * 2 * 16 * 63 * 4
    with pytest.raises(ValueError, match="n_layer=0"):
        checkpointed_block_activation_bytes(0, 2, 16, 63)
    with pytest.raises(ValueError, match="d_model=True"):
        checkpointed_block_activation_bytes(1, 2, 16, True)


# ----------------------------------------------------------------------------- the notebook's plots


def test_the_memory_and_timeline_plots_draw_from_the_measurements(case):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib import viz

    reshard, prefetch = case(2, "reshard")[0], case(2, "prefetch")[0]
    fig, (top, bottom) = plt.subplots(2, 1)
    viz.memory_over_step({"True": reshard.trace["True"], "False": reshard.trace["False"]}, ax=top)
    assert len(top.lines) == 4 + 4  # total + gathered per run, and 2 phase boundaries per run
    assert max(top.lines[0].get_ydata()) == pytest.approx(reshard.peak["True"] / 1e6)
    viz.fsdp_timeline(prefetch.events, ax=bottom)
    assert [t.get_text() for t in bottom.get_yticklabels()] == [
        "implicit: compute",
        "implicit: comm",
        "explicit: compute",
        "explicit: comm",
    ]
    assert len(bottom.patches) == sum(len(e) for e in prefetch.events.values())
    plt.close(fig)
