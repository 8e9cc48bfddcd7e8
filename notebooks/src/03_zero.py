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
# - how the libraries do it: torch's `ZeroRedundancyOptimizer` and DeepSpeed, on the same model;
# - what each stage costs in **time** and in **peak** memory (not only what is held after the step), and how the α–β
#   model of chapter 00 predicts stage 3's extra all-gathers.
#
# **What you need**: chapters 00 (collectives, α–β model) and 01 (16Ψ, activations); chapter 02's DDP helps.
# **Expected runtime**: about 2 minutes on a 2-core laptop (DeepSpeed's first run compiles a C++ op: +30 s once).
#
# Read along: `course_lib/zero.py` (our ZeRO), `course_lib/experiments/zero_libraries.py` (the libraries, measured).

# %%
# NBVAL_IGNORE_OUTPUT
import time

_t_notebook = time.perf_counter()
import matplotlib.pyplot as plt

from course_lib.experiments import zero
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
    return [zero.zero_stage_report(stage) for stage in range(4)]


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
from course_lib import viz

fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
for ax, (world, per_rank) in zip(axes, reports.items()):
    rows = per_rank[0]
    viz.stacked_bars({f"stage {r['stage']}": {k: r["measured"][k] for k in ("params", "grads", "optimizer")}
                      for r in rows}, ax=ax, unit="MB", title=f"N = {world} ranks: model states per rank, after a step")
    ax.plot([f"stage {r['stage']}" for r in rows], [r["formula"] / 1e6 for r in rows], "k_", markersize=30,
            label="formula")
    ax.set_ylabel("MB per rank")
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
# Stages 1 and 2 send the same bytes; they differ in **when**. Below, one more step per stage at N = 2 with small
# buckets (`bucket_cap_mb=0.05`, so the flat buffer is cut into several buckets), its collectives counted per
# phase of the step (`zero.zero_stage_profile`, which also times the stages and tracks the peak memory, §3b):

# %%
prof = spawn(zero.zero_stage_profile, 2, kwargs=dict(micro_batch=2, rounds=5))[0]
print(f"{'stage':>5} | {'forward':<22}| {'backward':<32}| {'step':<30}")
for st in range(4):
    c = prof["calls"][st]
    cell = {ph: ", ".join(f"{op} ×{k}" for op, k in c[ph].items()) or "—" for ph in ("forward", "backward", "step")}
    print(f"{st:>5} | {cell['forward']:<22}| {cell['backward']:<32}| {cell['step']:<30}")
nb2 = prof["buckets_stage2"]
print(f"stage 1 reduce-scatters after backward, in step(): {prof['calls'][1]['backward'] == {}}")
print(f"stage 2 reduce-scatters during backward, bucket by bucket ({nb2} buckets → {nb2} reduce-scatters): "
      f"{prof['calls'][2]['backward'] == {'reduce_scatter': nb2} and nb2 > 1}")
print(f"stage 3 all-gathers each unit in forward and again in backward ({len(prof['units'])} units): "
      f"{prof['calls'][3]['forward'].get('all_gather') == prof['calls'][3]['backward'].get('all_gather') == 3}")

# %% [markdown]
# Every stage hits its prediction, stage 3 included. That takes care with the tied embedding/output matrix, which the
# model uses twice in forward: our `Zero3` gathers parameters by *unit* (each transformer block, plus a root unit with
# the embeddings, the tied output layer and the final LayerNorm), one all-gather per unit and pass, so the tied matrix
# travels once per gather like every other weight. A textbook ZeRO-3 that gathers each parameter at each *use*
# (`Zero3(model, unit="param")`: twice in forward, twice in backward, its gradient reduced once) sends more; with
# Ψ_tied the tied weight's size, the predicted ratio is 1 + 2Ψ_tied/(3Ψ). Measured at N = 2:

# %%
cfg = zero.zero_config()
psi_tied = cfg.vocab_size * cfg.d_model
per_param = spawn(zero.zero_stage_report, 2, kwargs=dict(stage=3, zero3_unit="param"))[0]
expected = 1 + 2 * psi_tied / (3 * per_param["psi"])
print(f"Zero3(unit='param'), N=2: sent / 3Ψ predicted = {per_param['comm_ratio']:.4f} vs 1 + 2Ψ_tied/(3Ψ) = "
      f"{expected:.4f}: {abs(per_param['comm_ratio'] - expected) < 0.01}")
print("every stage (per-unit Zero3 at stage 3) within 1.00 ± 0.01:",
      all(abs(r["comm_ratio"] - 1) <= 0.01 for pr in reports.values() for r in pr[0]))

# %% [markdown]
# <a id="time-and-peak"></a>
# ## 3b. Time and peak memory per stage
#
# After the step is not the worst moment. `zero_stage_profile` samples what a rank holds after every module's
# forward and as every gradient is accumulated, split into **model states**, **transient** communication memory
# (stage 2's gradient staging buckets, filling or in flight in a reduce-scatter; stage 3's gathered full weights)
# and **activations** still held; the bars are each stage's peak (N = 2, micro-batch 2 per rank).

# %%
peak = {f"stage {st}": max((prof["peak"][st][ph] for ph in ("forward", "backward", "step")), key=lambda d: d["total"])
        for st in range(4)}
after = {f"stage {st}": prof["peak"][st]["after step"]["model states"] for st in range(4)}
ax = viz.stacked_bars({k: {c: v[c] for c in ("model states", "transient", "activations")} for k, v in peak.items()},
                      unit="MB", title="N = 2: peak bytes per rank during one step (model states after the step: ×)")
ax.plot(list(after), [v / 1e6 for v in after.values()], "kx", markersize=10, label="model states after the step")
ax.set_ylabel("MB per rank")
plt.tight_layout()
plt.show()
units = {u["name"]: u["gathered_bytes"] for u in prof["units"]}
g3 = max(prof["peak"][3][ph]["transient"] for ph in ("forward", "backward"))
print(f"{'stage':>5} {'peak':>10} {'model states':>13} {'transient':>10} {'activations':>12} {'after step':>11}")
for k, v in peak.items():
    print(f"{k[-1]:>5} {v['total']:>10,} {v['model states']:>13,} {v['transient']:>10,} {v['activations']:>12,} "
          f"{after[k]:>11,}")
print(f"stage 2: the staging buckets appear only during backward: "
      f"{prof['peak'][2]['backward']['transient'] > 0 and prof['peak'][2]['after step']['transient'] == 0}")
k3, rest3 = divmod(g3 - units["(root)"], units["blocks.0"])
print(f"stage 3: gathered at most the root unit ({units['(root)']:,} bytes) + one block in use + one prefetched "
      f"({units['blocks.0']:,} bytes each): {rest3 == 0 and 1 <= k3 <= 2}")

# %% [markdown]
# Stage 2's transient bar is its staging: as each gradient is ready it is copied into its bucket's staging buffer
# and the full `.grad` is dropped; when a bucket is complete its reduce-scatter starts. Our `ZeroOptimizer` waits
# for all of them at the end of backward, so the staging buffers of every bucket are alive together just before
# that wait — on this tiny model, where activations are mostly freed by then, stage 2's peak is about as high as
# stage 1's. Stage 3's transient is the root unit (embeddings and final LayerNorm, used at both ends of the
# forward) plus the block in use and, with prefetch, the next one already being gathered: at most two blocks at
# once, however many blocks the model has (this tiny one has only two).
#
# **Time.** Each stage's step, every stage once per round, 5 interleaved rounds (median, max over ranks):

# %%
# NBVAL_IGNORE_OUTPUT
from course_lib.experiments import collectives

for st in range(4):
    print(f"stage {st}: {prof['step_s'][st] * 1e3:6.1f} ms per step ({prof['step_s'][st] / prof['step_s'][0]:.2f}× DDP)")
unit_sizes = sorted(set(units.values()))
rows = spawn(collectives.bandwidth_benchmark, 2, kwargs=dict(
    sizes_bytes=(2**10, 2**12, *unit_sizes, 2**20, 2**22), ops=("all_gather",), iters=2, warmup=1))[0]
fit = collectives.fit_alpha_beta([r for r in rows if r["bytes"] not in unit_sizes])  # the units held out
timed = {r["bytes"]: r["time_s"] for r in rows}
extra = sum(fit.predict("all_gather", b, 2) for b in units.values())
measured_extra = sum(timed[b] for b in units.values())
print(f"α–β (all-gather on 2 ranks, fitted without the unit sizes): α = {fit.alpha_s['all_gather'] * 1e6:.0f} µs, "
      f"β = {fit.beta_bytes_per_s['all_gather'] / 1e9:.2f} GB/s")
print(f"stage 3's extra all-gathers (one per unit in backward, {len(units)} units): predicted {extra * 1e3:.2f} ms, "
      f"the same all-gathers timed alone {measured_extra * 1e3:.2f} ms (ratio {extra / measured_extra:.2f})")
print(f"for context, stage 3 − DDP step time: {(prof['step_s'][3] - prof['step_s'][0]) * 1e3:.2f} ms")

# %% [markdown]
# The prediction is for the three all-gathers stage 3 adds in backward (one per unit); they were timed alone, at
# exactly those sizes, in the same sweep the fit left them out of. The step times themselves mix more than that:
# here stages 1 and 2 use 10 small buckets (so that §3 shows bucket-by-bucket reduce-scatters), and each of their
# 20 collectives pays α; stage 3 issues 9 collectives per step, DDP 15 per-parameter all-reduces. On a model this
# small almost every collective is α, not bytes/β — the step time counts calls more than bytes.
#
# ## 4. Activations are not sharded
#
# ZeRO partitions *model states*. Each rank still runs forward and backward on its own micro-batch, so it holds that
# micro-batch's activations in full, at every stage (bytes saved for backward and still held at the end of forward).
# With the global batch fixed at 8, the micro-batch is 8/N: 4 sequences per rank at N = 2, 2 at N = 4 — that, not
# ZeRO, is why the N = 4 row is half the N = 2 row.

# %%
for world, per_rank in reports.items():
    acts = [r["activation_bytes"] for r in per_rank[0]]
    print(f"N={world} (micro-batch {8 // world}): activation bytes per rank at stages 0/1/2/3: "
          f"{', '.join(f'{a:,}' for a in acts)}; all equal to DDP's: {len(set(acts)) == 1}")

# %% [markdown]
# At an **equal per-rank micro-batch** (2 sequences) the activations are the same at N = 2 and N = 4 (the N = 2 run is
# the profile above; weights excluded, each rank's micro-batch its own tensor):

# %%
prof4 = spawn(zero.zero_stage_profile, 4, kwargs=dict(micro_batch=2, rounds=0))[0]
a2, a4 = prof["activation_bytes"], prof4["activation_bytes"]
print(f"micro-batch 2: N=2 {a2[0]:,} bytes, N=4 {a4[0]:,} bytes; equal at every stage: "
      f"{all(a2[st] == a4[st] for st in range(4))}")

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
clip = {stage: spawn(zero.zero_clip_and_resume, 2, kwargs=dict(stage=stage))[0] for stage in (1, 2)}
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
from course_lib.experiments import zero_libraries

z1 = spawn(zero_libraries.torch_zero1_memory, 2)[0]
print(zero_libraries.zero1_table(z1))
print(f"parameter-granular partition is imbalanced (max/mean > 1.05): {z1['imbalance'] > 1.05}")

# %% [markdown]
# ### DeepSpeed ZeRO, stages 0–3, on the same model
#
# DeepSpeed (`deepspeed.initialize` with `zero_optimization.stage`) runs here on CPU with gloo, reusing the process
# group `spawn` created. Its first use compiles a small C++ op (cached in `.cache/torch_extensions`). We count the same
# bytes as for our ZeRO, at the peak of a backward pass. The table's columns, per rank:
# - **formula**: the course's fp32 formula on DeepSpeed's padded count Ψ_pad; **measured**: model-state bytes held at
#   the peak (buffers excluded); **ratio** = measured / formula;
# - **fp32 master**: the fp32 copy of this rank's weight slice DeepSpeed keeps even for an fp32 model (4Ψ_pad/N —
#   the "master weights" of mixed precision);
# - **overhang** (stage 2): DeepSpeed's gradient partition buffer spans whole tensors at both ends of this rank's
#   slice, so it holds a little more than Ψ/N gradients;
# - **in-flight**: full gradients waiting in a bucket to be reduced at that moment (stages 2/3);
# - **step**: Adam's 4-byte step counters; **rest**: whatever none of the above explains (0 here);
# - **buffers**: working memory that is not a model state — the reduction bucket, stage 3's gathered weights.

# %%
# NBVAL_IGNORE_OUTPUT
ds_ok, ds_reason = zero_libraries.deepspeed_available()
print(ds_reason)
if ds_ok:
    ds = spawn(zero_libraries.deepspeed_zero_stages, 2, kwargs=dict(stages=(0, 1, 2, 3), config=zero.zero_config()))[0]
    print(zero_libraries.deepspeed_table(ds))

# %%
if ds_ok:
    for r in ds[1:]:
        print(f"stage {r['stage']}: DeepSpeed keeps an fp32 master partition of exactly 4Ψ_pad/N bytes: "
              f"{r['fp32_master'] == 4 * r['psi_pad'] // r['world_size']}; "
              f"nothing unexplained (|rest| ≤ 32 B): {abs(r['rest']) <= 32}")
    print(f"stage 0 holds 16Ψ (+ Adam step counters): {ds[0]['measured']['total'] - 16 * ds[0]['psi'] == ds[0]['adam_step']}")
    h3 = ds[3]["held"]
    held3 = sum(h3[k] for k in ("params", "grads", "master", "optimizer"))
    print(f"stage 3 between backward and step holds 20Ψ_pad/N = {20 * ds[3]['psi_pad'] // 2:,} bytes (16Ψ/N + the "
          f"4Ψ/N fp32 master): measured {held3:,} within 1.00 ± 0.01: {abs(held3 / (20 * ds[3]['psi_pad'] / 2) - 1) <= 0.01}")
else:
    print("DeepSpeed cells skipped:", ds_reason)

# %% [markdown]
# **Ours and DeepSpeed's at the same moment.** The same model at N = 2, both measured after backward and before the
# optimizer step (DeepSpeed's `held` snapshot; ours from the profile above), model states only:

# %%
# NBVAL_IGNORE_OUTPUT
if ds_ok:
    print(f"{'stage':>5} {'ours':>10} {'DeepSpeed':>10} {'DS − ours':>10} {'4Ψ_pad/N':>9}")
    for r in ds:
        st, h = r["stage"], r["held"]
        theirs = sum(h[k] for k in ("params", "grads", "master", "optimizer"))
        ours = prof["peak"][st]["after backward"]["model states"]
        print(f"{st:>5} {ours:>10,} {theirs:>10,} {theirs - ours:>10,} {4 * r['psi_pad'] // 2 if st else 0:>9,}")

# %% [markdown]
# Stage 0 is identical. In stages 2 and 3 DeepSpeed holds ours + its fp32 master partition (4Ψ_pad/N; stage 2 adds
# its few-KB gradient overhang). Stage 1 differs in *when* gradients shrink: DeepSpeed's ZeRO-1 reduces them at the
# end of `engine.backward` and keeps only its partition (4Ψ/N), while ours keeps the full flat gradient (4Ψ) until
# `step()` — at N = 2 that saving (2Ψ) happens to equal the master copy it adds (4Ψ/N = 2Ψ), so the totals match.

# %% [markdown]
# So DeepSpeed stages 1/2 hold ≈ formula + 4Ψ/N (its fp32 master partition; for a 16-bit model that copy *is* the
# formula's master weights) and pad partitions for alignment; stage 3 likewise holds 20Ψ/N once backward is done
# (printed above). At the same moment the difference to our ZeRO is that master copy plus padding (the table above).
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
# (a) `exercises/zero.py::Zero1Step.step` — reduce-scatter the flat gradient, step your shard, all-gather the
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
#   gathers by unit; a per-use, per-parameter gather pays the tied weight's second use on top. Stage 2 reduce-scatters
#   during backward, bucket by bucket; stage 1 after it.
# - Peaks are above the after-step numbers: stage 2 by its staging buckets, stage 3 by one gathered block + root.
# - Activations are not sharded: equal at an equal per-rank micro-batch, whatever N.
# - Every stage trains exactly like one device, with clipping and checkpoint/resume.
# - The paper's 7.5B / 64-GPU example: 120 / 31.4 / 16.6 / 1.9 GB per GPU.
# - This run's numbers:

# %%
# NBVAL_IGNORE_OUTPUT
print("peak bytes per rank (N=2, micro-batch 2): " + ", ".join(f"{k} {v['total']:,}" for k, v in peak.items()))
print("step time (ms): " + ", ".join(f"stage {st} {prof['step_s'][st] * 1e3:.1f}" for st in range(4)))
print(f"stage 3's extra all-gathers: α–β predicts {extra * 1e3:.2f} ms, timed alone {measured_extra * 1e3:.2f} ms")
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
