# %% [markdown]
# # 10 · Review: the techniques side by side, choosing a layout, DeepSpeed and Horovod in context, the final exam
#
# **What you will learn**
# - the techniques of chapters 02–06 once more, **side by side**: what each splits, what each rank holds, what it
#   sends. Run again here on 2 real ranks and set against the formulas: our DDP and ZeRO-1/2/3 (bytes held and
#   sent, weights against one device), torch's FSDP2 (bytes held and sent), our Megatron TP with and without
#   sequence parallelism (weight bytes, all-reduces per layer, activation bytes) and a 2-stage pipeline's bubble
#   (GPipe and 1F1B); FSDP2's and TP's equality with one device is checked in chapters 04 and 06, and chapter 07's
#   context and expert parallelism are not re-run;
# - the pipeline **bubble** once more, and **3D parallelism**: tensor parallel inside a node, pipeline across nodes,
#   data parallel (ZeRO) for the rest;
# - a **strategy chooser**, `course_lib.plan`: model size and cluster in, per-GPU memory of every layout and a
#   recommendation with its reasons out — checked against the ZeRO paper and against the bytes measured here;
# - where **DeepSpeed** (Microsoft) and **Horovod** (Uber) sit next to what you built, both run for real;
# - the **final O/X exam** over all chapters.
#
# **What you need**: chapters 00–07 (08–09 for the Ray references). Horovod is built once per machine by
# `make horovod` (`make test` does it; a few minutes, the first time only); without it, its cell says how to build
# it.
#
# **Stored build:** 35 s on 2 cores (0% of them busy just before it started).
#
# DeepSpeed's C++ op is compiled once and cached (notebook 03 usually did it).
#
# Read along: `course_lib/plan.py` (the chooser), `course_lib/experiments/review.py` (what this notebook runs),
# `course_lib/experiments/horovod.py` (Horovod beside our DDP).

# %% tags=["nbval-ignore-output"]
import time

_t_notebook = time.perf_counter()
from course_lib import plan
from course_lib.experiments import review as R
from course_lib.formulas import pipeline_bubble, pipeline_bubble_megatron
from course_lib.launch import spawn

# %% [markdown]
# <a id="comparison"></a>
# ## 1. The techniques, side by side
#
# Ψ parameters, N data-parallel ranks, fp32 AdamW (what the CPU runs measure; the paper's mixed-precision numbers
# are in §4):
#
# | technique | splits | model-state bytes per rank | elements sent per rank and step (× 4 B fp32, × (N−1)/N ring) | what grows |
# |---|---|---|---|---|
# | DDP (ch. 02) | nothing: N replicas | 16Ψ | 2Ψ (one all-reduce, overlapped with backward) | — |
# | ZeRO-1 (ch. 03) | optimizer state | 8Ψ + 8Ψ/N | 2Ψ (reduce-scatter + all-gather) | — |
# | ZeRO-2 (ch. 03) | + gradients | 4Ψ + 12Ψ/N | 2Ψ | — |
# | ZeRO-3 / FSDP (ch. 03–04) | + parameters | 16Ψ/N | 3Ψ (one more all-gather, in backward) | calls |
# | PP (ch. 05) | layers into p stages | ≈ 16Ψ/p | boundary activations, point-to-point | bubble (p−1)/(m+p−1) |
# | TP (ch. 06) | each layer's matrices | ≈ 16Ψ/t | 2 + 2 all-reduces of b·s·h per layer | traffic per token |
#
# Memory runs one way and traffic the other: DDP holds the most and ZeRO-3 the least, while DDP, ZeRO-1 and
# ZeRO-2 send the same 2Ψ and ZeRO-3 (≈ FSDP's full sharding: the same idea in another library) sends 3Ψ. None of
# them shards **activations** — each rank still runs its whole micro-batch. TP does: inside its column/row regions
# each rank computes (and saves for backward) only its heads and its slice of the MLP, while the LayerNorm inputs,
# the residual stream and the loss's inputs stay whole on every rank; sequence parallelism splits those along s
# too. A smaller micro-batch or recompute shrink activations on any layout.
#
# Measured again now, at N = 2, by the chapters' own experiments (`R.review_suite`: `zero`, `fsdp`,
# `pipeline`, `tensor_parallel`); each "measured ÷ formula" column divides what was measured by what the formula
# gives (the legend under the table spells out its symbols):

# %%
suite = spawn(R.review_suite, 2, timeout=600)[0]
rows = R.comparison_rows(suite)
print(R.comparison_table(rows, suite["world_size"]))

# %% [markdown]
# The same ratios checked, one row each (`R.review_result(suite, part="bytes")`): memory and traffic against the
# formulas (chapter 03 prints the ZeRO stages' bytes themselves), memory falling from DDP to ZeRO-3, FSDP2's bytes
# against our ZeRO-3's, and the activations — bytes saved for backward and still held at the end of forward, per
# rank — at every ZeRO stage (micro-batch 2) and under TP and TP + SP (chapter 06's step, 8 sequences, t = 2):

# %%
mem = {r["technique"]: r["memory_ratio"] for r in rows}
print(R.review_result(suite, part="bytes"))
acts = suite["profile"]["activation_bytes"]
one_act = suite["tp_one_device_activation_bytes"]
tp_act, sp_act = suite["tp"]["activation_bytes"], suite["sp"]["activation_bytes"]
print(
    f"\nactivations per rank: ZeRO stages 0–3 all {acts[0]:,} B (nothing sharded); TP t = 2 "
    f"{1 - tp_act / one_act:.0%} below one device's {one_act:,} B, TP + SP {1 - sp_act / one_act:.0%} below"
)

# %% [markdown]
# Weights after training against one device: max|Δparam| is rounding, so its digits vary from machine to machine,
# while the verdict does not (the cell fails if a row fails):

# %% tags=["nbval-ignore-output"]
equality = R.review_result(suite, part="equality")
print(equality)
equality.assert_passed()

# %% [markdown]
# <a id="bubble-review"></a>
# ## 2. The pipeline bubble, once more
#
# p stages, m micro-batches, equal stages: every stage idles p − 1 slots while the pipeline fills and drains, so
#
# $$\text{bubble} = \frac{\text{idle}}{\text{whole step}} = \frac{p-1}{m+p-1}
# \qquad(\text{Megatron quotes idle / ideal} = \tfrac{p-1}{m}).$$
#
# GPipe and 1F1B have the **same** bubble; 1F1B keeps at most p micro-batches of activations alive instead of m;
# interleaving v chunks per rank divides the fill and drain by v: (p−1)/(v·m+p−1). Predictions first:

# %%
print(f"{'p':>2} {'m':>3} {'(p−1)/(m+p−1)':>14} {'(p−1)/m':>8}")
for p, m in ((2, 1), (2, 4), (2, 8), (4, 4), (4, 8), (4, 27), (8, 32)):
    print(f"{p:>2} {m:>3} {pipeline_bubble(p, m):>14.3f} {pipeline_bubble_megatron(p, m):>8.3f}")
print(
    f"p = 4, m = 27: bubble = 3/30 = {pipeline_bubble(4, 27):.2f} of the step (Megatron's convention: "
    f"{pipeline_bubble_megatron(4, 27):.3f})"
)

# %% [markdown]
# Measured in the suite above (chapter 05's runner: 2 real stages, each a layer that sleeps 60 ms forward and 120 ms
# backward so that a busy laptop cannot blur the timings; bubble per rank = 1 − busy / step, median of 3
# steps):

# %% tags=["nbval-ignore-output"]
bubbles = R.review_result(suite, part="bubbles")
print(bubbles)
bubbles.assert_passed()

# %% [markdown]
# <a id="3d-parallelism"></a>
# ## 3. 3D parallelism
#
# Each technique has a natural place on a cluster of nodes with fast links inside (NVLink) and a slower network
# between them (Narayanan et al. 2021, arXiv:2104.04473; Megatron-DeepSpeed):
#
# - **TP inside a node.** Its traffic (2 + 2 all-reduces of b·s·h per layer) grows with the tokens of every
#   micro-batch and blocks the layer that waits for it — on the critical path, unlike DP's 2Ψ per step, which runs
#   during backward (chapter 06 compares the two per token) — so its group stays on NVLink, at most the node's size.
# - **PP across nodes.** Only boundary activations cross, point to point, once per micro-batch each way; it needs
#   m ≫ p micro-batches to keep the bubble small.
# - **DP for the rest**, usually with ZeRO. DeepSpeed's pipeline engine allows **ZeRO-1 only**: a pipeline
#   accumulates gradients over its m micro-batches, and sharding gradients (ZeRO-2) or parameters (ZeRO-3) would
#   communicate every micro-batch instead of once per step — DeepSpeed rejects that combination.
# - The alternative on one mesh: TP inside the node × FSDP across nodes (chapter 06's FSDP2 × TP on a 2-D mesh).
#
# Ranks multiply: dp × tp × pp = GPUs. Predicted per-GPU memory (the planner's formulas, §4: model states on
# Ψ/(t·p), Korthikanti's activations with selective recompute, micro-batch 1) for a 70B model (80 layers, h = 8192,
# 64 heads, s = 4096) on 8 nodes × 8 GPUs — predictions, not measurements:

# %%
import matplotlib.pyplot as plt

from course_lib import viz

m70 = R.FIXED_CASES["70B on 64×80 GB (8 per node)"][0]
bars = {}
print(
    f"{'layout':<34} {'states GB':>9} {'activations GB':>14} {'total GB':>9} {'bubble at m = 8':>16}"
)
for lay in (
    plan.Layout(dp=64, zero=3),
    plan.Layout(dp=8, tp=8, zero=2),
    plan.Layout(dp=8, tp=8, zero=3),
    plan.Layout(dp=4, tp=8, pp=2, zero=1),
    plan.Layout(dp=1, tp=8, pp=8, zero=0),
):
    mm = plan.memory_per_gpu(m70, lay, num_microbatches=8)
    bars[lay.name()] = {"model states": mm["model_states"], "activations": mm["activations"]}
    bubble = pipeline_bubble(lay.pp, 8) if lay.pp > 1 else 0.0
    print(
        f"{lay.name():<34} {mm['model_states'] / 1e9:>9.1f} {mm['activations'] / 1e9:>14.1f} {mm['total'] / 1e9:>9.1f}"
        f" {bubble:>16.0%}"
    )
ax = viz.stacked_bars(
    bars,
    unit="GB",
    scale=1e9,
    horizontal=True,
    title="70B on 8 nodes × 8 GPUs: predicted memory per GPU (micro-batch 1, m = 8)",
)
ax.axvline(72, color="k", linestyle="--", linewidth=1)
ax.text(73, len(bars) - 0.6, "usable: 90 % of 80 GB", fontsize=8)
plt.show()

# %% [markdown]
# Memory is not the whole story for a pipeline: its bubble column is time lost, not bytes, and the planner's
# memory formulas do not see it. The same predictions checked as a table:

# %%
from course_lib.results import Result

one = plan.memory_per_gpu(m70, plan.Layout(dp=8, tp=8))["activations"]
pp8 = plan.memory_per_gpu(m70, plan.Layout(dp=1, tp=8, pp=8), num_microbatches=8)["activations"]
z3_70 = plan.memory_per_gpu(m70, plan.Layout(dp=64, zero=3))
seventy = Result(
    title="70B on 8 nodes × 8 GPUs: the planner's formulas (predictions, not measurements)"
)
seventy.within(
    "1F1B first stage, PP 8 (p micro-batches of L/p layers): activations (B)",
    pp8,
    one,
    0.01,
    "TP 8 + SP without a pipeline",
)
seventy.condition(
    "ZeRO-3 over 64: model states (GB)",
    round(z3_70["model_states"] / 1e9, 1),
    z3_70["model_states"] < 72e9,
    "≤ 72 GB usable",
)
seventy.condition(
    "ZeRO-3 over 64: states + activations (GB)",
    round(z3_70["total"] / 1e9, 1),
    z3_70["total"] > 72e9,
    "> 72 GB usable: needs TP",
)
print(seventy)
pp8_total = plan.memory_per_gpu(m70, plan.Layout(dp=1, tp=8, pp=8), num_microbatches=8)["total"]
print(
    f"TP 8 + SP, PP 8 at m = 8: {pp8_total / 1e9:.1f} GB per GPU "
    f"({'within' if pp8_total <= 72e9 else 'over'} the 72 GB usable), and it idles {pipeline_bubble(8, 8):.0%} "
    f"of every step; m = 64 micro-batches bring that to {pipeline_bubble(8, 64):.0%} (m ≫ p)"
)
g70 = plan.recommend(m70, R.FIXED_CASES["70B on 64×80 GB (8 per node)"][1]).global_batch
print(
    f"§4's ranking instead trains one global batch of {g70} sequences per step on every layout, so "
    f"m = {g70} / (dp × micro-batch): TP 8 + SP, PP 8 (dp 1) runs at m = {g70}, bubble "
    f"{pipeline_bubble(8, g70):.1%}; TP 8 + SP, PP 2, ZeRO-1 (dp 4) at m = {g70 // 4}, bubble "
    f"{pipeline_bubble(2, g70 // 4):.1%}"
)

# %% [markdown]
# <a id="choosing"></a>
# ## 4. Choosing a strategy
#
# `plan.recommend(model, cluster)` adds up model states and activations per GPU for each layout and walks a
# ladder, cheapest communication first, stopping at the first that fits (90 % of the GPU's memory: the rest is kept
# for the CUDA context, communication buffers and fragmentation). Its bytes are mixed precision, as the planner
# counts them (16-bit weights and gradients, fp32 master weights and Adam moments: still 16Ψ in all):
#
# 1. **DDP** if everything fits on every GPU: the least traffic, overlapped with backward, no model changes. It
#    replicates: its 16Ψ per GPU stays 16Ψ however many GPUs you add, so it cannot rescue a model that does not fit.
#    (For a small model more GPUs mostly add communication: its all-reduce does not shrink with N while the
#    compute per GPU does — chapter 02 measured a tiny batch on 1 and 2 ranks.)
# 2. **ZeRO-2** (DeepSpeed stage 2; FSDP2's `fully_shard(reshard_after_forward=False)`): the same 2Ψ of traffic, 16Ψ shrinks to 2Ψ + 14Ψ/N.
# 3. **ZeRO-3 / FSDP**: 16Ψ/N for 3Ψ of traffic.
# 4. **TP inside the node** (with sequence parallelism) × ZeRO-2 or FSDP across nodes — when sharding the model
#    states is not enough because the **activations** do not fit (ZeRO never shards them); the 3D layout
#    (TP × PP × ZeRO-1) is listed beside it.
# 5. The same with **full recompute** (+≈33 % compute), then an error that says what is missing. With few GPUs but
#    plenty of CPU memory, **ZeRO-Offload** (optimizer states and step on the CPU; ZeRO-Infinity: NVMe) trades
#    PCIe traffic and CPU compute for GPU memory — DeepSpeed is above all about *memory*.
#
# First the ZeRO paper's table (Rajbhandari et al. 2019: Ψ = 7.5B, N = 64, mixed-precision Adam, K = 12; model
# states per GPU, decimal GB), through the planner:

# %%
paper = plan.zero_paper_table(7.5e9, 64)
print(
    ", ".join(f"{k} {v:.1f} GB" for k, v in paper.items()),
    "(checked against the paper below, with the fixed cases)",
)

# %% [markdown]
# **Against this notebook's measurements.** The same function with `precision="fp32"` and the course's model
# (`Model.from_config`: activations derived op by op, chapter 01) predicts what §1 measured at N = 2 (model states
# after a step, activations at micro-batch 2; the planner's bytes in the reference column):

# %%
print(R.review_result(suite, part="planner"))

# %% [markdown]
# **Fixed cases.** What the chooser says for five jobs, and what it must say:

# %%
cases = R.fixed_cases()
for c in cases:
    print(f"=== {c['case']} (expected: {c['expected']})")
    print(c["plan"].text(ranking=False) if c["plan"] is not None else f"PlanError: {c['error']}")
    print()

# %%
print(R.planner_result())

# %% [markdown]
# **Bad inputs** get an error naming the broken rule:

# %%
bad = [
    (lambda: plan.memory_per_gpu(plan.Model(7e9, 32, 768, 6, 2048), plan.Layout(dp=2, tp=4))),
    (lambda: plan.memory_per_gpu(m70, plan.Layout(pp=3))),
    (lambda: plan.check_layout(m70, plan.Layout(dp=4, tp=8), plan.Cluster(80, 8, 8))),
    (lambda: plan.check_layout(m70, plan.Layout(dp=4, tp=16), plan.Cluster(80, 8, 8))),
    (lambda: plan.Cluster(0, 8, 1)),
]
for make in bad:
    try:
        make()
    except plan.PlanError as err:
        print("PlanError:", err)

# %% [markdown]
# **Among what fits, the step-time model ranks.** Memory decides what fits; among those layouts (every TP size
# inside a node × pipeline × data parallel, at the recompute the ladder needed) `plan.recommend` ranks by the
# course's step-time model (chapter 00, `step_time.layout_step`): compute + exposed communication + bubble for one
# global batch, on a named node — `step_time.H100_NODE`, published FLOP/s and link bandwidths with an assumed 40 %
# MFU, not this laptop's α–β. Every layout of the same GPUs computes the same FLOPs per GPU, so what the
# communication leaves exposed and the pipeline's bubble order them; the ladder's choice (least traffic) is marked.
# Unlike §3, which fixed m = 8 to show the bubble, every layout here trains the same global batch per step, so
# a layout's m is that batch / (dp × micro-batch): fewer replicas mean more micro-batches per pipeline.
# The 7B case's ranking, then a widget that recomputes the whole plan, ranking included, as you type (it starts at
# the 7B case):

# %%
m7, c7 = R.FIXED_CASES["7B on 8×80 GB"][:2]
seven = plan.recommend(m7, c7)
print(seven.ranking_table())
print("step time:", seven.fastest_reason())
assert [p.total for *_, p in seven.ranking] == sorted(p.total for *_, p in seven.ranking), "ranked fastest first"
bare = plan.recommend(plan.Model(m7.params, m7.layers, m7.hidden, m7.heads, m7.seq_len), c7)
logits = seven.memory["total"] - bare.memory["total"]
print(
    f"the widget below has no vocabulary box: it plans this 7B model without the loss's fp32 logits, "
    f"{bare.memory['total'] / 1e9:.1f} GB per GPU for {bare.layout.name()} instead of {seven.memory['total'] / 1e9:.1f} "
    f"({logits / 1e9:.1f} GB of logits)"
)

# %%
viz.planner_widget()

# %% [markdown]
# Two notes the planner prints as numbers. If after ZeRO-3 memory still runs out because of **long sequences**, the
# culprit is activations (linear in s, plus s² for stored attention scores): activation checkpointing, sequence or
# tensor parallelism, or a smaller micro-batch help; more sharding does not. And the ladder's order is the
# communication argument of §1 and §3, while the ranking is the step-time model on a named node: its MFU is
# assumed and its links are the datasheet's, so it orders layouts by mechanism and this notebook does not measure
# that node.

# %% [markdown]
# <a id="deepspeed"></a>
# ## 5. DeepSpeed in context
#
# DeepSpeed (Microsoft, 2020) is a library around a training engine: `deepspeed.initialize(model, optimizer,
# config)` returns an engine whose `backward` and `step` do the distributed work that its JSON config asks for.
# ZeRO is its core — the paper came with it — and the config maps onto what you built:

# %%
import json

print(f"{'DeepSpeed zero_optimization':<54} {'the course':<50} planner layout (N=2)")
for r in R.deepspeed_mapping():
    print(f"{json.dumps(r['deepspeed']):<54} {r['ours']:<50} {r['plan']}")

# %% [markdown]
# Offload is DeepSpeed's answer when sharding over the GPUs you have is not enough: **ZeRO-Offload** keeps the
# optimizer state in CPU memory and runs Adam there (a fused C++ `cpu_adam`; the paper trains 13B on one GPU),
# **ZeRO-Infinity** extends it to NVMe. Besides ZeRO, DeepSpeed provides pipeline parallelism (with ZeRO-1, §3),
# tensor parallelism (AutoTP) and sequence parallelism (Ulysses).
#
# Run for real on CPU, stages 1–3 at N = 2 (chapter 03's experiment; bytes per rank at the peak of a backward pass)
# on a tiny GPT with odd sizes (Ψ ≈ 19k, so DeepSpeed pads), and the same training on one device. The first table's
# columns, per rank: **Ψ_pad** the parameter count after DeepSpeed's padding; **formula** the course's fp32
# formula on Ψ_pad; **measured** the model-state bytes held; **ratio** = measured / formula; then what explains
# the difference: **fp32 master** (DeepSpeed's fp32 copy of this rank's slice, 4Ψ_pad/N), **overhang** (stage 2:
# gradients of the tensors that straddle the slice's ends), **in-flight** (gradients waiting in a bucket),
# **step** (Adam's 4-byte step counters), **rest** (what none of these explains); **buffers**: working memory
# that is not a model state (the reduction bucket, stage 3's gathered weights). Then each stage's checks:

# %% tags=["nbval-ignore-output"]
from course_lib.experiments import zero_libraries

ds_ok, ds_reason = zero_libraries.deepspeed_available()
print(ds_reason)
if ds_ok:
    ds = spawn(
        zero_libraries.deepspeed_zero_stages,
        2,
        timeout=600,
        kwargs=dict(
            stages=(1, 2, 3), config=R.deepspeed_model_config(), micro_batch=8, return_params=True
        ),
    )[0]
    print(zero_libraries.deepspeed_table(ds))
    for r in ds:
        print(f"\nstage {r['stage']}:")
        print(R.max_delta_named(r))  # "(max |Δ|)": what an equality row's measured cell is
    for r in ds:
        r.assert_passed()

# %% [markdown]
# So at the peak of a backward pass DeepSpeed's stage s holds the course's stage-s formula, an fp32 master copy of
# its partition (4Ψ/N: for a 16-bit model that copy *is* the formula's master weights, here it comes on top), and
# two transient extras the table names: at stage 2 an **overhang** — its gradient partition keeps whole every
# tensor that straddles the slice's ends (at most 2 × the largest tensor) — and at stages 2–3 **in-flight**
# gradients that have arrived but wait for their bucket to fill (at most a bucket + the largest tensor; large
# here only because the model is tiny against the bucket). What is left unexplained is at most the padding; and
# it trains the same weights as one device.
#
# <a id="horovod"></a>
# ## 6. Horovod in context
#
# **Horovod** (Uber, 2017; Sergeev & Del Balso, arXiv:1802.05799) made data-parallel training a few-line change:
# `hvd.init()`, pick the GPU by `hvd.local_rank()`, wrap the optimizer in `hvd.DistributedOptimizer` (hooks start an
# asynchronous all-reduce of each gradient as backward produces it; `step()` waits), and
# `hvd.broadcast_parameters(model.state_dict(), root_rank=0)` so every replica starts from rank 0's weights. It
# **all-reduces gradients** — every rank's gradients are averaged, not copied from rank 0 (that is the broadcast, used
# once at the start) — and the same averaged step keeps the weights synchronised. There is **no parameter server**:
# the workers average among themselves with Baidu's **ring all-reduce** (2(N−1)/N × size per rank, chapter 00),
# through NCCL on GPUs and Gloo or MPI on CPUs. **Tensor Fusion** packs many small gradients into one buffer before
# all-reducing — DDP's buckets (chapter 02). It is a **data-parallel** framework for TensorFlow, Keras, PyTorch and
# MXNet, launched SPMD-style: `horovodrun -np 4 python train.py` (`hvd.rank()`, `hvd.local_rank()`, `hvd.size()` ↔
# torchrun's RANK, LOCAL_RANK, WORLD_SIZE). It does not split models.
#
# Horovod is **unmaintained**: its last release, 0.28.1, is from June 2023. Users moved to PyTorch's own DDP and FSDP,
# DeepSpeed, and Ray Train's `TorchTrainer` (chapter 08). That release does not build as shipped against torch 2.13
# (its CMake asks for C++14, torch needs C++17); `make horovod` builds it with that one setting changed.
#
# The APIs side by side:

# %%
from IPython.display import Markdown

from course_lib.experiments import horovod as H

Markdown(H.api_table_markdown())

# %% [markdown]
# The same tiny GPT trained four ways — Horovod (`horovodrun -np 2 --gloo`), our DDP, torch DDP (both on 2 ranks)
# and one device on the whole batch — from different initial weights on each rank (the broadcast must fix that),
# 5 SGD steps. One row needs a word: `hvd.broadcast_optimizer_state` creates a fresh optimizer's state by taking
# one step on zero gradients, so Horovod is also compared with one device that took that same step (plain SGD
# with momentum does not move on zero gradients; AdamW's weight decay would):

# %% tags=["nbval-ignore-output"]
hvd_ok = H.horovod_available()
if hvd_ok:
    cmp = H.compare_frameworks()
    print(R.max_delta_named(cmp))  # the same rows; "(max |Δ|)" names an equality row's measured cell
    cmp.assert_passed()
    print("\nwall time per launch (process start-up dominated on 2 cores — not a speed comparison):")
    print(cmp.timings)
else:
    print(H.BUILD_HINT)

# %% [markdown]
# <a id="final-exam"></a>
# ## 7. The chapter quiz and the final exam
#
# There is no new exercise in this chapter: `course-lib check` lists every exercise of the course, and
# `course-lib progress` shows which quizzes and exercises you have done. First chapter 10's quiz:

# %%
from course_lib.quiz import quiz

quiz("review")

# %% [markdown]
# Then the final exam: 40 statements from every chapter (all 14 seed statements included, never two items that give
# each other away, about as many true as false), then 3 numeric questions from three chapters' formulas. Run in a
# kernel, it grades and explains only after your last answer, scores per topic, and names the traps you fell for and
# the sections to reread. The stored text under it is the version for a reader without a kernel (GitHub, a PDF):
# the statements, then the answers and explanations to check yourself against. In a terminal: `course-lib exam`.

# %%
from course_lib.quiz import final_exam, grade_exam

final_exam(n=40, seed=0)

# %% [markdown]
# The programmatic path (what `course-lib exam` and the widget report), here for an answer sheet that says "O" to
# every statement and leaves the computations blank — a form holds about as many false statements as true ones:

# %%
from course_lib.quiz import exam_items

sheet = {item["id"]: "O" for item in exam_items(n=40, seed=0) if item.get("kind") != "numeric"}
result = grade_exam(sheet, n=40, seed=0, record=False)
print(f"all-O score: {result.score}/{result.total}; by topic, weakest first:")
print(result.topic_table())
print(
    f"traps missed: {len(result.missed_traps)}; sections to reread, e.g.: "
    + ", ".join(where for _, where in result.reread[:5])
)

# %% [markdown]
# ## Summary
# - Side by side (§1), measured here: DDP, ZeRO-1/2/3 and FSDP2 hold and send what their formulas say; memory falls
#   from DDP to ZeRO-3 while traffic rises from 2Ψ to 3Ψ; TP issues 2 + 2 all-reduces per layer; no ZeRO stage
#   shrinks activations, TP splits those inside its regions and TP + SP the rest.
# - The bubble (p−1)/(m+p−1) held on real stages; 1F1B keeps ≤ p micro-batches alive; memory alone does not
#   choose a pipeline: PP 8 at m = 8 has a bubble of (p−1)/(m+p−1) = 7/15 (§3).
# - 3D parallelism: TP inside a node, PP across nodes, ZeRO-1 data parallel for the rest — or TP × FSDP.
# - The chooser reproduces the ZeRO paper's 120 / 31.4 / 16.6 / 1.9 GB, agrees with the bytes measured above, and
#   gives ZeRO-2 for 7B on 8 GPUs, TP inside the node + ZeRO/FSDP (or PP) across nodes for 70B on 64, DDP for a
#   model that fits, and errors that say what is missing.
# - DeepSpeed's stages 1–3 = the course's stages + an fp32 master partition + transient gradient bytes (stage 2's
#   overhang, stages 2–3's in-flight buckets); Horovod = all-reduce data parallelism started during backward,
#   equal to our DDP and torch DDP; Horovod has had no release since June 2023.
# - This run's numbers:

# %% tags=["nbval-ignore-output"]
print(
    "memory ratios (measured/formula): "
    + ", ".join(f"{k} {v:.3f}" for k, v in mem.items() if v == v)
)
print(
    "bubble measured (max over ranks): "
    + ", ".join(
        f"{r['schedule']} m={r['m']} {max(r['per_rank']):.3f}" for r in suite["bubbles"]["rows"]
    )
)
if hvd_ok:
    print(
        "Horovod: "
        + ", ".join(
            f"{pair} max|Δparam| {d:.1e}"
            for pair, d in cmp.diffs.items()
            if pair.startswith("horovod")
        )
    )
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
