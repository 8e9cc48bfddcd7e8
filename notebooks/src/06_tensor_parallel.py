# %% [markdown]
# # 06 · Tensor parallelism: Megatron's column and row layers, DTensor, and a 2-D mesh
#
# **What you will learn**
# - how one matrix multiply is split across ranks **by columns** (no communication in forward) or **by rows**
#   (partial sums, one all-reduce) — and why Megatron's MLP and attention put the two back to back;
# - Megatron's **f** and **g** operators, and why a transformer layer needs exactly **2 all-reduces forward and 2
#   backward** — counted on real ranks;
# - that the tensor-parallel GPT *is* the one-device GPT (outputs, gradients, 10 AdamW steps), and what each rank
#   stores (1/t of the block weights, not of the LayerNorms);
# - TP's traffic against data parallelism's, per rank and step at the same global batch, and their step times under
#   the modelled accelerator clock, predicted with the step-time model and measured at two batch sizes; where the
#   traffic model puts their crossover, and how the bandwidth inside vs across nodes and each call's α move it
#   (chapter 00's α–β model);
# - sequence parallelism (all-reduce → reduce-scatter + all-gather) and the activation bytes it saves;
# - PyTorch's DTensor version (`parallelize_module`, `ColwiseParallel`, `RowwiseParallel`, `loss_parallel`) and
#   its traps; DP × TP on a 2-D `DeviceMesh`, with FSDP2 on the data-parallel dimension.
#
# **What you need**: chapters 00 (collectives, α–β), 02 (DDP) and 05 (model vs data parallelism). 2 CPU cores are
# enough: ranks are processes with the gloo backend.
#
# **Stored build:** 43 s on 2 cores (0% of them busy just before it started).
#
# Read along: `course_lib/tensor_parallel.py` (the algorithm, top to bottom) and
# `course_lib/experiments/tensor_parallel.py` (what this notebook runs on ranks).

# %% tags=["nbval-ignore-output"]
import time

_t_notebook = time.perf_counter()
import os

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from course_lib.experiments import tensor_parallel as E
from course_lib.experiments.collectives import AlphaBeta, fit_alpha_beta
from course_lib.experiments.common import parallel_config, reference_run, step_batch
from course_lib.formulas import dp_ring_bytes_per_token, tp_allreduce_bytes_per_layer, tp_ring_bytes_per_token
from course_lib.launch import spawn
from course_lib.memory import SavedTensorMeter
from course_lib.models import GPT
from course_lib.results import ADAMW, SGD, Result
from course_lib.tensor_parallel import qkv_rows

print(f"cores: {os.cpu_count()}")

# %% [markdown]
# ## 1. Tensor parallelism: split the operations inside a layer
# <a id="tensor-parallelism"></a>
#
# Chapter 05 split the model **between** layers: each pipeline stage holds some layers (inter-layer, "model" or
# pipeline parallelism). **Tensor parallelism** (Megatron-LM, Shoeybi et al. 2019) splits the work **inside**
# every layer: each weight matrix is cut into t pieces, every rank computes its piece of *every* layer, and
# collectives combine the pieces. So the O/X statement "tensor parallelism divides the model layer by layer" is
# false — that is pipeline parallelism; "tensor parallelism splits one operation across devices" is true.
#
# The t ranks of a tensor-parallel group work on **the same batch** (different batches is the data-parallel
# dimension, section 10), and the result is not an approximation: splitting a matrix product into blocks and adding
# the partial sums is exact arithmetic; only the floating-point summation order changes (equal to 1e-5 below).
#
# Notation (Megatron): b batch, s sequence, h hidden size, a heads, L layers, V vocabulary, t TP ranks.
# `nn.Linear` computes $Y = XA$ with $A = W^\top$ of shape (in, out).

# %% [markdown]
# ## 2. Column-parallel: split A by output columns
# <a id="column-parallel"></a>
#
# $$A = [A_1, A_2, \dots, A_t] \quad\Rightarrow\quad XA = [XA_1, XA_2, \dots, XA_t].$$
# Rank i holds $A_i$ (out/t columns) and the **full** input X, and computes its output columns $Y_i = XA_i$ with
# **no communication in forward**. If the full Y is needed, all-gather the blocks; if a row-parallel layer follows,
# pass $Y_i$ on as it is. In backward every rank holds only a *part* of $\partial L/\partial X = \sum_i
# \partial L/\partial Y_i \, A_i^\top$: those parts must be summed (all-reduced) — that is Megatron's **f**.

# %%
torch.manual_seed(0)
X, A = torch.randn(4, 8), torch.randn(8, 6)
blocks = [X @ Ai for Ai in A.chunk(2, dim=1)]  # rank 0 and rank 1, each with the full X
print("column-parallel: concatenating the blocks gives XA:", torch.allclose(torch.cat(blocks, 1), X @ A))

# %% [markdown]
# ## 3. Row-parallel: split A by input rows
# <a id="row-parallel"></a>
#
# $$A = \begin{bmatrix} A_1 \\ \vdots \\ A_t \end{bmatrix},\quad X = [X_1, \dots, X_t] \quad\Rightarrow\quad
# XA = \sum_i X_i A_i.$$
# Rank i holds rows $A_i$ and the matching input block $X_i$; its product $X_iA_i$ already has the **full output
# shape** but is only a partial sum: the ranks' results are **added** with an all-reduce (Megatron's **g**),
# not concatenated. A bias is added once, after the sum (before it, the all-reduce would add it t times). In
# backward, $\partial L/\partial X_i = \partial L/\partial Y \, A_i^\top$ is exactly rank i's block: no
# communication.

# %%
partials = [Xi @ Ai for Xi, Ai in zip(X.chunk(2, dim=1), A.chunk(2, dim=0), strict=True)]
print("row-parallel partial shape", tuple(partials[0].shape), "= full output shape", tuple((X @ A).shape))
print("row-parallel: summing the partials gives XA:", torch.allclose(partials[0] + partials[1], X @ A))
print("row-parallel: concatenating them does not:", tuple(torch.cat(partials, 1).shape) != tuple((X @ A).shape))

# %% [markdown]
# ## 4. The Megatron MLP: column, then row — and f, g
# <a id="megatron-mlp"></a>
#
# The MLP is $\text{GELU}(XA)\,B$. Split **A by columns**: each rank has $Y_i = \text{GELU}(XA_i)$ — GELU is
# element-wise, so it applies to each column block with no communication. That block is exactly the input block a
# **row-parallel B** needs: $Z = \sum_i Y_i B_i$, one all-reduce at the end. Had A been split by rows, each rank
# would hold a partial sum, and GELU is nonlinear — $\text{GELU}(a + b) \ne \text{GELU}(a) + \text{GELU}(b)$ —
# so the sum would have to be all-reduced *before* GELU: a second synchronisation.
#
# Megatron wraps the parallel region in two operators, each a tiny `torch.autograd.Function` in
# `course_lib/tensor_parallel.py`:
#
# | operator | where | forward | backward |
# |---|---|---|---|
# | **f** (`copy_to_tp`) | entry, before the column layer | identity | all-reduce of ∂L/∂X |
# | **g** (`reduce_from_tp`) | exit, after the row layer | all-reduce of the partial sums | identity |

# %%
a, b = torch.tensor(1.0), torch.tensor(-0.7)
print(f"GELU(a + b) = {F.gelu(a + b):.4f}, GELU(a) + GELU(b) = {F.gelu(a) + F.gelu(b):.4f}: equal? "
      f"{torch.allclose(F.gelu(a + b), F.gelu(a) + F.gelu(b))}")

# %% [markdown]
# The from-scratch pieces, as `course_lib` has them: f and g are one `autograd.Function` each way (`_Comm`: a
# collective in forward, another or none in backward), and the two layers call them around a local `F.linear`.

# %%
from IPython.display import display

from course_lib import show
from course_lib.tensor_parallel import ColumnParallelLinear, RowParallelLinear, copy_to_tp, reduce_from_tp

for obj in (copy_to_tp, reduce_from_tp, ColumnParallelLinear.forward, RowParallelLinear.forward):
    display(show.source(obj))

# %% [markdown]
# ## 5. Attention: split by heads
# <a id="attention"></a>
#
# Heads are independent, so the q, k, v projections are column-parallel **by heads**: each rank computes the
# attention of its a/t heads entirely, with no communication, and the output projection is row-parallel (one g).
# So the attention block, like the MLP, has one f and one g. The head count must be divisible by t.
#
# Our GPT fuses q, k, v into one `c_attn` (h → 3h). Which output rows belong to which head matters: with a
# `[q | k | v]` layout a contiguous block of rows would give rank 0 all of q and part of k. Our model lays the rows
# out head by head, `[q_0 k_0 v_0 | q_1 k_1 v_1 | …]` (Megatron's layout), so rank i's contiguous block is the q, k
# and v of whole heads — `qkv_rows` lists them, and `parallelize_attention` slices exactly those rows (the same
# `Shard(0)` holds for DTensor's `ColwiseParallel` in section 8).

# %%
cfg = parallel_config()
hd = cfg.d_model // cfg.n_head
for r in range(2):
    rows = qkv_rows(cfg.n_head, hd, 2, r)
    block = sorted(rows["q"] + rows["k"] + rows["v"])
    print(f"t=2, rank {r}: heads {r * cfg.n_head // 2}–{(r + 1) * cfg.n_head // 2 - 1}, c_attn rows "
          f"{block[0]}–{block[-1]} (contiguous: {block == list(range(block[0], block[-1] + 1))}); "
          f"q rows start {rows['q'][0]}, k {rows['k'][0]}, v {rows['v'][0]}")

# %% [markdown]
# ## 6. Real ranks: the TP GPT equals one device
#
# `tensor_parallel_gpt` turns the tiny GPT (`parallel_config()`: untied, bias-free, 4 blocks, everything divisible
# by 4) into its TP form on a process group, sliced from the same full weights: every block's `c_attn`/`c_fc`
# column-parallel and `c_proj` row-parallel; the token embedding **vocab-parallel** (rank i holds rows
# [i·V/t, (i+1)·V/t); a token outside gives zeros, then g sums); the output head column-parallel over V, and the
# loss computed **without gathering the logits** (max, Σexp and the target logit each all-reduced: 3 small
# all-reduces of b·s numbers). LayerNorms and the position embedding are replicated. Embedding and head are untied
# here; a tied pair would also work in our version (both split the same V rows of one table, so the tie survives as
# one shard), but not with `parallelize_module` (section 8).
#
# One spawn of 2 ranks runs everything of sections 6–9 (`E.notebook_suite`); the one-device references are
# computed here, in the notebook's process.

# %%
runs = spawn(E.notebook_suite, 2, kwargs=dict(batch_size=8, steps=10), timeout=240)
one = GPT(cfg, seed=0)
x, y = step_batch(0, cfg, 8)
with SavedTensorMeter(exclude=one) as meter:
    ref_logits, ref_loss = one(x, y)
ref_loss.backward()
one_device_activation = meter.bytes
ref_grads = {n: p.grad for n, p in one.named_parameters()}
trained = reference_run(cfg, 10, 8, "adamw")[0].state_dict()


tp = [r["tp"] for r in runs]
equal = Result(title="the TP GPT (t = 2) vs one device")
equal.condition("layers: Column/RowParallelLinear (bias) vs nn.Linear", runs[0]["layers"].passed,
                runs[0]["layers"].passed, "every row of their table passed")
equal.equal("logits (V/t columns per rank, concatenated)", torch.cat([r["logits"] for r in tp], -1), ref_logits, SGD)
equal.equal("loss", tp[0]["loss"], ref_loss.item(), SGD)
equal.equal("gradients (shards merged)", E.merge_shards(tp), ref_grads, SGD)
_ = equal.equal("weights after 10 AdamW steps (lr 1e-3)", E.merge_shards([r["train"] for r in runs], "state"),
                trained, ADAMW)

# %% tags=["nbval-ignore-output"]
print(equal)
equal.assert_passed()

# %% [markdown]
# **Dropout.** The course's models train without dropout, and the TP model refuses it: dropout on a split activation
# (my heads' attention probabilities, my block of the MLP) must draw a *different* mask on every rank, and on a
# replicated one (the residual stream) the *same* mask everywhere — Megatron keeps two random generators for that
# (its model-parallel RNG tracker). Without one, the ranks' copies of the residual stream would drift apart:

# %%
from course_lib.tensor_parallel import tensor_parallel_gpt

try:
    tensor_parallel_gpt(GPT(parallel_config(dropout=0.1), seed=0))
except ValueError as err:
    print(f"ValueError: {err}")

# %% [markdown]
# ## 7. Communication: 2 all-reduces forward and 2 backward per layer
# <a id="tp-communication"></a>
#
# Each block has two parallel regions (attention, MLP), each with one f and one g. In forward the two g's
# all-reduce, in backward the two f's do: **2 + 2 per transformer layer**, each of a (b, s, h) activation. The
# embedding (one g), the head (one f) and the loss (3 tiny all-reduces) come on top, once per model. Counted with
# `CommLog` (tag `tp` = inside the blocks):

# %%
L = cfg.n_layer
print("forward :", tp[0]["forward"])
print("backward:", tp[0]["backward"])
want = tp_allreduce_bytes_per_layer(8, cfg.block_size, cfg.d_model)["tensor_bytes"] * L * 2 * (2 - 1) / 2
calls = Result(title=f"our TP's collectives (CommLog), one step, L = {L}")
calls.exact("block all-reduces forward", tp[0]["forward"]["all_reduce:tp"], 2 * L, "2 per layer (g, g)")
calls.exact("block all-reduces backward (f's all-reduce of ∂L/∂X)", tp[0]["backward"]["all_reduce:tp"], 2 * L,
            "2 per layer (f, f)")
calls.exact("block all-reduce ring bytes per rank", tp[0]["block_tp_ring_bytes"], want, "L·4·b·s·h·4 B·2(t−1)/t")
print(calls)

# %% [markdown]
# **Memory.** Each rank stores 1/t of every block Linear. The embeddings' and head's split depends on V; LayerNorms
# and the position embedding are replicated on every rank:

# %%
full_block = sum(p.numel() * 4 for n, p in one.named_parameters() if n.startswith("blocks.") and ".ln_" not in n)
print(f"block Linears: {tp[0]['block_linear_bytes']:,} B per rank × t=2 = {tp[0]['block_linear_bytes'] * 2:,} B, "
      f"the whole model's {full_block:,} B")
print(f"everything else per rank: {tp[0]['other_param_bytes']:,} B (embeddings split over V, LayerNorms and "
      f"position embedding whole)")

# %% [markdown]
# **TP's traffic against DP's, and why TP still stays inside a node.** Compare the bytes one rank sends per step
# for the same global batch of B sequences of s tokens on the same 2 ranks. Every TP rank runs all B·s tokens
# (split along h), and every token's activations cross the group in every layer, forward and backward:
# $B s \cdot L \cdot 4 \cdot h \cdot \text{bytes} \cdot 2(t-1)/t$, which grows with the batch. Each DP rank trains on
# B·s/N of the tokens and sends the gradients once per step, $2(N-1)/N \cdot \Psi \cdot \text{bytes}$, whatever the
# batch; it also overlaps with backward (chapter 02), while TP's all-reduces sit on the critical path between layers.
# The two cross at $B s = 2(N-1)/N \cdot \Psi \,/\, (L \cdot 4 h \cdot 2(t-1)/t)$ global tokens. What moves the
# crossover in *time* is the bandwidth each one gets: TP inside a node on NVLink, DP across nodes on InfiniBand.
# Measured vs formula here, then predicted with chapter 00's α–β model for one layer of a GPT-3-sized model (L=96,
# h=12288, bf16, s=2048, micro-batch 1, t=8). The link numbers are *assumptions* for illustration: NVLink inside a
# node β ≈ 400 GB/s, InfiniBand between nodes β ≈ 50 GB/s per GPU (a 400 Gb/s NIC), α = 10 µs; compute at
# 300 TFLOP/s per GPU.

# %%
tokens = 8 * cfg.block_size  # the step above: 8 sequences, all of them on every TP rank
tp_per_token = tp[0]["block_tp_ring_bytes"] / tokens
tp_formula = tp_ring_bytes_per_token(L, cfg.d_model, 2)
print(f"TP, measured: {tp[0]['block_tp_ring_bytes']:,.0f} B per rank per step for {tokens} tokens = "
      f"{tp_per_token:,.0f} B per token; formula {tp_formula:,.0f}")
psi = one.num_params()
dp_step = dp_ring_bytes_per_token(psi, 2, 1)  # 2(N−1)/N·Ψ·4: per rank and step, whatever the batch
print(f"DP (N = 2), per rank per step: 2(N−1)/N·Ψ·4 = {dp_step:,.0f} B (Ψ = {psi:,})")
for batch in (8, 12, 13, 16, 64):
    tp_step = tp_formula * batch * cfg.block_size
    print(f"  global batch {batch:>3} × s={cfg.block_size}: TP {tp_step:>9,.0f} B, DP {dp_step:>9,.0f} B per rank "
          f"per step → {'TP' if tp_step < dp_step else 'DP'} sends fewer bytes")
cross = dp_step / tp_formula  # global tokens per step where TP's bytes reach DP's
print(f"crossover in bytes: DP sends fewer bytes per rank per step than TP beyond {cross:,.0f} global tokens per "
      f"step ({cross / cfg.block_size:,.1f} sequences of {cfg.block_size} at N = t = 2)")

# %% tags=["nbval-ignore-output"]
batches = [2, 4, 8, 16, 32, 64, 128]
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.loglog(batches, [tp_formula * b * cfg.block_size for b in batches], "o-", label="TP (t=2): every layer, every token")
ax.loglog(batches, [dp_step] * len(batches), "s-", label="DP (N=2): gradients once per step")
ax.plot([8], [tp[0]["block_tp_ring_bytes"]], "k*", markersize=12, label="TP measured (CommLog)")
ax.axvline(cross / cfg.block_size, color="grey", linestyle=":", label="crossover")
ax.set(xlabel="sequences per step (global batch)", ylabel="bytes sent per rank per step",
       title=f"DP sends fewer bytes beyond {cross / cfg.block_size:.1f} sequences per step")
ax.legend(fontsize=8, frameon=False)
plt.tight_layout()
plt.show()

# %%
NVLINK, INFINIBAND, LINK_ALPHA = 400e9, 50e9, 10e-6  # the assumed links: β (B/s) inside / across nodes, α (s)
big_L, big_h, s, t = 96, 12288, 2048, 8
layer = tp_allreduce_bytes_per_layer(1, s, big_h, dtype_bytes=2)
flops = 3 * 24 * s * big_h**2 / t  # forward 24·s·h² per layer (b = 1), ×3 for training, split over t
compute_s = flops / 300e12
for link, beta in (("NVLink, inside a node", NVLINK), ("InfiniBand, across nodes", INFINIBAND)):
    ab = AlphaBeta({"all_reduce": LINK_ALPHA}, {"all_reduce": beta}, t, 0)
    comm_s = layer["calls"] * ab.predict("all_reduce", layer["tensor_bytes"] / layer["calls"])
    print(f"one layer at t={t} over {link:<25}: TP comm {comm_s * 1e3:5.2f} ms vs compute {compute_s * 1e3:4.1f} ms "
          f"per micro-batch → {comm_s / compute_s:4.0%} of compute")

# %% [markdown]
# <a id="tp-vs-dp-time"></a>
# **TP vs DP step time on this machine, predicted then measured.** Bytes are not time. `E.tp_vs_dp_step_times`
# trains the same GPT on 2 ranks at global batches 8 and 16 (either side of the byte crossover above), once with
# our TP (t = 2: every rank all B sequences, 1/t of every layer) and once with our `DDP` (N = 2: every rank B/N
# sequences, all of every layer; buckets of about one block), under chapter 00's **modelled accelerator clock**
# ([accelerator-clock](00_setup_and_collectives.ipynb#accelerator-clock)): every block also sleeps its FLOPs / a
# calibrated rate, and gloo's threads have the cores meanwhile, as a GPU's communication runs beside its kernels.
# The cell first **predicts** each step with the step-time model (`course_lib.step_time`):
#
# - compute = FLOPs / rate, the same in both: a TP rank computes 1/t of every layer for all B sequences, a DP rank
#   all of every layer for B/N of them;
# - TP adds every all-reduce whole (`step_time.tp_step`): each sits on the critical path, since the next operation
#   needs the sum;
# - DP adds what its buckets leave after backward (`step_time.ddp_step`): a bucket all-reduces while backward
#   computes the layers before it, and the last one (the embeddings') is ready only when backward ends;
# - β: chapter 00's fit from the all-reduce sweep of section 6's spawn. α: measured in the spawn right before the
#   timing, the way TP's step issues its calls. Under the clock each all-reduce waits behind a sleep (a block's
#   forward sleeps after its ops, its backward before them) or comes right after its pair's. After a sleep gloo's
#   worker threads, and the peer's, must be woken and scheduled before the call starts; back to back they are
#   awake. The wake-up depends on what else the cores run, so gloo's α after a sleep has a tail of slow calls, and
#   the sweep's back-to-back α is not the one a clocked step meets. So the spawn replays one TP step's calls alone
#   (`E.tp_allreduce_gaps`: the same idle gap before each, from the step's modelled parts; 1 KiB each, so α alone),
#   several times, and takes the *mean* call of the median replay: a step pays the sum of its calls, slow wake-ups
#   included, which the median call would drop, and the timing reports the median step. TP puts all of its calls on
#   the critical path, so its prediction rests on this α; DP's bucket calls also follow backward's sleeps and use
#   the same α.
#
# Then it measures the four steps in interleaved rounds (`course_lib.timing.time_steps`: median [min–max] over
# rounds), and compares each median with its prediction within the course's ±20 % band (displayed, not asserted).

# %% tags=["nbval-ignore-output"]
from dataclasses import replace

from course_lib import step_time as st

race = spawn(E.tp_vs_dp_step_times, 2, kwargs=dict(batches=(8, 16)), timeout=240)[0]
fit = fit_alpha_beta(runs[0]["alpha_beta_rows"], min_bytes=2**20)  # chapter 00's fit of the sweep
here = AlphaBeta({"all_reduce": race["clocked_alpha"]},  # α: the calls replayed as the clocked step issues them
                 fit.beta_bytes_per_s, 2, fit.min_bytes, fit.points)
print(f"all-reduce α: {fit.alpha_s['all_reduce'] * 1e3:.2f} ms fitted to the back-to-back sweep, "
      f"{race['clocked_alpha'] * 1e3:.2f} ms replayed as TP's clocked step issues its calls (used below)")
print(here.table())


def predict(name, forward_s, link):
    """The step-time model of one timed step: TP's all-reduces all exposed, DP's buckets beside backward."""
    batch = int(name.split("=")[1])
    if name.startswith("TP"):
        fwd_bytes, bwd_bytes = st.tp_allreduces(L, batch * cfg.block_size, cfg.d_model)
        return st.tp_step(forward_s, fwd_bytes, bwd_bytes, link, 2)
    return st.ddp_step(forward_s, race["buckets"], link, 2)


pred = {name: predict(name, fwd, here) for name, fwd in race["forward_s"].items()}
timed = replace(race["timings"], predicted={name: p.total for name, p in pred.items()},
                title="TP (t = 2) vs DP (N = 2) at the same global batch: step time, measured vs predicted")
print(timed.table())

# %% [markdown]
# Where the time goes, batch by batch: the compute part of each prediction, the all-reduce time it leaves on the
# step, and which of the two the model and the measurement put first.

# %% tags=["nbval-ignore-output"]
for b in (8, 16):
    p_tp, p_dp = pred[f"TP, B={b}"], pred[f"DP, B={b}"]
    tp_exposed, dp_exposed = p_tp.total - p_tp.parts["compute"], p_dp.total - p_dp.parts["compute"]
    first = "TP" if p_tp.total < p_dp.total else "DP"
    print(f"B={b:>2}: compute {p_tp.parts['compute'] * 1e3:.0f} ms (TP) vs {p_dp.parts['compute'] * 1e3:.0f} ms (DP); "
          f"all-reduce left on the step: TP {tp_exposed * 1e3:.1f} ms ({race['tp_allreduces'][b]} calls, "
          f"{race['tp_allreduces'][b]} × α = {race['tp_allreduces'][b] * here.alpha_s['all_reduce'] * 1e3:.1f} ms), "
          f"DP {dp_exposed * 1e3:.1f} ms ({len(race['buckets'])} buckets, "
          f"{sum(p_dp.hidden.values()) * 1e3:.1f} ms more ran beside backward)")
    print(f"      predicted: {first} faster by {max(p_tp.total, p_dp.total) / min(p_tp.total, p_dp.total):.2f}×; "
          f"measured: {timed.compare(f'TP, B={b}', f'DP, B={b}').verdict}")
tp_ring = tp[0]["forward_ring_bytes"] + tp[0]["backward_ring_bytes"]  # every all-reduce of TP's step, batch 8
left = {name: p.total - p.parts["compute"] for name, p in pred.items()}  # all-reduce time left on each step
print(f"at B=8 TP's all-reduces carry {tp_ring:,.0f} ring bytes per rank, {tp_ring / dp_step:.2f}× DP's "
      f"{dp_step:,.0f}, and leave {left['TP, B=8'] / left['DP, B=8']:.1f}× DP's all-reduce time on the step")

# %% [markdown]
# **Where TP and DP cross, and what moves the crossover.** The compute is the same in both, so the crossover lies in
# the communication. Per step, TP makes $n_{TP}$ all-reduces whose ring bytes grow with the $Bs$ global tokens; DP
# makes $n_{DP}$ (its buckets) of $2(N-1)/N \cdot \Psi \cdot 4$ bytes, whatever the batch. With $\alpha + \text{ring
# bytes}/\beta$ per call, TP's all-reduces add up to more than DP's from
# $$Bs = \big(n_{DP}\,\alpha_{DP} + \text{DP's ring bytes}/\beta_{DP} - n_{TP}\,\alpha_{TP}\big)
# \cdot \beta_{TP} \,/\, \text{TP's ring bytes per token}$$
# global tokens per step on. With α = 0 and one link for both, that is the plot's byte crossover (counted here over
# all of TP's all-reduces, the embedding's, the head's and the loss's too; the plot counts the blocks'). Giving TP a
# link with a larger β than DP's (NVLink inside a node, InfiniBand across nodes) multiplies it by
# $\beta_{TP}/\beta_{DP}$; each of TP's calls subtracts its α. At or below zero, DP's all-reduces add up to less at
# every batch. The formula compares the all-reduces whole: DP's also run beside backward (above), which leaves even
# less of them on the step.

# %% tags=["nbval-ignore-output"]
n_tp, n_dp = race["tp_allreduces"][8], len(race["buckets"])
tp_ring_per_token = tp_ring / tokens  # all of TP's all-reduces: blocks, embedding, head, loss


def crossover_tokens(alpha_tp, beta_tp, alpha_dp, beta_dp):
    """Global tokens per step from which TP's all-reduces add up to more than DP's (α + ring bytes / β each)."""
    return (n_dp * alpha_dp + dp_step / beta_dp - n_tp * alpha_tp) * beta_tp / tp_ring_per_token


a_here, b_here = here.alpha_s["all_reduce"], here.beta_bytes_per_s["all_reduce"]
cases = {
    "one link, α = 0 (bytes alone)": (0, b_here, 0, b_here),
    f"this machine for both (α {a_here * 1e3:.2f} ms, β {b_here / 1e9:.2f} GB/s)": (a_here, b_here, a_here, b_here),
    f"TP on NVLink {NVLINK / 1e9:.0f} GB/s, DP on InfiniBand {INFINIBAND / 1e9:.0f} GB/s, α = 0":
        (0, NVLINK, 0, INFINIBAND),
    f"the same links, α = {LINK_ALPHA * 1e6:.0f} µs per call": (LINK_ALPHA, NVLINK, LINK_ALPHA, INFINIBAND),
}
print(f"TP: {n_tp} all-reduces per step, {tp_ring_per_token:,.0f} ring bytes per token; "
      f"DP: {n_dp} bucket all-reduces, {dp_step:,.0f} ring bytes per step")
for label, links in cases.items():
    c = crossover_tokens(*links)
    where = (f"from {c:,.0f} global tokens per step ({c / cfg.block_size:,.1f} sequences) on" if c > 0 else
             f"at every batch ({n_tp} × α of TP ≥ DP's {n_dp} calls with all their bytes)")
    print(f"{label:<62} → DP's all-reduces add up to less {where}")
bytes_only = crossover_tokens(0, b_here, 0, b_here)
print(f"the bandwidth ratio NVLink / InfiniBand = {NVLINK / INFINIBAND:.0f}× moves the crossover "
      f"{crossover_tokens(0, NVLINK, 0, INFINIBAND) / bytes_only:.0f}× further out; "
      f"at α = {LINK_ALPHA * 1e6:.0f} µs, "
      f"TP's {n_tp} calls take {n_tp * LINK_ALPHA * NVLINK / tp_ring_per_token:,.0f} tokens off it and DP's "
      f"{n_dp} add {n_dp * LINK_ALPHA * NVLINK / tp_ring_per_token:,.0f}")

# %% [markdown]
# ## 8. Sequence parallelism: the all-reduce becomes reduce-scatter + all-gather
# <a id="sequence-parallel"></a>
#
# TP divides the activations *inside* the parallel regions by t, but not the ones between them: LayerNorm inputs,
# the residual stream, dropout masks stay whole on every rank. Korthikanti et al. (2022) write the activations of a
# layer as $s b h (10 + 24/t + 5as/(ht))$ with TP: the 10·sbh part does not shrink. **Sequence parallelism** splits
# those regions along the sequence: each rank keeps s/t positions. Since all-reduce = reduce-scatter + all-gather,
# g becomes a **reduce-scatter** along s (each rank gets the summed output for its positions) and f an
# **all-gather** along s: the same bytes, but the activations in between are 1/t. LayerNorm weights (and here the
# position embedding) now see only s/t positions per rank: their gradients are **partial** and must be all-reduced
# over the TP group (`allreduce_sequence_parallel_grads`; each rank's partial gradient alone is wrong).
# DTensor's `SequenceParallel` style gets the same rule right by marking those gradients `Partial(sum)` (below).
#
# *Context parallelism* goes further for long sequences: it splits the sequence *through attention* too (ring
# attention passes K/V blocks around the group); torchtitan gives it its own mesh dimension, `cp`, next to `tp`.

# %%
sp = [r["sp"] for r in runs]
print("forward :", sp[0]["forward"])
print("backward:", sp[0]["backward"])
print(f"activation bytes saved for backward per rank: one device {one_device_activation:,}, "
      f"TP t=2 {tp[0]['activation_bytes']:,}, TP+SP {sp[0]['activation_bytes']:,} "
      f"(SP saves {1 - sp[0]['activation_bytes'] / tp[0]['activation_bytes']:.0%} of TP's)")
sp_table = Result(title="sequence parallelism (ours), t = 2")
sp_table.equal("gradients after the LayerNorm all-reduce", E.merge_shards(sp), ref_grads, SGD)
sp_table.exact("all-reduces left in the blocks (forward)", sp[0]["forward"].get("all_reduce:tp", 0), 0,
               "g → reduce-scatter, f → all-gather")
sp_table.exact("block ring bytes per rank", sp[0]["block_tp_ring_bytes"], tp[0]["block_tp_ring_bytes"],
               "TP's all-reduces (= reduce-scatter + all-gather)")
_ = sp_table.condition("activation bytes per rank", sp[0]["activation_bytes"],
                       sp[0]["activation_bytes"] < tp[0]["activation_bytes"] < one_device_activation,
                       "TP + SP < TP < one device", reference=tp[0]["activation_bytes"], against="TP")

# %% tags=["nbval-ignore-output"]
print(sp_table)
sp_table.assert_passed()

# %% [markdown]
# The saving is modest here: in this fp32 model without dropout the replicated part is mostly the LayerNorm inputs,
# and our column layers keep the all-gathered (full-sequence) input for their weight gradient. Megatron also
# re-gathers that input in backward instead of keeping it, which is how its layer reaches $sbh(34/t + 5as/(ht))$.

# %% [markdown]
# ## 9. The DTensor version: `parallelize_module`
# <a id="dtensor"></a>
#
# PyTorch expresses the same plan declaratively. A `DeviceMesh` names the ranks; `parallelize_module` takes a plan
# `{submodule name: style}` and turns the weights into DTensors (`Shard(0)` for `ColwiseParallel`, `Shard(1)` for
# `RowwiseParallel`) with the collectives inserted by the styles' input/output layouts. `loss_parallel()` computes
# the cross-entropy on logits sharded over V, never gathered. torch's own counter of the collectives DTensor
# issues, `CommDebugMode`, stands beside our `CommLog` counts of section 7. The second half is the
# sequence-parallel plan of the blocks: `SequenceParallel()` LayerNorms on s/t positions, the sequence gathered
# before attention and MLP, the row outputs reduce-scattered back to `Shard(1)`.

# %%
def dtensor_tp(batch_size=8):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, loss_parallel, parallelize_module)

    from course_lib.launch import device

    cfg, dev, t = parallel_config(), device(), dist.get_world_size()
    mesh = init_device_mesh(dev.type, (t,), mesh_dim_names=("tp",))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),  # vocab-parallel embedding
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}  # for loss_parallel
    for i in range(cfg.n_layer):
        plan |= {f"blocks.{i}.attn.c_attn": ColwiseParallel(), f"blocks.{i}.attn.c_proj": RowwiseParallel(),
                 f"blocks.{i}.mlp.c_fc": ColwiseParallel(), f"blocks.{i}.mlp.c_proj": RowwiseParallel()}
    model = parallelize_module(GPT(cfg, seed=0).to(dev), mesh, plan)
    x, y = step_batch(0, cfg, batch_size, dev)
    with loss_parallel():
        with CommDebugMode() as fwd:
            logits, loss = model(x, y)
        with CommDebugMode() as bwd:
            loss.backward()

    def full(g):  # a DTensor's global value; a plain tensor as it is
        return (g.full_tensor() if hasattr(g, "full_tensor") else g).cpu()

    out = {"loss": full(loss).item(), "grads": {n: full(q.grad) for n, q in model.named_parameters()},
           "forward": {str(k): v for k, v in fwd.get_comm_counts().items()},
           "backward": {str(k): v for k, v in bwd.get_comm_counts().items()}}
    # sequence parallelism on the blocks: activations Shard(1) between the parallel regions
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    sp_plan = {}
    for i in range(cfg.n_layer):
        sp_plan |= {f"{i}.ln_1": SequenceParallel(), f"{i}.ln_2": SequenceParallel(),
                    f"{i}.attn": gather, f"{i}.mlp": gather,
                    f"{i}.attn.c_attn": ColwiseParallel(), f"{i}.mlp.c_fc": ColwiseParallel(),
                    f"{i}.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                    f"{i}.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}
    blocks = parallelize_module(GPT(cfg, seed=0).blocks.to(dev), mesh, sp_plan)
    h = torch.randn(2, cfg.block_size, cfg.d_model, generator=torch.Generator().manual_seed(1)).to(dev)
    h = h.chunk(t, 1)[dist.get_rank()]  # my s/t positions
    with CommDebugMode() as sp_counts:
        for block in blocks:
            h = block(h)
        h.pow(2).sum().backward()
    out["sp"] = {str(k): v for k, v in sp_counts.get_comm_counts().items()}
    out["sp_grads"] = {n: full(q.grad) for n, q in blocks.named_parameters()}
    out["ln_placements"] = {type(q.grad.placements[0]).__name__ for n, q in blocks.named_parameters()
                            if ".ln_" in f".{n}"}
    return out


dtp = spawn(dtensor_tp, 2)[0]
blocks_ref = GPT(cfg, seed=0).blocks
hb = torch.randn(2, cfg.block_size, cfg.d_model, generator=torch.Generator().manual_seed(1))
for block in blocks_ref:
    hb = block(hb)
hb.pow(2).sum().backward()
print("CommDebugMode, forward: ", dtp["forward"])
print("CommDebugMode, backward:", dtp["backward"])
print("CommDebugMode, sequence-parallel blocks:", dtp["sp"])
dtensor = Result(title="DTensor parallelize_module (t = 2) vs one device and vs our TP")
dtensor.equal("loss under loss_parallel()", dtp["loss"], ref_loss.item(), SGD)
dtensor.equal("gradients (full_tensor)", dtp["grads"], ref_grads, SGD)
dtensor.exact("all-reduces forward: CommDebugMode vs our CommLog", sum(dtp["forward"].values()),
              sum(tp[0]["forward"].values()), "ours (2 per block + embedding + 3 in the loss)")
dtensor.exact("all-reduces backward: CommDebugMode vs our CommLog", sum(dtp["backward"].values()),
              sum(tp[0]["backward"].values()), "ours (2 per block + head)")
dtensor.equal("SP blocks: gradients (full_tensor)", dtp["sp_grads"],
              {n: q.grad for n, q in blocks_ref.named_parameters()}, SGD)
_ = dtensor.condition("SP blocks: LayerNorm weight gradients' placement", dtp["ln_placements"],
                      dtp["ln_placements"] == {"Partial"}, "Partial: DTensor defers their all-reduce over TP")

# %% tags=["nbval-ignore-output"]
print(dtensor)
dtensor.assert_passed()

# %% [markdown]
# Two traps (`tensor_parallel.dtensor_plan` and `parallelize_gpt` are the plan above, kept in `course_lib`):
# - **`loss_parallel()` needs the head's output as a DTensor** `Shard(-1)` (`use_local_output=False`). With the
#   default `ColwiseParallel()` the GPT receives plain local logits of V/t columns and its cross-entropy fails (or,
#   with luckier targets, computes a wrong loss).
# - **Tied weights.** Parallelizing the second of two modules that share a parameter re-wraps it as a new DTensor
#   parameter: the tie is silently gone. Use the untied config (as here) or re-tie after parallelizing.

# %%
dt = runs[0]["dtensor"]
print("trap 1, default ColwiseParallel head under the GPT's loss:", dt.local_logits_error)
print("trap 2, a tied GPT still tied after parallelize_module:", dt.tied_after_parallelize)

# %% [markdown]
# ## 10. Two dimensions: DP × TP on a `DeviceMesh`
# <a id="dp-tp"></a>
#
# 4 ranks as a (dp=2, tp=2) mesh: ranks {0, 1} and {2, 3} are TP groups (same batch shard, each half of every
# layer); ranks {0, 2} and {1, 3} are DP groups (replicas of the same weight shards, different halves of the
# batch). The TP all-reduces run in the **tp** groups, the gradient all-reduce in the **dp** groups — counted per
# mesh dimension (`CommRecord.group`). Then the torchtitan composition: DTensor TP over `mesh["tp"]`, and FSDP2
# `fully_shard` over `mesh["dp"]` (parameters sharded over dp: all-gather and reduce-scatter on dp, all-reduce on tp).

# %%
mesh_runs = spawn(E.mesh_suite, 4, kwargs=dict(global_batch=8, steps=5), timeout=240)
dp0 = sorted((r["dp_tp"] for r in mesh_runs if r["dp_tp"].dp_rank == 0), key=lambda r: r.tp_rank)
mesh_table = Result(title="2-D mesh (dp = 2, tp = 2) vs one device")
mesh_table.equal("DP×TP (ours), weights after 5 AdamW steps", E.merge_shards(dp0, "state"),
                 reference_run(cfg, 5, 8, "adamw")[0].state_dict(), ADAMW)
mesh_table.equal("FSDP2 (dp) × DTensor TP (tp), gradients", mesh_runs[0]["fsdp_tp"].grads, ref_grads, SGD)
print("collectives per step and mesh dimension:", mesh_runs[0]["dp_tp"].collectives_step0)
ring = mesh_runs[0]["dp_tp"].ring_bytes_step0
print(f"ring bytes per rank and step: tp {ring['tp']:,.0f}, dp {ring['dp']:,.0f}")
print("FSDP2 × TP collectives per mesh dimension:", mesh_runs[0]["fsdp_tp"].collectives)

# %% tags=["nbval-ignore-output"]
print(mesh_table)
mesh_table.assert_passed()

# %% [markdown]
# **3-D placement on a cluster (DP × PP × TP).** Put the dimension that talks most on the fastest links: **TP
# innermost**, within a node (NVLink; t ≤ GPUs per node, often 8) — its per-layer, per-token all-reduces sit on
# the critical path (section 7 printed their predicted share of a layer's compute over NVLink and over
# InfiniBand); **DP and PP** across nodes: DP all-reduces once per step, overlapped with backward and amortized
# over the batch; PP sends only boundary activations, point to point (chapter 05). torchtitan orders its mesh
# `(pp, dp_replicate, dp_shard, cp, tp)`: the last dimension is the innermost (consecutive ranks), so TP ranks
# are neighbours on one node, and PP is the outermost — rank = ((pp·DP + dp)·TP + tp), so the ranks of one
# pipeline stage are a contiguous block and only the stage boundaries cross those blocks.

# %% [markdown]
# ## 11. Exercise
# `exercises/tensor_parallel.py` — write `column_parallel_linear` and `row_parallel_linear` as
# `torch.autograd.Function`s, forward **and** backward by hand: where does each need its all-reduce?
#
# ```python
# def column_parallel_linear(x, weight, bias=None, group=None) -> Tensor
#     # x (…, in) whole on every rank; weight (out/t, in) and bias (out/t,): this rank's rows → y_i (…, out/t)
# def row_parallel_linear(x_shard, weight, bias=None, group=None) -> Tensor
#     # x_shard (…, in/t): this rank's block; weight (out, in/t); bias (out,) whole → y (…, out) whole
# ```
#
# The checker runs them on 2 and then 4 real ranks against `nn.Linear` (2-D and 3-D inputs, with and without bias):
# the output, ∂L/∂x and this rank's weight and bias gradients within `SGD`, and the number of all-reduces in each
# direction (the counts section 3's f and g imply). `check(name)` prints PASS, FAIL with the
# first wrong tensor and its error, or UNSOLVED while the `TODO` is still there (or run
# `course-lib check column_parallel_linear` in a terminal). Stuck? Hints come in two layers
# (`from course_lib.checks.tensor_parallel import hint`) — `hint(name, 1)` the idea, `hint(name, 2)` the API — and
# never the code.
#
# Until you write them, the checker reports *unsolved*:

# %%
from course_lib.check import check

print(check("column_parallel_linear"))
print(check("row_parallel_linear"))

# %% [markdown]
# The reference solutions (`solutions/tensor_parallel.py`) pass the same checks — here on 2 ranks only
# (`world_sizes=(2,)` keeps the notebook short; `check(name)` without it runs 2 and then 4, as your own check does):

# %%
print(check("column_parallel_linear", package="solutions", world_sizes=(2,)))
print(check("row_parallel_linear", package="solutions", world_sizes=(2,)))

# %% [markdown]
# ## 12. O/X quiz

# %%
from course_lib.quiz import quiz

quiz("tensor-parallel")

# %% [markdown]
# ## Summary
# - Column-parallel Linear: rank i computes its output columns from the full input, no forward communication;
#   row-parallel: partial sums of the full shape, added by one all-reduce (bias once). Column then row (MLP,
#   attention by heads) needs one f and one g per block: **2 all-reduces forward + 2 backward per layer**, counted
#   above (8 + 8 for 4 layers, plus 1 for the embedding, 1 for the head and 3 for the vocab-parallel loss).
# - The TP GPT equals one device: logits, loss, gradients and 10 AdamW steps within 1e-5 (printed above); so do
#   TP + sequence parallelism, DTensor's `parallelize_module` (the same collective counts), DP × TP on a 2 × 2 mesh
#   and FSDP2 × TP.
# - Each rank stores 1/t of the block Linears; LayerNorms and the position embedding stay whole.
# - Per rank and step at the same global batch, TP's bytes grow with the batch (every token, every layer; measured
#   = formula) and DP's do not (the gradients once): they cross at the batch printed above. The bandwidth ratio of
#   NVLink over InfiniBand moves that crossover in time by the same factor. TP stays inside a node because its
#   all-reduces sit on the critical path of every layer: the GPT-3-sized layer above printed what share of its
#   compute they take over NVLink and over InfiniBand; DP's gradients cross nodes once per step, beside backward;
#   PP's boundary activations are smaller still. At small sizes the number of calls matters too: each all-reduce pays α, and TP
#   makes one per parallel region and direction — the crossover cell prints how far α moves it.
# - Under the modelled clock both steps are predicted from the same parts (compute = FLOPs / rate, equal in both;
#   TP's all-reduces all on the critical path; DP's buckets beside backward) and measured at batches 8 and 16: the
#   table prints each median against its prediction, and the lines under it which of the two came first.
# - Sequence parallelism turns each all-reduce into reduce-scatter + all-gather (same bytes) and cuts the activation
#   bytes saved per rank (printed above); its LayerNorm gradients must be all-reduced over the TP group.

# %% tags=["nbval-ignore-output"]
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
