# %% [markdown]
# # 04 · FSDP: PyTorch's ZeRO-3
#
# **What you will learn**
# - to write an FSDP2 training script: `fully_shard` on each block, then on the root; `MixedPrecisionPolicy`;
#   gradient accumulation with `set_requires_gradient_sync`; `clip_grad_norm_` on sharded gradients; a sharded
#   `torch.distributed.checkpoint` (DCP) saved at world 2 and loaded at world 1;
# - that FSDP2 trains exactly like one device, and how it compares with the ZeRO-3 we wrote in chapter 03
#   (memory per rank, collectives, the unit gather/free);
# - what prefetch and activation checkpointing change in a step, predicted by the step-time model and measured
#   under the modelled accelerator clock; what `reshard_after_forward` trades (traffic against memory);
# - to read a **profiler trace** of one FSDP2 step: its all-gathers and reduce-scatters on gloo's threads, what
#   gloo runs for a reduce-scatter, and the step's **memory curve** with its peak against the course's meters;
# - to `torch.compile` each transformer block under FSDP2, checked against eager;
# - to write one FSDP unit yourself (the exercise): a flat sharded buffer, gathered for forward and again for backward,
#   freed in between, its gradient reduce-scattered.
#
# **What you need**: chapter 03 (ZeRO-3, our `Zero3`), chapter 00 (all-gather, reduce-scatter, the modelled clock);
# 2 CPU cores are enough (gloo); on GPUs the same rank functions run on nccl, one GPU per rank.
#
# **Stored build:** 70 s on 2 cores (1% of them busy just before it started).
#
# Read along: `course_lib/fsdp.py`.

# %% tags=["nbval-ignore-output"]
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
# `fully_shard(block)` on each transformer block, then `fully_shard(model)` on the root (embeddings, final LayerNorm,
# tied output layer) makes L + 1 *units*. Per step and per unit FSDP2 issues one all-gather before forward, one
# all-gather before backward (the forward freed the weights: `reshard_after_forward=True`) and one reduce-scatter of
# the unit's gradients — 3Ψ per step like ZeRO-3, in 3(L + 1) large messages. With `reshard_after_forward=False` the
# gathered weights stay from forward to backward: 2Ψ of traffic (like ZeRO-2), more memory during the step.
#
# <a id="reshard-default"></a>
# **The default** (torch 2.13): `reshard_after_forward=None`, which means `True` for every unit except the root, which
# keeps its parameters after forward (they are the first needed when backward starts, so freeing them would only
# gather them again at once). The measurements below pass `True` explicitly to every unit, the root included, so the
# counts are exactly 3(L + 1) collectives per step.
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
# ## 2. An FSDP2 training script
#
# Two rank functions you could paste into a script run by `torchrun` (or by `course_lib.launch.spawn`, which sends
# functions defined in a cell by value). `train_and_save` builds the model, shards it block by block and then the root,
# computes in bf16 (`MixedPrecisionPolicy`: fp32 shards, bf16 all-gathers and compute, fp32 gradient reduction),
# accumulates two micro-batches per step with the reduce-scatters only on the last, clips the global gradient norm,
# and saves a sharded DCP checkpoint. `load_at_world_1` builds the same model on **one** rank and loads it:
# DCP's `.metadata` says which rows of which tensor each file holds, so the checkpoint reshards on load.
# The cell below is a whole script but for its last four lines (the notebook's driver): saved as `fsdp_script.py`,
# `torchrun --nproc-per-node 2 -m course_lib.launch fsdp_script:train_and_save --arg "'ckpt'"` trains and saves
# on two processes, and `torchrun --nproc-per-node 1 -m course_lib.launch fsdp_script:load_at_world_1 --arg "'ckpt'"`
# loads on one (`course_lib.launch` calls `init_process_group` from torchrun's environment, then the function).

# %%
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from course_lib import launch
from course_lib.comm import CollectiveCounter
from course_lib.configs import zero_config
from course_lib.models import GPT
from course_lib.train import shard_batch, step_batch

CONFIG = zero_config()  # Ψ ≈ 129k, 2 blocks, tied embeddings


def build_fsdp2(world):
    mesh = init_device_mesh(launch.device().type, (world,))
    model = GPT(CONFIG, seed=0).to(launch.device())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:  # one unit per block ...
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # ... then the root: what no block owns
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def full_weights(model):  # every rank calls it (an all-gather); a plain, unsharded state dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train_and_save(path, steps=3, micro=2, max_norm=1.0):
    world = dist.get_world_size()
    model, opt = build_fsdp2(world)
    norms, scatters = [], []
    for step in range(steps):
        x, y = shard_batch(*step_batch(step, CONFIG, 4 * world, launch.device()))
        sent = 0
        for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            model.set_requires_gradient_sync(m == micro - 1)  # reduce-scatter on the last only
            with CollectiveCounter() as cc:  # counts this micro-batch's collectives
                _, loss = model(xm, ym)
                (loss / micro).backward()
            sent += cc.count(op="reduce_scatter")
        scatters.append(sent)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # a DTensor: the global norm
        norms.append(norm.full_tensor().item())
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)  # DTensor shards, keyed by name
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    local = model.blocks[0].attn.c_attn.weight.to_local().shape
    return {"norms": norms, "reduce_scatters": scatters, "local": tuple(local), "full": full_weights(model)}


def load_at_world_1(path):
    model, opt = build_fsdp2(dist.get_world_size())
    model_sd, optim_sd = get_state_dict(model, opt)  # the layout to fill (creates the optimizer state)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    local = model.blocks[0].attn.c_attn.weight.to_local().shape
    return {"local": tuple(local), "full": full_weights(model), "files": sorted(os.listdir(path))}


script_dir = tempfile.mkdtemp(prefix="fsdp_script_")
saved2 = launch.spawn(train_and_save, 2, args=(os.path.join(script_dir, "ckpt"),))
loaded1 = launch.spawn(load_at_world_1, 1, args=(os.path.join(script_dir, "ckpt"),))[0]
shutil.rmtree(script_dir)

# %% tags=["nbval-ignore-output"]
from course_lib.results import EXACT, Result

units = CONFIG.n_layer + 1
script = Result(title="the FSDP2 script: saved at world 2, loaded at world 1")
script.exact("reduce-scatters per step (2 micro-batches)", saved2[0]["reduce_scatters"], [units] * 3,
             against="one per unit: only the last micro-batch syncs")
norms = [[round(n, 4) for n in r["norms"]] for r in saved2]
script.condition("clip_grad_norm_: the global norm, each step", norms[0],
                 saved2[0]["norms"] == saved2[1]["norms"], "equal on every rank", norms[1], "rank 1")
script.exact("checkpoint files", loaded1["files"], [".metadata", "__0_0.distcp", "__1_0.distcp"],
             against="one per rank of world 2")
script.exact("c_attn.weight held by rank 0: world 2 → world 1", (saved2[0]["local"], loaded1["local"]),
             ((95, 63), (189, 63)), against="⌈189/2⌉ rows, then all 189")
script.equal("weights loaded at world 1 (max |Δ|)", loaded1["full"], saved2[0]["full"], EXACT,
             against="the world-2 weights saved")
print(script)
script.assert_passed()

# %% [markdown]
# **Without `course_lib`.** The script leans on four helpers: `course_lib.launch` sets up the process group,
# `launch.device()` picks the device, `step_batch` and `shard_batch` hand each rank its slice of a step's batch, and
# `CollectiveCounter` only counts collectives for the table above (drop it). The same script in plain torch, run by
# `torchrun --nproc-per-node 2 fsdp_script.py` (`build_fsdp2` with `device` in place of `launch.device()`):
#
# ```python
# from torch.utils.data import DataLoader, DistributedSampler
#
# def main(dataset, path, epochs=1):  # dataset: (x, y) pairs of token ids, e.g. a TensorDataset
#     gpu = torch.cuda.is_available()
#     dist.init_process_group("nccl" if gpu else "gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT: torchrun's env
#     if gpu:
#         torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per process
#     device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
#     sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # this rank's 1/N of the samples
#     loader = DataLoader(dataset, batch_size=4, sampler=sampler, drop_last=True)  # 4 per rank
#     model, opt = build_fsdp2(dist.get_world_size())
#     for epoch in range(epochs):
#         sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
#         for x, y in loader:  # in place of step_batch + shard_batch
#             x, y = x.to(device), y.to(device)
#             ...  # train_and_save's step: micro-batches, clip_grad_norm_, opt.step(), opt.zero_grad()
#     ...  # get_state_dict + dcp.save, as in train_and_save
#     dist.destroy_process_group()
# ```

# %% [markdown]
# ## 3. Exactly one device

# %%
def equality_suite():
    return [fsdp.fsdp2_vs_single_device(steps=steps, optimizer=opt, reshard_after_forward=rs)
            for opt, steps in (("sgd", 5), ("adamw", 10)) for rs in (True, False)]


from course_lib.results import for_optimizer

eq = spawn(equality_suite, 2)
r0 = eq[0][0]
print(f"placements {r0['placements']}; rank 0 holds c_attn.weight as "
      f"{r0['local_shapes']['blocks.0.attn.c_attn.weight']} of (189, 63)")
same = Result(title="FSDP2 vs one device, 2 ranks (max |Δparam| over both ranks)")
same.exact("every parameter is a DTensor", r0["all_dtensor"], True, against="fully_shard's Shard(0)")
for r in eq[0]:
    tol = for_optimizer(r["optimizer"])
    worst = max(rr["max_abs_diff"] for ranks in eq for rr in ranks
                if (rr["optimizer"], rr["reshard_after_forward"]) == (r["optimizer"], r["reshard_after_forward"]))
    same.condition(f"{r['optimizer']}, reshard_after_forward={r['reshard_after_forward']}, {r['steps']} steps",
                   worst, worst <= tol.atol, f"≤ {tol.atol:g} ({tol.name})", against="one device")
print(same)

# %% [markdown]
# ## 4. FSDP2 vs our Zero3
#
# Same model (Ψ ≈ 129k, tied embeddings), same data, fp32 AdamW, 2 ranks. Memory is counted from the real tensors
# after a step (DTensor → local shard); collectives are counted with `torch.distributed.tensor.debug.CommDebugMode`
# for FSDP2 and with our `CommLog` for Zero3.

# %%
cmp = spawn(fsdp.fsdp2_vs_zero3, 2)[0]
print(f"16Ψ/N = {cmp['formula_16psi_over_n']:,.0f} bytes per rank (Ψ unpadded; each row's ratio uses its own Ψ_pad)")
for name in ("fsdp2", "zero3"):
    s = cmp[name]
    ag, rs = s["collectives"]["all_gather"], s["collectives"]["reduce_scatter"]
    print(f"{name:<6} Ψ_pad {s['psi_pad']:>7,}  model states {s['memory']['total']:>9,} B "
          f"({s['memory_ratio']:.3f} × 16Ψ_pad/N)  all-gathers fwd/bwd {ag['forward']}/{ag['backward']}, "
          f"reduce-scatters {rs['backward']}, sent / 3Ψ·(N−1)/N = {s['comm_ratio']:.3f}")

# %%
units = cmp["units"]
both = Result(title=f"FSDP2 and our Zero3, {units} units, 2 ranks")
for name in ("fsdp2", "zero3"):
    s, c = cmp[name], cmp[name]["collectives"]
    both.exact(f"{name}: all-gathers fwd / bwd, reduce-scatters",
               (c["all_gather"]["forward"], c["all_gather"]["backward"], c["reduce_scatter"]["backward"]),
               (units, units, units), against="one per unit and pass")
    both.exact(f"{name}: bytes sent / 3Ψ_pad·(N−1)/N (6 decimals)", round(s["comm_ratio"], 6), 1.0,
               against="ZeRO-3's 3Ψ")
    both.within(f"{name}: model states / (16Ψ/N)", s["memory_ratio"], 1.0, 0.01, against="the ZeRO paper")
print(both)

# %% [markdown]
# How our Zero3 does it (`course_lib/zero3.py`): `gather` takes a unit's prefetched all-gather, or issues one now,
# and copies the gathered rows out into one buffer that holds the unit's full parameters; `_free` releases that
# buffer's storage (resized to 0 bytes) the moment the unit's forward is done, and again after its backward. Autograd's
# saved tensors point at the same storage, which `regather` refills in place before the unit's backward.

# %%
from IPython.display import display

from course_lib import show
from course_lib.zero3 import Zero3

display(show.source(Zero3.gather, docstring=False))
display(show.source(Zero3._free))

# %% [markdown]
# FSDP2 pads each tensor to ⌈dim0/N⌉ rows (so its Ψ_pad is a little larger than our flat padding). What both
# share is the *unit*: a whole block travels in one all-gather through a copy-in buffer (this rank's shards of every
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
print(Result(title="all-gathers in one forward, 2 ranks", checked=race.checked))

# %% tags=["nbval-ignore-output"]
print(fsdp_race.format_zero3(race))
print(race["timings"].compare("zero3 per-unit+prefetch", "zero3 per-unit").verdict)

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
# **What two CPU cores can show.** The last line under the table reads per unit with prefetch against per unit
# without, from the two ranges of rounds. Prefetch shortens a step only when the all-gather has idle hardware to run
# on while the unit computes: on a GPU, a copy engine and the link, on a stream of its own. Here there is none. Each
# rank computes on its training thread, its collectives run on gloo's worker thread, and both ranks' threads share
# the 2 cores, so a prefetched all-gather takes a core from this rank's compute or from the other rank's. What
# prefetch adds instead is work: one more unit gathered at once (one more buffer to allocate and fill) and a hand-off
# to gloo's thread and back for every unit. Whichever way the medians fall, the verdict line says whether the ranges
# can tell the two apart on this machine. FSDP2 runs the same collectives per unit. Where the verdict lines put it
# behind our Zero3, the likely cause is its own per-step Python work: its shards are `DTensor`s, whose operators go
# through a Python `__torch_dispatch__`, next to the little arithmetic of a model this small. Section 7's table of top
# ops counts those `PythonSubclass` calls for one step of its smaller model (3 units); nothing here times them for
# this one, so this is a likely cause, not a measured attribution.
# Prefetch's effect is measured under the modelled clock, in [Prefetch and recompute in a step](#prefetch-timing):
# there a unit's compute is the clock's sleep, which leaves the core free for the all-gather.

# %% [markdown]
# ## 5. Mixed precision
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

# %% tags=["nbval-ignore-output"]
bf16 = Result(title="bf16 compute vs fp32 one-device training")
bf16.condition("largest per-tensor relative error", mp["max_rel_err"]["bf16"], mp["max_rel_err"]["bf16"] < 0.02,
               "< 2 % (bf16: 8 significant bits, 7 stored; unit roundoff 2⁻⁸ ≈ 0.4 %)", against="fp32, one device")
print(bf16)
bf16.assert_passed()

# %% [markdown]
# ## 6. The FSDP2 features people reach for
#
# Each one below runs on real ranks on a 4-block version of the model (Ψ ≈ 224k) and returns a `Result` table of
# what it measured. The timing lessons run our `Zero3` under the modelled
# accelerator clock (`fsdp_race.zero3_clocked`), in the same processes.

# %%
from course_lib import viz
from course_lib.experiments import fsdp_features as F
from course_lib.experiments import fsdp_practice as P


def features_at_2(ckpt_dir):
    return {"reshard": F.reshard_memory_and_traffic(), "prefetch": F.prefetch_timeline(),
            "accumulate": F.accumulation_without_sync(), "clip": P.clip_grad_norm(),
            "ckpt": P.activation_checkpointing(), "meta": P.meta_device_init(),
            "flat": P.flat_vs_per_parameter(), "save": P.checkpoint_save(ckpt_dir),
            "clocked": fsdp_race.zero3_clocked()}


def features_at_4(path):
    return {"hsdp": F.hsdp(), "reshard_int": F.reshard_to_smaller_mesh(), "load": P.checkpoint_load(path)}


feat_dir = tempfile.mkdtemp(prefix="fsdp_features_")
f2 = spawn(features_at_2, 2, args=(feat_dir,))
saved = f2[0]["save"]
f4 = spawn(features_at_4, 4, args=(saved.path,))

# %% [markdown]
# ### `reshard_after_forward`: traffic against memory
# `True` (the default for every unit but the root) frees each unit's gathered weights after its forward and gathers
# them again in backward: 3Ψ of traffic, little memory. `False` keeps them from forward to backward: 2Ψ, but at the end of forward every unit is
# gathered at once. Bytes are counted per collective (`CollectiveCounter`); memory is tracked operator by operator
# with torch's `FSDPMemTracker`. The peaks depend on when the allocator sees each free (a busy machine shifts them by
# an activation or two), so this cell's numbers are not compared between runs; the bytes sent are exact.

# %% tags=["nbval-ignore-output"]
r = f2[0]["reshard"]
print(f"bytes sent per step: True {r.sent['True']:,.0f}, False {r.sent['False']:,.0f} "
      f"(False / True = {r.sent['False'] / r.sent['True']:.3f})")
print(f"peak over the step: True {r.peak['True']:,} B, False {r.peak['False']:,} B; "
      f"one block's gathered parameters = {r.block_param_bytes:,} B")
print(r)

# %%
viz.memory_over_step({"reshard_after_forward=True": r.trace["True"], "reshard_after_forward=False": r.trace["False"]},
                     title="bytes held over one step (FSDPMemTracker), 2 ranks")
plt.show()

# %% [markdown]
# `reshard_after_forward=<int>` is the middle ground: after forward each rank keeps a shard over a *smaller* group
# of k ranks (typically one node), so backward's all-gathers only span k ranks. At world 4 with k = 2:

# %%
print(f4[0]["reshard_int"])

# %% [markdown]
# ### Prefetch
# On a GPU, FSDP2 already prefetches **one unit ahead** without being asked: each all-gather runs on its own CUDA
# stream, issued before the previous unit's compute has finished, so the link and the copy engines work while the
# kernels run (in backward it is issued when the previous unit's backward starts). Explicit prefetch,
# `set_modules_to_forward_prefetch([...])` (and `..._backward_...`), issues it earlier still — two or more units ahead,
# or in an order autograd cannot guess — at the cost of one more unit gathered at once. On CPU with gloo there are no
# streams: each collective blocks the calling thread, so FSDP2's implicit overlap does not happen here; what
# shows is *when* each all-gather is issued:

# %%
pf = f2[0]["prefetch"]
print(pf)

# %% tags=["nbval-ignore-output"]
viz.fsdp_timeline(pf.events, title="when each all-gather (AG) and reduce-scatter (RS) is issued, rank 0")
plt.show()

# %% [markdown]
# Read the chart for *when* each collective is issued against the blocks' compute, not for how long a step takes:
# each plan is one recorded step, not repeated, each on its own time axis from that step's start, so where the two
# runs end is not a timing comparison. Each tick on a *comm* row spans the issuing call on rank 0's training thread
# (from the call into `torch.distributed` until it returns; the transfer runs on gloo's thread and is not drawn):
# a faint hairline is a call that returned at once, a solid tick one that held the training thread longer. On the
# compute rows the number is the block's index.
# The rows named *implicit* are FSDP2 with no prefetch plan, its default (on GPUs that default overlaps through CUDA
# streams; here, on gloo, nothing overlaps); *explicit* is the same model with `set_modules_to_forward_prefetch`.

# %% [markdown]
# <a id="prefetch-timing"></a>
# ### Prefetch and recompute in a step: predicted, then measured
# Our `Zero3` issues asynchronous all-gathers, so its prefetch really runs communication during compute once
# compute is a modelled accelerator's (`course_lib.clock`: each block sleeps what its FLOPs would take at the
# clock's rate). The prediction adds three parts, each measured on its own before the timed steps:
#
# * **compute** — the clock's sleeps, from each block's FLOPs; activation checkpointing (a
#   `torch.utils.checkpoint` around each block) adds one forward of the blocks to backward;
# * **exposed communication** — `step_time.zero3_step(prefetch=…)` walks the step unit by unit on one link:
#   without prefetch every all-gather is exposed; with it, unit i+1's runs behind unit i's compute. It prices
#   each all-gather and reduce-scatter at the sizes `Zero3` really sends, by replaying those collectives alone;
# * **host work** — what the model's compute and communication leave out: copying shards into each
#   all-gather's input and out of its output, the hooks, the optimizer (and checkpointing's re-run forward):
#   the same step under a clock that never sleeps, less its waits for collectives.
#
# Where prefetch acts is the wait: a `Zero3Waits` observer (`course_lib.fsdp_meters`) times every `work.wait()`
# of the step's all-gathers and reduce-scatters, so each measured step splits the same way — what the clock
# slept, those waits, and the rest (host work) — and the table below puts each part beside its prediction.

# %% tags=["nbval-ignore-output"]
clk = f2[0]["clocked"]
print(clk.timings)
print(clk.breakdown())
comm = {n: sum(clk.waits[n].values()) - clk.predicted[n].parts.get("exposed all_gather + reduce_scatter", 0.0)
        for n in clk.measured}
print("communication, measured waits − predicted exposed: "
      + ", ".join(f"{n} {d * 1e3:+.1f} ms" for n, d in comm.items()))
print(clk)
ag = {n: clk.waits[n]["all_gather"] for n in ("no prefetch", "prefetch")}
pf_saved, pf_model = clk.saving("no prefetch", "prefetch", "measured"), clk.saving("no prefetch", "prefetch", "predicted")
print(clk.timings.compare("prefetch", "no prefetch"))
print(f"prefetch: the all-gather waits fall from {ag['no prefetch'] * 1e3:.1f} to {ag['prefetch'] * 1e3:.1f} ms per "
      f"step; the step shrinks by {pf_saved * 1e3:.1f} ms (medians), the model said {pf_model * 1e3:.1f} ms")

# %% [markdown]
# **Reading the breakdown.** The table prints each variant's measured row above its predicted row.
#
# * **Communication, what prefetch changes.** Without prefetch the step waits for every all-gather; with prefetch
#   each one ran during the previous unit's sleep, so its wait nearly vanishes (the ratio row), and what the model
#   still charges is the first unit of each pass and the last reduce-scatter.
# * **Communication, why the two figures differ** (their difference is the line under the table). The model prices
#   each collective as a whole blocking call — a line through two sizes (the root's message and a block's) fitted
#   to the step's own collectives replayed alone, back to back (the mean call, the max over ranks) — and runs all
#   of them on **one link**, one at a time: in backward, a unit's all-gather starts only once the previous unit's
#   reduce-scatter is done, so without prefetch every reduce-scatter counts as exposed. The measured figure is only
#   the time spent inside `work.wait()`. `Zero3` waits for a unit's reduce-scatter only after the next unit's
#   backward, and gloo's worker threads (two per process group) can run it beside that unit's all-gather, so only
#   what is still running then is a wait; a collective's time that passes while the host works falls in the
#   host-work column. Either figure can be the larger: a wait also holds the other rank's lateness (a collective
#   ends only once both ranks have joined it), which the replay, its ranks in step from call to call, does not see.
# * **Host work.** It is predicted from the same step run with nothing sleeping, where gloo's thread and the
#   training thread compete for the two cores; under the clock a collective mostly runs while the training thread
#   sleeps or waits, so the host's work is measured in other conditions than the clocked step's, and with prefetch
#   the host also fills one more gather buffer per unit. The cell below prints measured − predicted host work for
#   each variant.
# * **The saving.** The difference of the two steps carries both steps' errors, a larger share of it than of either
#   step, which is why it is printed beside its prediction rather than banded.

# %% tags=["nbval-ignore-output"]
print("host work, measured − predicted: " + ", ".join(
    f"{n} {(clk.host(n) - clk.predicted[n].parts.get('host work', 0.0)) * 1e3:+.1f} ms" for n in clk.measured))

# %% [markdown]
# ### Gradient accumulation without the reduce-scatters
# Four micro-batches per step, with `set_requires_gradient_sync(False)` on the first three (see above). The price
# is memory: a unit that skips its reduce-scatter keeps its gradient **unsharded** (full size, on every rank) until
# the last micro-batch reduce-scatters the sum. The table also counts the gradient bytes each rank holds right after
# the first micro-batch's backward (`fsdp_meters.held_gradient_bytes`): its shards when every micro-batch syncs,
# the whole gradient when sync is off.

# %%
a = f2[0]["accumulate"]
print(f"reduce-scatters per step: {a.reduce_scatters}; all-gathers per step: {a.all_gathers}")
held = {v: h["sharded"] + h["unsharded"] for v, h in a.held.items()}
print(f"gradient bytes held after micro-batch 1: {held} (× {held['no_sync'] / held['sync_each']:.2f} with sync off)")
print(a)

# %% [markdown]
# ### HSDP on a (2, 2) mesh
# `init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))`, `fully_shard(..., mesh=mesh)`: every
# collective is counted with the mesh dimension it ran on.

# %%
h = f4[0]["hsdp"]
for dim, ops in h.per_group.items():
    print(f"{dim:<9}", {op: (v["calls"], f"groups of {v['group_size']}") for op, v in ops.items()})
print(h)

# %% [markdown]
# ### Gradient clipping on sharded gradients
# `torch.nn.utils.clip_grad_norm_` works on FSDP2's DTensor gradients: each rank sums the squares of its shard and the
# norm is reduced across ranks, so every rank gets the global norm.

# %%
print(f2[0]["clip"])

# %% [markdown]
# <a id="activation-checkpointing"></a>
# ### Activation checkpointing: the answer to "ZeRO does not shard activations"
# `checkpoint_wrapper` around each block keeps only the block's input for backward and recomputes the rest. Measured
# with torch's `MemTracker` (our `SavedTensorMeter`'s hooks are shadowed by checkpointing's own) against the formula
# (each block keeps its input, L·b·s·h·4 bytes). The clocked lesson above measures it in step time, against the model.

# %%
c = f2[0]["ckpt"]
print(f"activation bytes kept by the blocks: {c.block_stack_activation_bytes['none']:,} without, "
      f"{c.block_stack_activation_bytes['per_block']:,} with checkpointing; formula {c.formula_bytes:,}")

# %% tags=["nbval-ignore-output"]
print(c)  # the step's peaks, like reshard's, move with the allocator's timing

# %% [markdown]
# ### Meta-device initialisation: only rank 0 holds the full model
# Build the model on `torch.device("meta")` (shapes, no memory), `fully_shard` it, `to_empty(device=...)` allocates
# only this rank's shards; the weights then come from a full state dict loaded with
# `set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`: **rank 0** holds
# that full state dict (it loaded or built it) and broadcasts it, each other rank keeps only its shards (random
# re-initialisation of a DTensor on a CPU mesh would be rank-local and not equal one device's init). Measured on
# rank 1:

# %%
m = f2[1]["meta"]
print(f"full model {m.full_model_bytes:,} B; rank 1's construction peak {m.construction_peak:,} B; "
      f"its shards {m.shard_bytes:,} B")
print(m)

# %% [markdown]
# ### Why FSDP2 exists: FSDP1's FlatParameter vs per-parameter DTensors
# FSDP1 flattens each unit's parameters into one 1-D `FlatParameter` and cuts it into N equal pieces, so a rank's
# piece can end in the middle of a weight's row, and per-parameter things (a frozen weight, its own optimizer
# settings, a low-precision weight) get awkward. FSDP2 shards every parameter on its own along dim 0, as a `DTensor`
# that keeps its shape. `CPUOffloadPolicy` (shards kept in CPU memory between uses) needs an accelerator:

# %%
fl = f2[0]["flat"]
for unit, (shape, numel, names) in list(fl.fsdp1_flat_params.items())[:2]:
    print(f"FSDP1 unit {unit}: rank 0's FlatParameter shard, shape {shape}, {numel:,} elements "
          f"(1/{fl.world_size} of the unit's padded flat vector), flattened from {names}")
global_shape, local_shape = fl.fsdp2_param_shapes["blocks.0.attn.c_attn.weight"]
print(f"FSDP2 c_attn.weight: global shape {global_shape}, rank 0's local shard {local_shape}")
print("CPUOffloadPolicy here:", fl.cpu_offload_error)
print(fl)

# %% [markdown]
# <a id="sharded-checkpoints"></a>
# ### Checkpoints at another world size, and for one device
# The script in section 2 loaded a world-2 checkpoint at world 1; this one loads at world 4 — including
# `c_attn.weight`, whose 189 rows do not divide by 4 — and a full state dict exported for inference loads into a plain
# `GPT`:

# %%
from course_lib.results import REORDERED

key = "blocks.0.attn.c_attn.weight"
print(f"{key} per rank: world 2 {[r['save'].local_shapes[key] for r in f2]}, "
      f"world 4 {[r['load'].local_shapes[key] for r in f4]}")
plain = GPT(F.features_config())
plain.load_state_dict(torch.load(saved.inference_path, weights_only=True))
logits = plain(P.eval_batch(F.features_config(), "cpu")[0])[0]
moved = Result(title="the world-2 checkpoint, elsewhere")
moved.exact("ranks at world 4 whose contents match the saved digest", sum(r["load"].digest == saved.digest for r in f4),
            4, against="all 4")
moved.equal("plain GPT's logits from the exported state dict", logits, saved.logits, REORDERED, against="FSDP2's")
print(moved)
shutil.rmtree(feat_dir)

# %% [markdown]
# <a id="fsdp2-trace"></a>
# ## 7. A profiler trace of one FSDP2 step
#
# The collectives counted above, seen in time. The rank function profiles one step of section 2's script model
# (`build_fsdp2`: 3 units, bf16 compute) after a warm-up step, with `course_lib.profiling.profile_steps` —
# `torch.profiler` on every thread, the step's phases marked by `marked_step` (`forward`, `backward`, `optimizer`),
# exported as Chrome-trace JSON, one file per rank. Each collective leaves two marks: on the training thread the
# c10d call that issues it (`c10d::_allgather_base_` for FSDP2's `all_gather_into_tensor`,
# `c10d::_reduce_scatter_base_` for its `reduce_scatter_tensor`), and on one of gloo's worker threads
# (`pt_gloo_runloop`) a `gloo:…` range for the collective gloo actually runs. On CPU the training thread waits for
# each one.

# %% tags=["nbval-ignore-output"]
from course_lib import profiling


def fsdp2_step_trace():
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build_fsdp2(world)
    x, y = shard_batch(*step_batch(0, CONFIG, 4 * world, launch.device()))
    prof = profiling.profile_steps(lambda: profiling.marked_step(model, opt, x, y), steps=1, warmup=1,
                                   name=f"fsdp2_rank{rank}", title=f"rank {rank}: one FSDP2 step")
    curve = profiling.memory_curve(model, opt, x, y, name=f"fsdp2_memory_rank{rank}")  # a third step
    with memory.SavedTensorMeter(exclude=model) as meter:  # what autograd keeps from that forward
        _, loss = model(x, y)
    loss.backward()
    return prof, curve, meter.bytes


from course_lib import memory

traced = spawn(fsdp2_step_trace, 2)
profs = [prof for prof, _, _ in traced]
print(profs[0])
print(f"\nrank 1: {profs[1].trace_file}; open either at https://ui.perfetto.dev (drag the file in) "
      "or chrome://tracing (Load)")

# %% [markdown]
# Both ranks' files drawn back on one time axis (`profiling.read_traces`: the files carry the host's clock), one row
# per thread. Then the collectives in rank 0's step, counted from both marks, beside what section 1 says FSDP2
# issues with the default `reshard_after_forward` (the root keeps its parameters after forward): L + 1
# all-gathers in forward, L in backward, L + 1 reduce-scatters.

# %% tags=["nbval-ignore-output"]
both_ranks = profiling.read_traces([p.trace_path for p in profs])
fig, ax = plt.subplots(figsize=(9, 4.5))
profiling.draw_trace(both_ranks, ax=ax, title="one FSDP2 step on 2 ranks: gloo collectives (orange) between compute")
plt.tight_layout()
plt.show()

# %% tags=["nbval-ignore-output"]
import dataclasses
from collections import Counter

ev0 = both_ranks["rank 0"]
step = next(e for e in ev0 if e.name.startswith("ProfilerStep#"))
in_step = [e for e in ev0 if e.start >= step.start and e.end <= step.end]
calls = Counter(e.name for e in in_step if e.name.startswith("c10d::"))
gloo = Counter(e.name for e in in_step if e.name.startswith("gloo:"))
print("c10d calls on the training thread:", dict(calls))
print("gloo ranges on its worker threads:", dict(gloo))
layers = CONFIG.n_layer
seen = Result(title="collectives in one FSDP2 step, read from rank 0's trace")
seen.exact("all-gathers issued (c10d::_allgather_base_)", calls["c10d::_allgather_base_"], 2 * layers + 1,
           against="L + 1 in forward, L in backward")
seen.exact("gloo:all_gather ranges", gloo["gloo:all_gather"], 2 * layers + 1, against="one per all-gather")
seen.exact("reduce-scatters issued (c10d::_reduce_scatter_base_)", calls["c10d::_reduce_scatter_base_"],
           layers + 1, against="one per unit")
seen.condition("gloo ranges left for the reduce-scatters", {k: n for k, n in gloo.items() if k != "gloo:all_gather"},
               sum(n for k, n in gloo.items() if k != "gloo:all_gather") == layers + 1, "one per reduce-scatter")
comm = profiling.busy(ev0, "communication")
print(f"step {step.duration * 1e3:.1f} ms; collectives running {comm * 1e3:.1f} ms of it "
      f"({comm / step.duration:.0%})")
step1 = next(e for e in both_ranks["rank 1"] if e.name.startswith("ProfilerStep#"))
first = min((e for e in in_step if e.name == "gloo:all_gather"), key=lambda e: e.start)
print(f"rank 1's step began {(step1.start - step.start) * 1e3:+.1f} ms from rank 0's; rank 0's first all-gather "
      f"ran {first.duration * 1e3:.1f} ms (a collective ends only once both ranks have joined it)")
print(seen)
seen.assert_passed()

# %% [markdown]
# The first all-gather of a step also holds the ranks' skew: it cannot finish before the later rank has joined, so
# when the ranks start apart (the line above the table prints by how much, on the host's clock both files share),
# its range — and the profiler's `FSDP::all_gather` in the top-ops table — includes that wait, not only transfer.
#
# Read the last row's measured value: in torch 2.13 gloo runs `_reduce_scatter_base_` on CPU tensors as a gloo
# **all-reduce** of the whole unit's gradient buffer, after which each rank keeps its chunk. On gloo a reduce-scatter
# therefore moves an all-reduce's bytes (in a ring, 2(N − 1)/N of the buffer per rank instead of (N − 1)/N); NCCL
# runs a real reduce-scatter. The byte counts of section 4 are those of the collectives FSDP2 *asks for*.

# %% [markdown]
# <a id="fsdp2-memory"></a>
# **Memory over the step.** The same rank function then profiled a third step with `profile_memory=True`
# (`profiling.memory_curve`, chapter 01 §5): the bytes held on each rank, from its sharded model states (fp32
# parameter shards and Adam's moments) through the step. In forward each unit's all-gather brings its bf16 weights,
# which are freed after the unit's forward while the activations stay; in backward each unit is gathered again, its
# unsharded fp32 gradient is written, reduce-scattered, and only this rank's gradient shard stays. One thing the
# profiler cannot see: gloo's worker thread holds each collective's work (and its buffers) until the work has run, and
# when it, not the training thread, drops the last reference, the free happens outside the profiler's reach — a
# race, different from run to run. `profiling.unseen_frees` finds those buffers (an address handed out again without a
# free, or a collective's buffer never freed) and the curve frees each when its `gloo:` range ends. The peak is
# compared with the course's meters: the model states after the step (with the gradient shards) + the tensors autograd
# keeps from forward (`SavedTensorMeter`; they include the bf16 weights each Linear keeps for backward, which FSDP2
# frees after each unit's forward and gathers back before that unit's backward).

# %% tags=["nbval-ignore-output"]
curves = [c for _, c, _ in traced]
for rank, c in enumerate(curves):
    print(f"rank {rank}: held before the step {c.states_before['total']:,} B (sharded parameters + Adam state); "
          f"peak {c.peak:,} B in {c.peak_phase}; {len(c.unseen)} buffer(s) freed unrecorded")
fig, axes = plt.subplots(1, 2, figsize=(13, 3.2), sharey=True)
for rank, (c, ax) in enumerate(zip(curves, axes, strict=True)):
    expected = c.states_after["total"] + traced[rank][2]
    profiling.draw_memory_curve(c, ax=ax, references={"model states after + saved (meters)": expected},
                                title=f"rank {rank}: peak in {c.peak_phase}, ×{c.peak / expected:.2f} the meters' sum")
fig.suptitle("bytes held over one FSDP2 step (bf16 compute, 3 units), per rank", fontsize=11)
plt.tight_layout()
plt.show()

# %% tags=["nbval-ignore-output"]
fmem = Result(title="memory over one FSDP2 step: the profiler's allocator events against the course's meters")
for rank, c in enumerate(curves):
    fmem.checked += [dataclasses.replace(r, quantity=f"rank {rank}: {r.quantity}") for r in c.checked]
    fmem.within(f"rank {rank}: peak allocated (bytes)", c.peak, c.states_after["total"] + traced[rank][2],
                profiling.MEMORY_PEAK_BAND, "model states after the step + saved for backward (meters)")
print(fmem)

# %%
fmem.assert_passed()

# %% [markdown]
# <a id="fsdp2-compile"></a>
# ## 8. `torch.compile` on each block
#
# The usual recipe (torchtitan's, for example) compiles every transformer block **in place** and then shards it:
# `block.compile()` compiles the module's forward but leaves the module object (its name, its parameters) where it
# was, so `fully_shard(block)` wraps it as before; FSDP2's all-gather and reduce-scatter run in its hooks, around the
# compiled forward and backward, outside the graphs. The root (embeddings, final norm, tied head) stays eager here.
# The rank function trains 3 SGD steps eagerly and 3 compiled from the same init and compares losses and the full
# weights. The backend here is `aot_eager`: Dynamo captures each block's graph and AOTAutograd builds its forward and
# backward graphs, which run op by op, without inductor's code generation (chapter 01 §5 compiles with inductor and
# prints what its C++ code generation costs on this machine; two ranks compiling at once on two cores would pay it
# twice). `backend="inductor"` is the one-word change that makes the same cell generate code.

# %%
from course_lib.results import REORDERED, SGD


def compiled_blocks_vs_eager(backend="aot_eager", steps=3):
    import torch._dynamo

    mesh = init_device_mesh(launch.device().type, (dist.get_world_size(),))
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = GPT(CONFIG, seed=0).to(launch.device())
        for block in model.blocks:
            if compiled:
                block.compile(backend=backend)  # in place: still model.blocks[i]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, seconds = [], []
        for step in range(steps):
            t0 = time.perf_counter()
            x, y = shard_batch(*step_batch(step, CONFIG, 8, launch.device()))
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            seconds.append(time.perf_counter() - t0)
        full = {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
        runs["compiled" if compiled else "eager"] = {"losses": losses, "seconds": seconds, "weights": full}
    return runs


cb = spawn(compiled_blocks_vs_eager, 2)

# %% tags=["nbval-ignore-output"]
same_c = Result(title="FSDP2, each block compiled (aot_eager) vs eager, 2 ranks, 3 SGD steps")
for rank, r in enumerate(cb):
    same_c.equal(f"rank {rank}: losses", r["compiled"]["losses"], r["eager"]["losses"], REORDERED,
                 against="eager FSDP2")
    same_c.equal(f"rank {rank}: full weights after 3 steps", r["compiled"]["weights"], r["eager"]["weights"], SGD,
                 against="eager FSDP2")
print(same_c)
same_c.assert_passed()
te, tc = cb[0]["eager"]["seconds"], cb[0]["compiled"]["seconds"]
print(f"rank 0, first step: eager {te[0] * 1e3:.0f} ms, compiled {tc[0]:.1f} s (the compile); "
      f"the {len(te) - 1} later steps: eager {sum(te[1:]) / len(te[1:]) * 1e3:.0f} ms, "
      f"compiled {sum(tc[1:]) / len(tc[1:]) * 1e3:.0f} ms — one run each, not repeated: "
      "a difference between them is not a measurement")

# %% [markdown]
# What compiling changes is the code each block runs: with inductor, each block's elementwise ops are fused into
# generated kernels, the reason to compile on a GPU. `aot_eager` changes nothing in the kernels — it is the quick way
# to check that a model compiles at all under FSDP2 (graph capture and the backward graph, around FSDP2's hooks).
# On a model this small on CPU a step is mostly Python and the collectives; the later-step times above come from one
# unrepeated run of each, there to set the first step's compile beside them, not to compare eager with compiled.

# %% [markdown]
# ## 9. Exercise: one FSDP unit from scratch
#
# Section 2's script lets `fully_shard` do the work; here you write what one unit does inside. Open
# `exercises/fsdp.py`; check with `check("flat_unit")` (below) or `course-lib check flat_unit` in a terminal: it prints
# PASS, FAIL with the first rule broken, or UNSOLVED while the `TODO` is there. Stuck? Hints come in two layers,
# `hint("flat_unit", 1)` the idea and `hint("flat_unit", 2)` the API (`from course_lib.checks.fsdp import hint`), never
# the code.
#
# **`FlatUnit(module, process_group=None)`, an `nn.Module`; `forward(*args)` returns the module's output.** FSDP1's
# flat parameter for one module: all of the module's parameters, in `named_parameters()` order, flattened and laid end
# to end, zero-padded to N·S elements with S = ⌈Ψ/N⌉. `unit.shard`, an `nn.Parameter` of S elements, is slice
# [r·S, (r+1)·S) of that buffer and the unit's only parameter (the module keeps none of its own). The full parameters
# exist only while they are needed: all-gathered into the flat buffer before forward, its storage freed as soon as the
# module returns, gathered again into the same storage before the module's backward, and freed once the flat gradient
# has been reduce-scattered into `shard.grad`, averaged over ranks. One unit, one collective of each kind per pass, no
# prefetch: chapter 03's `Zero3` (section 4's `gather` and `_free`) does this for every block, each parameter padded
# on its own.
#
# *Checker* (`check("flat_unit")`, on 2 ranks): a transformer block with biases (its Ψ is odd, so the buffer is
# padded) wrapped by your `FlatUnit`, 3 AdamW steps, each rank on its half of the batch, beside the same block on one
# device on the whole batch. It requires: the shard to be slice r of the padded flat parameters (exactly) and the
# unit's only parameter; at rest, no more bytes than the shard; right after forward, the unit and autograd's saved
# tensors to hold at most the activations one device saves plus the shard (the full weights freed); after backward,
# the shard and its gradient only; one all-gather in forward, one all-gather and one reduce-scatter in backward
# (counted at the dispatcher, whatever API issues them); forward's output equal to the block's within `REORDERED`;
# the first `shard.grad` equal to slice r of one device's gradient within `SGD`; and the weights after 3 steps equal
# to one device's within `ADAMW`.
#
# The first cell checks your file; the last runs the same checker on the solution.

# %%
from course_lib.check import check
from course_lib.checks.fsdp import hint

check("flat_unit")

# %%
print(hint("flat_unit", 1))

# %%
check("flat_unit", package="solutions")

# %% [markdown]
# ## 10. O/X quiz

# %%
from course_lib.quiz import quiz

quiz("fsdp")

# %% [markdown]
# ## Summary
# - FSDP2 = ZeRO-3 with whole-module collectives: parameters are `Shard(0)` DTensors, trained exactly like one device.
# - Per rank it holds ≈16Ψ/N like our Zero3, and both send exactly 3Ψ per step in 3(L+1) collectives: one per unit,
#   few and large; per parameter and per use (the textbook ZeRO-3) the messages are many and small.
# - bf16 mixed precision halves the all-gathers and the gathered weights; shards, gradients and optimizer state stay fp32.
# - A training script is `fully_shard` per block then the root, a `MixedPrecisionPolicy`, `set_requires_gradient_sync`
#   for accumulation, `clip_grad_norm_` on DTensor gradients and DCP; its checkpoint loads at world 1 and 4 and into
#   a plain model for one-device inference.
# - Under the modelled clock, prefetch and recompute are measured against `step_time.zero3_step`'s prediction (the
#   table says whether each lands in the band): prefetch runs unit i+1's all-gather during unit i's compute,
#   recompute adds one forward of the blocks to backward.
# - The features: `reshard_after_forward=False` trades 3Ψ → 2Ψ of traffic for a peak with the whole model gathered;
#   `set_requires_gradient_sync(False)` cuts the reduce-scatters of accumulation to one per unit per step; HSDP keeps
#   all-gathers and reduce-scatters on the shard dimension and all-reduces on the replicate dimension; activation
#   checkpointing keeps only each block's input; with meta-device init only rank 0 holds the full state dict.
# - A profiler trace of one step shows 2L + 1 all-gathers and L + 1 reduce-scatters (section 7's table); on gloo
#   each reduce-scatter runs as an all-reduce. Its memory curve's peak is compared with the sharded model states +
#   the tensors autograd keeps from forward (section 7's memory table). Each block compiled (`aot_eager`) before `fully_shard` trains like
#   eager FSDP2 within the named tolerances (section 8's table).

# %% tags=["nbval-ignore-output"]
rsh = f2[0]["reshard"]
print(f"model states per rank / (16Ψ/N): FSDP2 {cmp['fsdp2']['memory_ratio']:.3f}, our Zero3 "
      f"{cmp['zero3']['memory_ratio']:.3f}")
print(f"reshard_after_forward=False: bytes sent {rsh.sent['False'] / rsh.sent['True']:.2f}× those of True, "
      f"peak {rsh.peak['False'] / rsh.peak['True']:.2f}×")
print(f"prefetch under the modelled clock: step {pf_saved * 1e3:.1f} ms shorter (predicted {pf_model * 1e3:.1f} ms); "
      f"recompute costs {clk.saving('prefetch + recompute', 'prefetch', 'measured') * 1e3:.0f} ms per step")
print(f"gradient bytes held after micro-batch 1 with sync off: × {held['no_sync'] / held['sync_each']:.2f}")
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
