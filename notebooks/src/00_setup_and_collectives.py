# %% [markdown]
# # 00 · Setup and collectives
#
# **What you will learn**
# - how the course starts *real* ranks (separate processes, `torch.distributed` with gloo on CPU, nccl on GPUs);
# - the five collectives every later chapter is built from: all-reduce, reduce-scatter, all-gather, broadcast,
#   send/recv — each run on real data;
# - why **all-reduce = reduce-scatter + all-gather**, and what that means for the bytes on the wire;
# - how to measure bus bandwidth the way nccl-tests does;
# - why distributed training is **not** always faster.
#
# Everything below calls `course_lib`; open `course_lib/launch.py` and `course_lib/comm.py` to read the code.
#
# <a id="kinds-of-parallelism"></a>
# **Two ways to split the work** (the course builds both). *Data parallelism* gives every device a full copy of the
# model and a different part of each batch; the copies' gradients must then be averaged every step (an all-reduce),
# or the copies would drift apart. *Model parallelism* splits one model over devices: consecutive layers (pipeline
# parallelism, chapter 05) or the matrices inside a layer (tensor parallelism, chapter 06). Data parallelism buys
# speed; model parallelism and sharding (chapters 03–06) make models trainable that one device cannot hold. The
# largest language models are trained with all three combined — data, tensor and pipeline: "3D" hybrid
# parallelism. Every kind pays for itself in communication between devices.

# %%
# NBVAL_IGNORE_OUTPUT
import time

_t_notebook = time.perf_counter()
import os

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.cli import doctor
from course_lib.experiments import ch00_collectives
from course_lib.launch import RankError, RankTimeout, spawn

doctor();  # versions, backend, cores, compiler — varies by machine, so nbval ignores this cell

# %% [markdown]
# ## 1. Spawning ranks
#
# `spawn(fn, world_size)` starts `world_size` fresh Python processes, initialises the process group in each
# (rank 0 … N−1) and runs `fn` there. What `fn` returns comes back to this notebook, **in rank order**.
# Ranks never print: the notebook prints what they return. The function may even be defined right here in a cell —
# it travels to the ranks by value.

# %%
def whoami():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)  # a first collective: the sum of all ranks' numbers
    return f"rank {dist.get_rank()} of {dist.get_world_size()} on {dist.get_backend()}: sum of ranks = {t.item():g}"


for line in spawn(whoami, 4):
    print(line)

# %% [markdown]
# A failing rank does not hang the notebook: its exception comes back naming the rank, with the traceback from
# inside that process, and every rank process is gone afterwards.

# %%
def fails_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 is unhappy")
    dist.barrier()  # rank 0 waits here for a rank that will never come


try:
    spawn(fails_on_rank_1, 2)
except RankError as err:
    print(f"caught RankError from rank {err.rank}: {err.exc_type}: {err.__cause__}")


def hangs():
    if dist.get_rank() == 0:
        time.sleep(60)


try:
    spawn(hangs, 2, timeout=3)
except RankTimeout as err:
    print("caught RankTimeout:", str(err).splitlines()[0])

# %% [markdown]
# ## 2. The collectives, on real data
#
# Rank *r* starts with its own tensor; each collective leaves a different result on each rank. With N ranks:
#
# | collective | rank r ends with |
# |---|---|
# | all-reduce | Σ over ranks of the whole tensor |
# | reduce-scatter | chunk r of that sum (1/N of it) |
# | all-gather | every rank's piece, concatenated |
# | broadcast | rank `src`'s tensor |
# | send / recv | what the neighbour sent |
#
# <a id="collective-semantics"></a>
# A collective completes only when **every** rank of the group calls it, the same operation in the same order; a
# rank that calls it alone blocks until the others arrive or the process group's timeout expires. send/recv is
# point-to-point: only the two ranks involved take part.

# %%
def show_collectives():
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.arange(n, dtype=torch.float32) + 10 * r  # rank r holds [10r, 10r+1, ...]
    out = {"start": x.tolist()}
    a = x.clone()
    comm.all_reduce(a)
    out["all_reduce"] = a.tolist()
    rs = torch.empty(1)
    comm.reduce_scatter(rs, x.clone())
    out["reduce_scatter"] = rs.tolist()
    ag = torch.empty(n)
    comm.all_gather(ag, torch.tensor([float(r)]))
    out["all_gather"] = ag.tolist()
    b = x.clone()
    comm.broadcast(b, src=0)
    out["broadcast"] = b.tolist()
    got = torch.empty(1)
    req = comm.isend(torch.tensor([100.0 + r]), (r + 1) % n)  # to the right
    comm.recv(got, (r - 1) % n)  # from the left
    req.wait()
    out["send/recv"] = got.tolist()
    return out


res = spawn(show_collectives, 4)
print(f"{'':<15}" + "".join(f"{'rank ' + str(r):<26}" for r in range(4)))
for key in res[0]:
    print(f"{key:<15}" + "".join(f"{str([round(v) for v in o[key]]):<26}" for o in res))

# %% [markdown]
# ## 3. All-reduce = reduce-scatter + all-gather
#
# A ring all-reduce is exactly two phases: a reduce-scatter (each rank ends up owning the sum of one chunk) and
# an all-gather (the owned chunks travel around once more). Each phase sends (N−1)/N of the tensor per rank, so
# all-reduce sends **2(N−1)/N** of it. `CommLog` records both counts for every call.
# This identity is the heart of ZeRO (chapter 03): keep the reduce-scatter, shard the step, all-gather later.

# %%
def rs_plus_ag_equals_ar(numel):
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
    with comm.CommLog() as log:
        ar = x.clone()
        comm.all_reduce(ar, tag="all-reduce")
        part = torch.empty(numel // n)
        comm.reduce_scatter(part, x.clone(), tag="two-phase")
        two = torch.empty(numel)
        comm.all_gather(two, part, tag="two-phase")
    return {"max_abs_diff": (ar - two).abs().max().item(), "summary": log.summary()}


N, NUMEL = 4, 1 << 16
res = spawn(rs_plus_ag_equals_ar, N, args=(NUMEL,))
print(f"max |all_reduce − all_gather(reduce_scatter)| over ranks: {max(r['max_abs_diff'] for r in res):.1e}")
print(f"{'op':<16}{'tag':<12}{'tensor_bytes':>14}{'ring_bytes':>12}")
for row in res[0]["summary"]:
    print(f"{row['op']:<16}{row['tag']:<12}{row['tensor_bytes']:>14,}{row['ring_bytes']:>12,.0f}")
sent = {tag: sum(r["ring_bytes"] for r in res[0]["summary"] if r["tag"] == tag) for tag in ("all-reduce", "two-phase")}
print(f"bytes sent per rank: all-reduce {sent['all-reduce']:,.0f} = reduce-scatter + all-gather "
      f"{sent['two-phase']:,.0f} = 2(N−1)/N × {4 * NUMEL:,} bytes: "
      f"{sent['all-reduce'] == sent['two-phase'] == 2 * (N - 1) / N * 4 * NUMEL}")

# %% [markdown]
# The two results agree up to float rounding (the sums are added in a different order), and the bytes are identical.
#
# ## 4. Bus bandwidth
#
# nccl-tests reports two numbers per message size: **algbw** = bytes / time and **busbw** = algbw × the ring factor
# (2(N−1)/N for all-reduce, (N−1)/N for reduce-scatter and all-gather). busbw is what the links actually carried,
# so it is comparable across collectives and world sizes. Small messages are latency-bound (tiny bandwidth); large
# ones approach what the transport can do. On CPU with gloo the "link" is a local TCP socket; on GPUs with nccl it
# is NVLink or the network.

# %%
# NBVAL_IGNORE_OUTPUT
SIZES = [2**k for k in range(10, 25, 2)]  # 1 KiB … 16 MiB
bw = spawn(ch00_collectives.bandwidth_benchmark, 2,
           kwargs=dict(sizes_bytes=SIZES, ops=("all_reduce", "all_gather"), iters=5))[0]
print(ch00_collectives.busbw_table(bw))

# %%
# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.5))
for op in ("all_reduce", "all_gather"):
    rows = [r for r in bw if r["op"] == op]
    ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", label=op)
ax.set_xscale("log", base=2)
ax.set_xlabel("message size (bytes)")
ax.set_ylabel("bus bandwidth (GB/s)")
ax.set_title("gloo, 2 ranks: bandwidth grows with message size")
ax.legend()
ax.grid(alpha=0.3)
plt.show()

# %%
ar = [r for r in bw if r["op"] == "all_reduce"]
print("large messages reach a higher bus bandwidth than small ones:", ar[-1]["busbw_GBps"] > 10 * ar[0]["busbw_GBps"])

# %% [markdown]
# ## 5. Distributed is not always faster
#
# Data parallelism splits the **compute** (each rank gets 1/N of the batch) but not the **communication** (each
# rank still all-reduces the whole gradient). Below, one linear layer trained data-parallel at world sizes 1 and 2:
# with a big batch compute dominates and 2 ranks win; with a tiny batch and a big layer the gradient all-reduce
# dominates and 2 ranks *lose*. We stay at world sizes ≤ the number of cores: more ranks than cores would measure
# processes fighting for a core (oversubscription), not communication.

# %%
# NBVAL_IGNORE_OUTPUT
cores = os.cpu_count()
worlds = [w for w in (1, 2) if w <= cores]
print(f"cores on this machine: {cores}; world sizes measured: {worlds}")
cases = {"compute-bound (d=256, batch 16384)": dict(d_model=256, global_batch=16384),
         "communication-bound (d=1024, batch 8)": dict(d_model=1024, global_batch=8)}
scaling = {name: {w: spawn(ch00_collectives.toy_data_parallel_step, w, kwargs=kw)[0] for w in worlds}
           for name, kw in cases.items()}
for name, by_world in scaling.items():
    for w, r in by_world.items():
        print(f"{name:<40} world {w}: step {r['step_s'] * 1e3:7.2f} ms "
              f"(compute {r['compute_s'] * 1e3:6.2f} ms, all-reduce {r['comm_s'] * 1e3:6.2f} ms)")

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(7, 2.8))
labels, comp, comm_t = [], [], []
for name, by_world in scaling.items():
    for w, r in by_world.items():
        labels.append(f"{name.split(' (')[0]}\nworld {w}")
        comp.append(r["compute_s"] * 1e3)
        comm_t.append(r["comm_s"] * 1e3)
ax.barh(labels, comp, label="compute")
ax.barh(labels, comm_t, left=comp, label="all-reduce")
ax.set_xlabel("ms per step")
ax.legend()
plt.tight_layout()
plt.show()

# %%
if len(worlds) == 2:
    cb, mb = scaling["compute-bound (d=256, batch 16384)"], scaling["communication-bound (d=1024, batch 8)"]
    print("compute-bound: 2 ranks faster than 1:", cb[2]["step_s"] < cb[1]["step_s"])
    print("communication-bound: 2 ranks slower than 1:", mb[2]["step_s"] > mb[1]["step_s"])

# %% [markdown]
# So the exam statement "분산 학습은 항상 단일 GPU 학습보다 빠르다" (distributed training is always faster than one
# GPU) is **X**: whether it pays depends on the ratio of compute to communication. Chapter 02 makes DDP hide
# communication behind the backward pass; chapters 03–06 trade memory for extra communication.
#
# ## 6. Exercise: ring all-reduce from send/recv
#
# Open `exercises/ch00_collectives.py` and implement `ring_all_reduce` using only `comm.isend` / `comm.recv` to your
# ring neighbours. Then run the checker — it runs your function on 2 and 3 real ranks and compares it with
# `dist.all_reduce`. Until you implement it, it reports *unsolved*:

# %%
from course_lib.check import check

check("ring_all_reduce")

# %% [markdown]
# The reference solution (`solutions/ch00_collectives.py`) passes the same check:

# %%
check("ring_all_reduce", package="solutions")

# %% [markdown]
# ## 7. O/X quiz
#
# Click **O** (true) or **X** (false) for each statement; each answer shows why. The quiz is in English; the
# **한국어** toggle (or `COURSE_LANG=ko`, or `course_lib.quiz.set_language("ko")`) switches to Korean. The exam's own
# Korean statements are always shown in Korean, with the English translation under them. In a terminal:
# `course-lib quiz --chapter 0`.

# %%
from course_lib.quiz import quiz

quiz(0)

# %% [markdown]
# ## Summary
# - `spawn` runs real ranks; failures and hangs come back as errors naming the rank, and no process is left behind.
# - All five collectives ran on 4 real ranks above; all-reduce equals reduce-scatter + all-gather, result and bytes.
# - Bus bandwidth grows with message size (the plot above, measured on this machine).
# - Adding ranks helped the compute-bound step and hurt the communication-bound one (the timings above).

# %%
# NBVAL_IGNORE_OUTPUT
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
