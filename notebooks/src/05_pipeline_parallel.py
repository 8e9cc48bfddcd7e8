# %% [markdown]
# # 05 · Pipeline parallelism: GPipe and 1F1B from scratch
#
# **What you will learn**
# - model parallelism vs data parallelism, and why naive model parallelism leaves devices idle;
# - micro-batches, the **pipeline bubble** and its formula $(p-1)/(m+p-1)$ — measured on real ranks, and
#   interleaved 1F1B's $(p-1)/(v\cdot m+p-1)$ beside it;
# - why the slowest stage sets the pace of the whole pipeline: the step $m\,(F+B)_\text{slowest} + \sum_\text{others}(F+B)$,
#   predicted beside measured;
# - the real GPT's pipeline under the modelled clock: its step predicted from each stage's own FLOPs / rate
#   (`step_time.pipeline_step`) beside the measured one, and each rank's idle time split into the schedule's
#   (fill / drain, waiting for a peer) and runtime overhead;
# - GPipe vs 1F1B: the same bubble, but 1F1B keeps at most $p$ micro-batches of activations alive instead of $m$
#   (measured in bytes);
# - that a pipeline step *is* one-device training on the full batch (proven below), alone and combined with data
#   parallelism (PP × DP);
# - `torch.distributed.pipelining` (`PipelineStage`, `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`)
#   on the same stages, and what the zero-bubble schedules change;
# - zero bubble (ZB-H1) on our runner: backward split into an input-gradient step B and a weight-gradient step W,
#   W delayed into the idle time, and each rank's idle time measured against (p−1)(F+B+W) for 1F1B and
#   (p−1)(F+B−W) for ZB-H1.
#
# **What you need**: chapters 00 (send/recv, the α–β cost model and the modelled accelerator clock), 01 (the tiny
# GPT) and 02 (data parallelism). 2 CPU cores are enough: ranks are processes with the gloo backend; on GPUs the same
# code runs on nccl.
#
# **Stored build:** 74 s on 2 cores (0% of them busy just before it started).
#
# Read along: `course_lib/pipeline.py` (stages, schedules, the runner) and `course_lib/experiments/pipeline.py`
# (what this notebook runs on ranks).

# %% tags=["nbval-ignore-output"]
import time

_t_notebook = time.perf_counter()
import os

import matplotlib.pyplot as plt

from course_lib.experiments import pipeline as E
from course_lib.experiments.common import parallel_config, reference_run
from course_lib.formulas import pipeline_bubble, pipeline_bubble_megatron, pipeline_p2p_bytes
from course_lib.launch import spawn
from course_lib.models import GPT
from course_lib import show
from course_lib.pipeline import (backward_input, backward_weight, make_schedules, peak_live_microbatches, simulate,
                                 split_gpt)
from course_lib.results import SGD, Result, for_optimizer
from course_lib.step_time import AGREEMENT_BAND, bubble_fraction, slowest_stage_step
from course_lib.viz import gantt

print(f"cores: {os.cpu_count()}")

# %% [markdown]
# ## 1. Model parallel vs data parallel
#
# **Data parallelism** (chapters 02–04) gives every device the *whole* model and a different slice of the batch,
# then averages gradients. **Model parallelism** splits *one model* across devices: each device stores and computes
# only a part of it. Two ways to split:
# - **pipeline parallelism**: consecutive layers form a *stage*, one stage per device; activations travel forward
#   from stage to stage and their gradients travel back (point-to-point send/recv between neighbours);
# - **tensor parallelism** (chapter 06): the matrices *inside* a layer are split, with collectives in every layer.
#
# Common misconceptions: model parallelism is *not* "every device trains the whole model and the results are
# combined" — that is data parallelism; and in a pipeline the devices do *not* perform the same computation: each
# runs different layers. Micro-batches do not make a pipeline "data parallel" either: every micro-batch passes
# through the same stages in turn.
#
# Our stages: the tiny GPT with **untied** embeddings (`parallel_config()`: 4 blocks). With tied weights the token
# embedding (first stage) and the output head (last stage) would be one tensor on two ranks, and Megatron-LM
# all-reduces that tensor's gradient between the first and last stage every step; untied, every parameter lives on
# exactly one stage and only activations cross stages.

# %%
cfg = parallel_config()
full = GPT(cfg)
for p in (2, 4):
    stages = split_gpt(GPT(cfg), p)
    sizes = [sum(t.numel() for t in s.parameters()) for s in stages]
    print(f"p={p}: blocks per stage {[list(s.blocks) for s in stages]}, parameters per stage {sizes} "
          f"(sum {sum(sizes):,}; whole model {full.num_params():,})")

# %% [markdown]
# Each stage holds only its own parameters — and so only its own gradients and optimizer states: pipeline
# parallelism divides the model states by about p. What it cannot divide is time: stage k needs stage k−1's output.
#
# ## 2. Why naive model parallelism idles, and micro-batches
#
# Pass one batch through p stages and only one stage works at any moment: the bubble is (p−1)/p. Cut the batch into
# **m micro-batches** and stage 1 works on micro-batch 2 while stage 2 works on micro-batch 1. Below, the schedules
# are simulated on paper (`pipeline.simulate`: forward = 1 slot, backward = 2 slots, free communication) — the
# same action lists the runner executes later.
#
# **Bubble fraction** (this course): a rank's idle time / the whole step time. With p equal stages and m
# micro-batches, each rank works m·(t_F + t_B) out of (m + p − 1)·(t_F + t_B):
# $$\text{bubble} = \frac{p-1}{m+p-1}.$$
# Megatron-LM's papers divide the same idle time by the *ideal* time instead: (p−1)/m.

# %% tags=["nbval-ignore-output"]
def legend_beside(ax):
    """Move the gantt's legend to the right of the axes, clear of the x-axis label."""
    ax.legend(handles=ax.get_legend().legend_handles, loc="center left", bbox_to_anchor=(1.01, 0.5),
              frameon=False, fontsize=8)


fig, axes = plt.subplots(3, 1, figsize=(9, 5.6))
for ax, (name, m) in zip(axes, [("gpipe", 1), ("gpipe", 4), ("1f1b", 4)], strict=True):
    events = simulate(make_schedules(name, 4, m), m)
    gantt([[tuple(e) for e in tl] for tl in events], ax=ax, unit="",
          title=f"{name if m > 1 else 'naive (one batch)'}, p=4, m={m}: bubble {pipeline_bubble(4, m):.2f}")
    legend_beside(ax)
plt.tight_layout()
plt.show()

# %%
paper = Result(title="simulated bubbles (unit costs), p = 4")
for name, m in [("gpipe", 1), ("gpipe", 4), ("1f1b", 4), ("gpipe", 16)]:
    events = simulate(make_schedules(name, 4, m), m)
    step = max(e.end for tl in events for e in tl)
    paper.exact(f"{name}, m={m} (Megatron's (p−1)/m = {pipeline_bubble_megatron(4, m):.2f})",
                round(1 - 3 * m / step, 12), round(pipeline_bubble(4, m), 12), "(p−1)/(m+p−1)")
print(paper)

# %% [markdown]
# GPipe (Huang et al. 2019) runs all forwards, then all backwards: every stage keeps **m** micro-batches of
# activations until their backward. **1F1B** (PipeDream-Flush, Narayanan et al. 2021) warms up with p − 1 − k
# forwards on stage k, then alternates one forward and one backward: a micro-batch's activations are freed as soon
# as its backward ran, so stage k keeps at most **p − k**. Same bubble, less memory:

# %%
for name in ("gpipe", "1f1b"):
    sched = make_schedules(name, 4, 8)
    print(f"{name:<5} p=4 m=8, stage 1 runs {sched[1]}")
    print(f"      peak live micro-batches per stage: {[peak_live_microbatches(s) for s in sched]}")

# %% [markdown]
# ## 3. Real ranks: a pipeline step equals one device
#
# `PipelineRunner` executes a schedule on real processes: activations go forward and gradients backward with
# `comm.isend` / `comm.irecv` (on gloo a *blocking* send waits for the matching receive, and in 1F1B stage 0 sends
# micro-batch 1's activation while stage 1 sends micro-batch 0's gradient back: blocking sends would deadlock).
# Gradients are accumulated over the m micro-batches and divided by m (torch's `scale_grads=True`): the mean over
# equal micro-batch means is the full-batch mean, so the update is one device's on the whole batch — the pipeline
# flushes at every step and no weight is stale. Checked against one device trained here in the notebook.
#
# First the runner's core as a rank function you could paste into a script: one 1F1B step on p real ranks, each
# stage one `Linear`. Warm-up forwards, then the steady state where each forward's activation goes down while the
# next gradient comes up, then the cool-down backwards. Every exchange posts its send and its receive
# **together** with `dist.batch_isend_irecv` (as Megatron-LM does): on NCCL a lone send of a large tensor can wait
# for its receive, and two stages sending to each other at once would then hang.

# %%
def one_f_one_b_step(m=4, micro=2, width=16):
    import torch
    import torch.distributed as dist

    from course_lib.launch import device

    r, p, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(p)])  # the same on every rank
    stage, first, last = model[r].to(dev), r == 0, r == p - 1  # stage r keeps layer r
    xs = torch.randn(m * micro, width, generator=torch.Generator().manual_seed(1)).to(dev).chunk(m)

    def p2p(send=None, to=None, recv_from=None):  # one batch: the send and the receive progress together
        buf = None if recv_from is None else torch.empty(micro, width, device=dev)
        ops = [dist.P2POp(dist.isend, send, to)] if send is not None else []
        ops += [dist.P2POp(dist.irecv, buf, recv_from)] if buf is not None else []
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return buf

    ins, outs = [], []
    def forward(i, x):  # returns the activation to send down (None on the last stage)
        x = xs[i] if first else x.requires_grad_()
        y = stage(x)
        ins.append(x)
        outs.append(y.pow(2).mean() / m if last else y)  # loss: mean over the batch
        return None if last else y.detach()

    def backward(grad):  # returns the gradient to send up (None on the first stage)
        x, y = ins.pop(0), outs.pop(0)
        torch.autograd.backward(y, None if last else grad)
        return None if first else x.grad

    dist.barrier()  # NCCL: a collective on the group before the first batched p2p
    warmup = min(p - 1 - r, m)
    for i in range(warmup):
        p2p(forward(i, None if first else p2p(recv_from=r - 1)), to=r + 1)
    x = None if first or warmup == m else p2p(recv_from=r - 1)
    for i in range(m - warmup):
        y = forward(warmup + i, x)
        grad = None if last else p2p(y, to=r + 1, recv_from=r + 1)  # act ↓, grad ↑ together
        more = i < m - warmup - 1
        x = p2p(backward(grad), to=r - 1, recv_from=r - 1 if more and not first else None)  # grad ↑, act ↓
    for _ in range(warmup):
        p2p(backward(None if last else p2p(recv_from=r + 1)), to=r - 1)
    return {f"{r}.{n}": q.grad.cpu() for n, q in stage.named_parameters()}


def one_device_grads(p=2, m=4, micro=2, width=16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(p)])
    x = torch.randn(m * micro, width, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    return {n: q.grad for n, q in model.named_parameters()}


import torch

ours_1f1b = {k: v for g in spawn(one_f_one_b_step, 2) for k, v in g.items()}
tiny_ref = one_device_grads()
core = Result(title="one 1F1B step written out (p = 2, m = 4) vs one device")
_ = core.equal("gradients of both stages", ours_1f1b, tiny_ref, SGD)

# %% tags=["nbval-ignore-output"]
print(core)
core.assert_passed()

# %% [markdown]
# The course's `PipelineRunner` is the same loop for any schedule (GPipe, 1F1B, interleaved), reading the order
# from a list of actions; here it trains the GPT:

# %%
def equality_suite():
    return {(s, o, v): E.pipeline_training(s, o, steps, 4, 16, num_chunks=v)
            for s, o, steps, v in [("gpipe", "sgd", 5, 1), ("1f1b", "sgd", 5, 1), ("gpipe", "adamw", 10, 1),
                                   ("1f1b", "adamw", 10, 1), ("interleaved", "sgd", 5, 2)]}


eq = spawn(equality_suite, 2)
refs = {("sgd", 5): reference_run(cfg, 5, 16, "sgd")[0], ("adamw", 10): reference_run(cfg, 10, 16, "adamw")[0]}
runner_table = Result(title="PipelineRunner on the GPT (p = 2, m = 4) vs one device")
for (s, o, v) in eq[0]:
    steps = 5 if o == "sgd" else 10
    merged = E.merge_states([r[(s, o, v)] for r in eq])
    runner_table.equal(f"{s}, {o}, {steps} steps: weights", merged, refs[(o, steps)].state_dict(), for_optimizer(o))

# %% tags=["nbval-ignore-output"]
print(runner_table)
runner_table.assert_passed()

# %% [markdown]
# ## 4. The bubble, measured
#
# To measure the bubble without a busy laptop's noise, each stage is a tiny real `Linear` under the shared
# modelled accelerator clock (`course_lib.clock`), at the rate where its forward sleeps t_F = 40 ms and its
# backward sleeps t_B = 2·t_F = 80 ms (chosen long beside a send, a receive or a Python step, so that the
# stage times set the schedule). Each rank records `perf_counter` at the start and end of
# every F and B (one clock for all processes on a machine); bubble_r = 1 − busy_r / (latest end − earliest start
# over all ranks), median of 3 steps after a warm-up. Interleaved 1F1B (v = 2 chunks per rank, §6) runs on the same
# ranks, each chunk's forward sleeping t_F/v = 20 ms and its backward t_B/v = 40 ms: the same work per rank, a fill
# and drain of chunks instead of stages.

# %%
def timing_suite():
    ms = {"gpipe": (1, 2, 4), "1f1b": (1, 2, 4), "interleaved": (2, 4)}  # interleaved: m divisible by p
    return {"sleep": E.measure_bubbles(("gpipe", "1f1b", "interleaved"), ms, t_f=0.04, t_b=0.08),
            "slow": E.unbalanced_timing(("gpipe", "1f1b"), num_microbatches=4, t_f=0.04, factor=2),
            "gpt": E.gpt_timelines(("gpipe", "1f1b"), num_microbatches=8, global_batch=32, steps=3),
            "clocked": E.gpt_clocked(("gpipe", "1f1b"), num_microbatches=8, global_batch=32, steps=3),
            "torch": [E.torch_pipelining_grads(s) for s in ("gpipe", "1f1b", "interleaved")],
            "zb": E.zero_bubble_order(num_microbatches=4)}


tm = spawn(timing_suite, 2)
sleep = tm[0]["sleep"]

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(3, 1, figsize=(9, 5.4), sharex=True)
for ax, name in zip(axes, ("gpipe", "1f1b", "interleaved"), strict=True):
    costs = "t_F = 20 ms, t_B = 40 ms per chunk, 2 chunks" if name == "interleaved" else "t_F = 40 ms, t_B = 80 ms"
    gantt(sleep.timelines[f"{name}/4"], ax=ax, title=f"{name}, p=2, m=4, measured ({costs})")
    legend_beside(ax)
plt.tight_layout()
plt.show()
ms = [1, 2, 4]
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(ms, [pipeline_bubble(2, m) for m in ms], "k--", label="(p−1)/(m+p−1)")
ax.plot(ms[1:], [pipeline_bubble(2, m, 2) for m in ms[1:]], "k:", label="(p−1)/(v·m+p−1), v = 2")
for name, mark, size in (("gpipe", "o", 10), ("1f1b", "s", 5), ("interleaved", "^", 7)):
    rows = [r for r in sleep.rows if r["schedule"] == name]
    ax.plot([r["m"] for r in rows], [max(r["per_rank"]) for r in rows], mark, mfc="none", ms=size,
            label=f"{name} measured (max over ranks)")
worst = max(abs(max(r["per_rank"]) - r["formula"]) for r in sleep.rows)
ax.set_title(f"measured bubble within {worst:.3f} of its formula", fontsize=10)
ax.set_xlabel("micro-batches m")
ax.set_ylabel("bubble fraction")
ax.set_xscale("log", base=2)
ax.legend(frameon=False, fontsize=8, loc="upper right")
plt.tight_layout()
plt.show()

# %% tags=["nbval-ignore-output"]
print(sleep)
bub = {(r["schedule"], r["m"]): max(r["per_rank"]) for r in sleep.rows}
for m in (2, 4):
    i, o = bub[("interleaved", m)], bub[("1f1b", m)]
    print(f"m={m}: interleaved (v=2) bubble {i:.3f} (formula {pipeline_bubble(2, m, 2):.3f}), 1F1B's {o:.3f} "
          f"(formula {pipeline_bubble(2, m):.3f}): interleaving made it {o / i:.2f}× "
          f"{'smaller' if i < o else 'not smaller'}")

# %% [markdown]
# More micro-batches → a smaller bubble (the fill and drain cost p − 1 slots whatever m is); interleaving shrinks
# the fill and drain themselves, to p − 1 *chunks* of 1/v the work.
#
# ### The slowest stage sets the pace
# Give stage 1 k = 2 times the work: its forward sleeps t_F = 80 ms, its backward t_B = 160 ms; stage 0 is
# unchanged. Once it has started, stage 1 never waits: stage 0 has each input ready before stage 1 needs it (stage
# 0's F + B is half of stage 1's), and stage 1, the last, makes its own gradients. So stage 1 works m·(F+B)_slow
# back to back — the steady state, paced by the slowest stage alone — and what it cannot
# overlap is one pass of the others: micro-batch 0's forward on stage 0 before it, the last gradient's backward on
# stage 0 after it. For GPipe and for 1F1B (slowest stage last):
# $$\text{step} = m\,(F+B)_\text{slowest} + \sum_{s \neq \text{slowest}} (F_s+B_s),$$
# which is (m + p − 1)(F + B) for equal stages (`step_time.slowest_stage_step`: its docstring derives the general
# case). Stage 0's own work is unchanged; the rest of its step is waiting for stage 1, so its idle share grows
# beyond (p−1)/(m+p−1). That is why stages are
# balanced (here, p = 2 over 4 blocks: two blocks each, with the embedding on the first stage and the head on the
# last).

# %% tags=["nbval-ignore-output"]
slow = tm[0]["slow"]
fig, ax = plt.subplots(figsize=(9, 1.8))
gantt(slow.timelines["1f1b"], ax=ax, title="1f1b, p=2, m=4, stage 1 2× slower (t_F = 80 ms, t_B = 160 ms), measured")
legend_beside(ax)
plt.tight_layout()
plt.show()
pace = Result(title="step time, p = 2, m = 4, stages costed by the modelled accelerator clock")
for name in ("gpipe", "1f1b"):
    even = next(r for r in sleep.rows if r["schedule"] == name and r["m"] == 4)
    pace.within(f"{name}, equal stages (F 40 ms): step (s)", even["step"], slowest_stage_step([0.04, 0.04], 4),
                AGREEMENT_BAND, "(m+p−1)(F+B)")
    row = next(r for r in slow.rows if r["schedule"] == name)
    pace.within(f"{name}, stage 1 2× slower: step (s)", row["step"], row["predicted"], AGREEMENT_BAND,
                "m·(F+B)_slow + (F+B)_other")
print(pace)
even = next(r for r in sleep.rows if r["schedule"] == "1f1b" and r["m"] == 4)
one = next(r for r in slow.rows if r["schedule"] == "1f1b")
agrees = abs(one["step"] - one["predicted"]) <= AGREEMENT_BAND * one["predicted"]
print(f"1F1B: stage 1 2× slower makes the step {one['step'] * 1e3:.0f} ms, {one['step'] / even['step']:.2f}× the "
      f"equal stages' {even['step'] * 1e3:.0f} ms (predicted {one['predicted'] / slowest_stage_step([0.04] * 2, 4):.2f}×)"
      f"; stage 0, whose work did not change, idles {one['per_rank'][0]:.0%} of the step instead of "
      f"{even['per_rank'][0]:.0%}: "
      + ("the step follows the slowest stage's pace" if agrees else "the step is off the slowest-stage model"))

# %% [markdown]
# ### The real GPT on 2 cores
# The same runner on the real GPT (p = 2, m = 8). Stages are not equal here (the last one also computes the output
# head and the loss), every send and receive is real work, and two processes share two cores with everything else
# on the machine, so these bubbles are reported, not asserted. Below, each rank's idle time is split three ways:
# **fill / drain** (before the rank's first forward and after its last backward) and **waiting for a peer** (blocked
# in a receive between two of its actions) are the schedule's idle time, stretched by a slow neighbour: the formula
# (p−1)/(m+p−1) models their sum (on the last stage the bubble falls at the ends of the step, on the first stage in
# the middle, waiting for the first gradient). **Runtime overhead** is the rest (Python between actions, posting
# messages, the loss, allocating buffers), which the formula does not model.

# %% tags=["nbval-ignore-output"]
gpt = dict(enumerate(tm))
fig, axes = plt.subplots(2, 1, figsize=(9, 3.6))
def idle_shares(ev):
    """Per rank, the share of the drawn step that is not compute (fill/drain + waiting + overhead)."""
    span = max(e[4] for tl in ev for e in tl) - min(e[3] for tl in ev for e in tl)
    return [1 - sum(e[4] - e[3] for e in tl if e[0] in ("F", "B")) / span for tl in ev]


for ax, name in zip(axes, ("gpipe", "1f1b"), strict=True):
    ev = gpt[0]["gpt"].schedules[name]["events"]
    gantt(ev, ax=ax, title=f"GPT, {name}, p=2, m=8: idle share per rank {[round(b, 2) for b in idle_shares(ev)]} "
                           f"(the schedule's bubble alone: {pipeline_bubble(2, 8):.2f})", label_microbatches=False)
    legend_beside(ax)
plt.tight_layout()
plt.show()
totals = {"schedule's idle (fill/drain + waiting)": 0.0, "runtime overhead": 0.0}
for name in ("gpipe", "1f1b"):
    for r, (span, busy, edges, wait, over) in enumerate(E.idle_split(gpt[0]["gpt"].schedules[name]["events"])):
        print(f"GPT {name:<5} rank {r}: step {span * 1e3:5.1f} ms = compute {busy / span:4.0%} + schedule's idle "
              f"{(edges + wait) / span:4.0%} (fill/drain {edges / span:3.0%}, waiting {wait / span:3.0%}; formula "
              f"{pipeline_bubble(2, 8):.0%}) + runtime overhead {over / span:4.0%}")
        totals["schedule's idle (fill/drain + waiting)"] += edges + wait
        totals["runtime overhead"] += over
biggest = max(totals, key=totals.get)
print("idle time summed over ranks and schedules: "
      + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in totals.items()) + f" — the larger part is {biggest}")

# %% [markdown]
# ### The real GPT under the modelled clock
# The same pipeline again (the same GPT, p = 2, m = 8, the same two stages), now under the modelled accelerator
# clock (`E.gpt_clocked`). `clock.calibrate` times each block's real forward and backward on one micro-batch and
# picks the rate at which every block sleeps at least 20× that (aiming at twice that, a margin for timing noise:
# the first line below prints what it got); a MIN all-reduce gives both ranks the lower of their two rates, so
# they run one clock. Each stage's forward then sleeps its FLOPs / rate and its backward twice
# that: the blocks on both stages, the embeddings on stage 0, the output head and the loss on stage 1. The two
# stages are therefore not equal, so the prediction takes each stage's own F and B instead of the equal-stage
# formula: `step_time.pipeline_step` simulates both ranks' schedules, starting an F when its input has arrived
# and the rank is free, a B when the next stage's gradient has arrived. Its end is the predicted step, and a rank's
# simulated idle share is 1 − m·(F_s + B_s) / step. The measured bubble of each rank, 1 − busy / step, is split as
# above into fill / drain, waiting for a peer and runtime overhead; the simulation models the first two, and the
# band leaves room for the third.

# %% tags=["nbval-ignore-output"]
clk = tm[0]["clocked"]
fig, axes = plt.subplots(2, 1, figsize=(9, 3.6), sharex=True)
for ax, row in zip(axes, clk.rows, strict=True):
    gantt(clk.timelines[row["schedule"]], ax=ax, label_microbatches=False,
          title=f"GPT under the clock, {row['schedule']}, p=2, m=8: measured step {row['step'] * 1e3:.0f} ms, "
                f"pipeline_step {row['predicted'] * 1e3:.0f} ms")
    legend_beside(ax)
plt.tight_layout()
plt.show()
print(clk.calibration)
print("modelled forward per micro-batch: "
      + ", ".join(f"stage {s} {f * 1e3:.2f} ms" for s, f in enumerate(clk.stage_forward_s))
      + f" (backward 2×); equal-stage formula bubble_fraction(2, 8) = {bubble_fraction(2, 8):.3f}")
print(clk)
for row in clk.rows:
    ok = abs(row["step"] - row["predicted"]) <= AGREEMENT_BAND * row["predicted"]
    ranks = "; ".join(
        f"rank {r} bubble {b:.0%} (simulated {sim:.0%}) = schedule's idle {s['fill_drain'] + s['waiting']:.0%} "
        f"+ runtime overhead {s['overhead']:.0%}"
        for r, (b, sim, s) in enumerate(zip(row["bubble"], row["simulated"], row["split"], strict=True)))
    print(f"{row['schedule']}: measured step {row['step'] * 1e3:.0f} ms, predicted {row['predicted'] * 1e3:.0f} ms: "
          f"{'within' if ok else 'outside'} ±{AGREEMENT_BAND:.0%}; {ranks}")
    print("    per micro-batch, measured (modelled): " + "; ".join(
        f"rank {r} F {f * 1e3:.1f} ({t * 1e3:.1f}) ms, B {b * 1e3:.1f} ({2 * t * 1e3:.1f}) ms"
        for r, (f, b, t) in enumerate(zip(row["F"], row["B"], clk.stage_forward_s, strict=True))))

# %% [markdown]
# ## 5. Live activations: GPipe holds m micro-batches, 1F1B at most p − stage
#
# `LiveActivationMeter` counts the bytes autograd saved for backward and has **not yet released**: a saved tensor
# leaves the count once the backward that used it has run. (A meter that kept every saved storage alive until the
# end of the step would read the same for both schedules.)

# %%
live_table = Result(title="live micro-batches and activation bytes, GPT p = 2, m = 8")
for rank in (0, 1):
    g, o = gpt[rank]["gpt"].schedules["gpipe"], gpt[rank]["gpt"].schedules["1f1b"]
    live_table.exact(f"rank {rank}: peak live micro-batches, GPipe", g["peak_live"], 8, "m")
    live_table.condition(f"rank {rank}: peak live micro-batches, 1F1B", o["peak_live"], o["peak_live"] <= 2 - rank,
                         f"≤ p − stage = {2 - rank}")
    ratio = g["peak_live_bytes"] / o["peak_live_bytes"]
    live_table.condition(f"rank {rank}: live bytes GPipe / 1F1B", round(ratio, 1),
                         ratio >= 0.8 * 8 / o["peak_live"], "≥ 0.8 × live micro-batches' ratio",
                         reference=8 // o["peak_live"])
print(live_table)

# %% tags=["nbval-ignore-output"]
for rank in (0, 1):
    live = {name: t["peak_live_bytes"] / 2**20 for name, t in gpt[rank]["gpt"].schedules.items()}
    print(f"rank {rank}: GPipe {live['gpipe']:.2f} MiB, 1F1B {live['1f1b']:.2f} MiB of live activations")

# %% [markdown]
# ## 6. Communication: point-to-point, predicted vs measured
#
# Between stages only the boundary activation (forward) and its gradient (backward) travel, one of each per
# micro-batch and boundary: b_micro · s · h · 4 bytes each. That is small next to tensor parallelism's all-reduces in
# every layer, which is why Megatron-LM keeps tensor parallelism inside a node (NVLink) and puts pipeline stages
# across nodes. Predicted (`formulas.pipeline_p2p_bytes`) vs counted by `CommLog` (ring-model accounting of what
# each rank sends, not bytes counted on the wire). On a slow link, time ≈ messages · α + bytes / β (chapter 00's
# cost model): 2·m messages per step per boundary.

# %%
act = gpt[0]["gpt"].activation_bytes
p2p_table = Result(title=f"p2p bytes per step, GPT p = 2, m = 8 ({act:,} B per boundary activation)")
for rank in (0, 1):
    for name in ("gpipe", "1f1b"):
        got = gpt[rank]["gpt"].schedules[name]
        p2p_table.exact(f"rank {rank} {name}: bytes sent in {got['sends']} messages", got["sent_bytes"],
                        int(pipeline_p2p_bytes(2, 8, act, stage=rank)), "pipeline_p2p_bytes")
print(p2p_table)

# %% [markdown]
# **Interleaved 1F1B** (Megatron-LM): each rank holds v chunks (virtual stages r, r + p, …), so each chunk's work is
# 1/v of a stage and the bubble shrinks to (p−1)/(v·m+p−1) — at the price of more messages between ranks: the
# pipeline now has v·p − 1 boundaries instead of p − 1, each crossed by every micro-batch twice, so
# (v·p − 1)/(p − 1) times as many (at p = 2, v = 2: 3×; v× only as p grows large). Our `interleaved_one_f_one_b` trained the GPT above (p = 2, v = 2) to one device's weights, and §4 measured its bubble on ranks; on paper:

# %%
for v in (1, 2):
    name = "1f1b" if v == 1 else "interleaved"
    kw = {"num_chunks": v} if v > 1 else {}
    events = simulate(make_schedules(name, 2, 4, **kw), 4, v, t_f=1 / v, t_b=2 / v)
    step = max(e.end for tl in events for e in tl)
    msgs = int(pipeline_p2p_bytes(2, 4, 1, stage=0, num_chunks=v))
    print(f"v={v}: simulated bubble {1 - 12 / step:.3f}, (p−1)/(v·m+p−1) = {pipeline_bubble(2, 4, v):.3f}; messages "
          f"per step sent by rank 0: {msgs} = {msgs // 4}× v=1's, (v·p − 1)/(p − 1) = {(v * 2 - 1) // (2 - 1)}")

# %% [markdown]
# ## 7. `torch.distributed.pipelining`
#
# The same stages (our `GPTStage` modules) wrapped in torch's `PipelineStage`, driven by `ScheduleGPipe`,
# `Schedule1F1B` and `ScheduleInterleaved1F1B` (2 chunks per rank), `scale_grads=True`. Same gradients as our
# runner? (Instead of splitting by hand, torch's tracer front end `pipeline(model, mb_args, split_spec=...)` cuts a
# traced model at `SplitPoint`s.)

# %%
def torch_pipelining_step(schedule="1f1b", m=4, micro=2, width=16):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from course_lib.launch import device

    r, p, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(p)])  # as one_f_one_b_step's
    stage = PipelineStage(model[r].to(dev), stage_index=r, num_stages=p, device=dev)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=lambda y, _: y.pow(2).mean(), scale_grads=True)
    x = torch.randn(m * micro, width, generator=torch.Generator().manual_seed(1)).to(dev)
    if r == 0:
        sched.step(x)
    else:  # the last stage (p = 2) computes the loss; its target is unused here
        sched.step(target=torch.zeros(m * micro, width, device=dev))
    return {f"{r}.{n}": q.grad.cpu() for n, q in model[r].named_parameters()}


torch_table = Result(title="torch.distributed.pipelining, p = 2, m = 4")
for name in ("gpipe", "1f1b"):
    theirs = {k: v for g in spawn(torch_pipelining_step, 2, args=(name,)) for k, v in g.items()}
    torch_table.equal(f"{name}: tiny stages' gradients", theirs, tiny_ref, SGD)
for r in tm:
    for t in r["torch"]:
        torch_table.exact(f"rank {t.rank}: {t.schedule} on our GPT stages, max|Δgrad| vs our runner",
                          t.max_grad_diff, 0.0, "our PipelineRunner")

# %% tags=["nbval-ignore-output"]
print(torch_table)
torch_table.assert_passed()

# %% [markdown]
# Newer schedules in torch 2.13: **`ScheduleInterleavedZeroBubble`** and **`ScheduleZBVZeroBubble`** (Qi et al. 2023,
# "Zero Bubble Pipeline Parallelism") split backward into **I** (gradient w.r.t. the input — the next stage up is
# waiting for it) and **W** (gradient w.r.t. the weights — nobody waits), and push the W's into what would be bubble;
# ZBV places 2 chunks per rank in a "V". **`ScheduleDualPipeV`** (DeepSeek-V3's DualPipe, V-shaped) also overlaps one
# micro-batch's forward with another's backward, so that one's communication runs during the other's compute.
# Below: torch's `ScheduleInterleavedZeroBubble` on our GPT (p = 2, 2 chunks per rank, m = 4), run for one real
# step; torch records no times, so this draws its static `pipeline_order` (one slot per action; virtual stage
# number in front: `2I0` = stage 2, input-grad of micro-batch 0), beside our 1F1B's order.

# %%
order = tm[0]["zb"].order
for r in (0, 1):
    print(f"zero bubble, rank {r}: {' '.join(a or '·' for a in order[r])}")
ours = make_schedules("interleaved", 2, 4, num_chunks=2)
for r in (0, 1):
    print(f"our interleaved 1F1B, rank {r}: {' '.join(f'{a.chunk * 2 + r}{a.op}{a.microbatch}' for a in ours[r])}")
zb_loss, gpipe_loss = tm[1]["zb"].loss, tm[1]["torch"][0].torch_loss
print(f"zero-bubble step's loss {zb_loss:.4f}, GPipe's {gpipe_loss:.4f}: equal within SGD's tolerance "
      f"{abs(zb_loss - gpipe_loss) <= SGD.atol + SGD.rtol * abs(gpipe_loss)}")

# %% tags=["nbval-ignore-output"]
def slots(order):
    out = []
    for r in sorted(order):
        row = []
        for i, a in enumerate(order[r]):
            if a is not None:
                stage, rest = int(a[0]), a[1:]
                row.append((rest[0], int(rest[1:]), stage // 2, i, i + 1))
        out.append(row)
    return out


fig, ax = plt.subplots(figsize=(9, 1.8))
gantt(slots(order), ax=ax, unit="", title="ScheduleInterleavedZeroBubble: static pipeline_order (F, I, W slots)")
legend_beside(ax)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Zero bubble on our runner
#
# A layer's backward is two products with its output gradient dY: the **input gradient** dX = dY·Wᵀ, which the
# previous stage is waiting for, and the **weight gradient** dW = Xᵀ·dY, which nothing reads before the optimizer
# step after the flush: no other stage needs it, and no forward of this step uses the updated weights. So W can be
# delayed. ZB-H1 (Qi et al. 2023, `pipeline.zero_bubble`) keeps 1F1B's order of forwards and backwards, but its B
# computes only the input gradient and sends it up at once; each stage queues its W's and runs one wherever it
# would otherwise wait for a peer (or hold more than p micro-batches, 1F1B's peak), the rest at the end. With F, B, W
# the per-stage times of the three steps, 1F1B leaves each rank idle (p−1)(F+B+W) (its B is the whole backward,
# B+W) and ZB-H1 (p−1)(F+B−W). (ZB-H2 warms up with more forwards to reach (p−1)(F+B−2W), i.e. nothing when
# F = B = W, with more activation memory.) The price: what W needs — each layer's input and output gradient —
# stays alive until W runs.
#
# Our split, after the idea of torch's `stage_backward_input` / `stage_backward_weight`: during F the runner keeps
# the output of every layer that owns parameters (`pipeline.weight_outputs`). **B** is one `torch.autograd.grad`
# from the stage output to the stage input that also returns the gradients at those layer outputs (the walk
# passes them anyway), computing no weight gradient and retaining the graph. **W** walks from each kept
# layer-output gradient to that layer's own parameters only: a single walk from all of them to all parameters would
# run down through the layers below once more, i.e. redo B. Under the clock, F sleeps the forward's FLOPs, B
# (`clock.backward_factor = 1`) the same again, and W, which runs no costed module, `clock.spend`s them once more.

# %%
show.source(backward_input, docstring=False)

# %%
show.source(backward_weight, docstring=False)

# %% [markdown]
# The order on paper first (F = B = W = 1 slot; the W's of the first micro-batches land where 1F1B waits):

# %%
for r, acts in enumerate(make_schedules("zero_bubble", 2, 4)):
    print(f"ZB-H1, p=2, m=4, rank {r}: {' '.join(map(repr, acts))}")
for name, costs, formula in (("1f1b", dict(t_b=2.0), "(p−1)(F+B+W) = 9"),
                             ("zero_bubble", dict(t_b=1.0, t_w=1.0), "(p−1)(F+B−W) = 3")):
    events = simulate(make_schedules(name, 4, 8), 8, **costs)
    step = max(e.end for tl in events for e in tl)
    idle = [step - sum(e.end - e.start for e in tl) for tl in events]
    print(f"{name:<11} on paper, p=4, m=8: idle per rank {idle} slots, {formula}")

# %% [markdown]
# On real ranks: the GPT trained with ZB-H1 against one device, and tiny clocked stages (as in §4, F = 40 ms)
# timed under 1F1B and ZB-H1 with `Timeline`: each rank's idle time is the step (earliest start to latest end over
# all ranks) less its F, B and W time; median of 3 steps after a warm-up.

# %%
def zero_bubble_suite():
    return {"train": E.pipeline_training("zero_bubble", "sgd", 5, 4, 16),
            "time": E.zero_bubble_timing(num_microbatches=4, t_f=0.04)}


zbs = spawn(zero_bubble_suite, 2)
zb_table = Result(title="ZB-H1 zero bubble on the GPT (p = 2, m = 4) vs one device")
_ = zb_table.equal("zero_bubble, sgd, 5 steps: weights", E.merge_states([r["train"] for r in zbs]),
                   refs[("sgd", 5)].state_dict(), SGD)

# %% tags=["nbval-ignore-output"]
print(zb_table)
zb_table.assert_passed()

# %% tags=["nbval-ignore-output"]
zbt = zbs[0]["time"]
fig, axes = plt.subplots(2, 1, figsize=(9, 3.6), sharex=True)
for ax, row in zip(axes, zbt.rows, strict=True):
    text = "(p−1)(F+B+W)" if row["schedule"] == "1f1b" else "(p−1)(F+B−W)"
    gantt(zbt.timelines[row["schedule"]], ax=ax,
          title=f"{row['schedule']}, p=2, m=4, measured: idle per rank {[round(i * 1e3) for i in row['idle']]} ms, "
                f"{text} = {row['formula'] * 1e3:.0f} ms")
    legend_beside(ax)
    if row["schedule"] == "zero_bubble":  # its B is the input gradient only
        for label in ax.get_legend().get_texts():
            label.set_text({"backward": "B: input grad", "weight grad": "W: weight grad"}.get(label.get_text(),
                                                                                              label.get_text()))
plt.tight_layout()
plt.show()
print(zbt)
one, zb = zbt.rows
print(f"idle per rank: ZB-H1 {max(zb['idle']) * 1e3:.0f} ms, 1F1B {max(one['idle']) * 1e3:.0f} ms (worst rank): "
      f"{max(one['idle']) / max(zb['idle']):.1f}× less (per micro-batch and stage: F {zb['F'] * 1e3:.0f} ms, "
      f"B {zb['B'] * 1e3:.0f} ms, W {zb['W'] * 1e3:.0f} ms; 1F1B's whole backward {one['B'] * 1e3:.0f} ms)")

# %% [markdown]
# ## 8. PP × DP: two pipelines side by side
#
# 4 ranks = 2 replicas × 2 stages (rank = replica·2 + stage). Each replica trains on half of every batch; after its
# pipeline step, each stage all-reduces its gradients with the same stage of the other replica (its data-parallel
# group: ranks {0, 2} for stage 0, {1, 3} for stage 1) — never across stages.

# %%
ppdp = spawn(E.pp_dp_training, 4, kwargs=dict(num_stages=2, steps=5, num_microbatches=2, global_batch=16))
ref5 = refs[("sgd", 5)]
ppdp_table = Result(title="PP × DP: 2 stages × 2 replicas, 5 SGD steps")
for replica in (0, 1):
    ppdp_table.equal(f"replica {replica}: weights", E.merge_states([r for r in ppdp if r.replica == replica]),
                     ref5.state_dict(), SGD)
_ = ppdp_table.exact("process groups each rank's all-reduces ran in", max(len(r.groups) for r in ppdp), 1,
                     "its stage's data-parallel group")

# %% tags=["nbval-ignore-output"]
print(ppdp_table)
ppdp_table.assert_passed()

# %% [markdown]
# ## 9. Exercise
# `exercises/pipeline.py::one_f_one_b_schedule(num_stages, num_microbatches, stage) -> list[Action]` — the order of
# `Action("F", i)` / `Action("B", i)` that one stage runs in a 1F1B step. The checker compares your list with the
# reference for every stage at p ∈ {1, 2, 3, 4} and m ∈ {1, 2, 3, 4, 6, 8}, then trains the GPT on 2 ranks with
# your lists (gradients equal to one device's, at most p − stage micro-batches alive). Stuck?
# `from course_lib.checks.pipeline import hint`; `hint("one_f_one_b_schedule", 1)` gives the idea,
# `hint("one_f_one_b_schedule", 2)` the API (never the code).

# %%
from course_lib.check import check

check("one_f_one_b_schedule")

# %%
check("one_f_one_b_schedule", package="solutions")

# %% [markdown]
# ## 10. O/X quiz

# %%
from course_lib.quiz import quiz

quiz("pipeline")

# %% [markdown]
# ## Summary
# - Pipeline parallelism splits the model into stages of consecutive layers; each stage holds only its own
#   parameters, gradients and optimizer states. It is model parallelism, not data parallelism.
# - GPipe, 1F1B and interleaved 1F1B all reproduce one device on the full batch (max |Δparam| printed above), and
#   so do 2 stages × 2 data-parallel replicas; torch's `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleaved1F1B`
#   give our gradients.
# - The bubble measured with fixed stage costs follows (p−1)/(m+p−1) for m = 1, 2, 4 (the table above gives the
#   margin); it shrinks as m grows, and is the same for GPipe and 1F1B. Interleaving with v chunks:
#   (p−1)/(v·m+p−1), measured on ranks beside 1F1B's, at (v·p − 1)/(p − 1) times the messages.
# - The slowest stage sets the pace: step = m·(F+B)_slowest + the other stages' (F+B) (predicted beside measured
#   above); the other stages wait for it.
# - On the real GPT a rank's idle time splits into the schedule's idle (fill / drain and waiting for a peer: the
#   bubble, stretched by a slow neighbour) and runtime overhead the formula does not model; the split above prints
#   which part is larger on this machine. Under the modelled clock, `pipeline_step` with each stage's own F and B
#   predicts the GPT's step; the verdict against the ±20 % band and each rank's split are printed above.
# - Zero bubble splits backward into B (input gradient: the previous stage waits for it) and W (weight gradient:
#   nobody waits) and runs W's where 1F1B idles; the GPT trained with it equals one device, and the measured idle
#   time per rank is printed above beside (p−1)(F+B−W) and 1F1B's (p−1)(F+B+W).
# - Each exchange posts its send and its receive together (`dist.batch_isend_irecv`): no crossing messages hang.
# - 1F1B keeps at most p − stage micro-batches alive (GPipe: m); the live activation bytes show the same ratio.
# - Stages exchange only boundary activations and their gradients, point to point: bytes predicted = measured.

# %% tags=["nbval-ignore-output"]
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
