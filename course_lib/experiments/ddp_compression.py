"""Chapter 02's gradient compression and cost-model prediction.

Rank functions (run them with ``launch.spawn``): :func:`compression_accuracy` (the loss after N steps
with fp32, fp16 and bf16 gradient all-reduces on our DDP and torch's, PowerSGD once through torch's
hook, and the bytes each of ours sends per step) and :func:`gradient_allreduce_time` (the measured
time of the gradient all-reduce, to compare with the α–β prediction) and :func:`fit_then_measure`
(α–β fitted, the gradient all-reduce predicted, then measured, in one process group). Parent
side: :func:`predict_gradient_allreduce` spawns it once.
Both notebook-facing results are :class:`results.Measured`: read like the dicts they were, with rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from ..ddp import DDP, make_buckets, torch_ddp, trainable_parameters
from ..launch import device
from ..models import GPT, GPTConfig
from ..results import Measured
from ..timing import time_steps
from .common import bench_config, make_optimizer, shard_batch, small_config, step_batch, train_step

__all__ = [
    "COMPRESSION_VARIANTS",
    "compression_accuracy",
    "gradient_allreduce_time",
    "fit_then_measure",
    "predict_gradient_allreduce",
]

COMPRESSION_VARIANTS = (
    "own_fp32",
    "own_fp16",
    "own_bf16",
    "torch_fp32",
    "torch_fp16",
    "torch_powersgd",
)


def _wrap(variant: str, model, bucket_cap_mb: float):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if variant.startswith("own_"):
        hook = None if variant == "own_fp32" else variant[4:]
        return DDP(model, bucket_cap_mb=bucket_cap_mb, comm_hook=hook)
    wrapped = torch_ddp(model, bucket_cap_mb=bucket_cap_mb)
    if variant == "torch_fp16":
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif (
        variant == "torch_powersgd"
    ):  # rank-1 low-rank approximation of each gradient matrix, after 2 plain steps
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif variant != "torch_fp32":
        raise ValueError(f"unknown variant {variant!r}; choose from {COMPRESSION_VARIANTS}")
    return wrapped


def _try_torch_bf16_hook(config: GPTConfig, bucket_cap_mb: float) -> str:
    """One step of torch DDP with ``bf16_compress_hook`` here: ``"ran"`` or the error it raised."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = torch_ddp(GPT(config, seed=0).to(device()), bucket_cap_mb=bucket_cap_mb)
    try:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        x, y = shard_batch(*step_batch(0, config, 2 * dist.get_world_size(), device()))
        train_step(model, make_optimizer("sgd", model.parameters()), x, y)
        return "ran"
    except Exception as e:  # noqa: BLE001 — we report whatever torch says, verbatim
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def compression_accuracy(
    steps: int = 40,
    global_batch: int = 16,
    bucket_cap_mb: float = 25.0,
    variants=COMPRESSION_VARIANTS,
    config: GPTConfig | None = None,
) -> Measured:
    """Rank function: train each variant ``steps`` AdamW steps from the same init on the same data.

    Returns :class:`Measured` reading as ``{"loss": {variant: loss on a held-out batch after
    training}, "grad_bytes_per_step": {own variant: CommLog bytes of the gradient all-reduces in one
    step}, "steps", "torch_bf16_hook": "ran" or the error torch raised}``; rows: a 16-bit hook sends
    exactly half of fp32's bytes, and ends within 1 % of fp32's loss. The weights are equal on every
    rank, so each rank's loss is the loss.
    One bucket by default (this model is small): torch's PowerSGD hook with many small buckets on gloo
    crashed here with a collective size mismatch (torch 2.13), one bucket runs.
    """
    config = config or small_config()
    dev = device()
    x_eval, y_eval = step_batch(10_000, config, global_batch, dev)
    loss, grad_bytes = {}, {}
    for variant in variants:
        model = _wrap(variant, GPT(config, seed=0).to(dev), bucket_cap_mb)
        opt = make_optimizer("adamw", model.parameters(), lr=3e-3)
        for step in range(steps):
            x, y = shard_batch(*step_batch(step, config, global_batch, dev))
            with comm.CommLog() as log:
                train_step(model, opt, x, y)
            if step == steps - 1 and variant.startswith("own_"):
                grad_bytes[variant] = log.total("tensor_bytes", tag="grad")
        with torch.no_grad():
            loss[variant] = model(x_eval, y_eval)[1].item()
    result = Measured(
        values={
            "loss": loss,
            "grad_bytes_per_step": grad_bytes,
            "steps": steps,
            "torch_bf16_hook": _try_torch_bf16_hook(config, bucket_cap_mb),
        }
    )
    for low in ("own_fp16", "own_bf16"):
        if low in grad_bytes and "own_fp32" in grad_bytes:
            result.exact(
                f"{low}: gradient bytes per step",
                grad_bytes[low],
                grad_bytes["own_fp32"] // 2,
                against="formula: half of own_fp32's",
            )
    for low, ref in (
        ("own_fp16", "own_fp32"),
        ("own_bf16", "own_fp32"),
        ("torch_fp16", "torch_fp32"),
    ):
        if low in loss and ref in loss:
            result.within(f"{low}: held-out loss", loss[low], loss[ref], 0.01, against=ref)
    return result


def gradient_allreduce_time(
    config: GPTConfig | None = None, bucket_cap_mb: float = 25.0, repeats: int = 7, warmup: int = 2
) -> Measured:
    """Rank function: seconds for the gradient all-reduce of ``config``'s model alone, bucket by bucket.

    Real gradients (one SGD step's) packed into DDP's buckets, then the buckets all-reduced back to
    back, blocking (no backward running beside them), timed by :func:`time_steps` (``repeats``
    rounds, max over ranks). Returns :class:`Measured` reading as ``{"bucket_bytes": [...],
    "measured_s" (the median), "rounds_s", "timing"}``.
    """
    config = config or bench_config()
    dev = device()
    model = GPT(config, seed=0).to(dev)
    train_step(model, make_optimizer("sgd", model.parameters()), *step_batch(0, config, 8, dev))
    flats = [
        torch.cat([p.grad.reshape(-1) for p in b])
        for b in make_buckets([p for _, p in trainable_parameters(model)], bucket_cap_mb * 2**20)
    ]

    def all_reduce_buckets():
        for flat in flats:
            comm.all_reduce(flat, tag="grad")

    timings = time_steps({"gradient all-reduce": all_reduce_buckets}, repeats, warmup=warmup)
    t = timings["gradient all-reduce"]
    return Measured(
        title=f"gradient all-reduce alone: {timings.header()}",
        values={
            "bucket_bytes": [f.numel() * f.element_size() for f in flats],
            "measured_s": t.median,
            "rounds_s": list(t.samples),
            "timing": t,
        },
    )


def fit_then_measure(config: GPTConfig | None = None, bucket_cap_mb: float = 25.0) -> dict:
    """Rank function: fit α–β to a short all-reduce sweep, predict the gradient all-reduce, measure it.

    The sweep is :func:`collectives.measure_alpha_beta`'s (its sizes, 5 repeats of 2 calls); the
    prediction (Σ over DDP's buckets of α + ring_factor · bytes / β) is made before
    :func:`gradient_allreduce_time` runs, in the same process group. Returns ``{"fit"
    (:class:`~course_lib.step_time.AlphaBeta`), "bucket_bytes", "predicted_s", "measured_s"}``.
    """
    from ..step_time import fit_alpha_beta
    from .collectives import FIT_SIZES, bandwidth_benchmark

    world = dist.get_world_size()
    rows = bandwidth_benchmark(FIT_SIZES, ops=("all_reduce",), iters=2, warmup=1, repeats=5)
    fit = fit_alpha_beta(rows)
    config = config or bench_config()
    sizes = [
        sum(p.numel() * p.element_size() for p in b)
        for b in make_buckets(
            [p for _, p in trainable_parameters(GPT(config))], bucket_cap_mb * 2**20
        )
    ]
    predicted = sum(fit.predict("all_reduce", b, world) for b in sizes)
    got = gradient_allreduce_time(config, bucket_cap_mb)
    return {
        "fit": fit,
        "bucket_bytes": sizes,
        "predicted_s": predicted,
        "measured_s": got["measured_s"],
    }


def predict_gradient_allreduce(
    world_size: int = 2, bucket_cap_mb: float = 25.0, config: GPTConfig | None = None
) -> Measured:
    """Parent side: fit α–β to a short all-reduce sweep, predict the gradient all-reduce, then measure it.

    One spawn of :func:`fit_then_measure`. Returns :class:`Measured` reading as ``{"alpha_s",
    "beta_bytes_per_s", "bucket_bytes", "predicted_s", "measured_s", "ratio"}`` (ratio =
    measured / predicted), with one row: the ratio lies within 0.5–2× (the fit and the
    measurement run seconds apart on a shared machine). The prediction is made before the
    measurement runs.
    """
    from ..launch import spawn

    got = spawn(
        fit_then_measure, world_size, kwargs=dict(config=config, bucket_cap_mb=bucket_cap_mb)
    )[0]
    fit, predicted = got["fit"], got["predicted_s"]
    ratio = got["measured_s"] / predicted
    result = Measured(
        values={
            "alpha_s": fit.alpha_s["all_reduce"],
            "bucket_bytes": got["bucket_bytes"],
            "beta_bytes_per_s": fit.beta_bytes_per_s["all_reduce"],
            "predicted_s": predicted,
            "measured_s": got["measured_s"],
            "ratio": ratio,
        }
    )
    result.condition(
        "gradient all-reduce: measured / predicted",
        ratio,
        0.5 <= ratio <= 2,
        "within 0.5–2×",
        reference=1.0,
        against="α–β prediction",
    )
    return result
