"""Benchmarks from the command line: ``python -m course_lib.bench ddp|ddp-exposure|zero3 [--world 2]``.

``ddp`` races, in one run, the ways of averaging gradients on the same model (naive, own per-parameter,
own bucketed with and without ``gradient_as_bucket_view`` / ``find_unused_parameters``, torch DDP with and
without ``gradient_as_bucket_view``, and the fp16/bf16-compressed variants of both) and prints tokens/s,
each ratio to torch DDP, and own fp16 / torch ``fp16_compress_hook`` with both against fp32.
``ddp-exposure`` prints chapter 02's exposed communication per step (blocking / overlapped, per parameter /
bucketed) under the modelled accelerator clock, predicted beside measured, with more rounds.
``zero3`` races our ``Zero3`` per parameter, per unit and per unit + prefetch against FSDP2
(``fully_shard`` per block + root) with AdamW, and prints step times, each ratio to FSDP2 and the
all-gathers per forward pass. Interleaved rounds, each round the max over ranks, the median over rounds.
``raydata`` trains 2 Ray Train workers fed by Ray Data and prints the streaming / serial wall-time ratio, with
the ``prefetch_batches=0`` and torch ``DataLoader(num_workers=1)`` baselines (timed inside the workers' loops).
"""

from __future__ import annotations

import argparse

from .experiments.ddp import ddp_benchmark, format_throughput
from .experiments.fsdp_race import format_zero3, zero3_race


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "what", choices=["ddp", "ddp-exposure", "zero3", "raydata"], help="which benchmark"
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0, help="ddp only")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (ddp: 9, zero3: 9)"
    )
    parser.add_argument("--d-model", type=int, default=128, help="zero3 only")
    parser.add_argument("--n-layer", type=int, default=4, help="zero3 only")
    ns = parser.parse_args(argv)
    if (
        ns.what == "raydata"
    ):  # chapter 09: streaming vs serial (and DataLoader, prefetch 0) inside Train workers
        from .experiments.ray_data import benchmark

        print(benchmark())
        return
    if ns.what == "ddp-exposure":
        from .experiments.ddp import exposed_communication
        from .launch import spawn

        kwargs = dict(bucket_cap_mb=ns.bucket_cap_mb, rounds=ns.rounds or 7)
        res = spawn(exposed_communication, ns.world, kwargs=kwargs, timeout=1800)[0]
        print(res.exposure_table())
        print(res)
        return
    if ns.what == "ddp":
        res = ddp_benchmark(
            ns.world,
            batch_size=ns.batch_size,
            bucket_cap_mb=ns.bucket_cap_mb,
            rounds=ns.rounds or 9,
        )
        print(format_throughput(res))
        tps = {v: res[v]["tokens_per_s"] for v in res["ratios_vs_torch"]}
        print(
            f"own bucketed / torch DDP tokens/s: {res['ratios_vs_torch']['own_bucketed']:.2f} "
            f"(+ gradient_as_bucket_view: {res['ratios_vs_torch']['own_bucket_view']:.2f}, torch with it: "
            f"{res['ratios_vs_torch']['torch_bucket_view']:.2f})"
        )
        print(
            f"own fp16 hook / torch fp16_compress_hook: {tps['own_fp16'] / tps['torch_fp16']:.2f} "
            f"(own fp16 / own fp32 {tps['own_fp16'] / tps['own_bucketed']:.2f}, "
            f"torch fp16 / torch fp32 {tps['torch_fp16'] / tps['torch_ddp']:.2f})"
        )
        return
    from .configs import zero_config
    from .launch import spawn

    cfg = zero_config(
        n_layer=ns.n_layer, d_model=ns.d_model, n_head=4, vocab_size=512, block_size=32
    )
    res = spawn(
        zero3_race,
        ns.world,
        kwargs=dict(rounds=ns.rounds or 9, batch_size=ns.batch_size, config=cfg),
        timeout=1800,
    )[0]
    print(format_zero3(res))


if __name__ == "__main__":
    main()
