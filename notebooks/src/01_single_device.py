# %% [markdown]
# # 01 · One device: the baseline every chapter is compared with
#
# **What you will learn**
# - the tiny GPT of this course (`course_lib/models.py`, nanoGPT-style) and the synthetic task it learns in
#   300 steps (the time it took on this machine is printed under the training cell);
# - how fast it trains on one device (tokens/s), and how that changes with the batch size (a measured sweep);
# - where the memory goes: **parameters, gradients, optimizer state** (the *model states*) and **activations** —
#   measured from the real tensors, then compared with the formulas (the 16Ψ rule of thumb);
# - **activation checkpointing** measured on one device: the bytes it saves and the forward it repeats;
# - **bf16 mixed precision** (`torch.autocast` on the CPU): what it does to memory, step time and loss, and why
#   mixed precision keeps fp32 master weights (the ZeRO paper's 2 + 2 + 12 = 16 bytes per parameter);
# - how many FLOPs a training token costs (6Ψ + 12·L·s·d) and what fraction of a measured matmul rate the run
#   achieves (MFU);
# - performance engineering as practitioners do it: a `torch.profiler` trace of a few steps (Chrome-trace JSON
#   for Perfetto, drawn here from the file, with the top ops of `key_averages()`); `torch.compile` (inductor on
#   the CPU) against eager — compile time, step time, equal losses — and a graph break found with
#   `torch._dynamo.explain`; the bytes allocated over one step (forward, backward, optimizer), its peak checked
#   against the model states + activations measured in section 3.
#
# **What you need**: chapter 00 is not required; PyTorch at the level of a training loop (`loss.backward()`,
# `optimizer.step()`).
#
# **Stored build:** 41 s on 2 cores (0% of them busy just before it started).
#
# This is the baseline the later chapters compare with: each of them checks that its distributed run equals a
# single-device run of the same model and data (computed in that chapter, on its own configuration), and measures
# its speed against one device.

# %% tags=["nbval-ignore-output"]
import time

_t_notebook = time.perf_counter()
import math

import matplotlib.pyplot as plt
import torch

from course_lib import formulas, memory
from course_lib.data import loss_floor, make_batch
from course_lib.models import GPT, tiny_config
from course_lib.results import Result
from course_lib.train import train_single_device, train_step

_ = torch.manual_seed(0)

# %% [markdown]
# ## 1. The model and the task
#
# Each sequence starts with two random tokens and continues as two interleaved counters: `x[t] = (x[t−2] + 1) mod V`.
# Position 0 cannot be predicted (cost ln V), every later position can (attend two back, add one). So the loss goes
# from ln V ≈ 3.47 (V = 32) toward the floor ln(V)/T.

# %%
cfg = tiny_config()
model = GPT(cfg)
print(cfg)
print(f"parameters Ψ = {model.num_params():,} (the tied embedding / output matrix counted once)")
x, y = make_batch(2, 12, cfg.vocab_size, seed=0)
print("a sample:", x[0].tolist())
print("targets: ", y[0].tolist())
print(f"loss floor ln(V)/T = {loss_floor(cfg.block_size, cfg.vocab_size):.3f}; untrained ≈ ln V = {math.log(cfg.vocab_size):.3f}")

# %% [markdown]
# ## 2. Train on one device
#
# <a id="throughput"></a>
# **Throughput** (tokens/s) is the number the later chapters compare with. A larger batch raises it only while the
# hardware has idle capacity; once the cores are saturated, a step's work grows with the batch and the cores have
# nothing left to give it, so throughput does not simply double with the batch size.

# %% tags=["nbval-ignore-output"]
run = train_single_device(cfg, steps=300, batch_size=32, lr=3e-3, progress=False)
print(f"{run['tokens_per_s']:,.0f} tokens/s ({run['seconds']:.1f} s for 300 steps), one process using "
      f"{torch.get_num_threads()} CPU thread(s)")

# %% [markdown]
# <a id="throughput-sweep"></a>
# **Throughput against the batch size.** The same model, one AdamW step per call, timed with
# `course_lib.timing.time_steps` (warm-up, interleaved rounds, median and min–max per batch size). Tokens/s =
# b·s / step time. A step has a fixed part (Python, autograd's bookkeeping, launching about 1,500 op calls of
# about 60 kinds — section 5's profile counts them —, the optimizer over every parameter) and a part that grows with b; while the fixed part dominates, a larger batch is
# nearly free, and once the matmuls fill the cores each extra row costs its full share.

# %% tags=["nbval-ignore-output"]
from course_lib.timing import time_steps


def one_step_at(batch):
    m = GPT(cfg)
    o = torch.optim.AdamW(m.parameters(), lr=3e-3)
    xb, yb = make_batch(batch, cfg.block_size, cfg.vocab_size, seed=0)
    return lambda: train_step(m, o, xb, yb)


BATCHES = (1, 4, 16, 64)
sweep_t = time_steps({f"b={b_}": one_step_at(b_) for b_ in BATCHES}, rounds=3, steps_per_round=2,
                     title="one AdamW step of the tiny GPT, by batch size")
tok_s = [b_ * cfg.block_size / sweep_t[f"b={b_}"].median for b_ in BATCHES]
print(sweep_t)
for lo_, hi_ in zip(range(len(BATCHES) - 1), range(1, len(BATCHES)), strict=True):
    print(f"b {BATCHES[lo_]:>2} → {BATCHES[hi_]:>2} ({BATCHES[hi_] // BATCHES[lo_]}× the tokens per step): "
          f"tokens/s ×{tok_s[hi_] / tok_s[lo_]:.2f}")
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(BATCHES, tok_s, "o-")
ax.set_xscale("log", base=2)
ax.set_xlabel("batch size b (sequences of s = 32 tokens)")
ax.set_ylabel("tokens/s (median step)")
ax.set_title(f"throughput ×{tok_s[-1] / tok_s[0]:.1f} for {BATCHES[-1] // BATCHES[0]}× the batch "
             f"(×{tok_s[-1] / tok_s[-2]:.2f} over the last 4×)")
plt.tight_layout()
plt.show()

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(run["loss"], label="training loss")
ax.axhline(loss_floor(cfg.block_size, cfg.vocab_size), color="gray", ls="--", label="floor ln(V)/T")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy (nats)")
ax.set_yscale("log")
floor = loss_floor(cfg.block_size, cfg.vocab_size)
last20 = sum(run["loss"][-20:]) / 20
ax.set_title(f"one device, batch 32: the loss approaches the floor (last-20 mean {last20:.3f} vs {floor:.3f})")
ax.legend()
plt.show()
claims = Result(title="sections 2 and 3, checked: the loss, the model states, the activations")  # shown in section 3
first = run["loss"][0]
claims.condition("first loss (nats)", round(first, 4), abs(first - math.log(cfg.vocab_size)) < 0.1, "|Δ| < 0.1",
                 round(math.log(cfg.vocab_size), 4), "ln V: a uniform guess")
_ = claims.condition("mean loss of the last 20 steps (nats)", round(last20, 4), last20 < 1.25 * floor,
                     "< 1.25 × the floor", round(floor, 4), "the floor ln(V)/T")

# %% [markdown]
# <a id="flops"></a>
# **FLOPs per token.** Each parameter is one multiply-add per token forward (2 FLOPs) and two backward (the input's
# and the weight's gradient, 4 FLOPs): **6Ψ**. Attention adds two matmuls that use no parameter, q·kᵀ and
# softmax·v: **12·L·s·d** per token for training (`formulas.training_flops_per_token`). A transformer layer holds
# about 12·d² parameters (4d² in attention, 8d² in the MLP), so Ψ ≈ 12·L·d² and the ratio of the two terms is
# 12·L·s·d / (6 · 12·L·d²) = **s / (6d)**: the attention term is dropped when s ≪ 6d (GPT-3: s = 2048,
# d = 12288, 2.8 %). Here s = 32 and d = 64, and the ratio is printed below. FLOPs per token × tokens/s = the
# **achieved FLOP/s**; divided by a reference rate it is the **MFU**, model FLOPs utilisation. On a GPU the
# reference is the datasheet peak; here it is the best rate we *measure* for an fp32 matmul of 512×512 and
# 1024×1024 on the same threads (`train.matmul_peak_flops`) — a measured matmul rate, not a datasheet peak.

# %%
fpt = formulas.training_flops_per_token(model.num_params(), cfg.n_layer, cfg.block_size, cfg.d_model)
attn_share = 12 * cfg.n_layer * cfg.block_size * cfg.d_model / fpt
print(f"FLOPs per token = 6Ψ + 12·L·s·d = {6 * model.num_params():,} + "
      f"{12 * cfg.n_layer * cfg.block_size * cfg.d_model:,} = {fpt:,.0f}")
print(f"attention term / 6Ψ = {12 * cfg.n_layer * cfg.block_size * cfg.d_model / (6 * model.num_params()):.3f}; "
      f"the large-model estimate s/(6d) = {cfg.block_size}/{6 * cfg.d_model} = {cfg.block_size / (6 * cfg.d_model):.3f} "
      f"(this model's embeddings and biases make Ψ larger than 12·L·d²)")
print(f"attention share of the FLOPs: {attn_share:.1%}")

# %% tags=["nbval-ignore-output"]
from course_lib.train import matmul_peak_flops

peak = max((matmul_peak_flops(n) for n in (512, 1024)), key=lambda r: r["flops_per_s"])
achieved = fpt * run["tokens_per_s"]
print(f"achieved: {achieved / 1e9:.2f} GFLOP/s; best measured fp32 matmul rate ({peak['n']}×{peak['n']}, "
      f"{peak['threads']} threads): {peak['flops_per_s'] / 1e9:.1f} GFLOP/s (min–max {peak['lo'] / 1e9:.1f}–"
      f"{peak['hi'] / 1e9:.1f}); MFU against that rate = {achieved / peak['flops_per_s']:.1%}")

# %% [markdown]
# Two things can hold a tiny model's MFU down, and later sections measure each: its matrices (64 wide) may be too
# small to keep the cores busy (section 4 prints the matmul rate at the model's own shape beside a 512-wide one), and layer norms, GELU,
# softmax and the Python loop take time that counts as no model FLOP (section 5's profile prints the share of the
# step its top ops hold, and how many `aten::` ranges a step runs).

# %% [markdown]
# ## 3. Where the memory goes
#
# **Model states.** In fp32 with Adam(W), every parameter costs 4 bytes (weight) + 4 (gradient) + 8 (two Adam
# moments) = **16 bytes**: the "16Ψ" rule. We count the bytes of the real tensors — unique storages, so the tied
# embedding/output weight counts once — after an optimizer step, when all three exist. (AdamW also keeps one
# 4-byte `step` counter per parameter *tensor*, which the rule of thumb ignores.) torch's Adam creates its moments
# lazily, at the first `step()`. The optimizer decides the third term: plain SGD without momentum keeps no state at
# all, SGD with momentum one buffer (4 bytes per parameter).

# %%
model, opt = run["model"], run["optimizer"]
states = memory.model_state_bytes(model, opt)
psi = model.num_params()
n_tensors = len(list(model.parameters()))
for key in ("params", "grads", "optimizer", "total"):
    print(f"{key:<10} {states[key]:>10,} bytes  = {states[key] / psi:5.2f} bytes/param")
print(f"16Ψ = {16 * psi:,} bytes; measured − 16Ψ = {states['total'] - 16 * psi} bytes; "
      f"{n_tensors} parameter tensors")
_ = claims.exact("model states − 16Ψ (bytes)", states["total"] - 16 * psi, 4 * n_tensors,
                 f"4 bytes × {n_tensors} AdamW step counters")

# %% [markdown]
# **Activations.** What autograd saves during the forward pass for the backward pass. We measure it with
# `saved_tensors_hooks` (`memory.SavedTensorMeter`) and compare it with the formula derived in
# `formulas.activation_bytes_estimate` for this model on a CPU in fp32: per transformer layer about **64·s·b·h bytes**
# (s sequence, b batch, h d_model). The derivation is a list of what every op saves; `memory.saved_tensors_table`
# reads the same list off the real autograd graph (below, per op, for one forward).
#
# The meter is two hooks: inside `with SavedTensorMeter(...)`, `torch.autograd.graph.saved_tensors_hooks(pack,
# unpack)` makes autograd pass every tensor an op saves for backward through `pack`, and through `unpack` when
# backward reads it. `pack` (below) counts each storage once — `q`, `k` and `v`, views of one matmul's output, share
# one — skips the parameters' storages (model states, counted above), and hands the tensor back unchanged.

# %%
from course_lib import show

show.source(memory.SavedTensorMeter._pack, docstring=False)

# %%
b, s = 32, cfg.block_size
x, y = make_batch(b, s, cfg.vocab_size, seed=0)
with memory.SavedTensorMeter(exclude=model) as meter:
    _, loss = model(x, y)
est = formulas.activation_bytes_estimate(cfg, b)
print(f"measured activations : {meter.bytes:,} bytes")
print(f"estimated (derived)  : {est['total']:,} bytes  (per layer {est['per_layer']:,} = "
      f"{est['per_layer'] / (s * b * cfg.d_model):.1f}·s·b·h)")
print(f"  = {cfg.n_layer} layers × {est['per_layer']:,} + {est['embedding'] + est['head']:,} outside the layers "
      f"(token ids and positions {est['embedding']:,}; final layer norm, logits' input and the loss's "
      f"log-probabilities and targets {est['head']:,})")
claims.exact(f"saved activations, b={b} (bytes)", meter.bytes, est["total"], "the derived formula")
k16 = formulas.korthikanti_activation_bytes(s, b, cfg.d_model, cfg.n_head, n_layers=cfg.n_layer)
print(f"for comparison, the 16-bit GPU formula s·b·h·(34+5as/h)·L = {k16:,.0f} bytes")
table = memory.saved_tensors_table(loss, exclude=model)
loss.backward()
per_op = {}
for row in table:
    if row["new"]:
        n, nb = per_op.get(row["op"], (0, 0))
        per_op[row["op"]] = (n + 1, nb + row["bytes"])
print(f"\n{'backward node (op)':<48}{'tensors':>8}{'bytes':>12}")
for op, (n, nb) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
    print(f"{op:<48}{n:>8}{nb:>12,}")
print(f"{'sum':<48}{sum(n for n, _ in per_op.values()):>8}{sum(nb for _, nb in per_op.values()):>12,}")
_ = claims.exact("sum of the per-op table (bytes)", sum(nb for _, nb in per_op.values()), meter.bytes, "the meter")

# %% [markdown]
# <a id="korthikanti"></a>
# **Why Korthikanti's formula gives a different number.** Korthikanti et al. (2022) count s·b·h·(34 + 5·a·s/h)
# bytes per layer for a GPU run in **16-bit** with **dropout**: their 34 is the same 16 saved floats per s·b·h as
# ours, at 2 bytes each (32), plus two 1-byte dropout masks (2); their 5·a·s/h is the **stored softmax** (2 bytes),
# its dropout mask (1) and the dropped-out probabilities (2), an s×s matrix per head. Here everything is fp32 (4
# bytes: 16 × 4 = 64), dropout is off (no masks), and the CPU's fused attention (SDPA) keeps no s×s matrix — only
# a log-sum-exp per row — and recomputes the probabilities in backward. With `attn="math"` (explicit softmax) the
# s×s term comes back, at 4 bytes: 4·a·s/h, measured next.

# %%
cfg_math = tiny_config(attn="math")
m_math = GPT(cfg_math)
x8, y8 = make_batch(8, s, cfg.vocab_size, seed=0)
m_sdpa = GPT(cfg)
with memory.SavedTensorMeter(exclude=m_math) as meter_math:
    m_math(x8, y8)
with memory.SavedTensorMeter(exclude=m_sdpa) as meter_sdpa_8:
    m_sdpa(x8, y8)
est_math, est_sdpa = formulas.activation_bytes_estimate(cfg_math, 8), formulas.activation_bytes_estimate(cfg, 8)
print(f"math attention, b=8: measured {meter_math.bytes:,} bytes, derived {est_math['total']:,}")
print(f"math − SDPA at b=8: measured {meter_math.bytes - meter_sdpa_8.bytes:,} bytes, derived "
      f"{est_math['total'] - est_sdpa['total']:,} = stored probabilities 4·a·s·s·b·L "
      f"{4 * cfg.n_head * s * s * 8 * cfg.n_layer:,} + causal masks s·s·L {s * s * cfg.n_layer:,} − SDPA's "
      f"log-sum-exp 4·a·s·b·L {4 * cfg.n_head * s * 8 * cfg.n_layer:,}")
claims.exact("math attention, b=8: saved (bytes)", meter_math.bytes, est_math["total"], "the derived formula")
_ = claims.exact("math − SDPA, b=8: saved (bytes)", meter_math.bytes - meter_sdpa_8.bytes,
                 est_math["total"] - est_sdpa["total"], "the derived formulas' difference")

# %% [markdown]
# <a id="activation-sweep"></a>
# **Activations grow with batch and sequence; model states do not.** A sweep over batch b and sequence s, measured
# with the meter and predicted with the derived formula:

# %%
sweep = []
for s_ in (8, 16, 32):
    for b_ in (4, 8, 16, 32):
        xb, yb = make_batch(b_, s_, cfg.vocab_size, seed=0)
        with memory.SavedTensorMeter(exclude=model) as m_:
            model(xb, yb)
        sweep.append(dict(s=s_, b=b_, measured=m_.bytes,
                          formula=formulas.activation_bytes_estimate(cfg, b_, s_)["total"]))
states_after = memory.model_state_bytes(model, opt)["total"]
print(f"activations at b=32, s=32 vs b=4, s=8: {sweep[-1]['measured'] / sweep[0]['measured']:.1f}× "
      f"(32× the tokens)")
claims.exact("(b, s) points where measured = formula", sum(p["measured"] == p["formula"] for p in sweep),
             len(sweep), "every point of the sweep")
_ = claims.exact("model states after the sweep (bytes)", states_after, states["total"],
                 "before it: b, s change nothing")

# %% tags=["nbval-ignore-output"]
print(claims)

# %%
claims.assert_passed()

# %%
from course_lib import viz

ax = viz.scaling_curves([4, 8, 16, 32], {f"s = {s_}: formula": [p["formula"] / 1e6 for p in sweep if p["s"] == s_]
                                         for s_ in (8, 16, 32)},
                        xlabel="batch size b", ylabel="saved activations (MB)",
                        title="activations grow linearly with b and (SDPA: no s×s term) with s; ×: measured")
for i, s_ in enumerate((8, 16, 32)):
    ax.plot([4, 8, 16, 32], [p["measured"] / 1e6 for p in sweep if p["s"] == s_], "x", color=f"C{i}", ms=9,
            label=f"s = {s_}: measured")
ax.axhline(states["total"] / 1e6, color="gray", ls="--", label="model states (any b, s)")
ax.legend(fontsize=8)
plt.show()

# %%
parts = {"parameters": states["params"], "gradients": states["grads"], "optimizer (Adam)": states["optimizer"],
         f"activations (b={b}, s={s})": meter.bytes}
viz.stacked_bars({"this model": parts}, unit="MB", horizontal=True,
                 title=f"one device: the activations are {meter.bytes / states['total']:.1f}× the model states "
                       f"at b={b}, s={s}")
plt.tight_layout()
plt.show()

# %% [markdown]
# Data parallelism (chapter 02) splits the
# batch, so it splits activations but replicates all 16Ψ; ZeRO (chapter 03) shards the model states, not the
# activations.
#
# <a id="saving-activation-memory"></a>
# Activations are saved *for backward*: under `torch.no_grad()` (inference) autograd saves none. When training
# needs less activation memory, **activation checkpointing** (recomputation) keeps only some forward activations
# and recomputes the rest during backward: more compute, less memory.
#
# <a id="activation-checkpointing"></a>
# **Activation checkpointing, measured.** `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` runs
# the block's forward without keeping what its ops save; it keeps the block's input `x`, and in backward runs the
# block's forward again to rebuild the saved tensors just before they are needed. Below every transformer block
# is wrapped so; the meter counts what the forward saves, a forward pre-hook counts how often a block's forward
# starts in one training step, and the gradients are compared with the plain model's. (A *pre*-hook, because
# non-reentrant checkpointing stops its recompute as soon as it has rebuilt the tensors backward needs, so the
# block's forward may never reach its end, where a post-hook would fire.)

# %%
from torch.utils.checkpoint import checkpoint

from course_lib.results import REORDERED


class Checkpointed(torch.nn.Module):
    """Run ``block`` under activation checkpointing: keep its input, recompute the rest in backward."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def step_with_counts(m):
    calls = []
    hooks = [blk.register_forward_pre_hook(lambda *_: calls.append(1)) for blk in m.modules()
             if type(blk).__name__ == "Block"]
    with memory.SavedTensorMeter(exclude=m) as saved:
        _, loss_ = m(x, y)
    loss_.backward()
    for h in hooks:
        h.remove()
    return saved.bytes, len(calls), {i: p_.grad for i, p_ in enumerate(m.parameters())}


plain, ckpt = GPT(cfg), GPT(cfg)
ckpt.blocks = torch.nn.ModuleList(Checkpointed(blk) for blk in ckpt.blocks)
bytes_plain, calls_plain, g_plain = step_with_counts(plain)
bytes_ckpt, calls_ckpt, g_ckpt = step_with_counts(ckpt)
keep = cfg.n_layer * b * s * cfg.d_model * 4  # one fp32 block input per layer
ac = Result(title=f"activation checkpointing, every block (b={b}, s={s}, L={cfg.n_layer}, fp32)")
ac.exact("saved activations, plain (bytes)", bytes_plain, meter.bytes, "section 3's measurement")
ac.exact("saved by the blocks, plain − checkpointed (bytes)", bytes_plain - bytes_ckpt,
         est["per_layer"] * cfg.n_layer - keep, "formula L·(per-layer − one input 4·s·b·h)")
ac.exact("block forwards per training step", calls_ckpt, 2 * calls_plain, "2 × plain (forward + recompute)")
ac.equal("gradients, checkpointed vs plain", g_ckpt, g_plain, REORDERED, "the plain model")
print(ac)
print(f"saved activations: {bytes_plain:,} → {bytes_ckpt:,} bytes ({bytes_plain / bytes_ckpt:.1f}× less)")

# %% [markdown]
# The price is the repeated forward of every block: about 2 of the 6 FLOPs per parameter and token again (plus
# the attention matmuls' forward), so counted in FLOPs the step grows by (2Ψ_blocks + 4·L·s·d) / (6Ψ + 12·L·s·d).
# That ratio counts only the matmuls. A tiny model's step also spends time on what FLOPs do not count: Python,
# launching each small op, layer norms and GELUs, and the checkpoint's own bookkeeping. Whatever the blocks'
# forward costs, the recompute pays again. So the cell below gives two predictions: the FLOP ratio, and the
# measured time of the blocks' forward alone (interleaved with the two steps) added to the plain step; it does
# not include the checkpoint's bookkeeping. Large models checkpoint selectively (only the cheap-to-recompute,
# memory-heavy parts, such as the attention's softmax) because the recompute costs that much.

# %% tags=["nbval-ignore-output"]
psi_blocks = sum(p_.numel() for p_ in plain.blocks.parameters())
extra = (2 * psi_blocks + 4 * cfg.n_layer * s * cfg.d_model) / fpt
opt_plain, opt_ckpt = torch.optim.AdamW(plain.parameters()), torch.optim.AdamW(ckpt.parameters())
h0 = torch.randn(b, s, cfg.d_model, requires_grad=True)  # a block input; the recompute runs with autograd on


def blocks_forward():
    h = h0
    for blk in plain.blocks:
        h = blk(h)


ac_t = time_steps({"plain": lambda: train_step(plain, opt_plain, x, y),
                   "checkpointed": lambda: train_step(ckpt, opt_ckpt, x, y),
                   "blocks' forward alone": blocks_forward}, rounds=5, steps_per_round=2,
                  title=f"one training step, b={b}")
print(ac_t)
t_plain, t_ckpt, t_fwd = (ac_t[k].median for k in ("plain", "checkpointed", "blocks' forward alone"))
ac_p = Result(title="checkpointed step time: two predictions (timings: shown, not asserted)")
ac_p.within("checkpointed / plain step, from FLOPs", t_ckpt / t_plain, 1 + extra, 0.2,
            "1 + recomputed FLOPs / step FLOPs")
ac_p.within("checkpointed / plain step, from time", t_ckpt / t_plain, 1 + t_fwd / t_plain, 0.2,
            "1 + blocks' forward time / plain step")
print(ac_p)

# %% [markdown]
# ## 4. The same rule at scale
# The ZeRO paper's example: Ψ = 7.5B parameters in mixed precision ((2 + 2 + K)·Ψ bytes, K = 12 for fp32 master
# weights + Adam's two moments) need 16Ψ = 120 GB of model states per GPU without sharding. Compare that with the
# memory of the paper's 32 GB V100 (2019) and of today's GPUs, printed below: where the states fit, what is left
# must still hold the activations, the communication buffers and the framework's workspace, and a model ten
# times larger needs 1.2 TB. Sharding the states (ZeRO, chapter 03) divides them by the number of GPUs:

# %%
GPU_GB = {"V100": 32, "A100 / H100": 80, "H200": 141, "MI300X / B200": 192}
states_gb = formulas.zero_model_state_bytes(7.5e9, 64, 0) / 1e9
print(f"7.5B params, 16Ψ = {states_gb:.0f} GB of model states; "
      + "; ".join(f"{gpu} {cap} GB: " + (f"holds them, {cap - states_gb:.0f} GB left" if cap > states_gb
                                         else "does not hold them") for gpu, cap in GPU_GB.items()))
for stage in range(4):
    gb = formulas.zero_model_state_bytes(7.5e9, 64, stage) / 1e9
    print(f"7.5B params, 64 GPUs, ZeRO stage {stage}: {gb:6.1f} GB per GPU")

# %% [markdown]
# <a id="mixed-precision"></a>
# **Mixed precision.** 2 + 2 + 12 is the ZeRO paper's (apex-style) accounting: 16-bit parameters and gradients plus
# fp32 master weights and Adam moments. `torch.amp` autocast keeps fp32 parameters and gradients instead and casts
# inside the operations: 4 + 4 + 8. Either way about 16 bytes per parameter — mixed precision does not halve the
# model states. fp16 has a 5-bit exponent, so small gradients underflow to zero: fp16 training multiplies the loss
# by a scale factor before backward and divides the gradients by it before the step (**loss scaling**, a fix for
# range, not for memory). bf16 has fp32's 8-bit exponent and is usually trained without loss scaling.

# %% [markdown]
# <a id="bf16-autocast"></a>
# **bf16 autocast, run here.** `torch.autocast("cpu", dtype=torch.bfloat16)` around the forward makes the
# matmul-heavy ops (linear layers, attention) cast their inputs to bf16 and compute in bf16; CPU autocast's
# fp32 list holds the losses (`cross_entropy`, `nll_loss`), and ops on neither list (layer norm, softmax, GELU)
# run in their input's dtype — layer norm sees fp32 here because the residual add of a bf16 output to the fp32
# stream promotes to fp32. The parameters stay fp32; each op casts
# the weight it uses on the fly. Backward runs outside the context: autograd replays every op in the dtype its
# forward used, and the gradients arrive in the parameters' dtype, fp32. The loop below is
# `train_single_device`'s, with the forward optionally under autocast; the same data, model seed and AdamW.
#
# **Why fp32 master weights.** bf16 keeps 8 significant bits (7 explicit mantissa bits): the gap between 1 and
# the next bf16 number is 2⁻⁷ ≈ 0.0078, so an update smaller than half that gap, added to a weight of about 1,
# rounds back to the same weight and is lost. In general an update Δw is lost when |Δw| is less than half the gap
# at w, 2⁻⁸·2^⌊log₂|w|⌋: roughly when **|w| ≳ 2⁸·|Δw|** = 256·|Δw| (up to 512· at the top of a power of two).
# Adam's steps are at most about lr in size whatever the gradient, so a weight a few hundred times larger than
# lr (here 3·10⁻³) rounds them away; the weights that the optimizer updates are therefore kept in fp32 — autocast's fp32 parameters, or apex's and the ZeRO paper's
# separate fp32 "master" copy next to bf16/fp16 working weights (2 + 2 + 12 bytes per parameter). The cell below
# measures both: the lost update, and how many of one optimizer step's updates of this model would round away with bf16 weights.

# %%
import contextlib


def train_loop(steps, batch_size=32, amp_dtype=None, lr=3e-3):
    """``train_single_device``'s AdamW loop; with ``amp_dtype`` the forward runs under autocast."""
    m = GPT(cfg)
    o = torch.optim.AdamW(m.parameters(), lr=lr)
    losses_ = []
    for i in range(steps):
        xb, yb = make_batch(batch_size, cfg.block_size, cfg.vocab_size, seed=i)
        o.zero_grad(set_to_none=True)
        amp = torch.autocast("cpu", dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
        with amp:  # the forward only: backward replays each op in the dtype its forward used
            logits_, loss_ = m(xb, yb)
        loss_.backward()
        o.step()
        losses_.append(loss_.item())
    return m, o, losses_, logits_.dtype


m16, o16, losses16, logits_dtype = train_loop(300, amp_dtype=torch.bfloat16)
with memory.SavedTensorMeter(exclude=m16) as meter16:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m16(x, y)
states16 = memory.model_state_bytes(m16, o16)
one = torch.tensor(1.0, dtype=torch.bfloat16)
mp = Result(title=f"bf16 autocast on the CPU, b={b}, s={s}")
mp.condition("dtype of the logits under autocast", str(logits_dtype), logits_dtype == torch.bfloat16,
             "bf16 (a linear layer's output)")
mp.condition("dtype of every parameter and gradient", "fp32",
             all(p_.dtype == p_.grad.dtype == torch.float32 for p_ in m16.parameters()), "all fp32")
mp.exact("model states (bytes)", states16["total"], states["total"], "the fp32 run: 16Ψ + 4 × tensors")
mp.condition("saved activations, autocast / fp32", round(meter16.bytes / meter.bytes, 3),
             meter16.bytes < meter.bytes, "< 1 (matmul inputs kept in bf16)")
mp.condition("bf16: 1 + 0.001 rounds to", (one + 0.001).item(), (one + 0.001).item() == 1.0, "= 1 (update lost)")
mp.condition("fp32: 1 + 0.001 rounds to", (torch.tensor(1.0) + 0.001).item(),
             (torch.tensor(1.0) + 0.001).item() != 1.0, "≠ 1 (update kept)")
print(mp)

# %% tags=["nbval-ignore-output"]
before = [p_.detach().clone() for p_ in m16.parameters()]
xb, yb = make_batch(32, s, cfg.vocab_size, seed=300)
train_step(m16, o16, xb, yb)  # one more fp32 step; what if the weights had been stored in bf16?
lost = sum(((w.bfloat16().float() + (p_.detach() - w)).bfloat16() == w.bfloat16()).sum().item()
           for w, p_ in zip(before, m16.parameters(), strict=True))
print(f"step 301 with bf16 weights: {lost / psi:.0%} of the {psi:,} parameters' updates would round away")
w_abs = torch.cat([w.abs().flatten() for w in before])
dw_abs = torch.cat([(p_.detach() - w).abs().flatten() for w, p_ in zip(before, m16.parameters(), strict=True)])
above = {k: (w_abs > 2**k * dw_abs).float().mean().item() for k in (8, 9)}
print(f"median |w| {w_abs.median():.3g}, median |Δw| {dw_abs.median():.2g}, median |w|/|Δw| "
      f"{(w_abs / dw_abs).nanmedian():.0f}; an update is lost where |w| ≳ 2⁸–2⁹·|Δw|: |w| > 2⁹·|Δw| for "
      f"{above[9]:.0%} of the parameters, > 2⁸·|Δw| for {above[8]:.0%}"
      + (f"; the {lost / psi:.0%} lost lie between the two" if above[9] <= lost / psi <= above[8] else ""))


def amp_step_at(batch, amp_dtype=torch.bfloat16):
    m = GPT(cfg)
    o = torch.optim.AdamW(m.parameters(), lr=3e-3)
    xb, yb = make_batch(batch, cfg.block_size, cfg.vocab_size, seed=0)

    def step():
        o.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=amp_dtype):
            _, loss_ = m(xb, yb)
        loss_.backward()
        o.step()

    return step


amp_t = time_steps({"fp32": one_step_at(32), "bf16 autocast": amp_step_at(32)}, rounds=5, steps_per_round=2,
                   title="one AdamW step, b=32")
print(amp_t)
print(amp_t.compare("bf16 autocast", "fp32").verdict)
mean20, mean20_16 = sum(run["loss"][-20:]) / 20, sum(losses16[-20:]) / 20
gap = max(abs(a - c) for a, c in zip(run["loss"], losses16, strict=True))
print(f"mean loss of the last 20 steps: fp32 {mean20:.4f}, bf16 autocast {mean20_16:.4f}; "
      f"largest per-step difference {gap:.3f}")
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(run["loss"], label="fp32")
ax.plot(losses16, label="bf16 autocast", alpha=0.8)
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy (nats)")
ax.set_yscale("log")
ax.set_title(f"same data and seed: last-20 mean loss {mean20:.3f} (fp32) vs {mean20_16:.3f} (bf16)")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# On a CPU, bf16 matmuls run at a high rate only where the cores have bf16 instructions (AVX-512 BF16, AMX) and
# the matrices are large enough to keep them busy; elsewhere each cast is extra work that buys nothing. The cell
# below prints what this CPU has and its bf16 and fp32 matmul rates: a 64-wide square, the shape of the model's own
# linear layers (the batch's token rows times a 64×64 weight), and a 512-wide square. On a GPU the tensor
# cores run bf16 matmuls at several times their fp32 rate and the activations take half the bytes — the reason
# mixed precision is the default for training large models, while the model states stay at 16 bytes per
# parameter either way.

# %% tags=["nbval-ignore-output"]
def matmul_rate(m, k, n, dtype, seconds=0.05):  # (m×k) @ (k×n): 2·m·k·n FLOPs a call
    a_, b_ = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a_ @ b_
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a_ @ b_
        calls += 1
    return 2 * m * k * n * calls / (time.perf_counter() - t0)


try:
    with open("/proc/cpuinfo") as f_:
        flags = next(line for line in f_ if line.startswith("flags")).split()
    has = ", ".join(f"{fl}: {'yes' if fl in flags else 'no'}" for fl in ("avx512_bf16", "amx_bf16", "amx_tile"))
except (OSError, StopIteration):
    has = "CPU flags not readable here"
print(f"torch.backends.cpu.get_cpu_capability(): {torch.backends.cpu.get_cpu_capability()}; {has}")
d_ = cfg.d_model
shapes = {  # (m, k, n)
    f"{d_}×{d_} square": (d_, d_, d_),
    f"model's linear shape, ({32 * cfg.block_size}×{d_}) @ ({d_}×{d_})": (32 * cfg.block_size, d_, d_),
    "512×512 square": (512, 512, 512),
}
fp32_rate = {}
for label, shape in shapes.items():
    r32, r16 = matmul_rate(*shape, torch.float32), matmul_rate(*shape, torch.bfloat16)
    fp32_rate[label] = r32
    print(f"{label} matmul: fp32 {r32 / 1e9:.1f} GFLOP/s, bf16 {r16 / 1e9:.1f} GFLOP/s (bf16 / fp32 ×{r16 / r32:.2f})")
print(f"the training run's achieved {achieved / 1e9:.1f} GFLOP/s (MFU above), against each fp32 rate: "
      + ", ".join(f"{achieved / r:.0%} of the {label}" for label, r in fp32_rate.items()))
print(f"(the run's b·s = {32 * cfg.block_size:,} token rows × {d_} features meet weights from {d_}×{d_} to "
      f"{d_}×{4 * d_}: the middle shape is the attention's output projection; q, k, v's is 3× and the MLP's 4× wider)")

# %% [markdown]
# ## 5. Performance engineering: a trace, torch.compile, memory over a step
#
# <a id="profiler-trace"></a>
# **A profiler trace.** `torch.profiler.profile` records every op a step dispatches (`aten::addmm`,
# `aten::_softmax`, …) as a range with a start and a duration on the thread that ran it; `record_shapes=True`
# adds each op's input shapes. `torch.profiler.record_function("forward")` adds a range of our own around a
# phase. A `schedule` of two warm-up steps (recorded, then dropped: first calls allocate and warm caches) and three active steps, with
# `prof.step()` at each step's end, puts each active step in a `ProfilerStep#N` range. `export_chrome_trace`
# writes the Chrome-trace JSON that practitioners open in **https://ui.perfetto.dev** (drag the file in) or in
# Chrome at **chrome://tracing** (Load). The step below is `profiling.marked_step`, written out.

# %% tags=["nbval-ignore-output"]
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from course_lib import profiling

model_t = GPT(cfg)
opt_t = torch.optim.AdamW(model_t.parameters(), lr=3e-3)


def profiled_step():
    with record_function("optimizer"):
        opt_t.zero_grad(set_to_none=True)
    with record_function("forward"):
        _, loss_ = model_t(x, y)
    with record_function("backward"):
        loss_.backward()
    with record_function("optimizer"):
        opt_t.step()


trace_path = profiling.TRACE_DIR / "01_tiny_gpt.json"
trace_path.parent.mkdir(parents=True, exist_ok=True)
ACTIVE = 3
with profiling.quiet_stderr():  # the profiler's C++ side prints its start and stop lines on stderr
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=2, active=ACTIVE, repeat=1)) as prof:
        for _ in range(2 + ACTIVE):
            profiled_step()
            prof.step()
prof.export_chrome_trace(str(trace_path))
print(f"trace of {ACTIVE} steps (b={b}, s={s}): {profiling.relative(trace_path)}")
print("open it at https://ui.perfetto.dev (drag the file in) or chrome://tracing (Load)")

# %% [markdown]
# **Reading the file back.** `profiling.read_trace` keeps every complete range of the JSON with its thread and
# classifies it by the range that encloses it: our `forward` / `backward` / `optimizer` marks, autograd's
# `…Backward0` nodes, `Optimizer.step#AdamW.step`. `profiling.draw_ops` draws the last profiled step from the
# file as a Gantt of the training thread: one lane per nesting depth, our phase marks on top, under each range
# the ops it called, long ranges labelled. The table under it is `prof.key_averages()`: the ops of all profiled
# steps grouped by name, sorted by **self** time (time in the op itself, not in the ops it calls), divided by
# the number of steps.

# %% tags=["nbval-ignore-output"]
import statistics

events = profiling.read_trace(trace_path)
steps_ev = [e for e in events if e.name.startswith("ProfilerStep#")]
main = profiling.training_threads(events)
last = steps_ev[-1]
in_last = [e for e in events if e.thread in main and last.start <= e.start and e.end <= last.end + 1e-9]
phase_ms = {ph: sum(e.duration for e in in_last if e.name == ph) * 1e3 for ph in profiling.MARKS}
aten = [e for e in in_last if e.name.startswith("aten::")]
trace_ms = statistics.median(e.duration for e in steps_ev) * 1e3
step_ms = ac_t["plain"].median * 1e3
print(f"{len(steps_ev)} ProfilerStep ranges; a step in the trace {trace_ms:.1f} ms (median) vs {step_ms:.1f} ms "
      f"measured without the profiler (time_steps, section 3): ×{trace_ms / step_ms:.2f}"
      + (", the profiler's own cost" if trace_ms > 1.1 * step_ms else ": the profiler's cost is within the noise"))
print(f"last step: forward {phase_ms['forward']:.1f} ms, backward {phase_ms['backward']:.1f} ms, "
      f"optimizer {phase_ms['optimizer']:.1f} ms; {len(aten)} aten:: ranges "
      f"({len({e.name for e in aten})} distinct ops)")
ax = profiling.draw_ops(events, window=(last.start, last.end),
                       title=f"one training step of the tiny GPT, b={b}: forward "
                             f"{phase_ms['forward']:.1f} ms, backward {phase_ms['backward']:.1f} ms, "
                             f"optimizer {phase_ms['optimizer']:.1f} ms")
drawn = [e for e in in_last if e.duration > 0 and not e.name.startswith(("ProfilerStep#", "PyTorch Profiler"))]
stack, depth = [], {}
for e in sorted(drawn, key=lambda e: (e.start, -e.duration)):  # the figure's lanes: nesting depth
    while stack and stack[-1] <= e.start + 1e-9:
        stack.pop()
    depth[e] = len(stack)
    stack.append(e.end)
longest = []  # the step's longest aten:: calls, none inside another: numbered on the figure
for e in sorted(aten, key=lambda e: -e.duration):
    if len(longest) < 6 and depth.get(e, 5) < 5 and all(e.end <= o.start or o.end <= e.start for o in longest):
        longest.append(e)
for k, e in enumerate(longest, 1):
    ax.text((e.start + e.end - 2 * last.start) / 2 * 1e3, depth[e], str(k), ha="center", va="center",
            fontsize=8, fontweight="bold", bbox=dict(boxstyle="circle,pad=0.2", fc="white", ec="black", lw=0.5))
plt.show()
print("numbered on the figure, the step's longest aten:: calls:")
for k, e in enumerate(longest, 1):
    print(f"  {k} {e.name} ({e.phase or 'step'}, {e.duration * 1e3:.2f} ms)")
ours = profiling.MARKS + ("ProfilerStep#",)  # our own ranges, not ops
top = sorted((a for a in prof.key_averages() if not a.key.startswith(ours)),
             key=lambda a: -a.self_cpu_time_total)[:8]
print(f"{'op (key_averages, by self CPU time)':<56}{'calls/step':>11}{'self ms/step':>13}{'total ms/step':>14}")
for a in top:
    print(f"{a.key[:55]:<56}{a.count / ACTIVE:>11g}{a.self_cpu_time_total / ACTIVE / 1e3:>13.2f}"
          f"{a.cpu_time_total / ACTIVE / 1e3:>14.2f}")
top_share = sum(a.self_cpu_time_total for a in top) / sum(e.duration for e in steps_ev) / 1e6
print(f"these {len(top)} ops hold {top_share:.0%} of the profiled steps' time")

# %% [markdown]
# **A worked reading.** The top lane holds the step from left to right: the blue `forward` range, and under it each
# block's `aten::layer_norm`, `aten::linear` (→ `aten::addmm`, the matmul with its bias),
# `aten::scaled_dot_product_attention` and `aten::gelu` — most of them too short to carry a name in the figure:
# the numbers mark the step's longest calls, named in the line printed under it, and Perfetto or chrome://tracing
# shows every range's name (hover or click). Then the green `backward` range, where autograd's
# `autograd::engine::evaluate_function: …Backward0` ranges run the same layers in reverse order, each calling the
# matmuls of its input's and its weight's gradients; then the purple `optimizer` range, `Optimizer.step#AdamW.step`,
# one `aten::lerp_`, `aten::addcdiv_`, … per parameter: on CPU tensors AdamW's default (`foreach=None`) is the
# per-parameter loop (torch picks the `_foreach_*` kernels, a few ops over all parameters at once, only for
# CUDA-like devices). The printed lines say how long each phase took
# and which ops took the most self time; what the step spends outside the matmuls (the count of `aten::` ranges
# against the few that do FLOPs) is the overhead the MFU paragraph of section 2 pointed at. In Perfetto, click a
# range to see its input shapes (`record_shapes`), and select a span to sum the ranges in it.

# %% [markdown]
# <a id="torch-compile"></a>
# **torch.compile.** `torch.compile(model)` returns a wrapper; nothing happens until its first call. Then
# **Dynamo** reads the Python bytecode of `forward` and records the torch ops it runs into an FX graph,
# **AOTAutograd** derives the backward graph from it ahead of time, and the backend, **inductor**, fuses chains of
# elementwise ops into single loops and generates code: C++ with OpenMP on a CPU (compiled here by g++), Triton
# kernels on a GPU. The first call pays all of that; later calls with the same shapes and dtypes run the
# generated code (other shapes recompile). The generated files go to `TORCHINDUCTOR_CACHE_DIR`, here the
# project's `.cache/inductor` (`use_project_cache`): a clean clone compiles cold, as timed below. The optimizer
# stays eager. `compile_vs_eager` trains both copies on the same batches and times them in interleaved rounds.

# %% tags=["nbval-ignore-output"]
from course_lib.experiments.compile import compile_vs_eager, twins, use_project_cache

_ = use_project_cache()  # TORCHINDUCTOR_CACHE_DIR = .cache/inductor
eager_m, twin_m = twins(cfg)  # two GPTs with the same initial weights
compiled_m = torch.compile(twin_m)  # backend="inductor", the default
run_c = compile_vs_eager(eager_m, compiled_m, batch_size=b, steps=5, rounds=5, steps_per_round=2)
print(run_c)
vs = run_c.timings.compare("compiled", "eager")
print(vs.verdict)
gain = run_c.timings["eager"].median - run_c.timings["compiled"].median
print(f"compile time paid back after {run_c.compile_s / gain:,.0f} steps (compile time / median gain per step)"
      if vs.sign < 0 else "no payback to compute: the compiled step is not measurably shorter on this machine")

# %%
run_c.assert_passed()

# %% [markdown]
# Why the tolerances: the first loss comes before any update, the same forward computed by other code (fused
# loops add in another order): `REORDERED`. After AdamW steps, rounding differences on near-zero gradients are
# scaled up by Adam's division by √v: `ADAMW`. What compiling changes is the work between the matmuls: each
# fused loop replaces several ops that each read and write the whole tensor, and the Python dispatch between
# them. The eager optimizer and the matmuls themselves (the same library calls either way) stay as they were.
# On a GPU, fusion removes a trip to memory per fused op, and `mode="reduce-overhead"` replays the step as a
# CUDA graph.
#
# <a id="graph-break"></a>
# **A graph break.** Dynamo captures only what it can trace. `.item()` turns a tensor into a Python number, and
# an `if` on that number is Python control flow that no graph can hold: Dynamo ends the graph before it, runs
# the Python, and starts a new graph after it. `torch._dynamo.explain` traces a function once and reports the
# graphs and why each one ended.

# %%
from course_lib.experiments.compile import quiet_dynamo


def normalise_then_softmax(logits):
    scale = logits.abs().max().item()  # a tensor → a Python float
    if scale > 1.0:  # Python control flow on it
        logits = logits / scale
    return torch.softmax(logits, dim=-1)


with quiet_dynamo():  # Dynamo also logs each break as a warning; explain reports it below
    explanation = torch._dynamo.explain(normalise_then_softmax)(torch.randn(4, 8))
print(f"graphs: {explanation.graph_count}, graph breaks: {explanation.graph_break_count}")
for r in explanation.break_reasons:
    print("break reason:", r.reason.strip().splitlines()[0])

# %% [markdown]
# <a id="memory-over-a-step"></a>
# **Memory over a step.** Section 3 counted the bytes by kind; a profiler with `profile_memory=True` records
# every allocation and free with the running total, so the bytes held can be drawn over time.
# `profiling.memory_curve(model, optimizer, x, y)` profiles one `marked_step` so (after setting the gradients to
# None, outside the profiler: it sees only frees of memory it saw allocated), reads the `[memory]` events back
# from the trace file and adds the model states held before the step. In the forward, the curve climbs as autograd
# saves activations; in backward, each node frees what it saved and allocates its parameters' gradients; the
# optimizer allocates its temporaries. The peak comes where the activations not yet freed and the gradients
# already written add up; it is compared below with section 3's meters: model states (with gradients) + saved
# activations. The table under the plot starts with what the step leaves allocated: the gradients (set to None before it;
# 4 bytes × Ψ in fp32), the growth of `memory.model_state_bytes` over the step. On a GPU,
# `torch.cuda.memory._record_memory_history()` records every allocation of the caching
# allocator with its Python stack, and `torch.cuda.memory._dump_snapshot("snap.pickle")` writes a file that
# https://pytorch.org/memory_viz draws as the same curve, each block coloured by the tensor that holds it.

# %% tags=["nbval-ignore-output"]
model_m = GPT(cfg)
opt_m = torch.optim.AdamW(model_m.parameters(), lr=3e-3)
train_step(model_m, opt_m, x, y)  # Adam's moments exist: a step like every later one
curve = profiling.memory_curve(model_m, opt_m, x, y, name="01_memory_step")
expected = states["total"] + meter.bytes
print(f"trace with memory events: {curve.trace_file}")
print(f"held before the step {curve.states_before['total']:,} bytes (parameters + Adam state); peak "
      f"{curve.peak:,} bytes in {curve.peak_phase}; at the end of forward {curve.at_end_of('forward'):,}")
ax = profiling.draw_memory_curve(curve, title=f"one training step, b={b}: allocated bytes peak in "
                                 f"{curve.peak_phase}, ×{curve.peak / expected:.2f} the meters' sum",
                                 references={"model states + activations (section 3)": expected})
plt.show()

# %% tags=["nbval-ignore-output"]
mem = Result(title=f"memory over one step, b={b}: the profiler's allocator events against the course's meters")
mem.checked += curve.checked
mem.within("peak allocated (bytes)", curve.peak, expected, profiling.MEMORY_PEAK_BAND,
           "model states + saved activations (section 3)")
mem.within("allocated at the end of forward − before (bytes)",
           curve.at_end_of("forward") - curve.states_before["total"], meter.bytes,
           profiling.MEMORY_PEAK_BAND, "saved activations (SavedTensorMeter)")
print(mem)

# %%
mem.assert_passed()

# %% [markdown]
# ## 6. Exercise: count the bytes yourself
#
# **The task.** In `exercises/single_device.py`, write
#
# ```python
# def count_model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict
# ```
#
# returning `{"params": …, "grads": …, "optimizer": …}`: the bytes of memory the model's parameters, their
# gradients and the optimizer's state occupy, each piece of memory counted **once** (a tied weight is one tensor
# under two names; two views of one buffer are one buffer). "optimizer" is every tensor in `optimizer.state`,
# AdamW's 4-byte `step` tensor per parameter included (section 3's table: 8Ψ + 4 bytes per parameter tensor).
#
# **What the checker compares.** `check("count_model_state_bytes")` runs on **one rank**: it builds a one-layer
# tiny GPT with tied and with untied embedding/output weights, takes one AdamW step, and compares your three
# numbers with `memory.model_state_bytes` **exactly** (they are byte counts).
#
# **Hints**, one layer at a time:
#
# <details><summary>Hint 1: the idea</summary>
#
# Count memory, not tensors: walk the parameters, then the gradients, then every tensor the optimizer keeps per
# parameter, and skip memory you have already counted.
# </details>
#
# <details><summary>Hint 2: the API</summary>
#
# `t.untyped_storage()` is the memory behind a tensor: `.nbytes()` its size, `.data_ptr()` its address (the same
# for two tensors that share it). `optimizer.state` maps each parameter to a dict of its state (AdamW: `step`,
# `exp_avg`, `exp_avg_sq`); not every value in it need be a tensor.
# </details>
#
# Until you implement it, the checker reports *unsolved*:

# %%
from course_lib.check import check

check("count_model_state_bytes")

# %%
check("count_model_state_bytes", package="solutions")

# %% [markdown]
# ## 7. O/X quiz

# %%
from course_lib.quiz import quiz

quiz("single-device")

# %% [markdown]
# ## Summary
# - The tiny GPT learns the counter task on one CPU process in 300 steps (loss curve above; its wall time printed below);
#   tokens/s grows with the batch, by less for each further 4× as the part of a step that grows with b takes
#   over from the fixed part (the sweep prints the factor per 4×).
# - Model states measured = 16 bytes per parameter (+4 bytes per parameter tensor for Adam's step counter).
# - Activations measured with saved-tensor hooks equal the derived CPU formula exactly (≈64·s·b·h per layer) at
#   every batch and sequence length of the sweep; Korthikanti's formula differs by precision, dropout masks and
#   the stored softmax.
# - Activation checkpointing keeps one input per block and runs each block's forward twice; bf16 autocast keeps
#   fp32 parameters and gradients (16 bytes per parameter still), saves fewer activation bytes, and follows the
#   fp32 loss curve; a bf16 weight would round small updates away, hence fp32 master weights.
# - A profiler trace shows what a step runs, op by op, on which thread; `torch.compile` compiles at the first
#   call and then runs the generated code (its losses, timing and a graph break are printed in section 5); the
#   bytes held over a step rise through forward as autograd keeps activations for backward and fall through
#   backward as it frees them (the peak, its phase and its ratio to section 3's meters are printed below).
# - This run's numbers:

# %% tags=["nbval-ignore-output"]
print(f"Ψ = {psi:,} parameters; model states {states['total']:,} bytes = {states['total'] / psi:.2f} bytes/param")
print(f"activations at b={b}, s={s}: {meter.bytes:,} bytes ({meter.bytes / states['total']:.1f}× the model states)")
print(f"{run['tokens_per_s']:,.0f} tokens/s × {fpt:,.0f} FLOPs/token = {achieved / 1e9:.2f} GFLOP/s, "
      f"MFU {achieved / peak['flops_per_s']:.1%} of the {peak['flops_per_s'] / 1e9:.1f} GFLOP/s measured matmul rate")
print(f"300 steps at batch 32 took {run['seconds']:.1f} s; tokens/s from b=1 to b={BATCHES[-1]}: "
      f"×{tok_s[-1] / tok_s[0]:.1f}")
print(f"checkpointing: activations ÷{bytes_plain / bytes_ckpt:.1f}, step ×{ac_t['checkpointed'].median / ac_t['plain'].median:.2f}"
      f"; bf16 autocast: activations ×{meter16.bytes / meter.bytes:.2f}, step "
      f"×{amp_t['bf16 autocast'].median / amp_t['fp32'].median:.2f}, last-20 loss {mean20_16:.3f} vs {mean20:.3f}")
print(f"profiled step {trace_ms:.1f} ms vs {step_ms:.1f} ms unprofiled; torch.compile: {run_c.compile_s:.1f} s to "
      f"compile, step {run_c.timings['compiled'].median * 1e3:.1f} vs {run_c.timings['eager'].median * 1e3:.1f} ms "
      f"eager ({vs.verdict.split(' (')[0]}); memory peak {curve.peak:,} bytes in {curve.peak_phase} (×{curve.peak / expected:.2f} states + activations)")
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
