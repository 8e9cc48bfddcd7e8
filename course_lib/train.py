"""The single-device training loop every chapter compares against (nanoGPT-style, one screen)."""

from __future__ import annotations

import time

from typing import Callable

import torch
import torch.distributed as dist

from .configs import make_optimizer
from .data import make_batch
from .launch import device as default_device
from .models import GPT, GPTConfig

__all__ = ["train_single_device"]


def train_single_device(
    config: GPTConfig,
    steps: int = 200,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
    device=None,
) -> dict:
    """Train ``GPT(config)`` with AdamW on the synthetic counter task; return the history.

    Returns ``{"model", "optimizer", "loss": [per step], "tokens_per_s", "seconds"}``.
    Batch ``i`` is ``make_batch(batch_size, T, V, seed + i)``: the same data every run.
    ``device`` defaults to :func:`course_lib.launch.device` (this rank's GPU under nccl, else the CPU).
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps} and batch_size={batch_size} must both be >= 1")
    dev = default_device() if device is None else torch.device(device)
    model = GPT(config, seed=seed).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    iterator = range(steps)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc="training", leave=False)
    t0 = time.perf_counter()
    for i in iterator:
        x, y = make_batch(batch_size, config.block_size, config.vocab_size, seed + i)
        losses.append(train_step(model, opt, x.to(dev), y.to(dev)))
    seconds = time.perf_counter() - t0
    return {
        "model": model,
        "optimizer": opt,
        "loss": losses,
        "seconds": seconds,
        "tokens_per_s": steps * batch_size * config.block_size / seconds,
    }


def matmul_peak_flops(n: int = 512, repeats: int = 5, threads: int | None = None) -> dict:
    """This CPU's measured fp32 matmul throughput: an ``n × n`` by ``n × n`` matmul, median of repeats.

    The peak that model FLOPs utilisation (MFU) is measured against: ``achieved FLOP/s / peak``.
    Each repeat times enough matmuls to take ≥ 50 ms after one warm-up. Returns
    ``{"flops_per_s" (median), "lo", "hi", "n", "threads"}``; ``threads`` defaults to torch's current
    setting (the one the training run used).
    """
    if n < 1 or repeats < 1:
        raise ValueError(f"matmul_peak_flops: n={n} and repeats={repeats} must be ≥ 1")
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        rates = []
        for _ in range(repeats):
            k, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.05:
                a @ b
                k += 1
            rates.append(2 * n**3 * k / (time.perf_counter() - t0))
        rates.sort()
        return {
            "flops_per_s": rates[len(rates) // 2],
            "lo": rates[0],
            "hi": rates[-1],
            "n": n,
            "threads": torch.get_num_threads(),
        }
    finally:
        torch.set_num_threads(old)


__all__ += ["matmul_peak_flops"]


# --------------------------------------------------------------------------- batches


def check_global_batch(global_batch: int, world_size: int, micro_batches: int = 1) -> None:
    """Raise if the global batch does not split into ``world_size × micro_batches`` equal pieces."""
    if global_batch % (world_size * micro_batches):
        what = "world_size" if micro_batches == 1 else "world_size × micro_batches"
        raise ValueError(
            f"global_batch={global_batch} is not divisible by {what} = {world_size * micro_batches}"
        )


def step_batch(
    step: int, config: GPTConfig, batch_size: int, dev=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch of ``batch_size`` sequences: the same on every rank (seeded by the step)."""
    x, y = make_batch(batch_size, config.block_size, config.vocab_size, seed=step)
    dev = default_device() if dev is None else dev
    return x.to(dev), y.to(dev)


def shard_batch(
    x: torch.Tensor, y: torch.Tensor, rank: int | None = None, world_size: int | None = None
):
    """Rank ``rank``'s ``1/N`` of a global batch (default: this rank in the default group)."""
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    check_global_batch(x.shape[0], world_size)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


# --------------------------------------------------------------------------- steps


def train_step(model, optimizer, x, y, after_backward: Callable[[], None] | None = None) -> float:
    """zero_grad → forward → backward → (``after_backward``) → step; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()
    return loss.item()


def reference_run(
    config: GPTConfig,
    steps: int,
    batch_size: int,
    optimizer: str = "adamw",
    *,
    seed: int = 0,
    max_norm: float | None = None,
    dev=None,
    **optimizer_overrides,
):
    """One device trained on the *full* batches ``step_batch(0 … steps−1)``: what every technique must equal.

    Returns ``(model, losses, grad_norms)`` (``grad_norms`` only with ``max_norm``: the norm that
    ``torch.nn.utils.clip_grad_norm_`` returned before clipping).
    """
    dev = default_device() if dev is None else dev
    model = GPT(config, seed=seed).to(dev)
    opt = make_optimizer(optimizer, model.parameters(), **optimizer_overrides)
    losses, norms = [], []
    clip = None
    if max_norm is not None:

        def clip():
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())

    for step in range(steps):
        losses.append(
            train_step(model, opt, *step_batch(step, config, batch_size, dev), after_backward=clip)
        )
    return model, losses, norms


__all__ += ["check_global_batch", "step_batch", "shard_batch", "train_step", "reference_run"]
