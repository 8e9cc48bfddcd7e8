# %% [markdown]
# # 03 · ZeRO-1/2/3: shard the model states
#
# **What you will learn**
# - why data parallelism wastes memory: every rank keeps all **16Ψ** bytes of model states;
# - ZeRO's three stages (Rajbhandari et al. 2019, arXiv:1910.02054): shard the optimizer state (1), then the
#   gradients (2), then the parameters themselves (3) — measured per rank on real ranks, against the formulas;
# - what it costs in communication (≈2Ψ for stages 1–2, like DDP; ≈3Ψ for stage 3);
# - that ZeRO shards **model states, not activations**;
# - that every stage is still exactly one-device training (with clipping and checkpoint/resume);
# - how the libraries do it: torch's `ZeroRedundancyOptimizer` and DeepSpeed, on the same model.
#
# Read along: `course_lib/zero.py` (our ZeRO), `course_lib/experiments/ch03_libraries.py` (the libraries, measured).

# %%
# NBVAL_IGNORE_OUTPUT
import time

_t_notebook = time.perf_counter()
import matplotlib.pyplot as plt

from course_lib.experiments import ch03_zero
from course_lib.launch import spawn

# %% [markdown]
# ## 1. The memory problem
#
# Mixed-precision Adam keeps, per parameter: a 16-bit weight (2 bytes) and gradient (2), plus an fp32 master weight,
# momentum and variance (K = 12 bytes): **16Ψ** — on *every* data-parallel rank. For Ψ = 7.5B that is 120 GB per
# GPU before a single activation. (CPU runs below are fp32: 4 + 4 + 8 = 16 bytes per parameter too.)
#
# | stage | sharded over N ranks | model states per rank (mixed, K=12) | fp32 Adam (what we measure) |
# |---|---|---|---|
# | 0 (DDP) | nothing | 16Ψ | 16Ψ |
# | 1 | optimizer state | 4Ψ + 12Ψ/N | 8Ψ + 8Ψ/N |
# | 2 | + gradients | 2Ψ + 14Ψ/N | 4Ψ + 12Ψ/N |
# | 3 | + parameters | 16Ψ/N | 16Ψ/N |
#
# How each stage works (`course_lib/zero.py`):
# - **Stage 1**: parameters live in one flat buffer, padded to a multiple of N and split evenly. After backward the
#   flat gradient is **reduce-scattered** (each rank gets the averaged gradient of its 1/N), each rank steps only its
#   partition (so it keeps only that partition's Adam state), and the updated partitions are **all-gathered**.
#   Reduce-scatter + all-gather = one all-reduce: the same bytes as DDP.
# - **Stage 2**: the reduce-scatter happens *during* backward, bucket by bucket, and each rank keeps only its
#   partition of the gradient.
# - **Stage 3**: each rank keeps only a shard of every parameter; a layer's full weights are all-gathered just before
#   its forward, freed after it, all-gathered again before its backward, and its gradients reduce-scattered into the
#   shards. One extra all-gather per step: 3Ψ instead of 2Ψ.

# %% [markdown]
# ## 2. Measured on real ranks
#
# Every stage trains the same tiny GPT (bias-free, tied embeddings, Ψ ≈ 129k, deliberately odd tensor sizes so
# padding happens) for 3 AdamW steps at world sizes 2 and 4. After the last step, before `zero_grad`, each rank sums
# `untyped_storage().nbytes()` over every unique storage reachable from its parameters, gradients, optimizer state
# and the wrapper's own buffers.

# %%
def all_stages():
    return [ch03_zero.zero_stage_report(stage) for stage in range(4)]


reports = {world: spawn(all_stages, world) for world in (2, 4)}
print(f"Ψ = {reports[2][0][0]['psi']:,} parameters")
print(f"{'N':>2} {'stage':>5} {'Ψ_pad':>8} {'params':>9} {'grads':>9} {'optim':>9} {'measured':>10} {'formula':>10} {'ratio':>7}")
for world, per_rank in reports.items():
    for r in per_rank[0]:
        m = r["measured"]
        print(f"{world:>2} {r['stage']:>5} {r['psi_pad']:>8,} {m['params']:>9,} {m['grads']:>9,} {m['optimizer']:>9,} "
              f"{m['total']:>10,} {r['formula']:>10,.0f} {r['ratio']:>7.4f}")

# %%
ok = all(abs(r["ratio"] - 1) <= 0.01 for per_rank in reports.values() for rank in per_rank for r in rank)
print("every rank, every stage: measured / formula within 1.00 ± 0.01:", ok)
print("(the tiny excess: AdamW's 4-byte step counter per parameter tensor, which the formula ignores)")

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
for ax, (world, per_rank) in zip(axes, reports.items()):
    rows = per_rank[0]
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "optimizer"):
        vals = [r["measured"][part] / 1e6 for r in rows]
        ax.bar([f"stage {r['stage']}" for r in rows], vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot([f"stage {r['stage']}" for r in rows], [r["formula"] / 1e6 for r in rows], "k_", markersize=30,
            label="formula")
    ax.set_title(f"N = {world} ranks (per rank)")
    ax.set_ylabel("MB of model states")
axes[0].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Communication
#
# From `CommLog`, the bytes one rank sends per step in a ring (tags "grad" and "param"), divided by the prediction
# (N−1)/N · c · Ψ_pad · 4 bytes with c = 2 (stages 0–2: one all-reduce, or reduce-scatter + all-gather) and c = 3
# (stage 3: the extra all-gather before backward).

# %%
for world, per_rank in reports.items():
    for r in per_rank[0]:
        ops = ", ".join(f"{row['op']}[{row['tag']}]×{row['calls']}" for row in r["comm"] if row["tag"] in ("grad", "param"))
        print(f"N={world} stage {r['stage']}: sent / predicted = {r['comm_ratio']:.4f}   ({ops})")

# %% [markdown]
# Every stage hits its prediction, stage 3 included. That takes care with the tied embedding/output matrix, which the
# model uses twice in forward: our `Zero3` gathers parameters by *unit* (each transformer block, plus a root unit with
# the embeddings, the tied output layer and the final LayerNorm), one all-gather per unit and pass, so the tied matrix
# travels once per gather like every other weight. A textbook ZeRO-3 that gathers each parameter at each *use*
# (`Zero3(model, unit="param")`: twice in forward, twice in backward, its gradient reduced once) sends more; with
# Ψ_tied the tied weight's size, the predicted ratio is 1 + 2Ψ_tied/(3Ψ). Measured at N = 2:

# %%
cfg = ch03_zero.zero_config()
psi_tied = cfg.vocab_size * cfg.d_model
per_param = spawn(ch03_zero.zero_stage_report, 2, kwargs=dict(stage=3, zero3_unit="param"))[0]
expected = 1 + 2 * psi_tied / (3 * per_param["psi"])
print(f"Zero3(unit='param'), N=2: sent / 3Ψ predicted = {per_param['comm_ratio']:.4f} vs 1 + 2Ψ_tied/(3Ψ) = "
      f"{expected:.4f}: {abs(per_param['comm_ratio'] - expected) < 0.01}")
print("every stage (per-unit Zero3 at stage 3) within 1.00 ± 0.01:",
      all(abs(r["comm_ratio"] - 1) <= 0.01 for pr in reports.values() for r in pr[0]))

# %% [markdown]
# ## 4. Activations are not sharded
#
# ZeRO partitions *model states*. Each rank still runs forward and backward on its own micro-batch, so it holds that
# micro-batch's activations in full, at every stage (bytes saved for backward and still held at the end of forward):

# %%
for world, per_rank in reports.items():
    acts = [r["activation_bytes"] for r in per_rank[0]]
    print(f"N={world}: activation bytes per rank at stages 0/1/2/3: {', '.join(f'{a:,}' for a in acts)}; "
          f"all equal to DDP's: {len(set(acts)) == 1}")

# %% [markdown]
# (Stage 3 saves its freshly gathered weights for backward too, but frees them right after each layer and gathers them
# again for backward, so they are not held; the meter counts what is still held at the end of forward.) To shrink
# activations you need other tools: activation checkpointing, smaller micro-batches, sequence/tensor/pipeline
# parallelism (chapters 05–06).
#
# ## 5. Still exactly one device
#
# Each stage's final weights against one device trained on the full batches (AdamW with weight decay):

# %%
for world, per_rank in reports.items():
    worst = max(r["max_abs_diff"] for rank in per_rank for r in rank)
    print(f"N={world}: max|Δparam| over stages and ranks ≤ 1e-5: {worst <= 1e-5}")

# %% [markdown]
# **Gradient clipping** needs the norm of the *whole* gradient, but each rank holds only a partition: each rank
# sums the squares of its partition, one scalar all-reduce adds them up. **Checkpointing** saves every partition's
# optimizer state; resuming from it continues exactly as if never interrupted.

# %%
clip = {stage: spawn(ch03_zero.zero_clip_and_resume, 2, kwargs=dict(stage=stage))[0] for stage in (1, 2)}
for stage, r in clip.items():
    norms_ok = all(abs(a - b) <= 1e-5 * b for a, b in zip(r["norms"], r["reference_norms"]))
    print(f"stage {stage}: global grad norm = torch.nn.utils.clip_grad_norm_ on one device: {norms_ok}; "
          f"clipped training = one device (≤ 1e-5): {r['max_abs_diff_uninterrupted'] <= 1e-5}; "
          f"resumed = uninterrupted, bit for bit: {r['resumed_equals_uninterrupted']}")

# %% [markdown]
# ## 6. The libraries
# ### torch's `ZeroRedundancyOptimizer` (ZeRO-1)
#
# PyTorch ships ZeRO-1 as `torch.distributed.optim.ZeroRedundancyOptimizer`. It partitions at **parameter**
# granularity: whole tensors are assigned to ranks (greedily, largest first), never split. When one tensor is a large
# share of the model — here a 2048-token embedding — the ranks' optimizer states are unequal, and the largest sets the
# memory you must provision. Our flat, padded buffer splits evenly to within N−1 elements.

# %%
from course_lib.experiments import ch03_libraries

z1 = spawn(ch03_libraries.torch_zero1_memory, 2)[0]
print(ch03_libraries.zero1_table(z1))
print(f"parameter-granular partition is imbalanced (max/mean > 1.05): {z1['imbalance'] > 1.05}")

# %% [markdown]
# ### DeepSpeed ZeRO, stages 0–3, on the same model
#
# DeepSpeed (`deepspeed.initialize` with `zero_optimization.stage`) runs here on CPU with gloo, reusing the process
# group `spawn` created. Its first use compiles a small C++ op (cached in `.cache/torch_extensions`). We count the same
# bytes as for our ZeRO. The table decomposes DeepSpeed's per-rank bytes: the course formula, plus an **fp32 master
# partition** it keeps even for an fp32 model (4Ψ_pad/N, the "master weights" of mixed precision), plus gradients
# waiting in buckets at the moment measured (the peak of backward), the Adam step counter, and the remainder.

# %%
# NBVAL_IGNORE_OUTPUT
ds_ok, ds_reason = ch03_libraries.deepspeed_available()
print(ds_reason)
if ds_ok:
    ds = spawn(ch03_libraries.deepspeed_zero_stages, 2, kwargs=dict(stages=(0, 1, 2, 3), config=ch03_zero.zero_config()))[0]
    print(ch03_libraries.deepspeed_table(ds))

# %%
if ds_ok:
    for r in ds[1:]:
        print(f"stage {r['stage']}: DeepSpeed keeps an fp32 master partition of exactly 4Ψ_pad/N bytes: "
              f"{r['fp32_master'] == 4 * r['psi_pad'] // r['world_size']}; "
              f"nothing unexplained (|rest| ≤ 32 B): {abs(r['rest']) <= 32}")
    print(f"stage 0 holds 16Ψ (+ Adam step counters): {ds[0]['measured']['total'] - 16 * ds[0]['psi'] == ds[0]['adam_step']}")
else:
    print("DeepSpeed cells skipped:", ds_reason)

# %% [markdown]
# So DeepSpeed stages 1/2 hold ≈ formula + 4Ψ/N (its fp32 master partition; for a 16-bit model that copy *is* the
# formula's master weights) and pad partitions for alignment; stage 3 likewise holds 20Ψ/N once backward is done.
# DeepSpeed's answer to "the model does not fit even sharded" is **ZeRO-Offload**: `"offload_optimizer":
# {"device": "cpu"}` keeps the optimizer state in CPU memory and runs the Adam step there (a fused C++ `cpu_adam`), and
# `"offload_param"` (stage 3) parks the parameters there too, trading PCIe traffic for GPU memory.
# <a id="offload"></a>
# **ZeRO-Infinity** extends the offload to NVMe (SSD). ZeRO is one part of DeepSpeed: it also provides pipeline
# parallelism, tensor parallelism (AutoTP) and sequence parallelism (DeepSpeed-Ulysses).
#
# ### Memory calculator
# The paper's example — Ψ = 7.5B, N = 64, mixed precision, K = 12 — per GPU (decimal GB, model states only):

# %%
from course_lib.viz import zero_memory_calculator

zero_memory_calculator()

# %% [markdown]
# ## 7. Exercises
# (a) `exercises/ch03_zero.py::Zero1Step.step` — reduce-scatter the flat gradient, step your shard, all-gather the
# parameters. (b) `ShardedLinear` — keep a shard of a Linear's weight; gather it around forward and backward, free it
# in between, reduce-scatter the weight gradient.

# %%
from course_lib.check import check

check("zero1_step")

# %%
check("sharded_linear")

# %%
check("zero1_step", package="solutions")

# %%
check("sharded_linear", package="solutions")

# %% [markdown]
# ## 8. O/X quiz

# %%
from course_lib.quiz import quiz

quiz(3)

# %% [markdown]
# ## Summary
# - Per-rank model states measured on real ranks match 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N and 16Ψ/N within 1 % at N = 2 and 4.
# - Communication: stages 0–2 send exactly one all-reduce's worth (2Ψ); stage 3 one all-gather more (3Ψ) when it
#   gathers by unit; a per-use, per-parameter gather pays the tied weight's second use on top.
# - Activations are not sharded.
# - Every stage trains exactly like one device, with clipping and checkpoint/resume.
# - The paper's 7.5B / 64-GPU example: 120 / 31.4 / 16.6 / 1.9 GB per GPU.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
