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

from course_lib.experiments import ch04_fsdp
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
    return [ch04_fsdp.fsdp2_vs_single_device(steps=steps, optimizer=opt, reshard_after_forward=rs)
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
cmp = spawn(ch04_fsdp.fsdp2_vs_zero3, 2)[0]
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
# per unit with prefetch (the default), and FSDP2.

# %%
from course_lib.experiments import ch04_race

race = spawn(ch04_race.zero3_race, 2, kwargs=dict(rounds=5))[0]
gathers, n_units = race["gathers_per_forward"], 5  # 4 blocks + the root
print(f"all-gathers per forward: {gathers}")
print(f"per unit (ours and FSDP2's): one all-gather per unit and forward: "
      f"{all(gathers[k] == n_units for k in ('zero3 per-unit', 'zero3 per-unit+prefetch', 'fsdp2'))}; "
      f"per parameter: {gathers['zero3 per-param']} (one per parameter and use)")

# %%
# NBVAL_IGNORE_OUTPUT
print(ch04_race.format_zero3(race))

# %%
fig, ax = plt.subplots(figsize=(7, 3))
names = list(race["times"])
ax.boxplot([[t * 1e3 for t in race["times"][n]] for n in names], tick_labels=names)
ax.set_ylabel("step time (ms), one AdamW step")
ax.set_ylim(bottom=0)
ax.set_title("ZeRO-3 four ways, 2 ranks (interleaved rounds; box = spread over rounds)")
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
mp = spawn(ch04_fsdp.fsdp2_mixed_precision, 2)[0]
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
ck = spawn(ch04_fsdp.fsdp2_checkpoint_roundtrip, 2, args=(ckpt_dir,))[0]
print("files:", ck["files"])
chunks = ck["example_chunks"]
print(f"{chunks['key']}: global {chunks['global_shape']}, shards (offset, size) {chunks['chunks']}")
print(f"resumed = uninterrupted, bit for bit: {ck['resumed_equals_uninterrupted']}")
print(f"full state dict on rank 0 loads into a plain GPT: {ck['load_state_dict_ok']}")
at4 = spawn(ch04_fsdp.fsdp2_load_checkpoint, 4, args=(ck["path"],))[0]
print(f"the world-2 checkpoint loads at world 4 with identical contents: {at4['digest'] == ck['saved_digest']}")
shutil.rmtree(ckpt_dir)  # the checkpoint was only for this demonstration

# %% [markdown]
# ## 6. Exercises
# (a) `exercises/ch04_fsdp.py` — wrap the blocks and the root with `fully_shard`; (b) save and restore a sharded
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
# ## 7. O/X quiz

# %%
from course_lib.quiz import quiz

quiz(4)

# %% [markdown]
# ## Summary
# - FSDP2 = ZeRO-3 with whole-module collectives: parameters are `Shard(0)` DTensors, trained exactly like one device.
# - Per rank it holds ≈16Ψ/N like our Zero3, and both send exactly 3Ψ per step in 3(L+1) collectives: one per unit,
#   few and large; per parameter and per use (the textbook ZeRO-3) the messages are many and small.
# - bf16 mixed precision halves the all-gathers and the gathered weights; shards, gradients and optimizer state stay fp32.
# - DCP checkpoints are sharded, bit-exact on resume, and load at a different world size.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
