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
from dataclasses import dataclass, field, replace

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


def _replayed_links(
    sizes: list[int], gap_s: float = 0.0, calls: int = 5, rounds: int = 3
) -> st.AlphaBeta:
    """α–β of the step's own collectives, replayed alone: the sizes it sends, as gloo runs them.

    For each op and each size in ``sizes`` (bytes: a unit's gathered parameters; the root's and a
    block's), ``rounds`` rounds of ``calls`` blocking calls, each after ``gap_s`` of sleep. Per
    round the mean call (a step pays every call, the slow ones too); the median round; the max
    over ranks (the slower rank's time is in the step). α and β are the line through the
    smallest and the largest size: exact at the sizes the model prices.

    Why back to back (``gap_s=0``), although under the clock each collective follows a sleep:
    in the step the host works between the sleep and the call (hooks, the copy into the
    gather's input), and the step's waits match calls made back to back — ≈ 2.5 ms per block
    all-gather in both, measured at load < 1 — while calls made right after a sleep paid
    gloo's wake-up, 2–4 ms more each, which put the model's exposed all-gathers 1.5–3× over the
    step's (as did chapter 00's sweep with an idle-α floor, over other sizes)."""
    world = dist.get_world_size()
    sizes = sorted(set(sizes))
    run = {
        "all_gather": lambda out, shard: dist.all_gather_into_tensor(out, shard),
        "reduce_scatter": lambda out, shard: dist.reduce_scatter_tensor(shard, out),
    }
    alpha, beta = {}, {}
    for op, call in run.items():
        seconds = []
        for nbytes in sizes:
            full = torch.zeros(nbytes // 4, device=device())
            shard = torch.zeros(nbytes // 4 // world, device=device())
            call(full, shard)  # warm-up
            means = []
            for _ in range(rounds):
                spent = 0.0
                for _ in range(calls):
                    time.sleep(gap_s)
                    t0 = time.perf_counter()
                    call(full, shard)
                    if full.is_cuda:  # nccl returns before the collective has run
                        torch.cuda.synchronize()
                    spent += time.perf_counter() - t0
                means.append(spent / calls)
            seconds.append(common.max_over_ranks(statistics.median(means)))
        factor = st.op_factor(op, world)
        (b0, t0), (b1, t1) = (sizes[0], seconds[0]), (sizes[-1], seconds[-1])
        # the line through both sizes; a larger message never costs less than a smaller one
        beta[op] = factor * (b1 - b0) / (t1 - t0) if t1 > t0 else float("inf")
        alpha[op] = t0 - factor * b0 / beta[op]
    return st.AlphaBeta(alpha, beta, world, sizes[0], dict.fromkeys(alpha, len(sizes)))


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
    links: object = field(default=None, repr=False)  # the replayed α–β the model priced with

    def host(self, name: str) -> float:
        """Seconds per step neither slept nor waiting on a collective: the host's own work."""
        return self.measured[name] - self.slept[name] - sum(self.waits[name].values())

    def breakdown(self) -> str:
        """Per variant, measured and predicted (ms): the step, compute, communication, host work.

        Measured: what the clock slept, the waits for all-gathers + reduce-scatters
        (``Zero3Waits``), the rest (:meth:`host`). Predicted: the clock's compute (and
        recompute), the communication ``zero3_step`` leaves exposed, the host work measured
        under a clock that never sleeps."""
        head = f"{'ms per step':<34}{'step':>6}{'compute':>9}{'communication':>15}{'host work':>11}"
        lines = [head]
        for n in self.measured:
            w, p = self.waits[n], self.predicted[n].parts
            comm = f"{w['all_gather'] * 1e3:.1f} + {w['reduce_scatter'] * 1e3:.1f}"
            lines.append(
                f"{n + ', measured':<34}{self.measured[n] * 1e3:>6.0f}{self.slept[n] * 1e3:>9.0f}"
                f"{comm:>15}{self.host(n) * 1e3:>11.1f}"
            )
            exposed = p.get("exposed all_gather + reduce_scatter", 0.0)
            lines.append(
                f"{n + ', predicted':<34}{self.predicted[n].total * 1e3:>6.0f}"
                f"{self.slept[n] * 1e3:>9.0f}{exposed * 1e3:>15.1f}{p.get('host work', 0.0) * 1e3:>11.1f}"
            )
        lines.append(
            "(measured communication: all-gather + reduce-scatter waits; predicted: what zero3_step "
            "leaves exposed)"
        )
        return "\n".join(lines)

    def saving(self, a: str, b: str, which: str) -> float:
        """``a`` − ``b``: measured (``which="measured"``) or predicted seconds."""
        if which == "measured":
            return self.measured[a] - self.measured[b]
        return self.predicted[a].total - self.predicted[b].total


def zero3_clocked(
    rounds: int = 5, steps_per_round: int = 3, batch: int = 1, ratio: float = 5.0, config=None
) -> ClockedResult:
    """Rank function: our ``Zero3`` without prefetch, with it, and with it plus per-block recompute.

    Default shape :func:`clocked_config`, ``batch`` sequences per rank (few tokens: compute per
    block comparable to one block's all-gather, so what prefetch hides shows).

    Under the modelled accelerator clock (every block sleeps ≥ ``ratio`` × 2 its real compute,
    ``clock.calibrate``), each variant predicted as three measured parts: the clock's compute,
    the communication ``step_time.zero3_step(prefetch=…, recompute=…)`` leaves exposed (the
    units Zero3 really holds, priced by the same collectives replayed alone,
    :func:`_replayed_links`), and the host's own work (:func:`_host_work`: the same step under a
    clock that never sleeps, less its waits). Rows: each variant's measured median within
    ``timing.AGREEMENT_BAND`` of its prediction; prefetch where it acts — the seconds the step
    waits for its all-gathers (``fsdp_meters.Zero3Waits``), at most half of those without
    prefetch (the model's ratio beside it); and what recompute costs against one forward of the
    blocks (the clock's sleeps, plus what checkpointing adds on the host). ``breakdown()``
    splits each measured step into sleeps, waits and host work. Same on every rank.

    Timed as ``rounds`` rounds of ``steps_per_round`` steps (``timing.time_steps``). Prefetch
    saves ≈ 20 ms per step here while single steps scatter by ±10 ms, whatever the clock's
    ``ratio``: a round's mean over 3 steps narrows the ranges enough to tell the variants apart,
    and ``ratio`` 5 keeps each block's sleep (≈ 7 ms forward) above an all-gather (≈ 2.5 ms)
    at under half the run time of ratio 15 (three quiet runs: ranges separate, ×1.11–1.19).
    """
    config = config or clocked_config()
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g).to(device())
    y = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g).to(device())
    probe = GPT(config).to(device())
    rate = common.min_over_ranks(calibrate(probe, x, y, ratio=ratio).rate)  # one rate on every rank
    clock = AcceleratorClock(rate)
    host = _host_work(config, x, y)
    steps, predicted, waits, calls = {}, {}, {}, dict.fromkeys(CLOCKED_VARIANTS, 0)
    links = None
    for name in CLOCKED_VARIANTS:
        z3, opt, waits[name], flops = _zero3_variant(name, config, clock, x, y)
        fwd = st.part_seconds(flops, rate)
        units = _zero3_units(z3, fwd)
        if links is None:  # the root's and a block's messages
            links = _replayed_links([u[1] for u in units])

        def step(z3=z3, opt=opt, name=name):
            calls[name] += 1
            return common.train_step(z3, opt, x, y)

        steps[name] = step
        recompute = [n for n, _ in fwd if n.startswith("blocks.")] if "recompute" in name else []
        p = st.zero3_step(fwd, units, links, world, prefetch=z3.prefetch, recompute=recompute)
        predicted[name] = replace(p, parts={**p.parts, "host work": host[name]})
    timings = time_steps(
        steps,
        rounds=rounds,
        steps_per_round=steps_per_round,
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
        host_recompute=host["prefetch + recompute"] - host["prefetch"],
        links=links,
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
    one_forward = sum(s for n, s in fwd if n.startswith("blocks.")) + res.host_recompute
    res.within(
        "recompute costs (recompute − prefetch), s",
        res.saving("prefetch + recompute", "prefetch", "measured"),
        one_forward,
        AGREEMENT_BAND,
        against="one forward of the blocks: sleeps + host",
    )
    return res


def _zero3_variant(name: str, config, clock: AcceleratorClock, x, y):
    """One of :data:`CLOCKED_VARIANTS`: ``(Zero3, SGD, its Zero3Waits, part FLOPs)`` on ``clock``."""
    model = GPT(config, seed=0).to(device())
    clock.apply(model)
    if name.endswith("recompute"):
        for i, block in enumerate(model.blocks):
            model.blocks[i] = Recompute(block)
    flops = st.part_flops(model, x, y)
    z3 = Zero3(model, prefetch=name != "no prefetch")
    waits = Zero3Waits()
    z3.add_observer(waits)
    return z3, torch.optim.SGD(z3.parameters(), lr=1e-3), waits, flops


def _host_work(config, x, y, repeats: int = 5) -> dict[str, float]:
    """Seconds per step each variant's host works: its step less its waits, under a clock that never sleeps.

    What the step-time model does not price: the real (small) compute, copying shards into each
    all-gather's input and out of its output, the hooks, checkpointing's re-run forward and saved-
    tensor hooks, the optimizer. With nothing to sleep, each step is that work plus the waits for
    its collectives (timed by ``Zero3Waits``), which are taken out. Variants interleaved, the
    median of ``repeats`` after a warm-up, the max over ranks."""
    fast = AcceleratorClock(1e30)
    built = {n: _zero3_variant(n, config, fast, x, y)[:3] for n in CLOCKED_VARIANTS}
    spent = {n: [] for n in built}
    for i in range(repeats + 1):  # the first is a warm-up
        for n, (z3, opt, waits) in built.items():
            dist.barrier()
            waits.reset()
            t0 = time.perf_counter()
            common.train_step(z3, opt, x, y)
            took = time.perf_counter() - t0
            if i:
                spent[n].append(took - sum(waits.seconds.values()))
    return {n: common.max_over_ranks(statistics.median(s)) for n, s in spent.items()}
