"""Chapter 04's race: our ``Zero3`` per parameter / per unit / per unit + prefetch against FSDP2.

:func:`zero3_race` (rank function) trains the same model on the same data with each variant and
times one AdamW step of each per interleaved round (``common.race``: max over ranks, median over
rounds); it also counts each variant's all-gathers in one forward (ours with ``CommLog``, FSDP2's
with ``CollectiveCounter``). ``python -m course_lib.bench zero3`` runs it from a terminal.
"""

from __future__ import annotations

import statistics

import torch.distributed as dist

from ..comm import CollectiveCounter, CommLog
from ..ddp import torch_ddp
from ..fsdp import fsdp2_wrap
from ..launch import device
from ..models import GPT
from ..zero3 import Zero3
from . import common
from .fsdp import FSDPResult

__all__ = ["ZERO3_VARIANTS", "BASELINE", "zero3_race", "format_zero3"]

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
    """Rank function: one AdamW step of each variant per round (same model, same data), timed by ``common.race``.

    The model (default ``d_model`` 128, 4 blocks, 0.9M parameters) is big enough that the step is
    communication and compute, not Python overhead. Returns the per-round times, the medians,
    each median's ratio to FSDP2's, and our variants' all-gathers in one forward (``CommLog``),
    checked: one per unit per unit variant and for FSDP2, one per parameter and use per parameter.
    No speed is asserted (timings flip on a busy machine). ``baseline``: also time torch DDP on
    the same model (no sharding), for scale.
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
    times = common.race(
        {name: (lambda n=name: common.train_step(models[n], opts[n], x, y)) for name in models},
        rounds=rounds,
        warmup=warmup,
    )
    med = common.median_times(times)
    plain = GPT(cfg)
    units, uses = cfg.n_layer + 1, len(list(plain.named_parameters(remove_duplicate=False)))
    res = FSDPResult(
        title=f"ZeRO-3 four ways at world {world}",
        values=dict(
            world_size=world,
            params=sum(p.numel() for p in plain.parameters()),
            rounds=rounds,
            tokens_per_step=batch_size * world * cfg.block_size,
            times=times,
            median_s=med,
            ratio_to_fsdp2={n: med[n] / med["fsdp2"] for n in med},
            gathers_per_forward=gathers,
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
        f"{r['zero3 per-unit+prefetch']:.2f} (goal at N=2: ≤ 1.10); spread (pstdev) of FSDP2's rounds: "
        f"{statistics.pstdev(res['times']['fsdp2']) * 1e3:.1f} ms"
    )
    return "\n".join(lines)
