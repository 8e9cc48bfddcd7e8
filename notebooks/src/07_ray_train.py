# %% [markdown]
# # 07 · Ray Core and Ray Train: the same training on a Ray cluster, surviving a worker failure
#
# **What you will learn**
# - Ray Core's three building blocks — **tasks** (remote functions), **actors** (remote objects with state) and
#   the **object store** — timed on your CPUs, with the parallel speed-up *and* its limits;
# - converting the course's tiny-GPT loop to **Ray Train**: `prepare_model`, `prepare_data_loader`,
#   `ScalingConfig`, `TorchTrainer.fit()`, `ray.train.report` — a 4-line diff from plain PyTorch;
# - **fault tolerance**: `FailureConfig(max_failures=1)`, a worker that fails mid-run, a resume from
#   `ray.train.get_checkpoint()` — and the proof that nothing is lost (final weights equal one device's);
# - a course strategy *inside* Ray Train: FSDP2 `fully_shard` on Ray's process group with a DCP checkpoint;
# - what changes on a real multi-node cluster (shared storage) and the exact commands;
# - what a training function that raises looks like from the driver (the worker's traceback), and an exercise:
#   convert a plain PyTorch loop to Ray Train, checked in a real `TorchTrainer`.
#
# **What you need**: chapters 01–02 (the tiny GPT, DDP) and 04 (FSDP2). Ray 2.60 is installed by `make setup`.
#
# **Expected runtime**: ≈ 2–3 minutes on 2 cores (Ray start-up ≈ 7 s, each `TorchTrainer.fit()` ≈ 30–60 s: mostly
# starting worker processes). One Ray session for the whole notebook: a local single-machine cluster that joins
# nothing else, no dashboard, shut down and its temp dir removed at the end. (Ray's internal ports listen on all
# interfaces — Ray has no loopback-only mode — so keep a laptop's firewall closed on untrusted networks.)
#
# Read along: `course_lib/ray_train.py` (start/stop, run names, a resource check, a report callback) and
# `course_lib/experiments/ray_train.py` (the training functions this notebook hands to Ray).

# %%
# NBVAL_IGNORE_OUTPUT
import time

_t_notebook = time.perf_counter()
import os
import shutil

import matplotlib.pyplot as plt
import numpy as np

from course_lib import ray_train
from course_lib.experiments import ray_train as E

ray = ray_train.start(num_cpus=2)   # ray.init(num_cpus=2, log_to_driver=False, _temp_dir=<short>, ...) on localhost
print(f"cores: {os.cpu_count()}, Ray {ray.__version__}, Ray start-up {time.perf_counter() - _t_notebook:.1f} s")
print(ray.cluster_resources()["CPU"], "logical CPUs in this Ray cluster")

# %% [markdown]
# <a id="ray-core"></a>
# ## 1. Ray Core: a general engine, with libraries on top
#
# Ray is a **general-purpose distributed computing engine** for Python, not a training-only library. Ray Core gives
# three primitives — tasks, actors, objects — and libraries are built from them: **Ray Train** (distributed
# training, this chapter), **Ray Data** (streaming data processing, chapter 08), Ray Tune (hyperparameter search),
# Ray Serve (model serving), RLlib (reinforcement learning). A Ray *cluster* is a head node plus worker nodes; a
# *driver* (this notebook) submits work, and Ray schedules it where the requested resources (CPUs, GPUs) are free.

# %% [markdown]
# <a id="tasks"></a>
# ## 2. Tasks: `@ray.remote` functions
#
# `ray.remote(f)` (or `@ray.remote` on a function) makes a **task**: `f.remote(args)` submits it and returns an
# `ObjectRef` — a future — *immediately*; `ray.get(ref)` waits for the value. Each task asks for 1 CPU by default,
# runs in a worker process, and keeps no state between calls. Submit many first, then `ray.get` them together:

# %%
busy_task = ray.remote(E.busy)     # E.busy: a pure-Python sum of squares (CPU-bound, holds the GIL)
nap_task = ray.remote(E.nap)       # E.nap: time.sleep — wall time, no CPU
ray.get([nap_task.remote(0.0) for _ in range(2)])        # warm up: start the 2 worker processes

ref = busy_task.remote(10)
print(type(ref).__name__, "returned at once; value:", ray.get(ref))

# %%
# NBVAL_IGNORE_OUTPUT
N = 5_000_000


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


t_serial = timed(lambda: [E.busy(N) for _ in range(4)])
t_parallel = timed(lambda: ray.get([busy_task.remote(N) for _ in range(4)]))
t_get_in_loop = timed(lambda: [ray.get(busy_task.remote(N)) for _ in range(4)])   # the anti-pattern
t_naps = timed(lambda: ray.get([nap_task.remote(1.0) for _ in range(4)]))
t_tiny_local = timed(lambda: [E.busy(10) for _ in range(200)])
t_tiny_ray = timed(lambda: ray.get([busy_task.remote(10) for _ in range(200)]))
speedup = t_serial / t_parallel
print(f"4 CPU-bound calls: serial {t_serial:.2f} s, 4 tasks {t_parallel:.2f} s (speed-up {speedup:.2f}× on 2 CPUs), "
      f"ray.get inside the loop {t_get_in_loop:.2f} s")
print(f"4 × 1 s naps as tasks on 2 CPUs: {t_naps:.2f} s (two waves)")
print(f"200 tiny calls: local {t_tiny_local * 1e3:.1f} ms, as tasks {t_tiny_ray * 1e3:.0f} ms")

# %% [markdown]
# The speed-up is bounded by the CPUs Ray was given (2 here, and less when the machine is busy); `ray.get` inside
# the loop waits for each task before submitting the next, so it is as slow as serial. Four 1-second naps take two
# *waves*: a sleeping task still holds its 1 CPU. And a task costs far more than a function call (scheduling,
# serialising arguments and results, a round trip to a worker process): tasks pay off only when each does real work.

# %%
print("parallel speed-up is at most the 2 CPUs (+10%):", speedup <= 2.2)
print("4 × 1 s naps on 2 CPUs take two waves (≥ 2 s, < 3.5 s):", 1.95 <= t_naps < 3.5)
print("200 tiny tasks are slower than 200 local calls:", t_tiny_ray > t_tiny_local)

# %% [markdown]
# <a id="actors"></a>
# ## 3. Actors: remote objects that keep state
#
# `ray.remote(Class).remote(...)` starts an **actor**: one worker process that holds the object. Calls through its
# handle run *in that process, one at a time, in submission order*, so the state is safe to update. Below: a
# **parameter server** (an actor holding a linear model's weights) and gradient **tasks** on two data shards. Each
# round, the tasks take the current weights (an `ObjectRef` from the actor, passed on without `ray.get`), and the
# actor applies their average — the data-parallel step of chapter 02, built from Ray Core pieces.
# Ray Train's training workers are actors too.

# %%
rng = np.random.default_rng(0)
X, w_true = rng.normal(size=(64, 3)), np.array([1.0, -2.0, 0.5])
y = X @ w_true
ps = ray.remote(E.ParameterServer).remote(3, lr=0.3)      # the actor
grad_task = ray.remote(E.shard_gradient)
shards = [(ray.put(X[i::2]), ray.put(y[i::2])) for i in range(2)]
for _ in range(60):
    w_ref = ps.get_weights.remote()                       # a future: tasks wait for it themselves
    updates = ray.get(ps.apply.remote(*[grad_task.remote(w_ref, xs, ys) for xs, ys in shards]))
w = ray.get(ps.get_weights.remote())
print("updates applied by the actor:", updates)
print("weights:", np.round(w, 4), " true:", w_true)
print("the actor's weights converged to the true ones (|Δ| < 1e-3):", bool(np.abs(w - w_true).max() < 1e-3))

# %% [markdown]
# <a id="object-store"></a>
# ## 4. The object store: `ray.put` once, pass the reference
#
# Arguments and results travel through Ray's **object store** (shared memory on each node). Passing a big array
# *by value* to many tasks stores it again for every call; `ref = ray.put(big)` stores it once, and tasks on the
# same node read it in place — a numpy array arrives as a **read-only, zero-copy** view.

# %%
checksum_task = ray.remote(E.checksum)
big = np.arange(8_000_000, dtype=np.float64)               # 64 MB
ray.get(checksum_task.remote(big[:10]))
t_by_value = timed(lambda: ray.get([checksum_task.remote(big) for _ in range(4)]))
t0 = time.perf_counter()
big_ref = ray.put(big)
by_ref = ray.get([checksum_task.remote(big_ref) for _ in range(4)])
t_by_ref = time.perf_counter() - t0

# %%
# NBVAL_IGNORE_OUTPUT
print(f"4 tasks on a 64 MB array: by value {t_by_value:.2f} s, ray.put once + refs {t_by_ref:.2f} s")

# %%
print("sum of the first 1000 elements as the task saw them:", by_ref[0][0])
print("the task's array is a read-only zero-copy view (writeable = False):", by_ref[0][1] is False)

# %% [markdown]
# <a id="torch-trainer"></a>
# ## 5. Ray Train: the tiny-GPT loop on a `TorchTrainer`
#
# The training function (`train_loop_per_worker`) is **plain PyTorch**. `TorchTrainer` starts
# `ScalingConfig(num_workers=...)` worker **actors**, creates the `torch.distributed` process group between them
# (gloo on CPU, nccl with `use_gpu=True`) *before* calling the function, and runs the same function on every worker
# (SPMD, like `torchrun`). The diff from a plain DDP loop is four lines:

# %%
import inspect

print("— plain PyTorch DDP (under torchrun) —")
print(E.PLAIN_LOOP)
print("— the same loop for Ray Train (course_lib/experiments/ray_train.py: ddp_loop) —")
src = inspect.getsource(E.ddp_loop)
print("\n".join(line for line in src.splitlines() if "# 1" in line or "# 2" in line or "# 3" in line
                or "# 4" in line or "get_checkpoint()" in line))

# %% [markdown]
# `num_workers=16, use_gpu=True` means **16 worker processes with one GPU each** (not one worker owning 16 GPUs);
# here: 2 workers, `use_gpu` chosen automatically. Ray does *not* fail when it cannot place the workers: they stay
# pending and `fit()` waits forever. On a fixed-size local cluster `ray_train.check_resources` says so first:

# %%
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig  # noqa: F401
from ray.train.torch import TorchTrainer

use_gpu = ray_train.auto_use_gpu()
try:
    ray_train.check_resources(num_workers=3, use_gpu=use_gpu)
except ValueError as err:
    print("ValueError:", err)
ray_train.check_resources(num_workers=2, use_gpu=use_gpu)
print("2 workers fit: ok")

# %% [markdown]
# <a id="prepare"></a>
# ### What `prepare_model` and `prepare_data_loader` do
#
# - `prepare_model(model)` moves the model to the worker's device and, with more than one worker, wraps it in
#   `DistributedDataParallel` (`parallel_strategy="ddp"`, the default). `parallel_strategy="fsdp"` wraps it in
#   PyTorch's *legacy* `FullyShardedDataParallel` class instead, and that path needs GPUs — section 7 uses FSDP2's
#   `fully_shard` directly, which runs on CPU.
# - `prepare_data_loader(loader)` replaces the sampler with a `DistributedSampler` (each worker gets a different
#   1/N of the data; `shuffle=True` becomes a sampler shuffle seeded by *seed + epoch*: call
#   `loader.sampler.set_epoch(epoch)`) and moves each batch to the worker's device.
#
# The workers report what they got (below, from the run's metrics): `DistributedDataParallel` and
# `DistributedSampler`.

# %% [markdown]
# <a id="checkpoints-and-failures"></a>
# ## 6. Metrics, checkpoints, and a worker that fails mid-run
#
# Every step the workers `ray.train.report({"loss": ...})`; after every epoch rank 0 saves *model, optimizer and
# epoch* into a directory and reports it as a `Checkpoint` (every worker calls `report`, only one passes a
# checkpoint). At the start the function asks `ray.train.get_checkpoint()` and, if there is one, restores and
# continues from the next epoch. We inject a failure: **rank 1 raises in epoch 1, step 1** (once: a marker file
# remembers). With `FailureConfig(max_failures=1)`, Ray tears the worker group down, starts a new one, and calls the
# function again — which resumes from epoch 0's checkpoint. Work since that checkpoint (epoch 1's first step) is
# redone; nothing else is lost.
#
# Train v2's `Result.metrics_dataframe` keeps only reports *with* a checkpoint, so `ray_train.ReportLog` (a
# `ray.train.UserCallback` whose `after_report` forwards every report to a small actor) collects all of them and
# drives one progress line.

# %%
# NBVAL_IGNORE_OUTPUT
import tempfile

marker = os.path.join(tempfile.mkdtemp(prefix="ch07_"), "failed-once")
cfg = E.train_config(fail={"rank": 1, "epoch": 1, "step": 1, "how": "raise", "marker": marker})
log = ray_train.ReportLog()
trainer = TorchTrainer(
    E.ddp_loop,
    train_loop_config=cfg,
    scaling_config=ScalingConfig(num_workers=2, use_gpu=use_gpu),
    run_config=RunConfig(**ray_train.run_config_kwargs("ddp"),            # a new name + storage_path per run
                         failure_config=FailureConfig(max_failures=1), callbacks=[log]),
)
t0 = time.perf_counter()
result = log.fit(trainer, total=cfg["epochs"] * 3 + cfg["epochs"] + 2)
t_ddp_fit = time.perf_counter() - t0
print(f"fit: {t_ddp_fit:.1f} s")

# %%
hist = log.history()
steps = [h for h in hist if "step" in h]
failures = log.failures()
print("failures seen by the controller:", len(failures), "| rank 1 among the failed:", 1 in failures[0])
print("reported (epoch, step):", [(h["epoch"], h["step"]) for h in steps])
print("final metrics:", {k: result.metrics[k] for k in ("epoch", "model", "sampler")})
print("the result has a checkpoint:", result.checkpoint is not None, "| error:", result.error)

# %%
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(range(len(steps)), [h["loss"] for h in steps], marker="o")
redo = [i for i, h in enumerate(steps) if i and (h["epoch"], h["step"]) <= (steps[i - 1]["epoch"], steps[i - 1]["step"])]
for i in redo:
    ax.axvline(i - 0.5, color="tab:red", ls="--", label="restart from the epoch-0 checkpoint")
ax.set(xlabel="report #", ylabel="rank 0 loss", title="loss reported through ReportLog")
ax.legend()
plt.show()

# %% [markdown]
# Nothing lost: the final weights equal **one device trained on the same global batches in the same order** (the
# sampler's permutation for each epoch, recomputed here in the notebook). That equality needs the data order and
# any RNG state to be restorable at a checkpoint: here the order is a function of the epoch, saved with the
# checkpoint; a loop that checkpoints mid-epoch must also save the position in the epoch (and a random sampler's
# generator state).

# %%
reference = E.reference_params(cfg, world=2)
final = E.final_state(result)
diff = max((final[k] - reference[k]).abs().max().item() for k in reference)
print("the worker failure was injected:", os.path.exists(marker))
print("epoch 1's first step was redone after the restart:", [(h["epoch"], h["step"]) for h in steps].count((1, 0)) == 2)
print("final weights after failure + resume equal one device (AdamW, max|Δ| ≤ 1e-5):", diff <= 1e-5)

# %% [markdown]
# ## 7. A course strategy inside Ray Train: FSDP2 on Ray's process group, DCP checkpoints
#
# `prepare_model(parallel_strategy="fsdp")` wraps the legacy `FullyShardedDataParallel` and refuses a CPU worker,
# so `E.fsdp_loop` does what chapter 04 does, on the process group Ray created:
# `init_device_mesh(device, (world,))`, `fully_shard` per block and on the model, AdamW on the sharded parameters.
# Checkpoints use **DCP** (`torch.distributed.checkpoint`): every worker `dcp.save`s *its* shard into its own
# directory and reports it; Ray gathers all the files into one checkpoint; on resume `dcp.load` reads it from
# `get_checkpoint().as_directory()`. This time the failure is harsher: **rank 0's process is killed** (SIGKILL, no
# Python exception) in epoch 1.

# %%
# NBVAL_IGNORE_OUTPUT
cfg_fsdp = E.train_config(fail={"rank": 0, "epoch": 1, "step": 2, "how": "kill",
                                "marker": os.path.join(os.path.dirname(marker), "killed-once")})
t0 = time.perf_counter()
result_fsdp = TorchTrainer(
    E.fsdp_loop, train_loop_config=cfg_fsdp, scaling_config=ScalingConfig(num_workers=2, use_gpu=use_gpu),
    run_config=RunConfig(**ray_train.run_config_kwargs("fsdp"), failure_config=FailureConfig(max_failures=1)),
).fit()
t_fsdp_fit = time.perf_counter() - t0
print(f"fit: {t_fsdp_fit:.1f} s")

# %%
with result_fsdp.checkpoint.as_directory() as d:
    files = sorted(os.listdir(os.path.join(d, "dcp")))
print("DCP checkpoint files:", files)
diff_fsdp = max((E.final_state(result_fsdp)[k] - reference[k]).abs().max().item() for k in reference)
print("one .distcp shard per worker:", sum(f.endswith(".distcp") for f in files) == 2)
print("FSDP2 after a killed worker + DCP resume equals one device (max|Δ| ≤ 1e-5):", diff_fsdp <= 1e-5)

# %% [markdown]
# ## 8. The same script on a real cluster
#
# Nothing in the training function knows the scale. On a cluster of GPU machines:
# ```bash
# # on the head node
# ray start --head --port=6379 --num-gpus=8
# # on every other node
# ray start --address=<head-ip>:6379 --num-gpus=8
# # anywhere that reaches the head: the driver
# python train.py        # ray.init(address="auto"); ScalingConfig(num_workers=16, use_gpu=True)
#                        # RunConfig(storage_path="s3://bucket/runs" or "/mnt/nfs/runs")
# ```
# What this one-machine notebook hides: **`storage_path` must be shared storage** (NFS, S3, GCS) that every node
# can reach — each worker uploads its checkpoint files there and a restarted worker on *another* node downloads
# them; a local `/tmp` path works only because all our workers share one disk. Between nodes, gloo/nccl pick a
# network interface (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME` when a machine has several). Placement:
# `ScalingConfig(placement_strategy="STRICT_SPREAD")` puts each worker on a different node, `"PACK"` (default)
# fills nodes first.
#
# Tried for real on one machine (as root, in `make test`): `tests/test_ray_multinode.py` makes two "hosts" — Linux
# network namespaces with their own addresses, joined by a veth pair — and runs
# `ip netns exec <host0> ray start --head --node-ip-address=10.77.0.1 --num-cpus=1 --temp-dir=<short dir>` and
# `ip netns exec <host1> ray start --address=10.77.0.1:6379 --node-ip-address=10.77.0.2 --num-cpus=1 ...`, each
# with `GLOO_SOCKET_IFNAME=<its veth>` in the environment (without it gloo connects to 127.0.0.1 and fails), then
# a `STRICT_SPREAD` `TorchTrainer` whose two workers report two different node IPs and chapter 02's DDP equal to
# one device across the nodes.
#
# <a id="worker-traceback"></a>
# ## 9. When the training function raises
#
# A worker's exception reaches the driver. With retries left (section 6), the controller hands it to callbacks —
# `after_exception` gets the exception object *without* its traceback (Ray does not send tracebacks with
# exceptions) — and restarts the group. What `ReportLog` received from section 6's failure:

# %%
print("the worker's error:", failures[0][1])

# %% [markdown]
# With no retries left (`FailureConfig(max_failures=0)`, the default), `fit()` raises `TrainingFailedError` in the
# driver — here its subclass `WorkerGroupError` — and *its text* carries the **worker's traceback**, innermost last:
# the file and line of your training function that raised. `err.worker_failures` maps each failed rank to its
# exception. Section 6's run again, with rank 1 raising in its very first step:

# %%
from ray.train import TrainingFailedError

cfg_raise = E.train_config(epochs=1, fail={"rank": 1, "epoch": 0, "step": 0, "how": "raise",
                                           "marker": os.path.join(os.path.dirname(marker), "raised-once")})
try:
    TorchTrainer(E.ddp_loop, train_loop_config=cfg_raise,
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=use_gpu),
                 run_config=RunConfig(**ray_train.run_config_kwargs("raise"))).fit()
except TrainingFailedError as err:
    error = err
print(f"fit() raised {type(error).__name__}; failed ranks:",
      {rank: f"{type(e).__name__}: {e}" for rank, e in error.worker_failures.items()})
print(error)                                  # the message: the worker's traceback, innermost frame last

# %% [markdown]
# <a id="exercise"></a>
# ## 10. Exercise: convert a plain PyTorch loop to Ray Train
#
# `exercises/ray_train.py` holds `plain_loop(config)` — the tiny GPT trained in one process — and
# `ray_train_loop(config)` for you to write: the same training as a `train_loop_per_worker`, with section 5's four
# changes (`prepare_model`; `prepare_data_loader` with the *per-worker* batch; `set_epoch`; a report per epoch
# with a checkpoint from rank 0). `check("ray_train_loop")` runs it in a real `TorchTrainer` with 2 workers (on this
# notebook's Ray session) and compares the checkpointed weights with one device trained on the same global batches;
# an exception in your function comes back as above, and a `NotImplementedError` means it is still a TODO.

# %%
from course_lib.check import check

check("ray_train_loop")

# %%
check("ray_train_loop", package="solutions")

# %% [markdown]
# ## 11. O/X quiz

# %%
from course_lib.quiz import quiz

quiz(7)

# %% [markdown]
# ## Summary
#
# - Ray Core: tasks run in parallel up to the CPUs Ray has (speed-up above, ≤ 2 on 2 CPUs), a task costs far more
#   than a call, an actor keeps state (the parameter server converged), `ray.put` shares big arrays zero-copy.
# - Ray Train: the tiny-GPT loop plus `prepare_model`, `prepare_data_loader`, `ray.train.report` runs on a
#   `TorchTrainer`; a worker that raised mid-run was restarted from the last checkpoint and the final weights equal
#   one device's; FSDP2 + DCP survived a *killed* worker the same way.
# - On a cluster: same function, `ScalingConfig(num_workers=16, use_gpu=True)`, and shared `storage_path`.
# - A worker that raises with no retries left: `fit()` raises `TrainingFailedError` carrying the worker's traceback.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"speed-up {speedup:.2f}×; DDP fit with a failure {t_ddp_fit:.0f} s; FSDP2 fit with a kill {t_fsdp_fit:.0f} s")
print(f"max|Δ| vs one device: DDP {diff:.1e}, FSDP2 {diff_fsdp:.1e}")
ray_train.stop()                                     # ray.shutdown() + remove Ray's temp dir and run storage
shutil.rmtree(os.path.dirname(marker), ignore_errors=True)   # the failure markers
print("Ray stopped:", not ray.is_initialized())
print(f"notebook runtime: {time.perf_counter() - _t_notebook:.1f} s")
