"""Chapter 08's runs: Ray Core building blocks, and the course's tiny GPT trained by Ray Train.

Ray Core (plain functions and a class; the notebook turns them into tasks/actors with ``ray.remote``):
:func:`busy`, :func:`busy_span`, :func:`nap`, :func:`nap_span`, :func:`checksum`, :class:`ParameterServer`,
:func:`shard_gradient`; :func:`peak_concurrency` counts how many of a set of spans ran at once.

Ray Train (``train_loop_per_worker`` functions: each runs on every worker *after* Ray has created the
``torch.distributed`` process group — gloo on CPU, nccl on GPUs):

* :func:`ddp_loop` — the plain PyTorch loop plus ``prepare_model`` / ``prepare_data_loader`` /
  ``ray.train.report``; a checkpoint (model, optimizer, epoch) every epoch and a resume from
  ``ray.train.get_checkpoint()`` (notebook 08 writes the same function in a cell);
* :func:`fsdp_loop` — the same training with FSDP2 ``fully_shard`` on Ray's process group and a DCP
  checkpoint that every worker writes a shard of;
* :func:`rank_function_loop` — any course rank function (e.g. chapter 02's) run unchanged on Ray's workers.

Parent side: :func:`reference_params` (one device, the same data order), :func:`final_state` and
:func:`rank_results` (read a Ray ``Result``'s checkpoint), :func:`equal_to_one_device` (the run's final
weights vs one device, as a ``results.Result`` row within ``for_optimizer``'s tolerance),
:func:`fail_once` (a worker that raises or is killed mid-run, once per run).

The loops here are Ray Train's (``train_loop_per_worker``: ``prepare_model`` / ``prepare_data_loader``,
reports and checkpoints); each step inside them, and the one-device reference, is
``course_lib.train.train_step``.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from ..data import SyntheticDataset
from ..models import GPT
from ..results import for_optimizer
from .common import Result, check_global_batch, make_optimizer, small_config, train_step

__all__ = [
    "busy",
    "busy_span",
    "nap",
    "nap_span",
    "peak_concurrency",
    "checksum",
    "ParameterServer",
    "shard_gradient",
    "train_config",
    "ddp_loop",
    "fsdp_loop",
    "rank_function_loop",
    "node_and_equality",
    "reference_params",
    "final_state",
    "rank_results",
    "fail_once",
    "equal_to_one_device",
]


# =========================================================================== Ray Core


def busy(n: int = 2_000_000) -> int:
    """CPU-bound pure Python: a sum of squares (holds the GIL, so threads would not help; processes do)."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def busy_span(n: int = 2_000_000) -> tuple[float, float]:
    """Run :func:`busy` and return its (start, end) on this machine's wall clock: how long one call took
    where it ran (the driver, or a Ray worker while another task does or does not run beside it)."""
    start = time.time()
    busy(n)
    return start, time.time()


def nap(seconds: float) -> float:
    """Sleep: takes wall time but no CPU (a task still occupies the 1 CPU it asked Ray for)."""
    time.sleep(seconds)
    return seconds


def nap_span(seconds: float) -> tuple[float, float]:
    """Sleep like :func:`nap`; return (start, end) on this machine's wall clock (``time.time``)."""
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def peak_concurrency(spans: list[tuple[float, float]]) -> int:
    """The most spans (start, end) that overlap at one instant: how many tasks ran at once."""
    events = sorted(
        [(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1])
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def checksum(array: np.ndarray) -> tuple[float, bool]:
    """(sum, writeable?) of an array: a task reading from the object store gets a *read-only* zero-copy view."""
    return float(array[:1000].sum()), bool(array.flags.writeable)


class ParameterServer:
    """An actor's state: weights of a linear model y = X·w, updated by averaged gradients (SGD)."""

    def __init__(self, dim: int, lr: float = 0.1):
        self.w = np.zeros(dim)
        self.lr = lr
        self.updates = 0

    def get_weights(self) -> np.ndarray:
        return self.w

    def apply(self, *grads: np.ndarray) -> int:
        self.w = self.w - self.lr * np.mean(grads, axis=0)
        self.updates += 1
        return self.updates


def shard_gradient(w: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of the mean squared error ½·mean((X·w − y)²) on one data shard."""
    return X.T @ (X @ w - y) / len(y)


# =========================================================================== Ray Train


def train_config(**overrides) -> dict:
    """The ``train_loop_config`` every Ray Train run here uses (the model is ``small_config()``)."""
    return {
        "epochs": 3,
        "samples": 48,
        "global_batch": 16,
        "optimizer": "adamw",
        "fail": None,
        **overrides,
    }


def fail_once(cfg: dict, rank: int, epoch: int, step: int) -> None:
    """If ``cfg["fail"]`` says so, make this worker fail here — once per run (a marker file remembers).

    ``cfg["fail"] = {"rank": r, "epoch": e, "step": s, "how": "raise" | "kill", "marker": path}``:
    ``raise`` raises a ``RuntimeError``; ``kill`` sends SIGKILL to the worker's own process (no Python
    exception, no clean-up: what a crashed or preempted node looks like). With
    ``"after_report": log`` (a ``ray_train.ReportLog``) the worker first waits until the report
    before this step has reached the log, so the run always shows the step redone after the
    restart (a real crash may also lose the reports still in flight).
    """
    f = cfg.get("fail")
    if (
        not f
        or (rank, epoch, step) != (f["rank"], f["epoch"], f["step"])
        or os.path.exists(f["marker"])
    ):
        return
    if f.get("after_report") is not None:
        f["after_report"].wait_for_report(epoch, step)
    with open(f["marker"], "w") as out:
        out.write(f"{rank} {epoch} {step}")
    if f["how"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected failure on rank {rank} in epoch {epoch}, step {step}")


def _loader(cfg: dict, world: int) -> DataLoader:
    config = small_config()
    check_global_batch(cfg["global_batch"], world)
    data = SyntheticDataset(cfg["samples"], config.block_size, config.vocab_size, seed=0)
    return DataLoader(data, batch_size=cfg["global_batch"] // world, shuffle=True)


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


# The same loop as notebook 08's train_loop_per_worker cell (kept here for the tests and smoke runs).
# fmt: off
def ddp_loop(cfg: dict) -> None:
    """``train_loop_per_worker``: the chapter-01 loop, DDP via ``prepare_model``, checkpoint + resume."""
    import ray.train
    from ray.train import Checkpoint
    from ray.train.torch import prepare_data_loader, prepare_model

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = prepare_model(GPT(small_config(), seed=0))          # 1: .to(device) + DDP (when world > 1)
    opt = make_optimizer(cfg["optimizer"], model.parameters())
    loader = prepare_data_loader(_loader(cfg, world))           # 2: DistributedSampler + batches .to(device)
    start = 0
    if (ckpt := ray.train.get_checkpoint()) is not None:        # resume: the last reported checkpoint
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        _unwrap(model).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, cfg["epochs"]):
        if world > 1:
            loader.sampler.set_epoch(epoch)                     # the data order is a function of the epoch
        for step, (x, y) in enumerate(loader):
            fail_once(cfg, rank, epoch, step)
            loss = train_step(model, opt, x, y)
            ray.train.report({"epoch": epoch, "step": step, "loss": loss})                     # 3: metrics
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                torch.save({"model": _unwrap(model).state_dict(), "optimizer": opt.state_dict(), "epoch": epoch},
                           os.path.join(d, "state.pt"))
                checkpoint = Checkpoint.from_directory(d)
            ray.train.report({"epoch": epoch, "loss": loss, "node": ray.util.get_node_ip_address(),
                              "model": type(model).__name__, "sampler": type(loader.sampler).__name__},
                             checkpoint=checkpoint)            # 4: a checkpoint
# fmt: on


def fsdp_loop(cfg: dict) -> None:
    """``train_loop_per_worker``: FSDP2 ``fully_shard`` on Ray's process group, DCP checkpoint + resume.

    Every worker saves *its* shard (``dcp.save``) into its own local directory and reports it; Ray
    uploads all of them into one checkpoint directory, which ``dcp.load`` reads back resharded.
    """
    import ray.train
    import torch.distributed.checkpoint as dcp
    from ray.train import Checkpoint
    from ray.train.torch import get_device, prepare_data_loader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    dev = get_device()
    mesh = init_device_mesh(dev.type, (world,))  # on the process group Ray created
    model = GPT(small_config(), seed=0).to(dev)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(cfg["optimizer"], model.parameters())
    loader = prepare_data_loader(_loader(cfg, world))
    start = 0
    if (ckpt := ray.train.get_checkpoint()) is not None:
        with ckpt.as_directory() as d:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optimizer": osd}
            dcp.load(state, checkpoint_id=os.path.join(d, "dcp"))
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
            with open(os.path.join(d, "dcp", "epoch.json")) as f:
                start = json.load(f)["epoch"] + 1
    for epoch in range(start, cfg["epochs"]):
        loader.sampler.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            fail_once(cfg, rank, epoch, step)
            loss = train_step(model, opt, x, y)
            ray.train.report({"epoch": epoch, "step": step, "loss": loss})
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        with tempfile.TemporaryDirectory() as d:
            msd, osd = get_state_dict(model, opt)
            dcp.save(
                {"model": msd, "optimizer": osd}, checkpoint_id=os.path.join(d, "dcp")
            )  # this rank's shard
            if rank == 0:
                with open(os.path.join(d, "dcp", "epoch.json"), "w") as f:
                    json.dump({"epoch": epoch}, f)
                torch.save(
                    full, os.path.join(d, "full.pt")
                )  # also the full tensors (one device's view), to compare with one device
            ray.train.report(
                {"epoch": epoch, "loss": loss}, checkpoint=Checkpoint.from_directory(d)
            )


def rank_function_loop(cfg: dict) -> None:
    """``train_loop_per_worker`` that runs ``cfg["fn"](*cfg["args"])`` — a course rank function, unchanged.

    Ray has created the process group, exactly what ``launch.spawn`` and ``torchrun`` do; each worker's
    return value comes back in the checkpoint (``rank<r>.pkl``), read with :func:`rank_results`.
    """
    import ray.train
    from ray.train import Checkpoint

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    value = cfg["fn"](*cfg.get("args", ()))
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(value, f)
        ray.train.report({"done": 1}, checkpoint=Checkpoint.from_directory(d))


def node_and_equality(steps: int = 3) -> dict:
    """Rank function for the multi-node run: this worker's node IP and chapter 02's DDP equality on it."""
    import ray

    from .ddp import equality_with_single_device

    res = equality_with_single_device("torch_ddp", "adamw", steps)
    return {
        "node": ray.util.get_node_ip_address(),
        "max_abs_diff": res.max_abs_diff,
        "ok": all(res.claims().values()),
    }


# =========================================================================== parent side


def reference_params(cfg: dict, world: int = 2) -> dict:
    """One device, the *same* data order as ``world`` workers behind ``DistributedSampler(shuffle=True)``.

    The sampler permutes the indices with ``seed + epoch`` and deals them out round-robin, so step
    k's global batch is ``perm[k·B:(k+1)·B]`` of that epoch's permutation.
    """
    config = small_config()
    data = SyntheticDataset(cfg["samples"], config.block_size, config.vocab_size, seed=0)
    model = GPT(config, seed=0)
    opt = make_optimizer(cfg["optimizer"], model.parameters())
    B = cfg["global_batch"]
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(epoch)).tolist()
        per_rank = [perm[r::world] for r in range(world)]
        b = B // world
        for k in range(len(per_rank[0]) // b + (len(per_rank[0]) % b > 0)):
            idx = [i for r in range(world) for i in per_rank[r][k * b : (k + 1) * b]]
            x = torch.stack([data[i][0] for i in idx])
            y = torch.stack([data[i][1] for i in idx])
            train_step(model, opt, x, y)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def final_state(result) -> dict:
    """The model parameters in a finished run's last checkpoint (DDP's ``state.pt`` or FSDP2's ``full.pt``)."""
    with result.checkpoint.as_directory() as d:
        if os.path.exists(os.path.join(d, "full.pt")):
            return torch.load(os.path.join(d, "full.pt"), weights_only=True)
        return torch.load(os.path.join(d, "state.pt"), weights_only=True)["model"]


def rank_results(result, world: int) -> list:
    """Each worker's return value from :func:`rank_function_loop`'s checkpoint, index = rank."""
    with result.checkpoint.as_directory() as d:
        out = []
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


def equal_to_one_device(result, cfg: dict, world: int = 2, title: str = "") -> Result:
    """A row: a finished run's last-checkpoint parameters vs :func:`reference_params` (one device, the same
    global batches in the same order), within the optimizer's named tolerance (``results.for_optimizer``)."""
    out = Result(title=title or f"Ray Train, {world} workers, vs one device")
    out.equal(
        "final parameters: max |Δparam|",
        final_state(result),
        reference_params(cfg, world),
        for_optimizer(cfg["optimizer"]),
        against="one device, same global batches",
    )
    return out
