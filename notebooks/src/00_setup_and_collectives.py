# %% [markdown]
# # 00 · Setup and collectives
#
# **What you will learn**
# - how a distributed program starts: the environment variables torchrun sets (MASTER_ADDR, MASTER_PORT, RANK,
#   WORLD_SIZE, LOCAL_RANK) and `dist.init_process_group(init_method="env://")`, done once by hand on two
#   processes, then by the course's `spawn` (separate processes, gloo on CPU, nccl on GPUs);
# - the four collectives every later chapter is built from — `dist.all_reduce`, `dist.reduce_scatter_single`,
#   `dist.all_gather_single`, `dist.broadcast` — and point-to-point `dist.isend` / `dist.irecv` (not a
#   collective: only two ranks take part), each called directly in a rank function on real data, and
#   `async_op=True` with `Work.wait()`;
# - why **all-reduce = reduce-scatter + all-gather**, and what that means for the bytes a ring moves;
# - how to measure bus bandwidth the way nccl-tests does, and the **α–β cost model** (time = α + bytes/β) that the
#   later chapters use to *predict* communication time before they measure it;
# - when data parallelism pays and when it does not: predict a step's time (compute = FLOPs / rate, plus the
#   α–β all-reduce), then measure it on 1 and 2 ranks under the **modelled accelerator clock**, and once on the
#   real clock.
#
# **What you need**: Python and basic PyTorch (tensors, `backward()`); no earlier chapter.
# **Stored build:** 59 s on 2 cores (0% of them busy just before it started).
#
# Everything below calls `course_lib`; open `course_lib/launch.py` and `course_lib/comm.py` to read the code.
#
# <a id="kinds-of-parallelism"></a>
# **Two ways to split the work** (the course builds both). *Data parallelism* gives every device a full copy of the
# model and a different part of each batch; the copies' gradients must then be averaged every step (an all-reduce),
# or the copies would drift apart. *Model parallelism* splits one model over devices: consecutive layers (pipeline
# parallelism, chapter 05) or the matrices inside a layer (tensor parallelism, chapter 06). Data parallelism buys
# speed; model parallelism and sharding (chapters 03–07) make models trainable that one device cannot hold. The
# largest language models are trained with all three combined — data, tensor and pipeline: "3D" hybrid
# parallelism. Every kind pays for itself in communication between devices.

# %% tags=["nbval-ignore-output"]
import time

_t_notebook = time.perf_counter()
import os

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.cli import doctor
from course_lib.experiments import collectives
from course_lib.launch import RankError, RankTimeout, spawn

doctor();  # versions, backend, cores, compiler: these vary by machine

# %% [markdown]
# ## 1. Starting ranks
#
# <a id="env-init"></a>
# **By hand, the way torchrun does it.** A distributed job is N ordinary processes that find each other. torchrun
# (or a cluster scheduler) starts them and gives each five environment variables: `MASTER_ADDR` and
# `MASTER_PORT`, where rank 0 listens (a small key-value store the others connect to, to exchange addresses);
# `WORLD_SIZE`, how many processes; `RANK`, this process's number 0 … N−1 over all machines; `LOCAL_RANK`, its
# number on this machine (which GPU to take). `dist.init_process_group(backend, init_method="env://")` reads them
# and returns once all N have joined. Below, the rank program is an ordinary function; the cell writes its source
# to a script and starts two Python processes on it with those variables set — torchrun's job, done by hand.

# %%
import inspect
import subprocess
import sys

from course_lib.launch import free_port


def rank_main():
    import os

    import torch
    import torch.distributed as dist

    use_gpus = torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])  # one GPU per rank, else the CPU
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_gpus else torch.device("cpu")
    if use_gpus:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if use_gpus else "gloo", init_method="env://")  # reads the 5 variables
    t = torch.tensor([float(dist.get_rank() + 1)], device=dev)
    dist.all_reduce(t)  # 1 + 2 on two ranks
    print(f"RANK={os.environ['RANK']} LOCAL_RANK={os.environ['LOCAL_RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']}"
          f" -> rank {dist.get_rank()} of {dist.get_world_size()}, all_reduce of rank+1 = {t.item():g}")
    dist.destroy_process_group()


script = inspect.getsource(rank_main) + "\nrank_main()\n"
env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
procs = [subprocess.Popen([sys.executable, "-c", script], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
for r, proc in enumerate(procs):
    out, err = proc.communicate(timeout=120)
    print(out.strip() if proc.returncode == 0 else f"rank {r} failed:\n{err}")

# %% [markdown]
# On two machines, the same function runs unchanged: `MASTER_ADDR` becomes rank 0's machine, `RANK` runs over
# both machines and `LOCAL_RANK` restarts at 0 on each. `torchrun --nproc-per-node 2 script.py` sets these
# variables for you (and `--nnodes`, `--node-rank`, `--rdzv-endpoint` for several machines).
#
# <a id="spawn"></a>
# **The course's `spawn` does the same.** `spawn(fn, world_size)` starts `world_size` fresh Python processes with
# these variables (the lines below, from `course_lib/launch.py`, up to the `env=` each rank's process starts
# with), calls `dist.init_process_group` in each (rank 0 …
# N−1), runs `fn` there and destroys the group afterwards. What `fn` returns comes back to this notebook, **in rank
# order**; ranks never print. The function may even be defined right here in a cell — it travels to the ranks by
# value. A rank function never creates or destroys the process group itself, so the same function runs under
# `spawn`, under torchrun (`python -m course_lib.launch module:function`) and in a Ray Train worker (chapter 08).

# %%
from course_lib import show

show.source(spawn, lines=(37, 66))

# %%
from course_lib.launch import device


def whoami():
    env = {k: os.environ[k] for k in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    t = torch.tensor([float(dist.get_rank())], device=device())  # every tensor on this rank's device
    dist.all_reduce(t)  # a first collective: the sum of all ranks' numbers
    return f"{env} -> rank {dist.get_rank()} of {dist.get_world_size()}, sum of ranks = {t.item():g}"


for line in spawn(whoami, 4):
    print(line)

# %% [markdown]
# A failing rank does not hang the notebook: its exception comes back naming the rank, with the traceback from
# inside that process. A rank that waits in a collective for a rank that never comes would hang, so `spawn` has a
# timeout after which it terminates every rank; the last line counts the rank processes still running.

# %%
import psutil


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

left = [p for p in psutil.Process().children(recursive=True) if "_rank_entry" in " ".join(p.cmdline())]
print(f"rank processes still running after both failures: {len(left)}")

# %% [markdown]
# ## 2. The collectives, on real data
#
# Rank *r* starts with its own tensor; each collective leaves a different result on each rank. With N ranks
# (the last row is point-to-point, not a collective):
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
# **point-to-point, not a collective**: only the two ranks involved take part, and the other ranks need not call
# anything. Below every rank sends to its right neighbour and receives from its left one — one step of a ring.
# `dist.isend` / `dist.irecv` return at once with a `Work` handle; `work.wait()` blocks until that message is
# done. A blocking `dist.send` on every rank at once could wait forever for a `recv` that no rank has reached yet.
#
# Every call works **in place** on tensors the caller allocates: the output of `reduce_scatter_single` is 1/N of
# its input, the output of `all_gather_single` N times its input (all on `device()`). These are torch 2.13's names
# for `reduce_scatter_tensor` and `all_gather_into_tensor` (same arguments; the old names are deprecated, and a
# torch ≤ 2.12 has only them).

# %%
def show_collectives():
    r, n, dev = dist.get_rank(), dist.get_world_size(), device()
    x = torch.arange(n, dtype=torch.float32, device=dev) + 10 * r  # rank r holds [10r, 10r+1, ...]
    out = {"start": x.tolist()}
    a = x.clone()
    dist.all_reduce(a)  # op=dist.ReduceOp.SUM by default
    out["all_reduce"] = a.tolist()
    rs = torch.empty(1, device=dev)
    dist.reduce_scatter_single(rs, x.clone())  # rank r gets element r of the sum
    out["reduce_scatter"] = rs.tolist()
    ag = torch.empty(n, device=dev)
    dist.all_gather_single(ag, torch.tensor([float(r)], device=dev))
    out["all_gather"] = ag.tolist()
    b = x.clone()
    dist.broadcast(b, src=0)
    out["broadcast"] = b.tolist()
    got = torch.empty(1, device=dev)
    ops = [dist.isend(torch.tensor([100.0 + r], device=dev), dst=(r + 1) % n),  # to the right
           dist.irecv(got, src=(r - 1) % n)]  # from the left
    for work in ops:
        work.wait()
    out["send/recv"] = got.tolist()
    return out


res = spawn(show_collectives, 4)
print(f"{'':<15}" + "".join(f"{'rank ' + str(r):<26}" for r in range(4)))
for key in res[0]:
    print(f"{key:<15}" + "".join(f"{str([round(v) for v in o[key]]):<26}" for o in res))

# %% [markdown]
# The same table, checked against the definitions: each rank's result recomputed here from the four starting
# tensors.

# %%
from course_lib.results import EXACT, SGD, Result

N4 = len(res)
starts = torch.tensor([o["start"] for o in res])  # row r: rank r's tensor
total = starts.sum(0)
defs = Result(title=f"the collectives on {N4} ranks vs their definitions")
defs.equal("all_reduce: every rank holds Σ_r x_r", [o["all_reduce"] for o in res], [total.tolist()] * N4, EXACT,
           "the sum")
defs.equal("reduce_scatter: rank r holds element r of Σ", [o["reduce_scatter"] for o in res],
           total.view(N4, 1).tolist(), EXACT, "the sum, split")
defs.equal("all_gather: every rank holds [0, 1, …, N−1]", [o["all_gather"] for o in res],
           [list(map(float, range(N4)))] * N4, EXACT, "the pieces")
defs.equal("broadcast: every rank holds rank 0's tensor", [o["broadcast"] for o in res], [res[0]["start"]] * N4,
           EXACT, "rank 0's start")
defs.equal("send/recv: rank r holds 100 + (r−1) mod N", [o["send/recv"] for o in res],
           [[100.0 + (r - 1) % N4] for r in range(N4)], EXACT, "the left neighbour's")
print(defs)

# %% [markdown]
# <a id="async-ops"></a>
# **Asynchronous collectives.** With `async_op=True` a collective returns a `Work` handle at once, before the
# data has moved; the rank may compute meanwhile, and must call `work.wait()` before it reads (or overwrites) the
# tensor. This is how DDP overlaps the gradient all-reduce with the rest of backward (chapter 02). On GPUs,
# `wait()` makes the current CUDA stream wait for the communication, without blocking the host. Below, each rank
# starts an all-reduce of 1 M floats, does a matmul while it is in flight, then waits.

# %%
def async_all_reduce(numel):
    dev = device()
    grad = torch.full((numel,), float(dist.get_rank() + 1), device=dev)
    work = dist.all_reduce(grad, async_op=True)  # returns at once
    a = torch.randn(128, 128, generator=torch.Generator().manual_seed(0)).to(dev)
    busy = (a @ a).sum()  # computes while the all-reduce is in flight
    work.wait()  # after this, grad holds the sum
    return {"work": type(work).__name__, "completed": work.is_completed(), "grad": grad[:3].tolist(),
            "unique": grad.unique().tolist(), "busy": busy.item()}


res_async = spawn(async_all_reduce, 2, args=(1 << 20,))
print(f"dist.all_reduce(async_op=True) returned a {res_async[0]['work']}; after wait(): completed "
      f"{[o['completed'] for o in res_async]}, every element = {res_async[0]['unique']} on both ranks "
      f"(1 + 2): {all(o['unique'] == [3.0] for o in res_async)}")

# %% [markdown]
# ## 3. All-reduce = reduce-scatter + all-gather
#
# A ring all-reduce is exactly two phases: a reduce-scatter (each rank ends up owning the sum of one chunk) and
# an all-gather (the owned chunks travel around once more). Each phase sends (N−1)/N of the tensor per rank, so
# all-reduce sends **2(N−1)/N** of it. `CommLog` records two counts for every call: `tensor_bytes` (the tensor's
# size) and `ring_bytes`. `ring_bytes` is **ring-model accounting** — what a ring algorithm moves per rank,
# `tensor_bytes × ring factor` — not bytes counted on the wire (gloo may pick another algorithm).
# This identity is the heart of ZeRO (chapter 03): keep the reduce-scatter, shard the step, all-gather later.

# %%
def rs_plus_ag_equals_ar(numel):
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(device())
    with comm.CommLog() as log:
        ar = x.clone()
        comm.all_reduce(ar, tag="all-reduce")
        part = torch.empty(numel // n, device=device())
        comm.reduce_scatter(part, x.clone(), tag="two-phase")
        two = torch.empty(numel, device=device())
        comm.all_gather(two, part, tag="two-phase")
    return {"all_reduce": ar.cpu(), "two_phase": two.cpu(), "summary": log.summary()}


N, NUMEL = 4, 1 << 16
res = spawn(rs_plus_ag_equals_ar, N, args=(NUMEL,))
print(f"{'op':<16}{'tag':<12}{'tensor_bytes':>14}{'ring_bytes':>12}")
for row in res[0]["summary"]:
    print(f"{row['op']:<16}{row['tag']:<12}{row['tensor_bytes']:>14,}{row['ring_bytes']:>12,.0f}")
sent = {tag: sum(r["ring_bytes"] for r in res[0]["summary"] if r["tag"] == tag) for tag in ("all-reduce", "two-phase")}
ring = Result(title=f"all-reduce = reduce-scatter + all-gather, {N} ranks, {NUMEL:,} fp32 values")
ring.equal("values on every rank", {r: o["two_phase"] for r, o in enumerate(res)},
           {r: o["all_reduce"] for r, o in enumerate(res)}, SGD, "dist.all_reduce")
ring.exact("ring bytes per rank, all-reduce", int(sent["all-reduce"]), 2 * (N - 1) * 4 * NUMEL // N,
           "formula 2(N−1)/N × bytes")
ring.exact("ring bytes per rank, reduce-scatter + all-gather", int(sent["two-phase"]), 2 * (N - 1) * 4 * NUMEL // N,
           "formula 2(N−1)/N × bytes")
print(ring)

# %% [markdown]
# The two results agree up to float rounding (the sums are added in a different order; the tolerance is the
# course's named `SGD` one, rtol 1e-5 / atol 1e-6). The byte check above
# compares the ring model's count for all-reduce with its counts for reduce-scatter + all-gather: it checks the
# *accounting* (2(N−1)/N = (N−1)/N + (N−1)/N), not a measurement of the wire. Section 4 also times the two
# phases against the one-call all-reduce. On gloo the comparison is not a ring's: gloo implements
# the reduce-scatter as a copy of the input, a full all-reduce and a copy of the rank's chunk, so there a
# reduce-scatter moves the whole all-reduce's bytes (chapter 03 returns to this).
#
# ## 4. Bus bandwidth and the α–β cost model
#
# <a id="bus-bandwidth"></a>
# nccl-tests reports two numbers per message size: **algbw** = bytes / time and **busbw** = algbw × the ring factor
# (2(N−1)/N for all-reduce, (N−1)/N for reduce-scatter and all-gather, 1 for send/recv). busbw is what a ring
# would carry per rank, so it is comparable across collectives and world sizes. On CPU with gloo the "link" is a
# local TCP socket; on GPUs with nccl it is NVLink or the network.
#
# <a id="alpha-beta"></a>
# The **α–β model** says one call costs `time = α + ring_factor · bytes / β`: a fixed cost α (latency, waking the
# other rank, synchronisation) plus the bytes at a bandwidth β. Small messages are the **latency regime** (time ≈ α,
# tiny bandwidth); large ones the **bandwidth regime** (time ≈ bytes/β). `collectives.measure_alpha_beta`
# sweeps 1 KiB … 16 MiB for all-reduce, all-gather, reduce-scatter and send/recv — warm-up calls first, then the
# **median of 5 repeats** per size, with the min–max spread kept — and fits α on the messages ≤ 4 KiB and β on
# the messages ≥ 1 MiB only: gloo switches algorithm with the message size, so one straight line through all sizes
# would fit neither end. Any later notebook calls the same function (a few seconds) to predict its own
# communication. α is the smallest of the small-message medians (a busy machine only adds time). We fit without the
# 8 MiB point and keep it to test the prediction on a size the fit never saw.

# %% tags=["nbval-ignore-output"]
from course_lib import viz

SIZES = list(collectives.FIT_SIZES) + [2**23]
_, bw = collectives.measure_alpha_beta(2, sizes_bytes=SIZES)
fit = collectives.fit_alpha_beta([r for r in bw if r["bytes"] != 2**23])
by_size = sorted(bw, key=lambda r: (collectives.OPS.index(r["op"]), r["bytes"]))
head, *rows = collectives.busbw_table(by_size).splitlines()
print(head)
for line, r in zip(rows, by_size, strict=True):
    print(line + ("  (held out of the fit)" if r["bytes"] == 2**23 else ""))
print()
print(fit.table())

# %% tags=["nbval-ignore-output"]
import matplotlib.pyplot as plt

fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
viz.alpha_beta_plot(bw, fit, ax=ax, title="gloo, 2 ranks: measured time per call vs the α–β fit")
ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))  # below: off the points
ar = sorted((r for r in bw if r["op"] == "all_reduce"), key=lambda r: r["bytes"])
at = {r["bytes"]: r for r in ar}
rise, after = at[2**20]["busbw_GBps"] / at[2**10]["busbw_GBps"], at[2**24]["busbw_GBps"] / at[2**20]["busbw_GBps"]
series = {}
for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
    mine = sorted((r for r in bw if r["op"] == op), key=lambda r: r["bytes"])
    # busbw ∝ 1/time: the slowest repeat gives the lowest bandwidth
    series[op] = ([r["busbw_GBps"] for r in mine], [r["busbw_GBps"] * r["time_s"] / r["time_hi_s"] for r in mine],
                  [r["busbw_GBps"] * r["time_s"] / r["time_lo_s"] for r in mine])
viz.scaling_curves([r["bytes"] for r in ar], series, ax=ax2, logx=True, xlabel="message size (bytes)",
                   ylabel="bus bandwidth (GB/s), median and min–max",
                   title=f"all-reduce busbw: ×{rise:.0f} from 1 KiB to 1 MiB (latency regime), "
                         f"×{after:.1f} from 1 to 16 MiB")
plt.tight_layout()
plt.show()

# %% [markdown]
# Left: the measured medians (dots, with min–max whiskers) and the fitted lines. In the latency regime the α–β
# model charges a call α whatever its size. On two shared cores a small call must also wake gloo's threads and
# the peer, and that wake-up varies from call to call: the whiskers of the small messages show the spread, and
# the cell below prints the fit's α next to the minimum time of one small all-reduce. Right: bus bandwidth
# climbs through the latency regime (where α is most of each call) and grows more slowly once messages are large
# (the title prints the gain from 1 to 16 MiB); with gloo on one machine it can even drop for the largest messages
# (copies through socket buffers). gloo also switches algorithm with the message size (one for small messages,
# another for large ones): the model fits α on the smallest calls and β on the large ones only. The rows below use wide **pass bands**, because the
# timings move with whatever else the machine is doing; they are shown, not asserted.

# %% tags=["nbval-ignore-output"]
ar = {r["bytes"]: r for r in bw if r["op"] == "all_reduce"}
med = {(r["op"], r["bytes"]): r["time_s"] for r in bw}
held = {r["op"]: fit.predict(r["op"], r["bytes"]) / r["time_s"] for r in bw if r["bytes"] == 2**23}
held_out = sorted(held.values())
sec4 = Result(title="section 4 on this machine (timings: shown, not asserted)")
sec4.condition("all-reduce busbw, 16 MiB / 1 KiB", ar[2**24]["busbw_GBps"] / ar[2**10]["busbw_GBps"],
               ar[2**24]["busbw_GBps"] > 10 * ar[2**10]["busbw_GBps"], "> 10×")
sec4.condition("held-out 8 MiB: predicted / measured, middle two of 4 ops", (held_out[1] + held_out[2]) / 2,
               0.5 <= (held_out[1] + held_out[2]) / 2 <= 2, "0.5–2×")
for size in (2**20, 2**22, 2**24):
    two = (med[("reduce_scatter", size)] + med[("all_gather", size)]) / med[("all_reduce", size)]
    sec4.condition(f"time (reduce-scatter + all-gather) / all-reduce, {size >> 20} MiB", two, two >= 1,
                   "≥ 1 on gloo (ring model: ≈ 1)")
print(sec4)
print("held-out 8 MiB, predicted / measured per op:", {op: round(v, 2) for op, v in held.items()})
fast = min(r["time_lo_s"] for r in bw if r["op"] == "all_reduce" and r["bytes"] <= 2**16)
print(f"all-reduce: the fit's α {fit.alpha_s['all_reduce'] * 1e6:.0f} µs (smallest ≤ 4 KiB median); the shortest "
      f"single call ≤ 64 KiB took {fast * 1e6:.0f} µs")

# %% [markdown]
# ## 5. When does data parallelism pay?
#
# Data parallelism splits the **compute** (each rank gets 1/N of the batch) but not the **communication** (each
# rank still all-reduces the whole gradient). Below, two models trained data-parallel on 1 and on 2 ranks, with
# little and with much gradient per FLOP. *Compute-bound*: one linear layer (`nn.Sequential(nn.Linear(d, d))`) at
# a big batch; a weight used in a matmul costs 6 FLOPs (forward + backward) per row of the batch, so its FLOPs per
# byte of gradient grow with the batch. *Communication-bound*: an embedding table of V rows in front of the same
# layer, at a small batch (`collectives.embedding_model`, the input end of a language model); a lookup costs
# almost no FLOPs, but its gradient is dense — all V × d entries, zero for the rows not looked up — and all of it
# is all-reduced. The step-time model predicts each step: compute = FLOPs / rate, plus the real computation the
# clock's sleep follows and the step's all-reduces, both timed alone first (the real compute: the step without
# its all-reduce under the clock, less what the clock slept; the all-reduces on the same gradients, each time
# after idling for the step's compute time, as they come in the step). Section 4's α–β model predicts the same
# all-reduces from the bytes; both are printed. The model splits the compute by N but not the all-reduce: the
# batch at which one rank's share of the compute equals the all-reduce is the crossover it predicts. We stay at
# world sizes ≤ the number of cores: more ranks than cores would measure processes fighting for a core
# (oversubscription), not communication.
#
# <a id="accelerator-clock"></a>
# **The modelled accelerator clock.** On a GPU node the accelerator computes while the communication threads and
# the network are free; on a 2-core laptop the ranks' compute and gloo's communication threads fight for the same
# two cores, so a measurement there mixes the algorithm with that contention. `course_lib.clock.AcceleratorClock`
# models the accelerator:
#
# * **What it does.** Every costed block of the model (here each layer) still computes for real — the numbers stay
#   exact — and then also *sleeps* its FLOPs / rate (forward, and 2× that in backward). While a rank sleeps, gloo's
#   threads have the cores.
# * **How the rate is set.** It is calibrated on the big batch, so that the block sleeps many times its real
#   compute (10×, times a margin of 2 for timing noise; the first line below prints the factor). That factor is
#   per block, at calibration: the layer alone, forward + backward at batch 32, timed once in this process. A
#   whole step's modelled / real compute (printed per case, at the 1-rank batch and at each rank's half) is
#   another measurement: the real step also computes the loss, runs autograd's bookkeeping and the clock's
#   hooks, and frees the gradients, in the race's processes, where both ranks compute at once; and at the half
#   batch the modelled compute halves while that fixed part does not. The table checks the smaller of the two.
# * **Why the small batch depends on it.** On the small batch the real step is mostly fixed overhead (Python,
#   autograd, the clock's own hooks) and the table's dense gradient written to memory; at the same rate the sleep
#   no longer dominates it (each case's line prints its modelled / real compute). So the small batch `MB` is
#   picked from the rate: the even batch whose modelled compute on one rank is nearest a fixed target (set in the
#   code below), so that its compute stays small beside the all-reduce, and at least 4 rows, so that the sleep
#   does not shrink beside that real work.
# * **Its limit.** The Python thread is blocked while it sleeps, so unlike a real host it cannot run ahead and
#   enqueue the next kernels or issue the next collective early.
#
# Every timing table names its clock.
#
# The variants run **interleaved in rounds** (1 rank alone on the whole batch, then 2 ranks on half each, in a
# rotated order), so a program that loads the machine meanwhile slows all of them alike; each variant is reported
# as the median with the min–max range of its rounds, and "faster" is said only when the ranges separate.
# Why the prediction times the all-reduces again instead of taking section 4's α–β: the α–β line is a fit through
# calls timed back to back, at other sizes, in another pair of processes, earlier. Under the clock each all-reduce
# comes after a stretch of compute with no collective, on the step's own gradient tensors, in the race's
# processes. On two shared cores a gloo call's time depends on such conditions (whether gloo's threads and the
# peer are awake and scheduled, what else holds the cores), by a factor that changes from run to run and can go
# either way. So the prediction uses the step's all-reduces timed alone, after idling as long as the step
# computes; the α–β estimate of the same bytes is printed beside it, with their ratio.

# %% tags=["nbval-ignore-output"]
from course_lib.clock import format_rate

D, CB, V = 1024, 32, 4096  # compute-bound: batch 32; communication-bound: a 4096-row table at a small batch
cal = collectives.calibrate_rate(D, CB)  # real forward+backward at batch 32, one thread per rank
print(f"rate: {cal}")
MB = max(4, 2 * round(0.010 * cal.rate / (12 * D * D)))  # the even batch nearest 10 ms modelled on 1 rank, ≥ 4
cases = {"compute-bound": (D, CB), "communication-bound": (D, MB, V)}
beta = fit.beta_bytes_per_s["all_reduce"]
print(f"FLOPs per byte: rate / β = {format_rate(cal.rate)} / {beta / 1e9:.2f} GB/s = {cal.rate / beta:.1f}")
print(f"cores on this machine: {os.cpu_count()}; load average (1 min): {os.getloadavg()[0]:.1f}")
race = spawn(collectives.scaling_race, 2, kwargs=dict(cases=cases, rate=cal.rate, fit=fit, rounds=7, steps=2,
                                                      require_ratio=("compute-bound",)))[0]
for name, (d, batch, *vocab) in cases.items():
    grad = sum(race.grad_bytes[name])
    flops = race.compute_s[name]["1"] * race.rate
    print(f"{name} ({f'{vocab[0]}-row table, ' if vocab else ''}d={d}, batch {batch}): "
          f"{flops / grad:.2g} FLOPs per byte of gradient; "
          f"model's crossover at batch {race.crossover_batch(name):.3g}")
    fit_ratio = {v: race.compute_s[name][v] / max(race.real_s[name][v], 1e-9) for v in ("1", "N")}
    print(f"  modelled / real compute of the whole step: {fit_ratio['1']:.1f}× at batch {batch}, "
          f"{fit_ratio['N']:.1f}× at each rank's {batch // 2} (the layer alone at calibration: ≥ {cal.ratio:.1f}×)")
    print(f"  all-reduces of its {grad / 2**20:.0f} MiB of gradient: {race.comm_s[name] * 1e3:.1f} ms timed alone "
          f"after idling (the prediction's), {race.comm_model_s[name] * 1e3:.1f} ms by section 4's α–β "
          f"(timed alone / α–β = {race.comm_s[name] / race.comm_model_s[name]:.2f})")
    intensity, machine = flops / grad, cal.rate / beta
    print(f"  {intensity:.2g} FLOPs per byte {'>' if intensity > machine else '<'} the machine's {machine:.1f} (rate / β): "
          f"by bandwidth alone, {'compute outlasts its all-reduce' if intensity > machine else 'its all-reduce outlasts compute'}")
print(race)

# %% tags=["nbval-ignore-output"]
import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

fig, ax = plt.subplots(figsize=(9, 4))
labels, x = [], 0
for name in cases:
    pred = race.predicted(name)
    for v in ("1", "N"):
        t = race.clocked[race.name(name, v)]
        ax.errorbar(x - 0.12, t.median * 1e3, yerr=[[(t.median - t.lo) * 1e3], [(t.hi - t.median) * 1e3]],
                    fmt="o", color="C0", capsize=4, label="measured (median, min–max)" if x == 0 else None)
        ax.plot(x + 0.12, pred[v] * 1e3, "s", color="C1", label="predicted" if x == 0 else None)
        labels.append(f"{name}\n{'1 rank' if v == '1' else '2 ranks'}")
        x += 1
ax.set_xticks(np.arange(len(labels)), labels)
ax.set_yscale("log")
ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))  # plain ms ticks: 10, 20, 50, 100
ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
ax.yaxis.set_minor_formatter(NullFormatter())
ax.set_ylabel("ms per step (max over ranks)")
outcome = []
for name in cases:
    c = race.clocked.compare(race.name(name, "N"), race.name(name, "1"))
    word = {-1: "2 ranks faster than 1", 0: "2 ranks and 1 indistinguishable", 1: "2 ranks slower than 1"}[c.sign]
    outcome.append(f"{name}: {word} (×{max(c.ratio, 1 / c.ratio):.2f})")
ax.set_title(f"{race.clock}\n" + "; ".join(outcome), fontsize=10)
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# **The same race on the real clock.** Without the clock the layer's real CPU compute is the "accelerator": it
# computes at least ten times the modelled rate (the calibration above), so the same all-reduce weighs that much
# more against it. On two cores
# the ranks' compute and gloo's threads also share the cores, and any other program on the machine takes its
# share. The real-clock table above (printed with the race) has a third row per case, **compute of 1/2**: every
# rank computes its half of the batch at the same time, without the all-reduce — the 2-rank step less its
# communication. The cell below prints what this machine measured; real timings vary from run to run.

# %% tags=["nbval-ignore-output"]
for name in cases:
    print(f"real clock, {name}: {race.verdict(name, race.real)}")
    one, half, two = (race.real[race.name(name, v)].median for v in ("1", "share", "N"))
    fixed = "Python, autograd, op launches" + (", the table's dense gradient" if len(cases[name]) == 3 else "")
    effect = "does not shorten the real step" if half >= one else f"shortens the real step by {1 - half / one:.0%}"
    print(f"  compute of 1/2 {half * 1e3:.2f} ms vs 1 rank on the whole batch {one * 1e3:.2f} ms "
          f"(×{half / one:.2f}): halving the batch {effect}" + (", not by 50%" if one > half > one / 2 else "")
          + (f": at this size most of it is per-step work that does not shrink with the batch ({fixed}), and "
             "both ranks compute at once" if half > 0.75 * one else "")
          + f"; the all-reduce adds {(two - half) * 1e3:.2f} ms (2 ranks − compute of 1/2)")

# %% [markdown]
# The course's O/X quizzes follow a Korean certification-style exam; its statements are quoted in Korean with an
# English translation. So the exam statement "분산 학습은 항상 단일 GPU 학습보다 빠르다" (“distributed training is
# always faster than one GPU”) is **X**: whether it pays depends on the ratio of compute to communication.
# Chapter 02 overlaps DDP's communication with the backward pass; chapters 03–07 trade memory for extra
# communication.
#
# <a id="exercise"></a>
# ## 6. Exercise: ring all-reduce from send/recv
#
# **The task.** In `exercises/collectives.py`, write
#
# ```python
# def ring_all_reduce(tensor: torch.Tensor) -> torch.Tensor
# ```
#
# a rank function: every rank calls it with its own `tensor` (any shape, fp32, on `device()`); when it returns,
# `tensor` holds the sum over all ranks, **in place**, and the function returns it. The only communication allowed
# is point-to-point with the two ring neighbours, rank r+1 and rank r−1 (mod N), through `comm.isend` /
# `comm.send` / `comm.recv` (they are `dist.isend` / `dist.send` / `dist.recv` that also count the bytes);
# no collective. The tensor's size need not be a multiple of N.
#
# **What the checker compares.** `check("ring_all_reduce")` runs your function on **2 ranks, then on 3**, with
# tensors of 1, 10 and 1003 elements drawn from a seeded generator per rank, and on every rank compares the result
# with `dist.all_reduce` of the same tensor, within the course's `SGD` tolerance (rtol 1e-5, atol 1e-6: another
# order of the same sums). It also fails a run that calls a collective through `comm`, or whose ranks together send
# more or fewer bytes than the bandwidth-optimal ring's 2(N−1) × the tensor's bytes (section 3). It reports the
# rank, the tensor size and the error.
#
# **Hints**, one layer at a time — open the next only when stuck:
#
# <details><summary>Hint 1: the idea</summary>
#
# Section 3: all-reduce = reduce-scatter + all-gather. Cut the tensor into N chunks. In the first phase each
# chunk travels once around the ring, and every rank it passes adds its own copy, so that after N−1 steps every
# rank owns the complete sum of one chunk. In the second phase the finished chunks travel around once more, and
# every rank overwrites its copy.
# </details>
#
# <details><summary>Hint 2: the API</summary>
#
# `torch.tensor_split(tensor.view(-1), N)` cuts into N views of the tensor (uneven sizes allowed): writing into
# a view writes into `tensor`. `comm.isend(t, dst)` returns a `Work`; call `.wait()` on it before you change the
# tensor it sends. `comm.recv(buf, src)` blocks until `buf` is filled: receive into a fresh
# `torch.empty_like(chunk)`, then add it to (phase 1) or copy it into (phase 2) your chunk.
# </details>
#
# <details><summary>Hint 3: which chunk, when</summary>
#
# In every step every rank sends one chunk to the right and receives one from the left. The chunk rank r sends
# at step s is the one it received (and updated) at step s−1; at step 0 of the first phase, rank r starts with
# chunk r. After the first phase, rank r owns the finished chunk r+1 (mod N) — the one the second phase starts
# with.
# </details>
#
# Until you implement it, the checker reports *unsolved*:

# %%
from course_lib.check import check

check("ring_all_reduce")

# %% [markdown]
# The reference solution (`solutions/collectives.py`) passes the same check:

# %%
check("ring_all_reduce", package="solutions")

# %% [markdown]
# ## 7. O/X quiz
#
# Click **O** (true) or **X** (false) for each statement; each answer shows why. The widget starts in English; the
# **한국어** toggle (or `COURSE_LANG=ko`, or `course_lib.quiz.set_language("ko")`) switches to Korean. The exam's own
# Korean statements are always shown in Korean, with the English translation under them. Read without a kernel
# (GitHub, nbviewer), the cell's text lists every statement in Korean with the English under it, then the answers and
# explanations. In a terminal: `course-lib quiz --chapter 0`.

# %%
from course_lib.quiz import quiz

quiz("collectives")

# %% [markdown]
# ## Summary
# - A distributed job is N processes that meet through MASTER_ADDR / MASTER_PORT and learn their place from
#   RANK, WORLD_SIZE and LOCAL_RANK: `dist.init_process_group(init_method="env://")` reads them (two processes
#   started by hand above); `spawn` sets the same variables and initialises the group for a rank function.
# - `spawn` runs real ranks; failures and hangs come back as errors naming the rank, and the rank processes are
#   terminated (their count after the failures is printed in section 1).
# - The four collectives (`dist.all_reduce`, `reduce_scatter_single`, `all_gather_single`, `broadcast`)
#   and point-to-point `isend`/`irecv` ran on 4 real ranks and matched their definitions; `async_op=True` returns
#   a `Work` to `wait()` on; all-reduce equals reduce-scatter +
#   all-gather in result, and in the ring model's byte accounting (`CommLog`), which is accounting, not a wire count.
# - The α–β fit and what this machine measured (printed below, from this run). Chapters 02 and 03 predict with the
#   same method, refitted on their own run: α and β change from run to run on shared cores.
# - Section 5 predicted a data-parallel step (FLOPs / rate + the α–β all-reduce) on 1 and 2 ranks, then measured it
#   under the modelled accelerator clock and on the real clock; the verdicts are printed below.

# %% tags=["nbval-ignore-output"]
print(f"all-reduce on 2 ranks: α = {fit.alpha_s['all_reduce'] * 1e6:.0f} µs, "
      f"β = {fit.beta_bytes_per_s['all_reduce'] / 1e9:.2f} GB/s; busbw {ar[2**10]['busbw_GBps']:.3f} GB/s at 1 KiB, "
      f"{ar[2**24]['busbw_GBps']:.2f} GB/s at 16 MiB")
print(f"held-out 8 MiB predicted / measured: {held_out[0]:.2f} … {held_out[-1]:.2f} over the 4 ops")
for name in cases:
    print(f"{name}, {race.clock}: predicted 2 ranks {race.expect(name)} than 1; measured: {race.verdict(name)}")
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
