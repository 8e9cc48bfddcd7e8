"""Benchmarks from the command line: ``python -m course_lib.bench ddp [--world 2]``.

``ddp`` races, in one run, the four ways of averaging gradients on the same model (naive, own
per-parameter, own bucketed, torch DDP) and prints tokens/s and each ratio to torch DDP.
The measurements themselves live in ``course_lib/experiments/`` (notebooks call them there):
interleaved rounds, each round the max over ranks, the median over rounds.
"""
from __future__ import annotations

import argparse

from .experiments.ch02_ddp import ddp_benchmark, format_throughput


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m course_lib.bench", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["ddp"], help="which benchmark")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=7)
    ns = parser.parse_args(argv)
    res = ddp_benchmark(ns.world, batch_size=ns.batch_size, bucket_cap_mb=ns.bucket_cap_mb, rounds=ns.rounds)
    print(format_throughput(res))
    print(f"own bucketed / torch DDP tokens/s: {res['ratios_vs_torch']['own_bucketed']:.2f}")


if __name__ == "__main__":
    main()
