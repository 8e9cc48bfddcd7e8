"""Predict, then measure: every technique's step time under the modelled clock, against the model.

:func:`measure_step_times` is a rank function (``launch.spawn(measure_step_times, 2)``). In one
process group it fits α–β on the spot (a short sweep), calibrates the clock's rate so every block
sleeps ≥ 10× its real compute, builds our DDP (with and without activation recompute), ZeRO-1/2
(``ZeroOptimizer``), ZeRO-3 (``Zero3``, with and without prefetch), a 1F1B pipeline and
tensor parallelism on the same GPT shape, predicts each one's step with
:mod:`course_lib.step_time` from what the objects really hold (DDP's buckets, ZeRO's padded
buckets, Zero3's units, each stage's parts) and times them all with
:func:`course_lib.timing.time_steps` in interleaved rounds. It returns, per technique, the
measured median, the prediction and its parts — the same on every rank.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .. import step_time as st
from ..clock import AcceleratorClock, calibrate, costed_parts
from ..comm import CommLog
from ..configs import parallel_config
from ..ddp import DDP
from ..launch import device
from ..models import GPT
from ..pipeline import PipelineRunner, make_schedules, split_gpt
from ..tensor_parallel import tensor_parallel_gpt
from ..timing import time_steps
from ..train import train_step
from ..zero import ZeroOptimizer
from ..zero3 import Zero3
from .collectives import bandwidth_benchmark, idle_alpha
from .common import min_over_ranks

__all__ = ["measure_step_times", "idle_alpha", "TECHNIQUES", "step_time_config"]

TECHNIQUES = (
    "DDP",
    "DDP + recompute",
    "ZeRO-1",
    "ZeRO-2",
    "ZeRO-3",
    "ZeRO-3 + prefetch",
    "pipeline 1F1B",
    "TP",
)
BUCKET_MB = 4.0  # about one block per bucket at d_model = 256


def step_time_config():
    """The measured shape: 4 blocks of d_model 256 (≈ 0.8 M parameters, 3 MB each), untied."""
    return parallel_config(d_model=256, n_layer=4, n_head=4, block_size=16)


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (``torch.utils.checkpoint``)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def _batch(config, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    y = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g)
    return x.to(device()), y.to(device())


def _ready(params, owner: dict, order: list[str]) -> str:
    """The part whose backward completes a bucket of ``params``: the latest in backward order."""
    return min((owner[p] for p in params), key=order.index)


def measure_step_times(
    rounds: int = 3, batch: int = 2, microbatches: int = 4, ratio: float = 20.0, config=None
) -> dict:
    """Rank function: measure and predict each of :data:`TECHNIQUES` (see the module docstring).

    ``batch``: sequences per rank (data parallel) or per TP group; the pipeline takes
    ``microbatches`` micro-batches of one sequence. ``ratio``: every block sleeps ≥ ``ratio`` × 2
    (``calibrate``'s margin) its real compute — 20 by default, since the real compute runs
    *besides* the sleeps and is what the model leaves out: at 40× it is ~3 % of a step, twice
    that when the shared machine gets busier after calibrating. Returns ``{"rate", "clock", "alpha_beta",
    "measured": {name: s}, "predicted": {name: Prediction}, "timings": Timings text,
    "tp_allreduces": (counted, modelled)}``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    config = config or step_time_config()
    d = config.d_model
    rows = bandwidth_benchmark(
        (2**10, 2**12, 2**16, 2**20, 2**22),
        ops=("all_reduce", "all_gather", "reduce_scatter", "send_recv"),
        iters=2,
        warmup=1,
        repeats=3,
    )
    fit = st.fit_alpha_beta(rows)
    idle = idle_alpha()
    alpha = {op: max(a, idle.get(op, a)) for op, a in fit.alpha_s.items()}
    ab = st.AlphaBeta(alpha, fit.beta_bytes_per_s, fit.world_size, fit.min_bytes, fit.points)

    probe = GPT(config).to(device())
    x, y = _batch(config, batch, seed=rank)
    rate = min_over_ranks(calibrate(probe, x, y, ratio=ratio).rate)  # one rate for every rank
    clock = AcceleratorClock(rate)
    steps, predicted = {}, {}

    def data_parallel(model, name, opt):
        steps[name] = lambda: train_step(model, opt, x, y)

    def plain():
        model = GPT(config).to(device())
        clock.apply(model)
        return model

    def ddp_buckets(model, buckets):
        owner, order = st.param_parts(model), [n for n, _, _ in costed_parts(model)]
        return [(sum(p.numel() * 4 for p in ps), _ready(ps, owner, order)) for ps in buckets]

    # DDP, and DDP with every block checkpointed
    for name, recompute in (("DDP", False), ("DDP + recompute", True)):
        model = plain()
        if recompute:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = _Checkpointed(block)
        ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
        data_parallel(ddp, name, torch.optim.SGD(ddp.parameters(), lr=1e-3))
        named = dict(model.named_parameters())
        buckets = ddp_buckets(model, [[named[n] for n in names] for names in ddp.buckets])
        fwd = st.part_seconds(st.part_flops(model, x, y), rate)
        blocks = [n for n, _ in fwd if n.startswith("blocks.")] if recompute else []
        predicted[name] = st.ddp_step(fwd, buckets, ab, world, recompute=blocks)

    # ZeRO-1 and ZeRO-2
    for stage in (1, 2):
        model = plain()
        opt = ZeroOptimizer(
            model.parameters(), torch.optim.SGD, stage, bucket_cap_mb=BUCKET_MB, lr=1e-3
        )
        data_parallel(model, f"ZeRO-{stage}", opt)
        owner, order = st.param_parts(model), [n for n, _, _ in costed_parts(model)]
        buckets = [(b.numel * 4, _ready(b.params, owner, order)) for b in opt.buckets]
        fwd = st.part_seconds(st.part_flops(model, x, y), rate)
        predicted[f"ZeRO-{stage}"] = st.zero_step(
            stage, fwd, buckets, ab, world, used_flags=len(opt.params)
        )

    # ZeRO-3, without and with prefetch
    for name, prefetch in (("ZeRO-3", False), ("ZeRO-3 + prefetch", True)):
        model = plain()
        fwd = st.part_seconds(st.part_flops(model, x, y), rate)
        z3 = Zero3(model, prefetch=prefetch)
        data_parallel(z3, name, torch.optim.SGD(z3.parameters(), lr=1e-3))
        names = [n for n, _ in fwd]
        units = []
        for row in z3.unit_table():
            mine = [n for n in names if any(p.startswith(n + ".") for p in row["params"])]
            units.append((row["name"], row["gathered_bytes"], mine, row["root"]))
        root = [u[:3] for u in units if u[3]]
        root = [(r[0], r[1], [n for n in names if not n.startswith("blocks.")]) for r in root]
        blocks = sorted((u[:3] for u in units if not u[3]), key=lambda u: names.index(u[2][0]))
        predicted[name] = st.zero3_step(fwd, root + blocks, ab, world, prefetch=prefetch)

    # a 1F1B pipeline over the ranks, micro-batches of one sequence
    model = plain()
    stages = split_gpt(model, world)
    schedules = make_schedules("1f1b", world, microbatches)
    runner = PipelineRunner(
        [stages[rank]],
        rank,
        schedules,
        microbatches,
        activation_shape=(1, config.block_size, d),
    )
    px, py = _batch(config, microbatches, seed=100)  # one pipeline: the same batch
    popt = torch.optim.SGD(stages[rank].parameters(), lr=1e-3)

    def pipeline_step():
        runner.step(px if rank == 0 else None, py if rank == world - 1 else None)
        popt.step()
        popt.zero_grad()

    steps["pipeline 1F1B"] = pipeline_step
    hidden = torch.zeros(1, config.block_size, d, device=device())
    stage_s = []
    for k, stage in enumerate(stages):
        flops = st.part_flops(stage, px[:1] if k == 0 else hidden)
        stage_s.append(sum(f for _, _, f in flops) / rate)
    p2p = ab.predict("send_recv", config.block_size * d * 4)
    predicted["pipeline 1F1B"] = st.pipeline_step(
        schedules, stage_s, microbatches, p2p, name="pipeline 1F1B"
    )

    # tensor parallelism over the ranks: the same batch on both
    tp = tensor_parallel_gpt(GPT(config).to(device()))
    clock.apply(tp)
    tx, ty = _batch(config, batch, seed=200)
    topt = torch.optim.SGD(tp.parameters(), lr=1e-3)

    def tp_step():
        train_step(tp, topt, tx, ty)

    steps["TP"] = tp_step
    fwd = st.part_seconds(st.part_flops(tp, tx, ty), rate)
    fwd_ar, bwd_ar = st.tp_allreduces(config.n_layer, batch * config.block_size, d)
    predicted["TP"] = st.tp_step(fwd, fwd_ar, bwd_ar, ab, world)
    with clock.paused(), CommLog() as log:
        tp_step()
    counted = sum(1 for r in log.records if r.op == "all_reduce")

    timings = time_steps(
        steps,
        rounds=rounds,
        clock=clock,
        predicted={n: p.total for n, p in predicted.items()},
        title="step time: measured under the clock vs the step-time model",
    )
    return {
        "rate": rate,
        "clock": clock.name,
        "alpha_beta": ab.table(),
        "measured": timings.medians(),
        "predicted": predicted,
        "timings": timings.table(),
        "tp_allreduces": (counted, len(fwd_ar) + len(bwd_ar)),
    }
