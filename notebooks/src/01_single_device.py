# %% [markdown]
# # 01 · One device: the baseline every chapter is compared with
#
# **What you will learn**
# - the tiny GPT of this course (`course_lib/models.py`, nanoGPT-style) and the synthetic task it learns in seconds;
# - how fast it trains on one device (tokens/s);
# - where the memory goes: **parameters, gradients, optimizer state** (the *model states*) and **activations** —
#   measured from the real tensors, then compared with the formulas (the 16Ψ rule of thumb);
# - how many FLOPs a training token costs (6Ψ + 12·L·s·d) and what fraction of this CPU's matmul peak the run
#   achieves (MFU).
#
# **What you need**: chapter 00 is not required; PyTorch at the level of a training loop (`loss.backward()`,
# `optimizer.step()`). **Expected runtime**: about 1½ minutes on an idle 2-core laptop (printed in the last cell).
#
# This is the baseline the later chapters compare with: each of them checks that its distributed run equals a
# single-device run of the same model and data (computed in that chapter, on its own configuration), and measures
# its speed against one device.

# %%
# NBVAL_IGNORE_OUTPUT
import time

_t_notebook = time.perf_counter()
import math

import matplotlib.pyplot as plt
import torch

from course_lib import formulas, memory
from course_lib.data import loss_floor, make_batch
from course_lib.models import GPT, tiny_config
from course_lib.train import train_single_device

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
# hardware has idle capacity; once the cores are saturated, twice the batch takes about twice as long, so
# throughput does not simply double with the batch size.

# %%
# NBVAL_IGNORE_OUTPUT
run = train_single_device(cfg, steps=300, batch_size=32, lr=3e-3, progress=False)
print(f"{run['tokens_per_s']:,.0f} tokens/s ({run['seconds']:.1f} s for 300 steps), one process using "
      f"{torch.get_num_threads()} CPU thread(s)")

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(run["loss"], label="training loss")
ax.axhline(loss_floor(cfg.block_size, cfg.vocab_size), color="gray", ls="--", label="floor ln(V)/T")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy (nats)")
ax.set_yscale("log")
ax.set_title("one device, batch 32: the loss falls to the floor")
ax.legend()
plt.show()
print(f"first loss ≈ ln V: {abs(run['loss'][0] - math.log(cfg.vocab_size)) < 0.1}")
print(f"mean loss of the last 20 steps below 0.3: {sum(run['loss'][-20:]) / 20 < 0.3}")

# %% [markdown]
# <a id="flops"></a>
# **FLOPs per token.** Each parameter is one multiply-add per token forward (2 FLOPs) and two backward (the input's
# and the weight's gradient, 4 FLOPs): **6Ψ**. Attention adds two matmuls that use no parameter, q·kᵀ and
# softmax·v: **12·L·s·d** per token for training (`formulas.training_flops_per_token`). For large models s ≪ d
# and the second term is usually dropped; here s = 32 and d = 64, so it is not negligible. FLOPs per token ×
# tokens/s = the **achieved FLOP/s**; divided by what this CPU's matmul reaches (measured below, same threads)
# it is the **MFU**, model FLOPs utilisation.

# %%
fpt = formulas.training_flops_per_token(model.num_params(), cfg.n_layer, cfg.block_size, cfg.d_model)
attn_share = 12 * cfg.n_layer * cfg.block_size * cfg.d_model / fpt
print(f"FLOPs per token = 6Ψ + 12·L·s·d = {6 * model.num_params():,} + "
      f"{12 * cfg.n_layer * cfg.block_size * cfg.d_model:,} = {fpt:,.0f}")
print(f"attention's parameter-free matmuls are more than 5% of the FLOPs here: {attn_share > 0.05}")

# %%
# NBVAL_IGNORE_OUTPUT
from course_lib.train import matmul_peak_flops

peak = matmul_peak_flops()
achieved = fpt * run["tokens_per_s"]
print(f"attention share of the FLOPs: {attn_share:.1%}")
print(f"achieved: {achieved / 1e9:.2f} GFLOP/s; matmul peak ({peak['n']}×{peak['n']}, {peak['threads']} threads): "
      f"{peak['flops_per_s'] / 1e9:.1f} GFLOP/s (min–max {peak['lo'] / 1e9:.1f}–{peak['hi'] / 1e9:.1f}); "
      f"MFU = {achieved / peak['flops_per_s']:.1%}")

# %% [markdown]
# A tiny model reaches a small fraction of the peak: its matrices (64 wide) are too small to keep the cores busy,
# and layer norms, GELU, softmax and the Python loop cost time without counting as model FLOPs.

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
print(f"16Ψ = {16 * psi:,} bytes; measured − 16Ψ = {states['total'] - 16 * psi} = 4 bytes × {n_tensors} step counters: "
      f"{states['total'] - 16 * psi == 4 * n_tensors}")

# %% [markdown]
# **Activations.** What autograd saves during the forward pass for the backward pass. We measure it with
# `saved_tensors_hooks` (`memory.SavedTensorMeter`) and compare it with the formula derived in
# `formulas.activation_bytes_estimate` for this model on a CPU in fp32: per transformer layer about **64·s·b·h bytes**
# (s sequence, b batch, h d_model). The derivation is a list of what every op saves; `memory.saved_tensors_table`
# reads the same list off the real autograd graph (below, per op, for one forward).

# %%
b, s = 32, cfg.block_size
x, y = make_batch(b, s, cfg.vocab_size, seed=0)
with memory.SavedTensorMeter(exclude=model) as meter:
    _, loss = model(x, y)
est = formulas.activation_bytes_estimate(cfg, b)
print(f"measured activations : {meter.bytes:,} bytes")
print(f"estimated (derived)  : {est['total']:,} bytes  (per layer {est['per_layer']:,} = "
      f"{est['per_layer'] / (s * b * cfg.d_model):.1f}·s·b·h)")
print(f"estimate equals measurement: {est['total'] == meter.bytes}")
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
print(f"{'sum':<48}{sum(n for n, _ in per_op.values()):>8}{sum(nb for _, nb in per_op.values()):>12,}"
      f"  = measured: {sum(nb for _, nb in per_op.values()) == meter.bytes}")

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
print(f"math attention, b=8: measured {meter_math.bytes:,} bytes = derived {est_math['total']:,}: "
      f"{meter_math.bytes == est_math['total']}")
print(f"math − SDPA at b=8: measured {meter_math.bytes - meter_sdpa_8.bytes:,} bytes = derived "
      f"{est_math['total'] - est_sdpa['total']:,}: "
      f"{meter_math.bytes - meter_sdpa_8.bytes == est_math['total'] - est_sdpa['total']} "
      f"= stored probabilities 4·a·s·s·b·L {4 * cfg.n_head * s * s * 8 * cfg.n_layer:,} + causal masks s·s·L "
      f"{s * s * cfg.n_layer:,} − SDPA's log-sum-exp 4·a·s·b·L {4 * cfg.n_head * s * 8 * cfg.n_layer:,}")

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
print(f"{len(sweep)} (b, s) points: measured = formula at every one: "
      f"{all(p['measured'] == p['formula'] for p in sweep)}")
print(f"activations at b=32, s=32 vs b=4, s=8: {sweep[-1]['measured'] / sweep[0]['measured']:.1f}× "
      f"(32× the tokens); model states unchanged by the sweep: {states_after == states['total']}")

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
viz.stacked_bars({"this model": parts}, unit="MB", horizontal=True, title="one device: memory of a training step")
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
# ## 4. The same rule at scale
# The ZeRO paper's example: Ψ = 7.5B parameters in mixed precision ((2 + 2 + K)·Ψ bytes, K = 12 for fp32 master
# weights + Adam's two moments) need 16Ψ = 120 GB of model states per GPU without sharding — more than any single GPU.
#
# <a id="mixed-precision"></a>
# **Mixed precision.** 2 + 2 + 12 is the ZeRO paper's (apex-style) accounting: 16-bit parameters and gradients plus
# fp32 master weights and Adam moments. `torch.amp` autocast keeps fp32 parameters and gradients instead and casts
# inside the operations: 4 + 4 + 8. Either way about 16 bytes per parameter — mixed precision does not halve the
# model states. fp16 has a 5-bit exponent, so small gradients underflow to zero: fp16 training multiplies the loss
# by a scale factor before backward and divides the gradients by it before the step (**loss scaling**, a fix for
# range, not for memory). bf16 has fp32's 8-bit exponent and is usually trained without loss scaling.

# %%
for stage in range(4):
    gb = formulas.zero_model_state_bytes(7.5e9, 64, stage) / 1e9
    print(f"7.5B params, 64 GPUs, ZeRO stage {stage}: {gb:6.1f} GB per GPU")

# %% [markdown]
# ## 5. Exercise: count the bytes yourself
# Implement `count_model_state_bytes` in `exercises/single_device.py` (unique storages!) and check it:

# %%
from course_lib.check import check

check("count_model_state_bytes")

# %%
check("count_model_state_bytes", package="solutions")

# %% [markdown]
# ## 6. O/X quiz

# %%
from course_lib.quiz import quiz

quiz(1)

# %% [markdown]
# ## Summary
# - The tiny GPT learns the counter task on one CPU process in seconds (loss curve above).
# - Model states measured = 16 bytes per parameter (+4 bytes per parameter tensor for Adam's step counter).
# - Activations measured with saved-tensor hooks equal the derived CPU formula exactly (≈64·s·b·h per layer) at
#   every batch and sequence length of the sweep; Korthikanti's formula differs by precision, dropout masks and
#   the stored softmax.
# - This run's numbers:

# %%
# NBVAL_IGNORE_OUTPUT
print(f"Ψ = {psi:,} parameters; model states {states['total']:,} bytes = {states['total'] / psi:.2f} bytes/param")
print(f"activations at b={b}, s={s}: {meter.bytes:,} bytes ({meter.bytes / states['total']:.1f}× the model states)")
print(f"{run['tokens_per_s']:,.0f} tokens/s × {fpt:,.0f} FLOPs/token = {achieved / 1e9:.2f} GFLOP/s, "
      f"MFU {achieved / peak['flops_per_s']:.1%} of a {peak['flops_per_s'] / 1e9:.1f} GFLOP/s matmul peak")
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
