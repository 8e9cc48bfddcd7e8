# %% [markdown]
# # 01 · One device: the baseline every chapter is compared with
#
# **What you will learn**
# - the tiny GPT of this course (`course_lib/models.py`, nanoGPT-style) and the synthetic task it learns in seconds;
# - how fast it trains on one device (tokens/s);
# - where the memory goes: **parameters, gradients, optimizer state** (the *model states*) and **activations** —
#   measured from the real tensors, then compared with the formulas (the 16Ψ rule of thumb).
#
# Every later chapter must reproduce *this* training run exactly, only spread over ranks.

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
run = train_single_device(cfg, steps=300, batch_size=32, lr=3e-3)
print(f"{run['tokens_per_s']:,.0f} tokens/s ({run['seconds']:.1f} s for 300 steps) with {torch.get_num_threads()} thread(s)")

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(run["loss"], label="training loss")
ax.axhline(loss_floor(cfg.block_size, cfg.vocab_size), color="gray", ls="--", label="floor ln(V)/T")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy (nats)")
ax.set_yscale("log")
ax.legend()
plt.show()
print(f"first loss ≈ ln V: {abs(run['loss'][0] - math.log(cfg.vocab_size)) < 0.1}")
print(f"mean loss of the last 20 steps below 0.3: {sum(run['loss'][-20:]) / 20 < 0.3}")

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
# (s sequence, b batch, h d_model). The well-known Korthikanti et al. (2022) formula, s·b·h·(34 + 5·a·s/h), is for 16-bit
# activations on GPUs with dropout masks and a stored s×s softmax; the CPU's fused attention kernel stores no s×s matrix.

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
loss.backward()

# %%
fig, ax = plt.subplots(figsize=(6, 2.6))
parts = {"parameters": states["params"], "gradients": states["grads"], "optimizer (Adam)": states["optimizer"],
         f"activations (b={b})": meter.bytes}
left = 0
for name, value in parts.items():
    ax.barh(["this model"], [value / 1e6], left=left / 1e6, label=name)
    left += value
ax.set_xlabel("MB")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2)
plt.tight_layout()
plt.show()

# %% [markdown]
# Activations grow with the batch and the sequence; model states do not. Data parallelism (chapter 02) splits the
# batch, so it splits activations but replicates all 16Ψ; ZeRO (chapter 03) shards the model states, not the
# activations.
#
# <a id="saving-activation-memory"></a>
# Activations are saved *for backward*: under `torch.no_grad()` (inference) autograd saves none. When training
# needs less activation memory, **activation checkpointing** (recomputation) keeps only some forward activations
# and recomputes the rest during backward: more compute, less memory.
#
# ## 4. The same rule at scale
# The ZeRO paper's example: Ψ = 7.5B parameters in mixed precision (2 + 2 + K·Ψ bytes, K = 12 for fp32 master
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
# Implement `count_model_state_bytes` in `exercises/ch01_memory.py` (unique storages!) and check it:

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
# - The tiny GPT learns the counter task on one CPU core in seconds (loss curve above).
# - Model states measured = 16 bytes per parameter (+4 bytes per parameter tensor for Adam's step counter).
# - Activations measured with saved-tensor hooks equal the derived CPU formula exactly (≈64·s·b·h per layer).

# %%
# NBVAL_IGNORE_OUTPUT
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
