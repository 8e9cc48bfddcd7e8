"""Benchmarks from the command line: ``python -m course_lib.bench ddp|zero3 [--world 2]``.

``ddp`` races, in one run, the four ways of averaging gradients on the same model (naive, own
per-parameter, own bucketed, torch DDP) and prints tokens/s and each ratio to torch DDP.
``zero3`` races our ``Zero3`` per parameter, per unit and per unit + prefetch against FSDP2
(``fully_shard`` per block + root) with AdamW, and prints step times, each ratio to FSDP2 and the
all-gathers per forward pass. Interleaved rounds, each round the max over ranks, the median over rounds.
"""
from __future__ import annotations

import argparse
import statistics

from .experiments.ch02_ddp import ddp_benchmark, format_throughput

ZERO3_VARIANTS = {"zero3 per-param": dict(unit="param"), "zero3 per-unit": dict(unit="block"),
                  "zero3 per-unit+prefetch": dict(unit="block", prefetch=True), "fsdp2": None}


def zero3_race(rounds: int = 9, batch_size: int = 8, config=None, warmup: int = 2) -> dict:
    """Rank function: one AdamW step of each variant per round (same model, same data), timed by ``common.race``.

    The model (default ``d_model`` 128, 4 blocks, 0.9M parameters) is big enough that the step is
    communication and compute, not Python overhead. Returns the per-round times, the medians,
    each median's ratio to FSDP2's, and our variants' all-gathers in one forward (``CommLog``).
    """
    import torch.distributed as dist

    from .comm import CollectiveCounter, CommLog
    from .experiments import common
    from .fsdp import fsdp2_wrap
    from .launch import device
    from .models import GPT
    from .zero3 import Zero3

    cfg = config or common.zero_config(n_layer=4, d_model=128, n_head=4, vocab_size=512, block_size=32)
    world, dev = dist.get_world_size(), device()
    x, y = common.shard_batch(*common.step_batch(0, cfg, batch_size * world, dev))
    models = {name: Zero3(GPT(cfg, seed=0).to(dev), **kw) if kw is not None else fsdp2_wrap(GPT(cfg, seed=0).to(dev))
              for name, kw in ZERO3_VARIANTS.items()}
    opts = {name: common.make_optimizer("adamw", m.parameters()) for name, m in models.items()}
    gathers = {}  # all-gathers in one forward: ours from CommLog, FSDP2's from the dispatcher
    for name, m in models.items():
        with CommLog() as log, CollectiveCounter() as counter:
            m(x, y)
        gathers[name] = counter.count(op="all_gather") if name == "fsdp2" else log.count(op="all_gather", tag="param")
    times = common.race({name: (lambda n=name: common.train_step(models[n], opts[n], x, y)) for name in models},
                        rounds=rounds, warmup=warmup)
    med = common.median_times(times)
    return dict(world_size=world, params=sum(p.numel() for p in GPT(cfg).parameters()), rounds=rounds,
                tokens_per_step=batch_size * world * cfg.block_size, times=times, median_s=med,
                ratio_to_fsdp2={n: med[n] / med["fsdp2"] for n in med}, gathers_per_forward=gathers)


def format_zero3(res: dict) -> str:
    lines = [f"world {res['world_size']}, {res['params'] / 1e6:.2f}M params, {res['tokens_per_step']} tokens/step, "
             f"AdamW, median of {res['rounds']} interleaved rounds (max over ranks)",
             f"{'variant':<25}{'step (ms)':>10}{'min':>8}{'max':>8}{'vs FSDP2':>10}{'all-gathers/fwd':>17}"]
    for name, t in res["times"].items():
        g = res["gathers_per_forward"][name]
        lines.append(f"{name:<25}{res['median_s'][name] * 1e3:>10.1f}{min(t) * 1e3:>8.1f}{max(t) * 1e3:>8.1f}"
                     f"{res['ratio_to_fsdp2'][name]:>10.2f}{g!s:>17}")
    r = res["ratio_to_fsdp2"]
    lines.append(f"per-unit / FSDP2 = {r['zero3 per-unit']:.2f}, per-unit+prefetch / FSDP2 = "
                 f"{r['zero3 per-unit+prefetch']:.2f} (goal at N=2: ≤ 1.10); spread (pstdev) of FSDP2's rounds: "
                 f"{statistics.pstdev(res['times']['fsdp2']) * 1e3:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ddp", "zero3"], help="which benchmark")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0, help="ddp only")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (ddp: 7, zero3: 9)")
    parser.add_argument("--d-model", type=int, default=128, help="zero3 only")
    parser.add_argument("--n-layer", type=int, default=4, help="zero3 only")
    ns = parser.parse_args(argv)
    if ns.what == "ddp":
        res = ddp_benchmark(ns.world, batch_size=ns.batch_size, bucket_cap_mb=ns.bucket_cap_mb, rounds=ns.rounds or 7)
        print(format_throughput(res))
        print(f"own bucketed / torch DDP tokens/s: {res['ratios_vs_torch']['own_bucketed']:.2f}")
        return
    from .experiments.common import zero_config
    from .launch import spawn

    cfg = zero_config(n_layer=ns.n_layer, d_model=ns.d_model, n_head=4, vocab_size=512, block_size=32)
    res = spawn(zero3_race, ns.world, kwargs=dict(rounds=ns.rounds or 9, batch_size=ns.batch_size, config=cfg),
                timeout=1800)[0]
    print(format_zero3(res))


if __name__ == "__main__":
    main()
