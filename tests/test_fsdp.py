"""FSDP2 (torch ``fully_shard``): trains like one device, holds 16Ψ/N, talks once per unit, checkpoints exactly.

Every configuration runs inside ONE spawn per world size (a spawn costs ~2 s on 2 cores): the rank
function ``_suite`` calls the notebook's rank functions from ``course_lib.fsdp`` one after the
other and returns their numbers; the parametrized tests below each read the case they name.
The model is the ZeRO chapter's (``fsdp.fsdp_config``: bias-free, tied, Ψ = 128,835, odd sizes),
so FSDP2's row padding and our ``Zero3``'s element padding both happen at N = 2 and 4.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import fsdp
from course_lib.launch import spawn
from course_lib.models import GPT

WORLDS = [2, 4]
EQUALITY = {  # name: (optimizer, reshard_after_forward, worlds)
    "sgd": ("sgd", True, [2, 4]),
    "sgd-keep-gathered": ("sgd", False, [2, 4]),
    "adamw": ("adamw", True, [2, 4]),
    "adamw-keep-gathered": ("adamw", False, [2, 4]),
}
ZERO3 = {"reshard": (True, [2, 4]), "keep-gathered": (False, [2, 4])}  # name: (reshard_after_forward, worlds)


# ----------------------------------------------------------------------------- the runs


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

    def empty_blocks():
        m = GPT(fsdp.fsdp_config())
        m.blocks = nn.ModuleList()
        return m

    wrapped = fsdp.fsdp2_wrap(GPT(fsdp.fsdp_config()))
    world = dist.get_world_size()
    return {
        "no-blocks": catch(lambda: fsdp.fsdp2_wrap(NoBlocks())),
        "empty-blocks": catch(lambda: fsdp.fsdp2_wrap(empty_blocks())),
        "not-a-module": catch(lambda: fsdp.fsdp2_wrap("gpt")),
        "mesh-smaller-than-world": catch(lambda: fsdp.fsdp2_wrap(GPT(fsdp.fsdp_config()),
                                                                  mesh=DeviceMesh("cpu", list(range(world - 1))))),
        "mesh-not-a-mesh": catch(lambda: fsdp.fsdp2_wrap(GPT(fsdp.fsdp_config()), mesh=(world,))),
        "reshard-int": catch(lambda: fsdp.fsdp2_wrap(GPT(fsdp.fsdp_config()), reshard_after_forward=2)),
        "mp-policy-type": catch(lambda: fsdp.fsdp2_wrap(GPT(fsdp.fsdp_config()), mp_policy=torch.bfloat16)),
        "wrapped-twice": catch(lambda: fsdp.fsdp2_wrap(wrapped)),
        "bad-optimizer": catch(lambda: fsdp.fsdp2_vs_single_device(steps=1, optimizer="lbfgs")),
        "batch-not-divisible": catch(lambda: fsdp.fsdp2_vs_single_device(steps=1, global_batch=world + 1)),
        "resume-at-0": catch(lambda: fsdp.fsdp2_checkpoint_roundtrip("/nonexistent", resume_at=0)),
    }


def _suite(tmp_dir: str, load_from: str | None) -> dict:
    """Rank function: every case for this world size, one after the other."""
    world = dist.get_world_size()
    out = {"equality": {}, "zero3": {}}
    for name, (opt, reshard, worlds) in EQUALITY.items():
        if world in worlds:
            out["equality"][name] = fsdp.fsdp2_vs_single_device(steps=10, optimizer=opt,
                                                                reshard_after_forward=reshard)
    for name, (reshard, worlds) in ZERO3.items():
        if world in worlds:
            out["zero3"][name] = fsdp.fsdp2_vs_zero3(steps=3, reshard_after_forward=reshard)
    out["mixed"] = fsdp.fsdp2_mixed_precision(steps=5)
    out["checkpoint"] = fsdp.fsdp2_checkpoint_roundtrip(tmp_dir, steps=4, resume_at=2)
    if world == 2:
        out["errors"] = _error_cases()
    if load_from is not None:
        out["reshard_on_load"] = fsdp.fsdp2_load_checkpoint(load_from)
    return out


_RESULTS: dict[int, list] = {}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(world)`` → every rank's ``_suite`` output (one spawn per world size, cached)."""
    tmp = str(tmp_path_factory.mktemp("fsdp"))

    def get(world: int) -> list:
        if world not in _RESULTS:
            load_from = None
            if world != 2:  # world 4 loads the checkpoint world 2 wrote: DCP reshards on load
                load_from = get(2)[0]["checkpoint"]["path"]
            _RESULTS[world] = spawn(_suite, world, args=(tmp, load_from), timeout=300)
        return _RESULTS[world]

    return get


def grid(cases: dict, worlds_of=lambda v: v[-1]):
    return [pytest.param(w, name, id=f"world={w},{name}") for w in WORLDS for name, v in cases.items()
            if w in worlds_of(v)]


# ----------------------------------------------------------------------------- wrapping (no ranks needed)


def test_padded_numel_rounds_every_dim0_up_to_a_multiple_of_n():
    model = GPT(fsdp.fsdp_config())
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
def test_fsdp2_trains_like_one_device_on_the_full_batch(results, world, name):
    for r in results(world):
        got = r["equality"][name]
        assert got["keys_match"] and got["all_dtensor"] and got["placements"] == ["(Shard(dim=0),)"]
        if got["optimizer"] == "sgd":
            assert got["max_abs_diff"] <= 1e-6, got["max_abs_diff_per_tensor"]
        else:
            assert got["allclose_1e-5"], got["max_abs_diff_per_tensor"]
        # the average of N equal slices' losses is the full-batch loss
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(got["reference_losses"]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_every_rank_holds_its_dim0_chunk_of_each_parameter(results, world):
    ranks = [r["equality"]["sgd"] for r in results(world)]
    shapes = GPT(fsdp.fsdp_config()).state_dict()
    for name in ranks[0]["local_shapes"]:
        rows = [r["local_shapes"][name][0] for r in ranks]
        chunks = [c.shape[0] for c in shapes[name].chunk(world)]  # torch.chunk may return fewer than N
        assert rows == chunks + [0] * (world - len(chunks))
        assert sum(rows) == shapes[name].shape[0]


# ----------------------------------------------------------------------------- memory: 16Ψ/N


@pytest.mark.parametrize("world,name", grid(ZERO3))
def test_model_state_bytes_per_rank_are_16_psi_over_n_for_fsdp2_and_zero3(results, world, name):
    for r in results(world):
        got = r["zero3"][name]
        psi = got["psi"]
        for side in ("fsdp2", "zero3"):
            s = got[side]
            assert s["psi_pad"] % world == 0 and psi <= s["psi_pad"] < psi * 1.02
            assert s["memory_ratio"] == pytest.approx(1.0, abs=0.03), (side, s["memory"], s["memory_formula"])
            assert s["memory"]["total"] == pytest.approx(16 * psi / world, rel=0.03)
        # params and grads are stored padded: exactly 4Ψ_pad/N each
        assert got["fsdp2"]["memory"]["params"] == 4 * got["fsdp2"]["psi_pad"] // world
        assert got["fsdp2"]["memory"]["grads"] == 4 * got["fsdp2"]["psi_pad"] // world
        assert got["memory_ratio_fsdp2_over_zero3"] == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_fsdp2_pads_rows_so_its_psi_pad_is_at_least_zero3s(results, world):
    got = results(world)[0]["zero3"]["reshard"]
    assert got["fsdp2"]["psi_pad"] == fsdp.padded_numel(GPT(fsdp.fsdp_config()), world)
    assert got["fsdp2"]["psi_pad"] >= got["zero3"]["psi_pad"]


# ----------------------------------------------------------------------------- collectives per step


@pytest.mark.parametrize("world,name", grid(ZERO3))
def test_fsdp2_issues_one_all_gather_per_unit_per_pass_and_one_reduce_scatter_per_unit(results, world, name):
    for r in results(world):
        got = r["zero3"][name]
        units = got["units"]
        assert units == fsdp.fsdp_config().n_layer + 1  # every block, plus the root
        c = got["fsdp2"]["collectives"]
        assert c["all_gather"]["forward"] == units
        assert c["all_gather"]["backward"] == (units if got["reshard_after_forward"] else 0)
        assert c["reduce_scatter"]["forward"] == 0 and c["reduce_scatter"]["backward"] == units
        # CommDebugMode's own counts agree with ours; nothing else was communicated
        counts = got["fsdp2_comm_debug_counts"]
        assert counts == {"c10d._allgather_base_": c["all_gather"]["forward"] + c["all_gather"]["backward"],
                          "c10d._reduce_scatter_base_": units}
        assert got["fsdp2_other_collectives"] == []


@pytest.mark.parametrize("world,name", grid(ZERO3))
def test_fsdp2_sends_exactly_3_psi_pad_per_step_or_2_when_keeping_gathered_weights(results, world, name):
    for r in results(world):
        got = r["zero3"][name]
        f = got["fsdp2"]
        passes = 2 if got["reshard_after_forward"] else 1
        assert f["collectives"]["all_gather"]["tensor_bytes"] == passes * 4 * f["psi_pad"]
        assert f["collectives"]["reduce_scatter"]["tensor_bytes"] == 4 * f["psi_pad"]
        assert f["comm_ratio"] == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_zero3_sends_more_than_fsdp2_because_it_gathers_the_tied_weight_per_use(results, world):
    got = results(world)[0]["zero3"]["reshard"]
    z = got["zero3"]
    cfg = fsdp.fsdp_config()
    unique = sum(1 for _ in GPT(cfg).parameters())
    assert z["collectives"]["all_gather"]["forward"] == unique + 1  # the tied weight: embedding and lm_head
    assert z["collectives"]["reduce_scatter"]["backward"] == unique
    tied_pad = -(-cfg.vocab_size * cfg.d_model // world) * world
    assert z["comm_ratio"] == pytest.approx(1 + 2 * tied_pad / (3 * z["psi_pad"]), rel=1e-9)
    assert z["sent_per_step"] > got["fsdp2"]["sent_per_step"]


@pytest.mark.parametrize("world", WORLDS, ids=[f"world={w}" for w in WORLDS])
def test_step_times_are_measured_on_every_rank_alike(results, world):
    ranks = results(world)
    got = ranks[0]["zero3"]["reshard"]
    for side in ("fsdp2", "zero3"):
        assert len(got[side]["step_s_rounds"]) == 3 and all(t > 0 for t in got[side]["step_s_rounds"])
    # max over ranks: every rank reports the same numbers
    assert all(r["zero3"]["reshard"]["fsdp2"]["step_s_rounds"] == got["fsdp2"]["step_s_rounds"] for r in ranks)
    assert got["step_time_ratio_fsdp2_over_zero3"] > 0


# ----------------------------------------------------------------------------- mixed precision


@pytest.fixture(params=WORLDS, ids=[f"world={w}" for w in WORLDS])
def mixed(results, request):
    return results(request.param)


def test_mixed_precision_keeps_fp32_sharded_params_grads_and_optimizer_state(mixed):
    for r in mixed:
        m = r["mixed"]
        assert m["all_dtensor"] and m["sharded_param_dtypes"] == ["torch.float32"]
        assert m["local_shard_dtypes"] == ["torch.float32"]
        assert m["grad_dtypes"] == {"bf16": ["torch.float32"], "fp32": ["torch.float32"]}
        assert m["optimizer_state_dtypes"] == ["torch.float32"]


def test_mixed_precision_computes_in_bf16_on_gathered_plain_parameters(mixed):
    m = mixed[0]["mixed"]
    assert m["compute"] == {"weight_type": "Parameter", "weight_dtype": "torch.bfloat16",
                            "input_dtype": "torch.bfloat16"}
    assert m["logits_dtype"] == {"bf16": "torch.bfloat16", "fp32": "torch.float32"}


def test_mixed_precision_halves_gathered_bytes_but_reduces_in_fp32(mixed):
    for r in mixed:
        m = r["mixed"]
        assert m["comm"]["bf16"]["all_gather"]["dtypes"] == ["bfloat16"]
        assert m["comm"]["bf16"]["reduce_scatter"]["dtypes"] == ["float32"]
        assert m["gather_bytes_ratio_bf16_over_fp32"] == 0.5
        assert m["reduce_bytes_ratio_bf16_over_fp32"] == 1.0
        assert m["peak_gathered_ratio_bf16_over_fp32"] == 0.5
        # the forward peak is the root unit plus one block, never the whole model
        assert 0 < m["peak_gathered_bytes"]["fp32"] < 4 * fsdp.padded_numel(GPT(fsdp.fsdp_config()), m["world_size"])


def test_mixed_precision_stays_close_to_fp32_and_fp32_fsdp2_is_exact(mixed):
    m = mixed[0]["mixed"]
    assert m["max_rel_err"]["fp32"] < 1e-5
    assert 1e-4 < m["max_rel_err"]["bf16"] < 3e-2  # bf16 rounding shows, but stays small
    torch.testing.assert_close(torch.tensor(m["losses"]["bf16"]), torch.tensor(m["losses"]["reference"]),
                               rtol=2e-2, atol=0)


# ----------------------------------------------------------------------------- sharded checkpoint


@pytest.fixture(params=WORLDS, ids=[f"world={w}" for w in WORLDS])
def checkpoint(results, request):
    return results(request.param)


def test_resume_from_a_sharded_dcp_checkpoint_equals_uninterrupted_training_bit_for_bit(checkpoint):
    for r in checkpoint:
        c = r["checkpoint"]
        assert c["fresh_model_differed"] and c["restored_equals_saved"]
        assert c["resumed_equals_uninterrupted"] and c["max_abs_diff"] == 0.0


def test_every_rank_writes_its_own_shard_file(checkpoint):
    c = checkpoint[0]["checkpoint"]
    n = c["world_size"]
    rank_files = [f"__{r}_0.distcp" for r in range(n)]
    assert c["files"] == [".metadata"] + rank_files
    twelve_psi_over_n = 12 * c["psi"] / n  # fp32 weights + exp_avg + exp_avg_sq, this rank's 1/N
    for f in rank_files:  # + the tied weight's second key and per-tensor framing
        assert 0.9 < c["file_bytes"][f] / twelve_psi_over_n < 1.6, c["file_bytes"]
    rows = -(-189 // n)  # FSDP2's chunk of dim 0, as DCP records it: (offsets, sizes) per rank
    assert c["example_chunks"] == {"key": "model.blocks.0.attn.c_attn.weight", "global_shape": (189, 63),
                                   "chunks": [((r * rows, 0), (min(rows, 189 - r * rows), 63)) for r in range(n)]}
    assert c["checkpoint_key_counts"]["model"] == 16 and c["checkpoint_key_counts"]["optim.state"] == 45
    assert c["tied_weight_keys"] == ["model.lm_head.weight", "model.wte.weight"]


def test_a_full_state_dict_loads_into_a_plain_single_device_model(checkpoint):
    c = checkpoint[0]["checkpoint"]
    assert c["rank0_full_state_dict_keys"] == 16  # cpu_offload=True: only rank 0 gets the full tensors
    assert all(r["checkpoint"]["rank0_full_state_dict_keys"] == 0 for r in checkpoint[1:])
    assert c["load_state_dict_ok"] and c["rank0_full_equals_fsdp"]
    assert c["single_device_loss"] == pytest.approx(c["fsdp_loss"], rel=1e-6)
    assert c["torch_save_keys"] == ["model", "optim"] and c["torch_save_model_equals_saved"]


def test_a_checkpoint_saved_at_world_2_loads_at_world_4(results):
    saved = results(2)[0]["checkpoint"]["saved_digest"]
    loaded = results(4)
    assert len(saved) == 16 + 45
    for r in loaded:
        assert r["reshard_on_load"]["world_size"] == 4
        assert r["reshard_on_load"]["digest"] == saved
    assert loaded[0]["reshard_on_load"]["local_shapes"]["blocks.0.attn.c_attn.weight"] == (48, 63)


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize("label,exc_type,words", [
    ("no-blocks", "TypeError", ["model.blocks", "NoBlocks has no .blocks", "fully_shard"]),
    ("empty-blocks", "TypeError", ["non-empty", "length 0"]),
    ("not-a-module", "TypeError", ["nn.Module", "str"]),
    ("mesh-smaller-than-world", "ValueError", ["world_size=2", "shape (1,)"]),
    ("mesh-not-a-mesh", "TypeError", ["DeviceMesh", "tuple"]),
    ("reshard-int", "TypeError", ["reshard_after_forward", "2"]),
    ("mp-policy-type", "TypeError", ["MixedPrecisionPolicy", "dtype"]),
    ("wrapped-twice", "ValueError", ["already sharded"]),
    ("bad-optimizer", "ValueError", ["lbfgs", "adamw", "sgd"]),
    ("batch-not-divisible", "ValueError", ["global_batch=3", "world_size=2"]),
    ("resume-at-0", "ValueError", ["resume_at=0"]),
])
def test_misuse_gives_a_clear_error(results, label, exc_type, words):
    got_type, message = results(2)[0]["errors"][label]
    assert got_type == exc_type, message
    for w in words:
        assert w in message, message


# ----------------------------------------------------------------------------- the chapter's exercise checker

WRONG = {
    "root-only": ("fsdp2_wrap_blocks", "from torch.distributed.fsdp import fully_shard\n"
                  "def wrap_blocks(model, mesh, reshard_after_forward=True):\n"
                  "    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)\n",
                  "block(s) [0, 1, 2] are not wrapped"),
    "root-keeps-default": ("fsdp2_wrap_blocks", "from torch.distributed.fsdp import fully_shard\n"
                           "def wrap_blocks(model, mesh, reshard_after_forward=True):\n"
                           "    for b in model.blocks:\n"
                           "        fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward)\n"
                           "    return fully_shard(model, mesh=mesh)\n",
                           "3 all-gather(s) in backward, expected 4"),
    "model-only-checkpoint": ("sharded_checkpoint", "import torch.distributed.checkpoint as dcp\n"
                              "class ShardedCheckpoint:\n"
                              "    @staticmethod\n"
                              "    def save(model, optimizer, path):\n"
                              "        dcp.save({'model': model.state_dict()}, checkpoint_id=path)\n"
                              "    @staticmethod\n"
                              "    def load(model, optimizer, path):\n"
                              "        sd = model.state_dict()\n"
                              "        dcp.load({'model': sd}, checkpoint_id=path)\n",
                              "load the optimizer state too"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_exercise_checker_explains_a_wrong_fsdp_answer(case, tmp_path, monkeypatch):
    import sys

    import course_lib.check as chk

    name, source, words = WRONG[case]
    pkg = tmp_path / "exercises"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ch04_fsdp.py").write_text(source)
    monkeypatch.setattr(chk, "_course_root", lambda: tmp_path)
    for mod in [m for m in sys.modules if m == "exercises" or m.startswith("exercises.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        result = chk.check(name)
    finally:  # forget the wrong answer's modules; monkeypatch then puts the real ones back
        for mod in [m for m in sys.modules if m == "exercises" or m.startswith("exercises.")]:
            del sys.modules[mod]
    assert result.status == "failed", str(result)
    assert words in result.message, result.message
