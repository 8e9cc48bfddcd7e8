# %% [markdown]
# # 02 · Data parallelism: DDP from scratch
#
# **What you will learn**
# - why data parallelism replicates the model and splits the batch, and why that is *exactly* one-device training
#   on the full batch (proven below on real ranks);
# - how DDP hides communication: asynchronous all-reduces launched **during** backward, packed into **buckets**;
# - how our `course_lib.ddp.DDP` compares with `torch.nn.parallel.DistributedDataParallel`;
# - when more ranks make a step **slower**;
# - `DistributedSampler` + `set_epoch`, the global batch size and the learning rate, and gradient accumulation with
#   `no_sync()`.
#
# Read along: `course_lib/ddp.py` (the algorithm, ~300 lines) and `course_lib/experiments/ch02_ddp.py` (the measurements).

# %%
# NBVAL_IGNORE_OUTPUT
import time

_t_notebook = time.perf_counter()
import os

import matplotlib.pyplot as plt
from torch.utils.data.distributed import DistributedSampler

from course_lib.experiments import ch02_ddp
from course_lib.data import SyntheticDataset
from course_lib.ddp import make_buckets, trainable_parameters
from course_lib.launch import spawn
from course_lib.models import GPT

print(f"cores: {os.cpu_count()}")

# %% [markdown]
# ## 1. The idea
#
# N ranks hold the **same** weights. Each takes a different 1/N of the global batch, runs forward and backward, and
# then the gradients are **averaged** with an all-reduce. Every rank applies the same update, so the weights stay
# identical. Because the loss is a mean over samples, the mean of N equal-sized shard gradients *is* the
# full-batch gradient:
#
# $$\nabla L = \frac{1}{B}\sum_{i=1}^{B} \nabla \ell_i = \frac{1}{N}\sum_{r=1}^{N} \underbrace{\frac{N}{B}\sum_{i \in \text{shard } r}\nabla \ell_i}_{\text{rank } r\text{'s gradient}}$$
#
# So DDP is not an approximation: it must reproduce one device, to float rounding. We check that for four ways of
# averaging — naive (all-reduce after backward), our DDP per parameter, our DDP with buckets, and torch's DDP —
# with SGD (5 steps) and AdamW (10 steps). Each rank starts from a *different* random init: wrapping broadcasts
# rank 0's weights.
#
# <a id="synchronous-data-parallelism"></a>
# This is **synchronous** data parallelism: every step waits for all ranks, so all replicas hold the same weights.
# Asynchronous schemes (a parameter server applying each worker's gradient as it arrives) avoid the wait, but a
# gradient may then have been computed from stale weights.

# %%
VARIANTS = ["naive", "own_per_param", "own_bucketed", "torch_ddp"]
OPTIMIZERS = {"sgd": 5, "adamw": 10}


def equality_suite():
    return [ch02_ddp.equality_with_single_device(v, o, steps) for v in VARIANTS for o, steps in OPTIMIZERS.items()]


eq = spawn(equality_suite, 2)
worst = {}  # per (variant, optimizer): the rank with the largest difference
for rank_rows in eq:
    for r in rank_rows:
        key = (r.variant, r.optimizer)
        if key not in worst or r.max_abs_diff > worst[key].max_abs_diff:
            worst[key] = r
for (v, o), r in worst.items():
    for claim, ok in r.claims().items():
        print(f"{v:<15} {o:<6} {claim}: {ok}")

# %%
# NBVAL_IGNORE_OUTPUT
for (v, o), r in worst.items():
    print(f"{v:<15} {o:<6} {r.max_abs_diff:.1e}")

# %% [markdown]
# ## 2. Overlap: communicate while backward is still computing
#
# Backward produces gradients from the last layer to the first. The naive version waits until backward has finished,
# then all-reduces every gradient. DDP registers a hook on every parameter
# (`register_post_accumulate_grad_hook`) and launches an **asynchronous** all-reduce as soon as a gradient is final,
# so the last layers' gradients travel while the first layers are still being differentiated. A callback queued on
# the autograd engine waits for all of them before `backward()` returns — no extra call in the training loop.
#
# Many tiny all-reduces each pay a fixed latency (α in the α + β·bytes cost model), so DDP packs gradients into
# **buckets** (default 25 MiB) in *reverse* registration order — roughly the order backward produces them:

# %%
cfg = ch02_ddp.bench_config()
model = GPT(cfg)
for cap_mb in (None, 4.0, 25.0):
    if cap_mb is None:
        print(f"bucket_cap_mb=None: {len(trainable_parameters(model))} all-reduces per step (one per parameter)")
        continue
    buckets = make_buckets(trainable_parameters(model), int(cap_mb * 2**20))
    sizes = [sum(p.numel() * 4 for _, p in b) / 2**20 for b in buckets]
    print(f"bucket_cap_mb={cap_mb}: {len(buckets)} bucket(s) of {', '.join(f'{s:.2f}' for s in sizes)} MiB; "
          f"first bucket starts with {buckets[0][0][0]!r}")

# %%
# NBVAL_IGNORE_OUTPUT
tl = spawn(ch02_ddp.ddp_timelines, 2, kwargs=dict(bucket_cap_mb=2.0))[0]
colors = {"compute": "tab:blue", "comm": "tab:orange", "wait": "tab:gray"}
fig, ax = plt.subplots(figsize=(8, 2.8))
for row, key in enumerate(["naive", "overlapped"]):
    for kind, name, a, b in tl[key]:
        lane = row * 2 + (0 if kind == "compute" else 1)
        ax.barh(lane, (b - a) * 1e3, left=a * 1e3, color=colors[kind], edgecolor="white", height=0.8)
ax.set_yticks([0, 1, 2, 3], ["naive: compute", "naive: all-reduce", "DDP: compute", "DDP: all-reduce/wait"])
ax.set_xlabel("ms since the start of forward (rank 0)")
ax.set_title("naive (all-reduce after backward) vs DDP (async buckets during backward)")
plt.tight_layout()
plt.show()

# %%
ov = tl["overlapped"]
backward_end = max(b for kind, name, a, b in ov if kind == "compute")
first_comm = min(a for kind, name, a, b in ov if kind == "comm")
naive_backward_end = max(b for kind, name, a, b in tl["naive"] if kind == "compute")
naive_first_comm = min(a for kind, name, a, b in tl["naive"] if kind == "comm")
print("DDP starts communicating before backward ends:", first_comm < backward_end)
print("naive starts communicating only after backward ends:", naive_first_comm >= naive_backward_end)

# %% [markdown]
# ## 3. Step time vs bucket size
#
# Too small: many messages, each paying the latency. Too large: the one bucket is ready only when backward ends, so
# nothing overlaps. The sweet spot lies in between (timings vary from machine to machine — and on a 2-core laptop
# the gloo transport and backward compete for the same cores, which blunts the effect).

# %%
# NBVAL_IGNORE_OUTPUT
sweep = spawn(ch02_ddp.bucket_size_sweep, 2, kwargs=dict(bucket_sizes_mb=(None, 0.25, 1.0, 4.0, 16.0, 64.0)))[0]
for r in sweep:
    print(f"bucket_cap_mb={str(r['bucket_cap_mb']):<6} {r['n_buckets']:>3} buckets  {r['step_s'] * 1e3:7.1f} ms/step")
fig, ax = plt.subplots(figsize=(5, 3))
labels = ["per param" if r["bucket_cap_mb"] is None else str(r["bucket_cap_mb"]) for r in sweep]
ax.plot(labels, [r["step_s"] * 1e3 for r in sweep], marker="o")
ax.set_xlabel("bucket_cap_mb")
ax.set_ylabel("ms per step (2 ranks)")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 4. Our DDP vs torch DDP
#
# The same model, the same data, the same bucket size, timed in interleaved rounds in one run (the order rotates
# every round so noise hits every variant alike). `python -m course_lib.bench ddp` runs the same race from a terminal.
#
# <a id="unused-parameters"></a>
# torch's DDP expects, by default (`find_unused_parameters=False`), a gradient for every trainable parameter in
# every backward: its buckets are complete only then. If forward leaves a parameter unused, its gradient never
# arrives and DDP reports an error at the next iteration. `find_unused_parameters=True` makes DDP walk the autograd
# graph after each forward and mark such parameters ready, at an extra cost every step.

# %%
# NBVAL_IGNORE_OUTPUT
race = ch02_ddp.ddp_benchmark(2, bucket_cap_mb=4.0, rounds=5)
print(ch02_ddp.format_throughput(race))

# %% [markdown]
# ## 5. When more ranks are slower
#
# Strong scaling: a **fixed** global batch split over 1 and 2 ranks (no more ranks than cores — beyond that we would
# measure processes fighting for cores). With a tiny global batch (2 sequences of 8 tokens) the compute per rank is
# small, while every rank still all-reduces all 12.6 MB of gradients: adding a rank makes the step slower.

# %%
# NBVAL_IGNORE_OUTPUT
worlds = [w for w in (1, 2) if w <= os.cpu_count()]
scal = ch02_ddp.scaling(worlds, global_batch=2, config=ch02_ddp.bench_config(block_size=8))
for r in scal:
    print(f"world {r['world_size']}: {r['step_s'] * 1e3:6.1f} ms/step ({r['compute_s'] * 1e3:6.1f} ms without the "
          f"all-reduce), {r['tokens_per_s']:,.0f} tokens/s")

# %%
if len(scal) == 2:
    print("tiny global batch: 2 ranks slower than 1:", scal[1]["step_s"] > scal[0]["step_s"])

# %% [markdown]
# The exam trap "분산 학습은 항상 단일 GPU 학습보다 빠르다" is **X**. DDP pays off when each rank has enough compute
# to hide the all-reduce behind (big per-rank batches, big layers, fast links).
#
# ## 6. Feeding the ranks: `DistributedSampler` and `set_epoch`
#
# Each rank must see a **different** shard of every epoch, and the shards must be reshuffled every epoch — with the
# same permutation on every rank, so that they still do not overlap. `DistributedSampler(dataset, num_replicas=N,
# rank=r, shuffle=True, seed=s)` shuffles with a generator seeded by `seed + epoch`; call `sampler.set_epoch(epoch)`
# at the start of every epoch, or every epoch repeats epoch 0's order.

# %%
ds = SyntheticDataset(num_samples=12, seq_len=8, vocab_size=32, seed=0)
samplers = [DistributedSampler(ds, num_replicas=2, rank=r, shuffle=True, seed=0) for r in range(2)]
epochs = {}
for epoch in range(2):
    for s in samplers:
        s.set_epoch(epoch)
    epochs[epoch] = [list(s) for s in samplers]
    print(f"epoch {epoch}: rank 0 gets {epochs[epoch][0]}, rank 1 gets {epochs[epoch][1]}")
for epoch, (a, b) in epochs.items():
    print(f"epoch {epoch}: shards disjoint and together cover the dataset:",
          not set(a) & set(b) and sorted(a + b) == list(range(len(ds))))
print("reshuffled between epochs:", epochs[0][0] != epochs[1][0])

# %% [markdown]
# **Global batch and learning rate.** With per-rank batch b on N ranks, one optimizer step averages N·b samples:
# the *global* batch is N·b. Going from 1 to N ranks at fixed b therefore takes N× fewer steps per epoch with an N×
# larger batch. The usual remedy is the **linear scaling rule** (Goyal et al. 2017, "Accurate, Large Minibatch SGD"):
# multiply the learning rate by N, with a warm-up over the first steps; it works up to a point (for Adam a
# square-root rule is often used instead). Keeping the global batch fixed (b = B/N, as in section 5) changes nothing
# about the optimisation — only the speed.
#
# ## 7. Gradient accumulation with `no_sync()`
#
# To reach a large global batch with little memory, run k micro-batches and step once. Only the last backward needs
# to communicate: inside `with ddp.no_sync():` the hooks only accumulate local gradients, and the next synced backward
# all-reduces the sum once.

# %%
acc = spawn(ch02_ddp.accumulation_with_no_sync, 2, kwargs=dict(micro_batches=4))[0]
print(f"4 micro-batches per step: {acc.grad_allreduces} gradient all-reduces = one per bucket "
      f"({acc.buckets} buckets), not 4 × {acc.buckets}")
print("accumulated step equals one device on the whole batch (max|Δ| ≤ 1e-6):",
      acc.claims()["accumulated step equals one device on the whole batch (max|Δ| ≤ 1e-6)"])

# %% [markdown]
# ## 8. The same code on GPUs and under torchrun
#
# Nothing above names a device: rank functions put tensors on `course_lib.launch.device()`. On a machine with ≥ N
# GPUs, `spawn(..., backend="auto")` picks **nccl** and one GPU per rank, unchanged. To run on a cluster, put the
# training function in a module and start it with `torchrun --nnodes ... --nproc-per-node ... -m course_lib.launch
# mymodule:train` — the process group comes from torchrun's environment instead of `spawn`. Torch's own DDP is
# used the same way: `DistributedDataParallel(model)` after the process group exists.
#
# ## 9. Exercises
# (a) `exercises/ch02_ddp.py::allreduce_gradients` — average gradients after backward; (b) `BucketedReducer` —
# buckets + async all-reduce launched from gradient hooks.

# %%
from course_lib.check import check

check("allreduce_gradients")

# %%
check("bucketed_reducer")

# %%
check("allreduce_gradients", package="solutions")

# %%
check("bucketed_reducer", package="solutions")

# %% [markdown]
# ## 10. O/X quiz

# %%
from course_lib.quiz import quiz

quiz(2)

# %% [markdown]
# ## Summary
# - Data parallelism is exact: naive, our DDP (per parameter and bucketed) and torch DDP all reproduce one device on
#   the full batch (SGD ≤ 1e-6, AdamW ≤ 1e-5 after 10 steps).
# - DDP overlaps: its all-reduces start before backward ends (the timeline).
# - Our bucketed DDP runs at about torch DDP's speed (the race above prints the ratio measured on this machine).
# - With a tiny global batch, 2 ranks are slower than 1: communication does not shrink with N.
# - `DistributedSampler` + `set_epoch` gives disjoint, reshuffled shards; `no_sync` makes accumulation cost one
#   all-reduce per bucket per step.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
