"""One harness for every experiment: named configs, optimizers, batches, a train step, the reference run, a race.

Every chapter's rank functions (``experiments/chNN_<topic>.py``) and every test build on these, so
that "the ZeRO model", "AdamW" or "rank r's slice of step k's batch" mean the same thing everywhere.

* **Configs** — :func:`small_config` (26k parameters: equality checks, exercises), :func:`zero_config`
  (chapters 03–04: Ψ = 128,835 with odd sizes, so padding happens at N = 2 and 4), :func:`bench_config`
  (3.2M parameters: communication matters on CPU), :func:`parallel_config` (chapters 05–06: untied,
  ``n_layer = 4``, heads, ``d_model`` and vocabulary divisible by 4).
* **Optimizers** — :data:`OPTIMIZERS` and :func:`make_optimizer` (with per-call overrides).
* **Data** — :func:`step_batch` (step k's batch, identical on every rank) and :func:`shard_batch`
  (rank r's ``1/N``: the mean of N equal shard means is the full-batch mean).
* **Steps** — :func:`train_step`; :func:`reference_run`: one device on the full batches.
* **Reductions over ranks** — :func:`mean_over_ranks`, :func:`max_over_ranks`.
* **Races** — :func:`race`: variants timed in interleaved rounds, each round the max over ranks.
* **Results** — :class:`Result`: a dataclass whose :meth:`~Result.claims` is the dict of booleans a
  notebook's claim cell prints and a test asserts.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..data import make_batch
from ..launch import device
from ..models import GPT, GPTConfig, equality_config

__all__ = ["small_config", "zero_config", "bench_config", "parallel_config", "OPTIMIZERS", "make_optimizer",
           "check_global_batch", "step_batch", "shard_batch", "train_step", "reference_run", "mean_over_ranks",
           "max_over_ranks", "max_abs_diff", "state_diff", "race", "median_times", "Result"]


# =========================================================================== configs


def small_config(**overrides) -> GPTConfig:
    """26k parameters, bias-free, tied: equality checks and exercises (fast on any laptop)."""
    return equality_config(**{"vocab_size": 32, "block_size": 16, "n_layer": 2, "n_head": 2, "d_model": 32,
                              **overrides})


def zero_config(**overrides) -> GPTConfig:
    """The ZeRO / FSDP chapters' model: bias-free, tied, Ψ = 128,835 with odd tensor sizes.

    ``d_model = 63`` makes many sizes odd, so ZeRO's per-element padding and FSDP2's per-row
    padding both happen at N = 2 and 4.
    """
    return equality_config(**{"vocab_size": 512, "d_model": 63, "n_layer": 2, "n_head": 3, "block_size": 16,
                              **overrides})


def bench_config(**overrides) -> GPTConfig:
    """A model where communication matters on CPU: d_model 256, 4 layers (≈3.2M params, 12.6 MB of fp32 grads)."""
    return equality_config(**{"vocab_size": 32, "block_size": 32, "n_layer": 4, "n_head": 4, "d_model": 256,
                              **overrides})


def parallel_config(**overrides) -> GPTConfig:
    """Pipeline and tensor parallelism: untied embeddings, bias-free, 4 layers, everything divisible by 4.

    Untied: the embedding (first stage) and the output head (last stage) live on different
    ranks in a pipeline, and in tensor parallelism they are split along different dimensions.
    """
    return equality_config(**{"vocab_size": 32, "block_size": 16, "n_layer": 4, "n_head": 4, "d_model": 64,
                              "tie_weights": False, **overrides})


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


# =========================================================================== data


def check_global_batch(global_batch: int, world_size: int, micro_batches: int = 1) -> None:
    """Raise if the global batch does not split into ``world_size × micro_batches`` equal pieces."""
    if global_batch % (world_size * micro_batches):
        what = "world_size" if micro_batches == 1 else "world_size × micro_batches"
        raise ValueError(f"global_batch={global_batch} is not divisible by {what} = {world_size * micro_batches}")


def step_batch(step: int, config: GPTConfig, batch_size: int, dev=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch of ``batch_size`` sequences: the same on every rank (seeded by the step)."""
    x, y = make_batch(batch_size, config.block_size, config.vocab_size, seed=step)
    dev = device() if dev is None else dev
    return x.to(dev), y.to(dev)


def shard_batch(x: torch.Tensor, y: torch.Tensor, rank: int | None = None, world_size: int | None = None):
    """Rank ``rank``'s ``1/N`` of a global batch (default: this rank in the default group)."""
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    check_global_batch(x.shape[0], world_size)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


# =========================================================================== steps


def train_step(model, optimizer, x, y, after_backward: Callable[[], None] | None = None) -> float:
    """zero_grad → forward → backward → (``after_backward``) → step; returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()
    return loss.item()


def reference_run(config: GPTConfig, steps: int, batch_size: int, optimizer: str = "adamw", *, seed: int = 0,
                  max_norm: float | None = None, dev=None, **optimizer_overrides):
    """One device trained on the *full* batches ``step_batch(0 … steps−1)``: what every technique must equal.

    Returns ``(model, losses, grad_norms)`` (``grad_norms`` only with ``max_norm``: the norm that
    ``torch.nn.utils.clip_grad_norm_`` returned before clipping).
    """
    dev = device() if dev is None else dev
    model = GPT(config, seed=seed).to(dev)
    opt = make_optimizer(optimizer, model.parameters(), **optimizer_overrides)
    losses, norms = [], []
    clip = None
    if max_norm is not None:
        clip = lambda: norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())  # noqa: E731
    for step in range(steps):
        losses.append(train_step(model, opt, *step_batch(step, config, batch_size, dev), after_backward=clip))
    return model, losses, norms


# =========================================================================== over ranks


def mean_over_ranks(value: float, group=None) -> float:
    """The average of a per-rank number over ranks (of equal-sized shards' losses: the global-batch loss)."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def max_over_ranks(value: float, group=None) -> float:
    """The largest per-rank number (a synchronous step lasts as long as its slowest rank)."""
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def max_abs_diff(a: dict, b: dict) -> float:
    """max |a[k] − b[k]| over the keys of ``b`` (state dicts: full tensors)."""
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def state_diff(model_or_state, reference) -> float:
    """max |Δ| between a model (or a full state dict) and a reference model, over the reference's keys."""
    got = model_or_state if isinstance(model_or_state, dict) else model_or_state.state_dict()
    want = reference if isinstance(reference, dict) else reference.state_dict()
    return max_abs_diff(got, want)


# =========================================================================== races


def race(steps: dict[str, Callable[[], None]], rounds: int, steps_per_round: int = 1, warmup: int = 1,
         group=None) -> dict[str, list[float]]:
    """Time ``{name: one_step()}`` fairly; returns seconds per step for each name and round.

    * **interleaved rounds**: each round runs every variant once, in an order rotated by the
      round, so a noisy neighbour or a thermal dip hits all of them alike;
    * after a barrier (every rank starts together), a round's time is the **max over ranks**: a
      synchronous step lasts as long as its slowest rank.
    Report the median over rounds (:func:`median_times`), or ratios of medians.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                steps[name]()
            times[name].append(max_over_ranks((time.perf_counter() - t0) / steps_per_round, group=group))
    return times


def median_times(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items()}


# =========================================================================== results


@dataclass
class Result:
    """Base of the small results experiments return: the numbers, and the claims they support.

    ``claims()`` returns ``{statement: bool}``: the notebook prints it, the tests assert every
    value, so a claim cannot drift from its check.
    """

    def claims(self) -> dict[str, bool]:
        return {}

    def as_dict(self) -> dict:
        return asdict(self)
