"""Named models and optimizer settings: what "the ZeRO model" or "AdamW" means everywhere in the course.

* **Configs** — :func:`small_config` (26k parameters: equality checks, exercises), :func:`zero_config`
  (chapters on ZeRO and FSDP: Ψ = 128,835 with odd sizes, so padding happens at N = 2 and 4),
  :func:`bench_config` (3.2M parameters: communication matters on CPU), :func:`parallel_config` (pipeline
  and tensor parallelism: untied, ``n_layer = 4``, heads, ``d_model`` and vocabulary divisible by 4).
* **Optimizers** — :data:`OPTIMIZERS` and :func:`make_optimizer` (with per-call overrides).

Experiments, checkers and tests import these from here (a foundation module), so a checker never
imports an experiment to learn which model it runs.
"""

from __future__ import annotations

import torch

from .models import GPTConfig, equality_config

__all__ = [
    "small_config",
    "zero_config",
    "bench_config",
    "parallel_config",
    "OPTIMIZERS",
    "make_optimizer",
]


def small_config(**overrides) -> GPTConfig:
    """26k parameters, bias-free, tied: equality checks and exercises (fast on any laptop)."""
    return equality_config(
        **{
            "vocab_size": 32,
            "block_size": 16,
            "n_layer": 2,
            "n_head": 2,
            "d_model": 32,
            **overrides,
        }
    )


def zero_config(**overrides) -> GPTConfig:
    """The ZeRO / FSDP chapters' model: bias-free, tied, Ψ = 128,835 with odd tensor sizes.

    ``d_model = 63`` makes many sizes odd, so ZeRO's per-element padding and FSDP2's per-row
    padding both happen at N = 2 and 4.
    """
    return equality_config(
        **{
            "vocab_size": 512,
            "d_model": 63,
            "n_layer": 2,
            "n_head": 3,
            "block_size": 16,
            **overrides,
        }
    )


def bench_config(**overrides) -> GPTConfig:
    """A model where communication matters on CPU: d_model 256, 4 layers (≈3.2M params, 12.6 MB of fp32 grads)."""
    return equality_config(
        **{
            "vocab_size": 32,
            "block_size": 32,
            "n_layer": 4,
            "n_head": 4,
            "d_model": 256,
            **overrides,
        }
    )


def parallel_config(**overrides) -> GPTConfig:
    """Pipeline and tensor parallelism: untied embeddings, bias-free, 4 layers, everything divisible by 4.

    Untied: the embedding (first stage) and the output head (last stage) live on different
    ranks in a pipeline, and in tensor parallelism they are split along different dimensions.
    """
    return equality_config(
        **{
            "vocab_size": 32,
            "block_size": 16,
            "n_layer": 4,
            "n_head": 4,
            "d_model": 64,
            "tie_weights": False,
            **overrides,
        }
    )


# =========================================================================== optimizers

# AdamW's eps = 1e-6 instead of 1e-8: its first update is lr·g/(|g| + eps), and a gradient that is
# ~1e-8 by cancellation (one of the embedding's) turns fp32 rounding noise — which differs between a
# full-batch mean on one device and an average of per-rank means — into a 1e-5 weight difference.
# eps = 1e-6 leaves every ordinary update unchanged (median |g| ~ 5e-4) and keeps the comparison
# about the parallel technique, not about Adam.
OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1, eps=1e-6)),
}


def make_optimizer(name: str, params, **overrides) -> torch.optim.Optimizer:
    """``OPTIMIZERS[name]`` over ``params``; ``overrides`` replace its settings (e.g. ``lr=0.5``)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer={name!r} is not one of {sorted(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **{**kwargs, **overrides})
