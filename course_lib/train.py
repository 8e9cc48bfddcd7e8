"""The single-device training loop every chapter compares against (nanoGPT-style, one screen)."""
from __future__ import annotations

import time

import torch

from .data import make_batch
from .models import GPT, GPTConfig

__all__ = ["train_single_device"]


def train_single_device(config: GPTConfig, steps: int = 200, batch_size: int = 32, lr: float = 3e-3,
                        seed: int = 0, progress: bool = True) -> dict:
    """Train ``GPT(config)`` with AdamW on the synthetic counter task; return the history.

    Returns ``{"model", "optimizer", "loss": [per step], "tokens_per_s", "seconds"}``.
    Batch ``i`` is ``make_batch(batch_size, T, V, seed + i)``: the same data every run.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps} and batch_size={batch_size} must both be >= 1")
    model = GPT(config, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    iterator = range(steps)
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(iterator, desc="training", leave=False)
    t0 = time.perf_counter()
    for i in iterator:
        x, y = make_batch(batch_size, config.block_size, config.vocab_size, seed + i)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    return {"model": model, "optimizer": opt, "loss": losses, "seconds": seconds,
            "tokens_per_s": steps * batch_size * config.block_size / seconds}
