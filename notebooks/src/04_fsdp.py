# %% [markdown]
# # 04 · FSDP: PyTorch's ZeRO-3
#
# **What you will learn**
# - `torch.distributed.fsdp.fully_shard` ("FSDP2") — parameters become `DTensor`s sharded on dim 0, gathered per
#   *wrapped module* just in time, freed after use;
# - that FSDP2 trains exactly like one device;
# - how it compares with the ZeRO-3 we wrote in chapter 03: memory per rank, collectives, step time;
# - mixed precision (`MixedPrecisionPolicy`: bf16 compute, fp32 shards and reductions);
# - sharded checkpoints with `torch.distributed.checkpoint` (every rank writes its own shards; loads at another
#   world size).
#
# Read along: `course_lib/fsdp.py`.

# %%
# NBVAL_IGNORE_OUTPUT
import time

_t_notebook = time.perf_counter()
import shutil
import tempfile

import matplotlib.pyplot as plt

from course_lib.experiments import fsdp
from course_lib.launch import spawn

# %% [markdown]
# ## 1. Wrapping decides the communication
#
# `fsdp2_wrap` calls `fully_shard(block)` on each transformer block, then `fully_shard(model)` on the root
# (embeddings, final LayerNorm, tied output layer): L + 1 *units*. Per step and per unit FSDP2 issues one all-gather
# before forward, one all-gather before backward (the forward freed the weights: `reshard_after_forward=True`) and one
# reduce-scatter of the unit's gradients — 3Ψ per step like ZeRO-3, in 3(L + 1) large messages. With
# `reshard_after_forward=False` the gathered weights stay from forward to backward: 2Ψ of traffic (like ZeRO-2), more
# memory during the step.
#
# <a id="wrap-granularity"></a>
# The unit is what is gathered at once. Call `fully_shard(model)` on the root only and the whole model is one unit:
# forward gathers all parameters together, so the peak holds the full model on every rank; per-block units gather
# one block at a time.
#
# <a id="gradient-sync"></a>
# **Gradient accumulation**: `model.set_requires_gradient_sync(False)` on the intermediate micro-batches skips their
# reduce-scatters (FSDP2's counterpart of DDP's `no_sync()`); meanwhile each rank keeps *unsharded*, full-size
# gradients, so it trades communication for memory. Turn it back on for the last micro-batch.
#
# <a id="hsdp"></a>
# **HSDP** (hybrid sharding: FSDP1's `HYBRID_SHARD`, FSDP2's `fully_shard` on a 2-D device mesh) shards within a
# group of ranks, typically one node, and replicates across groups: the all-gathers and reduce-scatters stay on the
# fast links inside a node, and only the gradient all-reduce between replicas crosses nodes.
#
# ## 2. Exactly one device

# %%
def equality_suite():
    return [fsdp.fsdp2_vs_single_device(steps=steps, optimizer=opt, reshard_after_forward=rs)
            for opt, steps in (("sgd", 5), ("adamw", 10)) for rs in (True, False)]


eq = spawn(equality_suite, 2)
r0 = eq[0][0]
print(f"parameters are DTensors: {r0['all_dtensor']}, placements {r0['placements']}")
print(f"rank 0 holds c_attn.weight as {r0['local_shapes']['blocks.0.attn.c_attn.weight']} of (189, 63)")
for r in eq[0]:
    limit = 1e-6 if r["optimizer"] == "sgd" else 1e-5
    worst = max(rr["max_abs_diff"] for ranks in eq for rr in ranks
                if (rr["optimizer"], rr["reshard_after_forward"]) == (r["optimizer"], r["reshard_after_forward"]))
    print(f"{r['optimizer']:<6} reshard_after_forward={str(r['reshard_after_forward']):<5} "
          f"{r['steps']:>2} steps: max|Δparam| vs one device ≤ {limit:.0e}: {worst <= limit}")

# %% [markdown]
# ## 3. FSDP2 vs our Zero3
#
# Same model (Ψ ≈ 129k, tied embeddings), same data, fp32 AdamW, 2 ranks. Memory is counted from the real tensors
# after a step (DTensor → local shard); collectives are counted with `torch.distributed.tensor.debug.CommDebugMode`
# for FSDP2 and with our `CommLog` for Zero3.

# %%
cmp = spawn(fsdp.fsdp2_vs_zero3, 2)[0]
print(f"16Ψ/N = {cmp['formula_16psi_over_n']:,.0f} bytes per rank")
for name in ("fsdp2", "zero3"):
    s = cmp[name]
    ag, rs = s["collectives"]["all_gather"], s["collectives"]["reduce_scatter"]
    print(f"{name:<6} Ψ_pad {s['psi_pad']:>7,}  model states {s['memory']['total']:>9,} B "
          f"({s['memory_ratio']:.3f} × formula)  all-gathers fwd/bwd {ag['forward']}/{ag['backward']}, "
          f"reduce-scatters {rs['backward']}, sent / 3Ψ·(N−1)/N = {s['comm_ratio']:.3f}")

# %%
f2, z3 = cmp["fsdp2"], cmp["zero3"]
units = cmp["units"]
print(f"FSDP2: one all-gather per unit in forward and in backward, one reduce-scatter per unit ({units} units): "
      f"{f2['collectives']['all_gather']['forward'] == f2['collectives']['all_gather']['backward'] == units == f2['collectives']['reduce_scatter']['backward']}")
print(f"FSDP2 sends exactly 3Ψ_pad·(N−1)/N: {abs(f2['comm_ratio'] - 1) < 1e-6}")
print(f"both hold ≈16Ψ/N (within 1 %): {abs(f2['memory_ratio'] - 1) < 0.01 and abs(z3['memory_ratio'] - 1) < 0.01}")
print(f"our Zero3 gathers by unit too: {units} all-gathers in forward, {units} in backward, {units} reduce-scatters: "
      f"{z3['collectives']['all_gather']['forward'] == z3['collectives']['all_gather']['backward'] == units == z3['collectives']['reduce_scatter']['backward']}")
print(f"our Zero3 sends exactly 3Ψ_pad·(N−1)/N too: {abs(z3['comm_ratio'] - 1) < 1e-6}")

# %%
# NBVAL_IGNORE_OUTPUT
print(f"step time: FSDP2 {f2['step_s'] * 1e3:.1f} ms, our Zero3 {z3['step_s'] * 1e3:.1f} ms "
      f"(FSDP2 / Zero3 = {cmp['step_time_ratio_fsdp2_over_zero3']:.2f})")

# %% [markdown]
# FSDP2 pads each tensor to ⌈dim0/N⌉ rows (so its Ψ_pad is a little larger than our flat padding). What makes both
# fast is the *unit*: a whole block travels in one all-gather through a copy-in buffer (this rank's shards of every
# parameter of the block, concatenated), is copied out into the full tensors, and its gradients go back in one
# reduce-scatter launched as soon as the block's backward is done — few, large messages, each paying the latency once.
# With **prefetch** the next unit's all-gather is issued before the current unit computes, so the two can overlap.
#
# The race below trains the same 4-block model (d_model 128) four ways, one AdamW step of each per round, rounds
# interleaved: our `Zero3(unit="param")` (the textbook ZeRO-3: one collective per parameter and per use), per unit,
# per unit with prefetch (the default), and FSDP2 — and torch DDP (no sharding at all) for scale: what ZeRO-3's
# extra all-gathers cost against plain data parallelism.

# %%
from course_lib.experiments import fsdp_race

race = spawn(fsdp_race.zero3_race, 2, kwargs=dict(rounds=5))[0]
gathers, n_units = race["gathers_per_forward"], 5  # 4 blocks + the root
print(f"all-gathers per forward: {gathers}")
print(f"per unit (ours and FSDP2's): one all-gather per unit and forward: "
      f"{all(gathers[k] == n_units for k in ('zero3 per-unit', 'zero3 per-unit+prefetch', 'fsdp2'))}; "
      f"per parameter: {gathers['zero3 per-param']} (one per parameter and use)")

# %%
# NBVAL_IGNORE_OUTPUT
print(fsdp_race.format_zero3(race))

# %%
fig, ax = plt.subplots(figsize=(8, 3))
names = list(race["times"])
ax.boxplot([[t * 1e3 for t in race["times"][n]] for n in names], tick_labels=names)
ax.set_ylabel("step time (ms), one AdamW step")
ax.set_ylim(bottom=0)
ax.set_title("ZeRO-3 four ways and DDP, 2 ranks (interleaved rounds; box = spread over rounds)")
plt.xticks(rotation=15)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Mixed precision
#
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`: shards, gradients and optimizer
# state stay fp32; each all-gather casts to bf16 (half the bytes), the layers compute in bf16, and gradients are
# reduced in fp32.

# %%
mp = spawn(fsdp.fsdp2_mixed_precision, 2)[0]
print(f"sharded parameters: {mp['sharded_param_types']} {mp['sharded_param_dtypes']}; "
      f"optimizer state {mp['optimizer_state_dtypes']}")
print(f"all-gather bytes bf16 / fp32 = {mp['gather_bytes_ratio_bf16_over_fp32']:.2f}; "
      f"reduce-scatter bytes bf16 / fp32 = {mp['reduce_bytes_ratio_bf16_over_fp32']:.2f}; "
      f"peak gathered parameters bf16 / fp32 = {mp['peak_gathered_ratio_bf16_over_fp32']:.2f}")
print(f"bf16 run within 2 % (per-tensor relative error) of fp32 one-device training: {mp['max_rel_err']['bf16'] < 0.02}")

# %% [markdown]
# ## 5. Sharded checkpoints
#
# `torch.distributed.checkpoint` (DCP) saves `get_state_dict(model, optimizer)`: each rank writes only its own shards
# (one file per rank plus `.metadata` with each shard's offsets). Loading into a fresh model restores training
# bit for bit; because the metadata says which rows each file holds, the same checkpoint loads at another world size.

# %%
ckpt_dir = tempfile.mkdtemp(prefix="fsdp_ckpt_")
ck = spawn(fsdp.fsdp2_checkpoint_roundtrip, 2, args=(ckpt_dir,))[0]
print("files:", ck["files"])
chunks = ck["example_chunks"]
print(f"{chunks['key']}: global {chunks['global_shape']}, shards (offset, size) {chunks['chunks']}")
print(f"resumed = uninterrupted, bit for bit: {ck['resumed_equals_uninterrupted']}")
print(f"full state dict on rank 0 loads into a plain GPT: {ck['load_state_dict_ok']}")
at4 = spawn(fsdp.fsdp2_load_checkpoint, 4, args=(ck["path"],))[0]
print(f"the world-2 checkpoint loads at world 4 with identical contents: {at4['digest'] == ck['saved_digest']}")
shutil.rmtree(ckpt_dir)  # the checkpoint was only for this demonstration

# %% [markdown]
# ## 6. The FSDP2 features people reach for
#
# Each one below runs on real ranks on a 4-block version of the model (Ψ ≈ 224k), and prints what it measured.
# Results carry their claims (`result.claims()`), which the tests assert too.

# %%
from course_lib import viz
from course_lib.experiments import fsdp_features as F
from course_lib.experiments import fsdp_practice as P


def show(result):
    for claim, ok in result.claims().items():
        print(f"{claim}: {ok}")


def features_at_2(ckpt_dir):
    return {"reshard": F.reshard_memory_and_traffic(), "prefetch": F.prefetch_timeline(),
            "accumulate": F.accumulation_without_sync(), "clip": P.clip_grad_norm(),
            "ckpt": P.activation_checkpointing(), "meta": P.meta_device_init(),
            "flat": P.flat_vs_per_parameter(), "save": P.checkpoint_save(ckpt_dir)}


def features_at_4(path):
    return {"hsdp": F.hsdp(), "reshard_int": F.reshard_to_smaller_mesh(), "load": P.checkpoint_load(path)}


feat_dir = tempfile.mkdtemp(prefix="fsdp_features_")
f2 = spawn(features_at_2, 2, args=(feat_dir,))
saved = f2[0]["save"]
f4 = spawn(features_at_4, 4, args=(saved.path,))
f1 = spawn(P.checkpoint_load, 1, args=(saved.path,))

# %% [markdown]
# ### `reshard_after_forward`: traffic against memory
# `True` (the default) frees each unit's gathered weights after its forward and gathers them again in backward: 3Ψ
# of traffic, little memory. `False` keeps them from forward to backward: 2Ψ, but at the end of forward every unit is
# gathered at once. Bytes are counted per collective (`CollectiveCounter`); memory is tracked operator by operator
# with torch's `FSDPMemTracker`.

# %%
r = f2[0]["reshard"]
print(f"bytes sent per step: True {r.sent['True']:,.0f}, False {r.sent['False']:,.0f} "
      f"(False / True = {r.sent['False'] / r.sent['True']:.3f})")
print(f"peak over the step: True {r.peak['True']:,} B, False {r.peak['False']:,} B; "
      f"one block's gathered parameters = {r.block_param_bytes:,} B")
show(r)

# %%
viz.memory_over_step({"reshard_after_forward=True": r.trace["True"], "reshard_after_forward=False": r.trace["False"]},
                     title="bytes held over one step (FSDPMemTracker), 2 ranks")
plt.show()

# %% [markdown]
# `reshard_after_forward=<int>` is the middle ground: after forward each rank keeps a shard over a *smaller* group
# of k ranks (typically one node), so backward's all-gathers only span k ranks. At world 4 with k = 2:

# %%
show(f4[0]["reshard_int"])

# %% [markdown]
# ### Prefetch
# FSDP2 issues a unit's all-gather when the unit starts; `set_modules_to_forward_prefetch` (and `..._backward_...`)
# issue the next unit's all-gather one unit earlier, so on a GPU it can overlap the current unit's compute. On CPU
# with gloo the all-gather runs in the caller's time, so the measured step time is reported, not claimed faster:

# %%
pf = f2[0]["prefetch"]
print("forward all-gathers already issued when block i starts:", pf.gathers_issued_at_block_start)
show(pf)

# %%
# NBVAL_IGNORE_OUTPUT
print({k: f"{v * 1e3:.1f} ms" for k, v in pf.step_s.items()})
viz.fsdp_timeline(pf.events, title="when each all-gather (AG) and reduce-scatter (RS) is issued, rank 0")
plt.show()

# %% [markdown]
# ### Gradient accumulation without the reduce-scatters
# Four micro-batches per step, with `set_requires_gradient_sync(False)` on the first three (see above):

# %%
a = f2[0]["accumulate"]
print(f"reduce-scatters per step: {a.reduce_scatters}; all-gathers per step: {a.all_gathers}")
show(a)

# %% [markdown]
# ### HSDP on a (2, 2) mesh
# `init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`, `fully_shard(..., mesh=mesh)`: every
# collective is counted with the mesh dimension it ran on.

# %%
h = f4[0]["hsdp"]
for dim, ops in h.per_group.items():
    print(f"{dim:<9}", {op: (v["calls"], f"groups of {v['group_size']}") for op, v in ops.items()})
show(h)

# %% [markdown]
# ### Gradient clipping on sharded gradients
# `torch.nn.utils.clip_grad_norm_` works on FSDP2's DTensor gradients: each rank sums the squares of its shard and the
# norm is reduced across ranks, so every rank gets the global norm.

# %%
show(f2[0]["clip"])

# %% [markdown]
# <a id="activation-checkpointing"></a>
# ### Activation checkpointing: the answer to "ZeRO does not shard activations"
# `checkpoint_wrapper` around each block keeps only the block's input for backward and recomputes the rest. Measured
# with torch's `MemTracker` (our `SavedTensorMeter`'s hooks are shadowed by checkpointing's own) against the formula
# (each block keeps its input, L·b·s·h·4 bytes):

# %%
c = f2[0]["ckpt"]
print(f"activation bytes kept by the blocks: {c.block_stack_activation_bytes['none']:,} without, "
      f"{c.block_stack_activation_bytes['per_block']:,} with checkpointing; formula {c.formula_bytes:,}")
show(c)

# %%
# NBVAL_IGNORE_OUTPUT
print(f"step time without / with checkpointing: {c.step_s['none'] * 1e3:.1f} / {c.step_s['per_block'] * 1e3:.1f} ms "
      f"(recompute ≈ {c.recompute_s * 1e3:.1f} ms)")

# %% [markdown]
# ### Never holding the full model: meta-device initialisation
# Build the model on `torch.device("meta")` (shapes, no memory), `fully_shard` it, `to_empty(device=...)` allocates
# only this rank's shards; the weights then come from a full state dict loaded with
# `set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))` (random
# re-initialisation of a DTensor on a CPU mesh would be rank-local and not equal one device's init).

# %%
m = f2[1]["meta"]
print(f"full model {m.full_model_bytes:,} B; rank 1's construction peak {m.construction_peak:,} B; "
      f"its shards {m.shard_bytes:,} B")
show(m)

# %% [markdown]
# ### Why FSDP2 exists: FSDP1's FlatParameter vs per-parameter DTensors
# FSDP1 flattens each unit's parameters into one 1-D `FlatParameter` and cuts it into N equal pieces, so a rank's
# piece can end in the middle of a weight's row, and per-parameter things (a frozen weight, its own optimizer
# settings, a low-precision weight) get awkward. FSDP2 shards every parameter on its own along dim 0, as a `DTensor`
# that keeps its shape. `CPUOffloadPolicy` (shards kept in CPU memory between uses) needs an accelerator:

# %%
fl = f2[0]["flat"]
print("FSDP1 flat parameter per unit (rank 0):", {k: v for k, v in list(fl.fsdp1_flat_params.items())[:2]})
print("FSDP2 c_attn.weight (global, local):", fl.fsdp2_param_shapes["blocks.0.attn.c_attn.weight"])
print("CPUOffloadPolicy here:", fl.cpu_offload_error)
show(fl)

# %% [markdown]
# ### Checkpoints at another world size, and for one device
# The world-2 DCP checkpoint loads at world 1 and world 4 — including `c_attn.weight`, whose 189 rows do not divide
# by 4 — and a full state dict exported for inference loads into a plain `GPT`:

# %%
import torch

from course_lib.models import GPT

key = "blocks.0.attn.c_attn.weight"
print(f"{key} per rank: world 2 {[r['save'].local_shapes[key] for r in f2]}, world 1 {f1[0].local_shapes[key]}, "
      f"world 4 {[r['load'].local_shapes[key] for r in f4]}")
print("world 1 loads identical contents:", all(x.digest == saved.digest for x in f1))
print("world 4 loads identical contents:", all(r["load"].digest == saved.digest for r in f4))
plain = GPT(F.features_config())
plain.load_state_dict(torch.load(saved.inference_path, weights_only=True))
logits = plain(P.eval_batch(F.features_config(), "cpu")[0])[0]
print("one-device GPT from the exported state dict gives FSDP2's logits:",
      torch.allclose(logits, saved.logits, atol=1e-6))
shutil.rmtree(feat_dir)

# %% [markdown]
# ## 7. Exercises
# (a) `exercises/fsdp.py` — wrap the blocks and the root with `fully_shard`; (b) save and restore a sharded
# checkpoint with DCP.

# %%
from course_lib.check import check

check("fsdp2_wrap_blocks")

# %%
check("sharded_checkpoint")

# %%
check("fsdp2_wrap_blocks", package="solutions")

# %%
check("sharded_checkpoint", package="solutions")

# %% [markdown]
# ## 8. O/X quiz

# %%
from course_lib.quiz import quiz

quiz(4)

# %% [markdown]
# ## Summary
# - FSDP2 = ZeRO-3 with whole-module collectives: parameters are `Shard(0)` DTensors, trained exactly like one device.
# - Per rank it holds ≈16Ψ/N like our Zero3, and both send exactly 3Ψ per step in 3(L+1) collectives: one per unit,
#   few and large; per parameter and per use (the textbook ZeRO-3) the messages are many and small.
# - bf16 mixed precision halves the all-gathers and the gathered weights; shards, gradients and optimizer state stay fp32.
# - DCP checkpoints are sharded, bit-exact on resume, and load at a different world size (1, 2, 4) and into a plain
#   model for one-device inference.
# - The features: `reshard_after_forward=False` trades 3Ψ → 2Ψ of traffic for a peak with the whole model gathered;
#   `set_requires_gradient_sync(False)` cuts the reduce-scatters of accumulation to one per unit per step; HSDP keeps
#   all-gathers and reduce-scatters on the shard dimension and all-reduces on the replicate dimension; activation
#   checkpointing keeps only each block's input; meta-device init never holds the full model.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
