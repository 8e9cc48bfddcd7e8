"""Chapter 10: Horovod run for real, beside the course's own DDP and torch DDP — same model, same data.

Horovod (Uber, 2017; LF AI & Data) made ring all-reduce data parallelism a few-line change to a
training script. It is retired: its last release, 0.28.1, is from June 2023, Ray 2.x's
``HorovodTrainer`` refuses to run (:func:`ray_on_horovod` shows its message), and users moved to
torch's own DDP / FSDP, DeepSpeed, and Ray Train's ``TorchTrainer``. No wheel of it fits torch 2.13:
``make horovod`` builds one once per machine (``tools/build_horovod.py``, ≈7 min on 2 cores).

API for notebook 10 (everything returns to the parent; workers never print):

* :func:`horovod_available` → bool; :data:`BUILD_HINT` says how to get it (``make horovod``).
* :func:`compare_frameworks` ``(steps=5, global_batch=16, optimizer="sgd", world_size=2)`` →
  :class:`FrameworkComparison`: the tiny GPT (``common.small_config``) trained by Horovod
  (``horovodrun -np N --gloo``), by ``course_lib.ddp.DDP`` and by torch DDP (both via
  ``launch.spawn``) and on one device (``common.reference_run``), rank r starting from seed r and
  taking its ``1/N`` of the same batches; ``.diffs`` holds max|Δparam| for every pair,
  ``.rank_spread`` the largest difference between one run's ranks; it is a ``results.Result``:
  ``print(cmp)`` shows the checked rows (pairs within ``for_optimizer(optimizer)``: SGD or ADAMW),
  ``.claims()`` their verdicts.
  A catch it measures: ``hvd.broadcast_optimizer_state`` on a fresh optimizer first takes one step
  on zero gradients to create the state. SGD with momentum does not move; AdamW applies weight decay
  and counts a step, so with ``optimizer="adamw"`` Horovod ends ≈2e-3 away from the others — and
  equal to one device that took the same zero-gradient step (:func:`one_device`).
* :func:`run_horovod` — the Horovod run alone; ``{"states": [per rank], "losses": [...]}``.
* :data:`API_TABLE` (rows of :data:`API_COLUMNS`) and :func:`api_table_markdown`: Horovod ↔ course_lib
  ↔ torch ↔ DeepSpeed (``zero_optimization.stage`` 1/2/3 + offload ↔ ``ZeroOptimizer`` / ``Zero3``).

Failures: no ``horovodrun`` → :class:`HorovodNotAvailable` (with :data:`BUILD_HINT`); a worker that
raises → :class:`HorovodRunError` naming the rank, with its traceback; a run past ``timeout`` →
:class:`HorovodTimeout`. In every case the whole ``horovodrun`` process tree is ended before the call
returns. The comparison runs every framework on CPU with gloo (Horovod here is built without CUDA),
so all four do the same arithmetic.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ddp import DDP, torch_ddp
from ..launch import device, spawn, write_atomic
from ..models import GPT, GPTConfig
from ..results import EXACT, Row, Tolerance, for_optimizer
from ..timing import Timings, time_steps
from .common import (
    OPTIMIZERS,
    Result,
    check_global_batch,
    make_optimizer,
    max_abs_diff,
    mean_over_ranks,
    shard_batch,
    small_config,
    step_batch,
    train_step,
)

__all__ = [
    "HOROVOD_VERSION",
    "BUILD_HINT",
    "FRAMEWORKS",
    "API_COLUMNS",
    "API_TABLE",
    "HorovodNotAvailable",
    "HorovodRunError",
    "HorovodTimeout",
    "FrameworkComparison",
    "horovod_available",
    "horovodrun_path",
    "run_horovod",
    "ddp_rank",
    "one_device",
    "compare_frameworks",
    "api_table_markdown",
    "ray_on_horovod",
]

HOROVOD_VERSION = "0.28.1"
BUILD_HINT = (
    "Horovod is not installed in this venv. Build it once per machine with `make horovod` "
    "(≈7 min on 2 cores; the wheel is cached in ~/.cache/course_lib/wheels, later installs take seconds)."
)
FRAMEWORKS = ("horovod", "course DDP", "torch DDP", "one device")


class HorovodNotAvailable(RuntimeError):
    """``horovodrun`` or ``horovod.torch`` is missing: the message says how to build it."""


class HorovodRunError(RuntimeError):
    """A Horovod worker raised or died, or ``horovodrun`` failed; ``.rank`` (None: the launcher), ``.log_tail``."""

    def __init__(
        self, rank, what: str, remote_traceback: str = "", log_tail: str = "", run_dir: str = ""
    ):
        self.rank, self.remote_traceback, self.log_tail, self.run_dir = (
            rank,
            remote_traceback,
            log_tail,
            run_dir,
        )
        who = "horovodrun" if rank is None else f"Horovod worker rank {rank}"
        text = f"{who}: {what}"
        if remote_traceback:
            text += f"\n\n--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        if log_tail.strip():
            text += f"\n--- horovodrun output (tail) ---\n{log_tail}"
        super().__init__(text)


class HorovodTimeout(TimeoutError):
    """The run did not finish within ``timeout``; its process tree was ended. ``.run_dir``, ``.log_tail``."""

    def __init__(self, timeout: float, log_tail: str, run_dir: str):
        self.log_tail, self.run_dir = log_tail, run_dir
        super().__init__(
            f"horovodrun did not finish within timeout={timeout:g}s; it and its workers were killed "
            f"(a worker waiting in an all-reduce that another never joins waits until then)"
            + (f"\n--- horovodrun output (tail) ---\n{log_tail}" if log_tail.strip() else "")
        )


# =========================================================================== is it here?


def horovodrun_path() -> str | None:
    """``horovodrun`` beside this interpreter (a kernel's PATH may lack the venv), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return here if os.access(here, os.X_OK) else shutil.which("horovodrun")


def horovod_available() -> bool:
    """True when ``horovod.torch`` and ``horovodrun`` are installed (``make horovod``; see :data:`BUILD_HINT`)."""
    return importlib.util.find_spec("horovod") is not None and horovodrun_path() is not None


# =========================================================================== the Horovod worker


def _horovod_train(
    hvd,
    config: GPTConfig,
    steps: int,
    global_batch: int,
    optimizer: str,
    fail_rank: int | None,
    hang_rank: int | None,
) -> dict:
    """What each ``horovodrun`` worker runs: the textbook Horovod recipe on the course's model and data."""
    rank, world, dev = hvd.rank(), hvd.size(), device()
    model = GPT(config, seed=rank).to(
        dev
    )  # a different start on every rank: the broadcast must fix it
    opt = make_optimizer(optimizer, model.parameters())
    # Horovod's three lines: average gradients by all-reduce (started by hooks during backward, waited
    # for in step()), start from rank 0's weights and from rank 0's optimizer state.
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    losses = []
    for step in range(steps):
        if step == 1 and rank == fail_rank:
            raise RuntimeError(
                f"rank {rank} failed on purpose at step {step} (fail_rank={fail_rank})"
            )
        if step == 1 and rank == hang_rank:
            time.sleep(
                3600
            )  # never joins the all-reduce: the others wait, the parent's timeout ends it
        x, y = shard_batch(
            *step_batch(step, config, global_batch, dev), rank=rank, world_size=world
        )
        opt.zero_grad()  # Horovod's zero_grad takes no set_to_none (torch's default, True, applies)
        _, loss = model(x, y)
        loss.backward()  # hooks start one async all-reduce per gradient as it is ready
        opt.step()  # waits for them (the average over ranks), then the wrapped optimizer's step
        losses.append(
            hvd.allreduce(loss.detach().reshape(1), op=hvd.Average, name=f"loss.{step}").item()
        )
    return {
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "losses": losses,
    }


def _worker_main(run_dir: str) -> None:
    """Entry point of ``python -m course_lib.experiments.horovod RUN_DIR`` under horovodrun."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    caller = int(os.environ["COURSE_LIB_CALLER_PID"])
    threading.Thread(target=_exit_with_caller, args=(caller, run_dir), daemon=True).start()
    rank = int(os.environ.get("HOROVOD_RANK", "-1"))
    try:
        import horovod.torch as hvd

        hvd.init()
        rank = hvd.rank()
        with open(os.path.join(run_dir, "job.pkl"), "rb") as f:
            job = pickle.load(f)
        out = pickle.dumps(_horovod_train(hvd, **job))
        hvd.join()  # every rank finished before anyone leaves
        write_atomic(os.path.join(run_dir, f"rank{rank}.ok"), out)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        write_atomic(
            os.path.join(run_dir, f"rank{rank}.err"),
            pickle.dumps((type(exc).__name__, str(exc), traceback.format_exc())),
        )
        os._exit(1)


def _exit_with_caller(pid: int, run_dir: str) -> None:
    """End this worker (and clean up) when the process that called :func:`run_horovod` is gone (a killed kernel)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(run_dir, ignore_errors=True)
            os._exit(1)
        time.sleep(1.0)


# =========================================================================== the parent side


def _end_tree(proc: subprocess.Popen) -> None:
    """Kill horovodrun and every process under it (its workers run in sessions of their own)."""
    import psutil

    try:
        victims = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        victims = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for v in victims:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=5)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _check_inputs(steps: int, global_batch: int, world_size: int, optimizer: str) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZERS)}")
    check_global_batch(global_batch, world_size)  # every rank takes an equal 1/N of each batch


def run_horovod(
    steps: int = 5,
    global_batch: int = 16,
    optimizer: str = "sgd",
    world_size: int = 2,
    *,
    config: GPTConfig | None = None,
    timeout: float = 180.0,
    fail_rank: int | None = None,
    hang_rank: int | None = None,
) -> dict:
    """``horovodrun -np world_size --gloo`` on this module; returns ``{"states": [...], "losses": [...]}``.

    ``fail_rank`` / ``hang_rank`` make that rank raise / stop at step 1, to see the failure handling.
    """
    _check_inputs(steps, global_batch, world_size, optimizer)
    launcher = horovodrun_path()
    if launcher is None or importlib.util.find_spec("horovod") is None:
        raise HorovodNotAvailable(BUILD_HINT)
    run_dir = tempfile.mkdtemp(prefix="course_lib_hvd_")
    with open(os.path.join(run_dir, "job.pkl"), "wb") as f:
        pickle.dump(
            dict(
                config=config or small_config(),
                steps=steps,
                global_batch=global_batch,
                optimizer=optimizer,
                fail_rank=fail_rank,
                hang_rank=hang_rank,
            ),
            f,
        )
    worker = (
        f"{shlex.quote(sys.executable)} -m course_lib.experiments.horovod {shlex.quote(run_dir)}"
    )
    # All on loopback: -H localhost:N, the lo interface for gloo, no ssh, no cache file in ~/.horovod.
    cmd = [
        launcher,
        "-np",
        str(world_size),
        "-H",
        f"localhost:{world_size}",
        "--gloo",
        "--network-interfaces",
        "lo",
        "--start-timeout",
        str(int(max(30, timeout))),
        "--disable-cache",
        *shlex.split(worker),
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        COURSE_LIB_CALLER_PID=str(os.getpid()),
        PYTHONPATH=os.pathsep.join([p or os.getcwd() for p in sys.path]),
    )
    log_path = os.path.join(run_dir, "horovodrun.log")
    proc = None
    try:
        with open(log_path, "wb") as log:  # workers never print into the notebook
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise HorovodTimeout(timeout, _tail(log_path), run_dir) from None
        errors = sorted(
            (os.stat(p).st_mtime_ns, r, p)
            for r in range(world_size)
            if os.path.exists(p := os.path.join(run_dir, f"rank{r}.err"))
        )
        if errors:  # the earliest exception caused the rest
            _, r, path = errors[0]
            with open(path, "rb") as f:
                name, msg, tb = pickle.load(f)
            raise HorovodRunError(r, f"raised {name}: {msg}", tb, _tail(log_path), run_dir)
        missing = [
            r for r in range(world_size) if not os.path.exists(os.path.join(run_dir, f"rank{r}.ok"))
        ]
        if rc != 0 or missing:
            raise HorovodRunError(
                None,
                f"exited with code {rc}; no result from rank(s) {missing}",
                log_tail=_tail(log_path),
                run_dir=run_dir,
            )
        results = []
        for r in range(world_size):
            with open(os.path.join(run_dir, f"rank{r}.ok"), "rb") as f:
                results.append(pickle.load(f))
        return {"states": [res["state"] for res in results], "losses": results[0]["losses"]}
    finally:
        if proc is not None:
            _end_tree(proc)
        shutil.rmtree(run_dir, ignore_errors=True)


def ddp_rank(kind: str, config: GPTConfig, steps: int, global_batch: int, optimizer: str) -> dict:
    """Rank function (``launch.spawn``): the same recipe with ``kind`` = ``"course"`` or ``"torch"`` DDP."""
    rank, dev = dist.get_rank(), device()
    model = GPT(config, seed=rank).to(
        dev
    )  # wrapping broadcasts rank 0's weights, as hvd.broadcast_parameters
    wrapped = {"course": DDP, "torch": torch_ddp}[kind](model)
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for step in range(steps):
        x, y = shard_batch(*step_batch(step, config, global_batch, dev))
        losses.append(mean_over_ranks(train_step(wrapped, opt, x, y)))
    return {
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
        "losses": losses,
    }


def one_device(
    config: GPTConfig,
    steps: int,
    global_batch: int,
    optimizer: str,
    *,
    horovod_init_step: bool = False,
) -> tuple[dict, list[float]]:
    """One device on the full batches (``common.reference_run``'s loop): ``(state_dict, losses)``.

    ``horovod_init_step=True`` first does what ``hvd.broadcast_optimizer_state`` does to a fresh
    optimizer to create its state: set every gradient to zero and take one optimizer step. Nothing
    moves under SGD with momentum (its buffer starts at 0 either way); AdamW applies its weight decay
    once and counts a step, which changes its bias correction ever after.
    """
    dev = torch.device("cpu")
    model = GPT(config, seed=0).to(dev)
    opt = make_optimizer(optimizer, model.parameters())
    if horovod_init_step:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    losses = [
        train_step(model, opt, *step_batch(step, config, global_batch, dev))
        for step in range(steps)
    ]
    return model.state_dict(), losses


INIT_STEP = "one device after a zero-gradient step"


@dataclass
class FrameworkComparison(Result):
    """The same training by each framework: final max|Δparam| between every pair, ranks' agreement, losses.

    ``diffs`` covers every pair of :data:`FRAMEWORKS` plus ``"horovod vs one device after a
    zero-gradient step"``; ``init_step_effect`` is how far that step alone moves one device's run.
    ``states`` keeps each run's rank-0 final parameters, which the rows compare with
    :attr:`tolerance` (the named tolerance of the optimizer, ``results.for_optimizer``).
    """

    world_size: int
    steps: int
    global_batch: int
    optimizer: str
    diffs: dict = field(default_factory=dict)  # "a vs b" -> max|Δparam|
    rank_spread: dict = field(
        default_factory=dict
    )  # framework -> max|Δ| between its ranks' final params
    losses: dict = field(default_factory=dict)  # framework -> global-batch loss per step
    seconds: dict = field(
        default_factory=dict
    )  # framework -> wall time with start-up (timing: varies), the medians of ``timings``
    timings: Timings | None = field(default=None, repr=False)  # one round of each run, time_steps
    init_step_effect: float = 0.0  # max|Δ| one device vs one device after a zero-gradient step
    states: dict = field(default_factory=dict, repr=False)  # framework -> rank 0's final state_dict

    @property
    def tolerance(self) -> Tolerance:
        return for_optimizer(self.optimizer)

    def checks(self) -> list[Row]:
        """Every pair equal within :attr:`tolerance` — except Horovod's, when the zero-gradient step
        moved the optimizer (AdamW): then they must differ, and Horovod must equal one device after it.

        The quantity texts name the tolerance's absolute part (the printed claims of notebook 10);
        the tolerance column names the whole rule.
        """
        tol = self.tolerance
        moved = not tol.ok(self.states[INIT_STEP], self.states["one device"])
        rows = []
        for pair, d in self.diffs.items():
            a, b = pair.split(" vs ", 1)
            same = tol.ok(self.states[a], self.states[b])
            if moved and a == "horovod" and b != INIT_STEP:
                rows.append(
                    Row(
                        f"{pair}: max|Δparam| > {tol.atol:.0e} (the zero-gradient step moved "
                        f"{self.optimizer})",
                        d,
                        None,
                        b,
                        f"outside {tol}",
                        not same,
                    )
                )
            else:
                rows.append(
                    Row(f"{pair}: max|Δparam| ≤ {tol.atol:.0e}", d, None, b, str(tol), same)
                )
        spread = max(self.rank_spread.values(), default=0.0)
        rows.append(
            Row(
                "every run's ranks end with identical parameters",
                spread,
                None,
                "rank 0 of each run",
                str(EXACT),
                all(s == 0.0 for s in self.rank_spread.values()),
            )
        )
        return list(self.checked) + rows


def compare_frameworks(
    steps: int = 5,
    global_batch: int = 16,
    optimizer: str = "sgd",
    world_size: int = 2,
    *,
    config: GPTConfig | None = None,
    timeout: float = 240.0,
) -> FrameworkComparison:
    """Train the tiny GPT with Horovod, the course's DDP, torch DDP and one device; compare final weights."""
    _check_inputs(steps, global_batch, world_size, optimizer)
    if not horovod_available():
        raise HorovodNotAvailable(BUILD_HINT)
    config = config or small_config()
    states, out = {}, FrameworkComparison(world_size, steps, global_batch, optimizer)

    def horovod():
        hvd = run_horovod(
            steps, global_batch, optimizer, world_size, config=config, timeout=timeout
        )
        states["horovod"], out.losses["horovod"] = hvd["states"], hvd["losses"]

    def ddp(kind):
        ranks = spawn(
            ddp_rank,
            world_size,
            args=(kind, config, steps, global_batch, optimizer),
            backend="gloo",
            timeout=timeout,
        )
        states[f"{kind} DDP"] = [r["state"] for r in ranks]
        out.losses[f"{kind} DDP"] = ranks[0]["losses"]

    def single(name, init):
        state, out.losses[name] = one_device(
            config, steps, global_batch, optimizer, horovod_init_step=init
        )
        states[name] = [state]

    runs = {
        "horovod": horovod,
        "course DDP": lambda: ddp("course"),
        "torch DDP": lambda: ddp("torch"),
        "one device": lambda: single("one device", False),
        INIT_STEP: lambda: single(INIT_STEP, True),
    }
    # each run once, start-up included (a wall time, not a step time: it varies with the machine)
    out.timings = time_steps(
        runs, rounds=1, warmup=0, device="cpu", title="wall time with start-up"
    )
    out.seconds = out.timings.medians()
    for name, per_rank in states.items():
        out.rank_spread[name] = max(
            (max_abs_diff(s, per_rank[0]) for s in per_rank[1:]), default=0.0
        )
        out.states[name] = per_rank[0]
    for i, a in enumerate(FRAMEWORKS):
        for b in FRAMEWORKS[i + 1 :]:
            out.diffs[f"{a} vs {b}"] = max_abs_diff(states[a][0], states[b][0])
    out.diffs[f"horovod vs {INIT_STEP}"] = max_abs_diff(states["horovod"][0], states[INIT_STEP][0])
    out.init_step_effect = max_abs_diff(states["one device"][0], states[INIT_STEP][0])
    return out


# =========================================================================== the API side by side

API_COLUMNS = ("task", "Horovod", "course_lib", "torch", "DeepSpeed")
API_TABLE = [
    (
        "start N processes",
        "horovodrun -np 2 --gloo python train.py",
        "launch.spawn(fn, world_size=2)",
        "torchrun --nproc-per-node 2 train.py",
        "deepspeed --num_gpus 2 train.py",
    ),
    (
        "join the group",
        "hvd.init()",
        "(spawn initialises it)",
        "dist.init_process_group('gloo')",
        "deepspeed.init_distributed()",
    ),
    (
        "who am I",
        "hvd.rank(), hvd.size(), hvd.local_rank()",
        "dist.get_rank(), launch.device()",
        "dist.get_rank(), dist.get_world_size()",
        "engine.global_rank, engine.world_size",
    ),
    (
        "same start weights",
        "hvd.broadcast_parameters(model.state_dict(), root_rank=0)",
        "DDP(model) broadcasts rank 0's",
        "DistributedDataParallel(model) broadcasts rank 0's",
        "deepspeed.initialize(model=..., config=...) broadcasts",
    ),
    (
        "same optimizer state",
        "hvd.broadcast_optimizer_state(opt, root_rank=0)",
        "(fresh optimizer on equal weights)",
        "(fresh optimizer on equal weights)",
        "(inside the engine)",
    ),
    (
        "average gradients",
        "hvd.DistributedOptimizer(opt, named_parameters=...): hooks start one all-reduce "
        "per gradient during backward; step() waits for them",
        "DDP(model, bucket_cap_mb=25): hooks + buckets during backward",
        "DistributedDataParallel(model, bucket_cap_mb=25)",
        "engine.backward(loss); engine.step()",
    ),
    (
        "fuse small tensors",
        "tensor fusion: HOROVOD_FUSION_THRESHOLD",
        "bucket_cap_mb",
        "bucket_cap_mb",
        "reduce_bucket_size / allgather_bucket_size",
    ),
    (
        "accumulate k micro-batches",
        "DistributedOptimizer(..., backward_passes_per_step=k)",
        "with ddp.no_sync():",
        "with ddp.no_sync():",
        "gradient_accumulation_steps: k",
    ),
    (
        "compress gradients",
        "compression=hvd.Compression.fp16",
        "DDP(..., comm_hook='fp16')",
        "register_comm_hook(None, fp16_compress_hook)",
        "communication_data_type: 'fp16'",
    ),
    (
        "shard optimizer state (ZeRO-1)",
        "— (data parallel only)",
        "zero.ZeroOptimizer(params, AdamW, stage=1)",
        "ZeroRedundancyOptimizer(params, AdamW)",
        "zero_optimization: {stage: 1}",
    ),
    (
        "+ shard gradients (ZeRO-2)",
        "—",
        "zero.ZeroOptimizer(params, AdamW, stage=2)",
        "fully_shard(model, reshard_after_forward=False)",
        "zero_optimization: {stage: 2}",
    ),
    (
        "+ shard parameters (ZeRO-3)",
        "—",
        "zero3.Zero3(model)",
        "fully_shard(model) (FSDP2)",
        "zero_optimization: {stage: 3}",
    ),
    (
        "offload to CPU",
        "—",
        "— (not built in the course)",
        "fully_shard(..., offload_policy=CPUOffloadPolicy())",
        "offload_optimizer: {device: cpu} (stage 1-3); offload_param: {device: cpu} (stage 3)",
    ),
    (
        "split the model (PP / TP)",
        "— (no model parallelism)",
        "pipeline.py, tensor_parallel.py",
        "torch.distributed.pipelining, DTensor parallelize_module",
        "PipelineModule; TP via Megatron-DeepSpeed",
    ),
    (
        "status",
        "retired: last release 0.28.1, June 2023",
        "this course",
        "maintained (PyTorch)",
        "maintained (Microsoft)",
    ),
]


def api_table_markdown() -> str:
    """:data:`API_TABLE` as a Markdown table (``display(Markdown(api_table_markdown()))``)."""

    def row(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join(
        [row(API_COLUMNS), row(["---"] * len(API_COLUMNS)), *(row(r) for r in API_TABLE)]
    )


def ray_on_horovod() -> str:
    """What Ray 2.x says when asked for its ``HorovodTrainer`` (the message it raises, as text)."""
    from ray.train.horovod import HorovodTrainer

    try:
        HorovodTrainer(lambda: None)
    except (DeprecationWarning, Exception) as exc:  # noqa: BLE001 - the message is the point
        return f"{type(exc).__name__}: {exc}"
    return "HorovodTrainer was created (this Ray still supports it)"


if __name__ == "__main__":
    _worker_main(sys.argv[1])
