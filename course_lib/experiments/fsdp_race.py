"""Chapter 04's race: our ``Zero3`` per parameter / per unit / per unit + prefetch against FSDP2.

:func:`zero3_race` (rank function) trains the same model on the same data with each variant and
times one AdamW step of each per interleaved round (:func:`course_lib.timing.time_steps`: max
over ranks, median and range over rounds); it also counts each variant's all-gathers in one
forward (ours with ``CommLog``, FSDP2's with ``CollectiveCounter``).
``python -m course_lib.bench zero3`` runs it from a terminal.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .. import step_time as st
from ..clock import AcceleratorClock, calibrate
from ..comm import CollectiveCounter, CommLog
from ..configs import parallel_config
from ..ddp import torch_ddp
from ..fsdp import fsdp2_wrap
from ..fsdp_meters import Zero3Waits
from ..launch import device
from ..models import GPT
from ..results import Result
from ..timing import AGREEMENT_BAND, time_steps
from ..zero3 import Zero3
from . import common
from .collectives import bandwidth_benchmark, idle_alpha
from .fsdp import FSDPResult

__all__ = [
    "ZERO3_VARIANTS",
    "BASELINE",
    "zero3_race",
    "format_zero3",
    "CLOCKED_VARIANTS",
    "ClockedResult",
    "zero3_clocked",
    "clocked_config",
    "Recompute",
]

ZERO3_VARIANTS = {
    "zero3 per-param": dict(unit="param"),
    "zero3 per-unit": dict(unit="block", prefetch=False),
    "zero3 per-unit+prefetch": dict(unit="block", prefetch=True),
    "fsdp2": None,
}
BASELINE = "ddp (torch, for scale)"  # no sharding: the step time ZeRO-3's extra communication is measured against


def _build(name: str, kw, cfg, dev):
    if name == BASELINE:
        return torch_ddp(GPT(cfg, seed=0).to(dev))
    if kw is None:
        return fsdp2_wrap(GPT(cfg, seed=0).to(dev))
    return Zero3(GPT(cfg, seed=0).to(dev), **kw)


def zero3_race(
    rounds: int = 9, batch_size: int = 8, config=None, warmup: int = 2, baseline: bool = True
) -> FSDPResult:
    """Rank function: one AdamW step of each variant per round (same model, same data), by ``time_steps``.

    The model (default ``d_model`` 128, 4 blocks, 0.9M parameters) is big enough that the step is
    communication and compute, not Python overhead. Returns the per-round times, the medians,
    each median's ratio to FSDP2's, and our variants' all-gathers in one forward (``CommLog``),
    checked: one per unit per unit variant and for FSDP2, one per parameter and use per parameter.
    No speed is asserted (timings flip on a busy machine). ``baseline``: also time torch DDP on
    the same model (no sharding), for scale. ``res["timings"]`` is the :class:`Timings` (ranges,
    :meth:`~course_lib.timing.Timings.compare`).
    """
    cfg = config or common.zero_config(
        n_layer=4, d_model=128, n_head=4, vocab_size=512, block_size=32
    )
    world, dev = dist.get_world_size(), device()
    x, y = common.shard_batch(*common.step_batch(0, cfg, batch_size * world, dev))
    variants = dict(ZERO3_VARIANTS, **({BASELINE: None} if baseline else {}))
    models = {name: _build(name, kw, cfg, dev) for name, kw in variants.items()}
    opts = {name: common.make_optimizer("adamw", m.parameters()) for name, m in models.items()}
    gathers = {}  # all-gathers in one forward: ours from CommLog, FSDP2's from the dispatcher
    for name, m in models.items():
        with CommLog() as log, CollectiveCounter() as counter:
            m(x, y)
        gathers[name] = (
            counter.count(op="all_gather")
            if name in ("fsdp2", BASELINE)
            else log.count(op="all_gather", tag="param")
        )
    timings = time_steps(
        {name: (lambda n=name: common.train_step(models[n], opts[n], x, y)) for name in models},
        rounds=rounds,
        warmup=warmup,
    )
    times, med = timings.samples(), timings.medians()
    plain = GPT(cfg)
    units, uses = cfg.n_layer + 1, len(list(plain.named_parameters(remove_duplicate=False)))
    res = FSDPResult(
        title=f"ZeRO-3 four ways at world {world}: {timings.header()}",
        values=dict(
            world_size=world,
            params=sum(p.numel() for p in plain.parameters()),
            rounds=rounds,
            tokens_per_step=batch_size * world * cfg.block_size,
            times=times,
            median_s=med,
            ratio_to_fsdp2={n: med[n] / med["fsdp2"] for n in med},
            gathers_per_forward=gathers,
            timings=timings,
        ),
    )
    for name in ("zero3 per-unit", "zero3 per-unit+prefetch", "fsdp2"):
        res.exact(
            f"{name}: all-gathers per forward",
            gathers[name],
            units,
            against="one per unit (blocks + root)",
        )
    res.exact(
        "zero3 per-param: all-gathers per forward",
        gathers["zero3 per-param"],
        uses,
        against="one per parameter and use",
    )
    return res


def format_zero3(res: dict) -> str:
    lines = [
        f"world {res['world_size']}, {res['params'] / 1e6:.2f}M params, {res['tokens_per_step']} tokens/step, "
        f"AdamW, median of {res['rounds']} interleaved rounds (max over ranks)",
        *([res["timings"].header()] if "timings" in res else []),
        f"{'variant':<25}{'step (ms)':>10}{'min':>8}{'max':>8}{'vs FSDP2':>10}{'all-gathers/fwd':>17}",
    ]
    for name, t in res["times"].items():
        g = res["gathers_per_forward"][name]
        lines.append(
            f"{name:<25}{res['median_s'][name] * 1e3:>10.1f}{min(t) * 1e3:>8.1f}{max(t) * 1e3:>8.1f}"
            f"{res['ratio_to_fsdp2'][name]:>10.2f}{g!s:>17}"
        )
    r = res["ratio_to_fsdp2"]
    lines.append(
        f"per-unit / FSDP2 = {r['zero3 per-unit']:.2f}, per-unit+prefetch / FSDP2 = "
        f"{r['zero3 per-unit+prefetch']:.2f}; spread (pstdev) of FSDP2's rounds: "
        f"{statistics.pstdev(res['times']['fsdp2']) * 1e3:.1f} ms"
    )
    if "timings" in res:  # what the ranges, not the medians, can tell apart on this machine
        for ours in ("zero3 per-unit", "zero3 per-unit+prefetch"):
            lines.append(res["timings"].compare(ours, "fsdp2").verdict)
    return "\n".join(lines)


# =========================================================================== under the modelled clock

CLOCKED_VARIANTS = ("no prefetch", "prefetch", "prefetch + recompute")


class Recompute(nn.Module):
    """A block whose activations are recomputed in backward (``torch.utils.checkpoint``).

    Zero3's unit is this wrapper: its hooks fire once per pass, and the recompute (which calls
    the inner block) runs after the unit was re-gathered for backward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def _min_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def _fit_links() -> st.AlphaBeta:
    """α–β fitted on the spot (a short sweep), α no lower than an idle machine's."""
    rows = bandwidth_benchmark(
        (2**10, 2**14, 2**18, 2**21),
        ops=("all_gather", "reduce_scatter"),
        iters=2,
        warmup=1,
        repeats=3,
    )
    fit = st.fit_alpha_beta(rows)
    idle = idle_alpha()
    alpha = {op: max(a, idle.get(op, a)) for op, a in fit.alpha_s.items()}
    return st.AlphaBeta(alpha, fit.beta_bytes_per_s, fit.world_size, fit.min_bytes, fit.points)


def _zero3_units(z3: Zero3, fwd) -> list:
    """``zero3_step``'s units from what Zero3 really holds: the root first, then the blocks."""
    names = [n for n, _ in fwd]
    root, blocks = [], []
    for row in z3.unit_table():
        mine = [n for n in names if any(p.startswith(n + ".") for p in row["params"])]
        if row["root"]:
            root.append(
                (
                    row["name"],
                    row["gathered_bytes"],
                    [n for n in names if not n.startswith("blocks.")],
                )
            )
        else:
            blocks.append((row["name"], row["gathered_bytes"], mine))
    return root + sorted(blocks, key=lambda u: names.index(u[2][0]))


def clocked_config():
    """4 blocks of d_model 256 (3 MB each) on 8 tokens: a block's compute near its all-gather's time."""
    return parallel_config(d_model=256, n_layer=4, n_head=4, block_size=8)


@dataclass
class ClockedResult(Result):
    """Our Zero3 three ways under the modelled clock: measured medians beside the step-time model."""

    clock: str = ""
    measured: dict = field(default_factory=dict)  # {variant: median s}
    predicted: dict = field(default_factory=dict)  # {variant: step_time.Prediction}
    timings: object = field(default=None, repr=False)
    slept: dict = field(default_factory=dict)  # {variant: s the clock sleeps per step}
    waits: dict = field(default_factory=dict)  # {variant: {op: s waited per step (Zero3Waits)}}
    host_recompute: float = 0.0  # s recompute adds on the host (a clock that never sleeps)

    def host(self, name: str) -> float:
        """Seconds per step neither slept nor waiting on a collective: the host's own work."""
        return self.measured[name] - self.slept[name] - sum(self.waits[name].values())

    def breakdown(self) -> str:
        """Per variant: the step, what the clock slept, the waits, and the host's work (ms)."""
        lines = ["ms per step     step   slept   all-gather wait   reduce-scatter wait   host work"]
        for n in self.measured:
            w = self.waits[n]
            lines.append(
                f"{n:<22}{self.measured[n] * 1e3:>6.0f}{self.slept[n] * 1e3:>8.0f}"
                f"{w['all_gather'] * 1e3:>18.1f}{w['reduce_scatter'] * 1e3:>22.1f}"
                f"{self.host(n) * 1e3:>12.1f}"
            )
        return "\n".join(lines)

    def saving(self, a: str, b: str, which: str) -> float:
        """``a`` − ``b``: measured (``which="measured"``) or predicted seconds."""
        if which == "measured":
            return self.measured[a] - self.measured[b]
        return self.predicted[a].total - self.predicted[b].total


def zero3_clocked(
    rounds: int = 3, batch: int = 1, ratio: float = 15.0, config=None
) -> ClockedResult:
    """Rank function: our ``Zero3`` without prefetch, with it, and with it plus per-block recompute.

    Default shape :func:`clocked_config`, ``batch`` sequences per rank (few tokens: compute per
    block comparable to one block's all-gather, so what prefetch hides shows).

    Under the modelled accelerator clock (every block sleeps ≥ ``ratio`` × 2 its real compute,
    ``clock.calibrate``) and predicted by ``step_time.zero3_step(prefetch=…, recompute=…)`` from
    the units Zero3 really holds and α–β fitted on the spot. Rows: each variant's measured
    median within ``timing.AGREEMENT_BAND`` of its prediction; prefetch where it acts — the
    seconds the step waits for its all-gathers (``fsdp_meters.Zero3Waits``), at most half of
    those without prefetch (the model's ratio beside it); and what recompute costs against one
    forward of the blocks (the clock's sleeps, plus what checkpointing adds on the host: a
    checkpointed minus a plain step under a clock that does not sleep). ``breakdown()`` splits
    each step into sleeps, waits and the host's own work (copies into and out of the gather
    buffers, hooks, the optimizer), which the model leaves out.
    Same on every rank.
    """
    config = config or clocked_config()
    rank, world = dist.get_rank(), dist.get_world_size()
    ab = _fit_links()
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g).to(device())
    y = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g).to(device())
    probe = GPT(config).to(device())
    rate = _min_over_ranks(calibrate(probe, x, y, ratio=ratio).rate)  # one rate on every rank
    clock = AcceleratorClock(rate)
    host_recompute = _host_recompute(config, x, y)
    steps, predicted, waits, calls = {}, {}, {}, dict.fromkeys(CLOCKED_VARIANTS, 0)
    for name in CLOCKED_VARIANTS:
        model = GPT(config, seed=0).to(device())
        clock.apply(model)
        recompute = name.endswith("recompute")
        if recompute:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = Recompute(block)
        fwd = st.part_seconds(st.part_flops(model, x, y), rate)
        z3 = Zero3(model, prefetch=name != "no prefetch")
        opt = torch.optim.SGD(z3.parameters(), lr=1e-3)
        waits[name] = Zero3Waits()
        z3.add_observer(waits[name])

        def step(z3=z3, opt=opt, name=name):
            calls[name] += 1
            return common.train_step(z3, opt, x, y)

        steps[name] = step
        blocks = [n for n, _ in fwd if n.startswith("blocks.")] if recompute else []
        predicted[name] = st.zero3_step(
            fwd, _zero3_units(z3, fwd), ab, world, prefetch=z3.prefetch, recompute=blocks
        )
    timings = time_steps(
        steps,
        rounds=rounds,
        clock=clock,
        predicted={n: p.total for n, p in predicted.items()},
        title="our Zero3 under the modelled clock: measured vs zero3_step's prediction",
    )
    res = ClockedResult(
        title=f"what prefetch saves and recompute costs, world {world} ({clock.name})",
        clock=clock.name,
        measured=timings.medians(),
        predicted=predicted,
        timings=timings,
        slept={n: p.parts["compute"] + p.parts.get("recompute", 0.0) for n, p in predicted.items()},
        waits={n: {op: s / calls[n] for op, s in w.seconds.items()} for n, w in waits.items()},
        host_recompute=host_recompute,
    )
    # prefetch, measured where it acts: the seconds the step waits for its all-gathers. The model
    # says only the first unit of each pass (and the root) still waits.
    ag = {n: res.waits[n]["all_gather"] for n in ("no prefetch", "prefetch")}
    exposed = {n: predicted[n].parts.get("exposed all_gather + reduce_scatter", 0.0) for n in ag}
    res.condition(
        "prefetch: all-gather wait per step / without prefetch",
        round(ag["prefetch"] / ag["no prefetch"], 2),
        ag["prefetch"] <= 0.5 * ag["no prefetch"],
        "≤ 0.5",
        reference=round(exposed["prefetch"] / exposed["no prefetch"], 2),
        against="zero3_step's exposed ratio",
    )
    # "recompute adds one forward of the blocks", measured: the extra step time against one
    # forward of the blocks — what the clock sleeps for it plus its real host work
    one_forward = sum(s for n, s in fwd if n.startswith("blocks.")) + host_recompute
    res.within(
        "recompute costs (recompute − prefetch), s",
        res.saving("prefetch + recompute", "prefetch", "measured"),
        one_forward,
        AGREEMENT_BAND,
        against="one forward of the blocks: sleeps + host",
    )
    return res


def _host_recompute(config, x, y, repeats: int = 5) -> float:
    """Seconds recompute adds to a training step on the host: checkpointed minus plain.

    Both on one device under a clock too fast to sleep, so its FLOP counting and hooks run as in
    the step; checkpointing re-runs them in backward and adds its own saved-tensor hooks. Median
    of ``repeats`` interleaved pairs after a warm-up."""
    models = {}
    for recompute in (False, True):
        model = GPT(config, seed=0).to(device())
        AcceleratorClock(1e30).apply(model)
        if recompute:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = Recompute(block)
        models[recompute] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
    extra = []
    for i in range(repeats + 1):  # the first is a warm-up
        took = {}
        for recompute, (model, opt) in models.items():
            t0 = time.perf_counter()
            common.train_step(model, opt, x, y)
            took[recompute] = time.perf_counter() - t0
        if i:
            extra.append(took[True] - took[False])
    return max(0.0, statistics.median(extra))
