"""``course-lib smoke``: every chapter's rank functions once, small, with ``backend="auto"``.

On a CPU machine it runs them on gloo (world 2); on a CUDA machine on nccl, one GPU per rank
(world = number of GPUs; a single GPU runs world 1, since nccl refuses two ranks on one GPU).
It proves the rule every rank function follows: each tensor and model lives on
``launch.device()``, so the notebooks run unchanged on GPUs. Each row reports the backend and
the device the ranks actually used. Every chapter adds its rank functions to :data:`SMOKE`, named
by the chapter's topic (``course_lib.chapters``); ``--chapter`` takes a topic or a number.

All spawn entries first run in one spawn, one after another on the same ranks (starting the
processes costs more than most entries). If anything fails there, each entry runs again in a
spawn of its own, so a failing function cannot hang or fail the others and its row names it.
"""

from __future__ import annotations

import importlib
import tempfile
from dataclasses import dataclass

from ..chapters import chapter
from ..launch import gpu_count, spawn
from ..timing import time_steps

__all__ = [
    "SMOKE",
    "SMOKE_RAY",
    "SmokeRow",
    "smoke_world",
    "smoke_entries",
    "run_smoke",
    "format_smoke",
]

TMP = "<tmp>"  # stands for a fresh temporary directory, shared by the ranks (checkpoints)
PASSES = "PASSES"  # a kwargs key: every Result the target returns must pass all its rows
MIN_WORLD = "MIN_WORLD"  # a kwargs key: the fewest ranks the entry can run on (point-to-point: 2)


def _tiny(**overrides):
    from .common import small_config

    return small_config(
        **{"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "d_model": 16, **overrides}
    )


def _zero_tiny():
    from .common import zero_config

    return zero_config(vocab_size=64, d_model=15, n_head=3, block_size=8)


E05 = "course_lib.experiments.pipeline"


def _pipe_tiny():
    from .common import parallel_config

    return parallel_config(block_size=8, d_model=16, n_head=2)


E00, E02, E03, E04 = ("course_lib.experiments." + m for m in ("collectives", "ddp", "zero", "fsdp"))

# (chapter topic, "module:function", kwargs): small versions of what each notebook runs on ranks.
SMOKE: list[tuple[str, str, dict]] = [
    ("collectives", "course_lib.launch:hello", {}),
    (
        "single-device",
        "course_lib.train:train_single_device",
        dict(config=_tiny(), steps=2, batch_size=2, progress=False),
    ),
    (
        "collectives",
        f"{E00}:bandwidth_benchmark",
        dict(
            sizes_bytes=(2**10, 2**14),
            ops=("all_reduce", "all_gather", "reduce_scatter"),
            iters=2,
            warmup=1,
        ),
    ),
    (
        "collectives",
        f"{E00}:scaling_race",
        dict(cases={"tiny": (32, 8)}, rounds=1, steps=1, warmup=0),
    ),
    (
        "collectives",
        f"{E00}:bandwidth_benchmark",
        dict(sizes_bytes=(2**10,), ops=("send_recv",), iters=1, warmup=1, repeats=2, MIN_WORLD=2),
    ),
    (
        "ddp",
        f"{E02}:equality_with_single_device",
        dict(variant="own_bucketed", steps=2, global_batch=8, config=_tiny()),
    ),
    (
        "ddp",
        f"{E02}:equality_with_single_device",
        dict(variant="torch_ddp", steps=2, global_batch=8, config=_tiny()),
    ),
    (
        "ddp",
        f"{E02}:accumulation_with_no_sync",
        dict(micro_batches=2, global_batch=8, config=_tiny()),
    ),
    (
        "ddp",
        f"{E02}:ddp_throughput",
        dict(
            config=_tiny(), batch_size=2, bucket_cap_mb=0.01, rounds=1, steps_per_round=1, warmup=1
        ),
    ),
    (
        "ddp",
        f"{E02}:bucket_size_sweep",
        dict(
            bucket_sizes_mb=(None, 0.01),
            config=_tiny(),
            batch_size=2,
            rounds=1,
            steps_per_round=1,
            warmup=0,
        ),
    ),
    ("ddp", f"{E02}:ddp_step_time", dict(config=_tiny(), global_batch=4, steps=1, warmup=0)),
    ("ddp", f"{E02}:ddp_timelines", dict(config=_tiny(), batch_size=2, steps=1)),
    (
        "ddp",
        "course_lib.experiments.ddp_compression:compression_accuracy",
        dict(steps=2, global_batch=4, config=_tiny()),
    ),
    (
        "ddp",
        "course_lib.experiments.ddp_compression:gradient_allreduce_time",
        dict(config=_tiny(), repeats=1, warmup=0),
    ),
    ("zero", f"{E03}:zero_stage_report", dict(stage=2, steps=2, config=_zero_tiny())),
    ("zero", f"{E03}:zero_stage_report", dict(stage=3, steps=2, config=_zero_tiny())),
    (
        "zero",
        f"{E03}:zero_clip_and_resume",
        dict(stage=2, steps=3, resume_at=1, config=_zero_tiny()),
    ),
    ("zero", f"{E03}:zero_stage_profile", dict(micro_batch=2, rounds=1, config=_zero_tiny())),
    (
        "zero",
        "course_lib.experiments.zero_libraries:torch_zero1_memory",
        dict(config=_tiny(), steps=1),
    ),
    ("fsdp", f"{E04}:fsdp2_vs_single_device", dict(steps=2, config=_zero_tiny(), global_batch=4)),
    ("fsdp", f"{E04}:fsdp2_vs_zero3", dict(steps=1, config=_zero_tiny(), global_batch=4)),
    (
        "fsdp",
        f"{E04}:fsdp2_mixed_precision",
        dict(MIN_WORLD=2, steps=1, config=_zero_tiny(), global_batch=4),
    ),
    (
        "fsdp",
        f"{E04}:fsdp2_checkpoint_roundtrip",
        dict(tmp_dir=TMP, steps=2, resume_at=1, config=_zero_tiny()),
    ),
    (
        "fsdp",
        "course_lib.experiments.fsdp_race:zero3_race",
        dict(rounds=1, batch_size=2, config=_zero_tiny(), warmup=0),
    ),
    (
        "pipeline",
        f"{E05}:pipeline_training",
        dict(schedule="1f1b", steps=2, num_microbatches=2, global_batch=4, config=_pipe_tiny()),
    ),
    (
        "pipeline",
        f"{E05}:sleep_bubbles",
        dict(microbatches=(2,), t_f=0.002, t_b=0.004, steps=1, warmup=0),
    ),
    (
        "pipeline",
        f"{E05}:gpt_timelines",
        dict(num_microbatches=2, global_batch=4, steps=2, config=_pipe_tiny()),
    ),
    (
        "pipeline",
        f"{E05}:torch_pipelining_grads",
        dict(schedule="1f1b", num_microbatches=2, global_batch=4, config=_pipe_tiny()),
    ),
]

_F04, _P04 = "course_lib.experiments.fsdp_features", "course_lib.experiments.fsdp_practice"
SMOKE += [  # chapter 04, part 2: FSDP2's features (HSDP and reshard-to-int need world 4: in the tests)
    ("fsdp", f"{_F04}:reshard_memory_and_traffic", dict(config=_zero_tiny(), global_batch=4)),
    (
        "fsdp",
        f"{_F04}:accumulation_without_sync",
        dict(micro_batches=2, steps=1, global_batch=4, config=_zero_tiny()),
    ),
    ("fsdp", f"{_F04}:prefetch_timeline", dict(config=_zero_tiny(), global_batch=4, rounds=1)),
    ("fsdp", f"{_P04}:clip_grad_norm", dict(steps=1, global_batch=4, config=_zero_tiny())),
    (
        "fsdp",
        f"{_P04}:activation_checkpointing",
        dict(config=_zero_tiny(), global_batch=4, rounds=1),
    ),
    ("fsdp", f"{_P04}:meta_device_init", dict(config=_zero_tiny())),
    (
        "fsdp",
        f"{_P04}:checkpoint_save",
        dict(tmp_dir=TMP, steps=1, global_batch=4, config=_zero_tiny()),
    ),
    ("fsdp", f"{_P04}:flat_vs_per_parameter", dict(MIN_WORLD=2, config=_zero_tiny())),
]

_E06 = "course_lib.experiments.tensor_parallel"
SMOKE += [  # chapter 06: tensor parallelism (the 2-D mesh is (world/2, 2) here; (2, 2) in the tests)
    ("tensor-parallel", f"{_E06}:linear_layers", dict(in_features=8, out_features=8, batch=2)),
    ("tensor-parallel", f"{_E06}:tp_step", dict(config=_pipe_tiny(), batch_size=4)),
    (
        "tensor-parallel",
        f"{_E06}:tp_step",
        dict(config=_pipe_tiny(), batch_size=4, sequence_parallel=True),
    ),
    ("tensor-parallel", f"{_E06}:tp_training", dict(steps=2, batch_size=4, config=_pipe_tiny())),
    ("tensor-parallel", f"{_E06}:dtensor_step", dict(config=_pipe_tiny(), batch_size=4)),
    ("tensor-parallel", f"{_E06}:dtensor_sequence_parallel_blocks", dict(config=_pipe_tiny())),
    (
        "tensor-parallel",
        f"{_E06}:dp_tp_training",
        dict(steps=1, global_batch=4, config=_pipe_tiny(), mesh_shape=None),
    ),
    (
        "tensor-parallel",
        f"{_E06}:fsdp_tp_step",
        dict(global_batch=4, config=_pipe_tiny(), mesh_shape=None),
    ),
]

_CP07, _EP07 = "course_lib.experiments.context_parallel", "course_lib.experiments.expert_parallel"
_P3D = "course_lib.experiments.parallel_3d"
_CPE = "context-expert-parallel"


def _moe_tiny(**overrides):
    from .expert_parallel import moe_gpt_config

    return moe_gpt_config(
        **{"vocab_size": 32, "block_size": 8, "n_head": 2, "d_model": 16, **overrides}
    )


# Sizes that divide for a smoke world of 1, 2, 4 or 8 ranks: 8 heads (Ulysses: H/c whole heads), an
# even number of tokens per rank (zig-zag: two chunks), block_size 16 (the CP GPT's 2c chunks), 8
# experts (E/e each), batches of 8. PASSES: each rank's Result must pass every one of its rows.
_QKV = dict(batch=1, heads=8, seq_per_rank=4, head_dim=4, PASSES=True)
SMOKE += [  # chapter 07: context parallelism, then MoE / expert parallelism, each against one device
    (_CPE, f"{_CP07}:attention_equality", _QKV),  # ring and all-gather (both layouts), Ulysses
    (_CPE, f"{_CP07}:attention_traffic", _QKV),  # bytes each rank sends == the formulas
    (
        _CPE,
        f"{_CP07}:cp_gpt_training",
        dict(steps=2, batch_size=2, config=_tiny(block_size=16), PASSES=True),
    ),
    (_CPE, f"{_EP07}:ep_equality", dict(tokens=32, config=_moe_tiny(), PASSES=True)),
    (_CPE, f"{_EP07}:ep_training", dict(steps=2, global_batch=8, config=_moe_tiny(), PASSES=True)),
    # the mesh: pipeline stages whose blocks are tensor-parallel (dp: the world's remaining factor)
    (_CPE, f"{_P3D}:dp_pp_tp_training", dict(pp=1, tp=2, steps=2, PASSES=True, MIN_WORLD=2)),
    (_CPE, f"{_P3D}:dp_pp_tp_training", dict(pp=2, tp=1, steps=2, PASSES=True, MIN_WORLD=2)),
]

_E09 = "course_lib.experiments.horovod"
SMOKE += [  # chapter 10: the review suite (chapters 03-06 again) and the DDP side of the Horovod comparison
    (
        "review",
        "course_lib.experiments.review:review_suite",
        dict(bubble_ms=(2.0, 4.0), microbatches=(2,)),
    ),
    (
        "review",
        f"{_E09}:ddp_rank",
        dict(kind="course", config=_tiny(), steps=2, global_batch=4, optimizer="sgd"),
    ),
    (
        "review",
        f"{_E09}:ddp_rank",
        dict(kind="torch", config=_tiny(), steps=2, global_batch=4, optimizer="sgd"),
    ),
]

# Ray chapters: a rank function inside a real ``TorchTrainer`` (Ray makes the process group: gloo on CPU,
# nccl with ``use_gpu``); run in the parent, one Ray session for all of them. ``RAY_DATA`` as the target:
# chapter 09's Ray Data pipeline streamed into the workers, each of which takes a real step on its device.
RAY_DATA = "ray_data"
SMOKE_RAY: list[tuple[str, str, dict]] = [
    (
        "ray-train",
        f"{E02}:equality_with_single_device",
        dict(variant="torch_ddp", steps=2, global_batch=8, config=_tiny()),
    ),
    ("ray-data", RAY_DATA, dict(rows=64, files=4, batch_size=4)),
]


@dataclass
class SmokeRow:
    chapter: str
    function: str
    world_size: int
    backend: str
    device: str
    status: str  # "pass" | "skip" (needs more ranks than the machine has) | "FAIL"
    seconds: float
    error: str = ""


def _run_one(target: str, kwargs: dict, tmp: str) -> dict:
    """Rank function: run ``target(**kwargs)`` and say which backend and device this rank used."""
    import torch.distributed as dist

    from ..launch import device

    module, name = target.split(":")
    kwargs = {k: tmp if isinstance(v, str) and v == TMP else v for k, v in kwargs.items()}
    passes = kwargs.pop(PASSES, False)
    kwargs.pop(MIN_WORLD, None)
    got = getattr(importlib.import_module(module), name)(**kwargs)
    if passes:
        _assert_passed(got, f"rank {dist.get_rank()}: {name}")
    return {"backend": dist.get_backend(), "device": str(device())}


def _assert_passed(got, where: str) -> None:
    """A :data:`PASSES` entry: the Result(s) it returned (one, or a dict of them) passed every row."""
    from ..results import Result

    results = list(got.values()) if isinstance(got, dict) else [got]
    results = [r for r in results if isinstance(r, Result)]
    if not results:
        raise TypeError(f"{where} returned no Result, so a PASSES entry has nothing to check")
    for res in results:
        try:
            res.assert_passed()
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None


def smoke_world() -> int:
    """World size for the smoke run: one rank per GPU (nccl), or 2 CPU ranks (gloo)."""
    gpus = gpu_count()
    return gpus if gpus >= 1 else 2


def _ray_data_step(batch_size: int) -> dict:
    """Rank function in a Ray Train worker: stream this worker's shard, one train step per batch on its device."""
    import ray.train
    import torch
    import torch.distributed as dist

    from ..launch import device
    from ..models import GPT
    from .common import make_optimizer, small_config, train_step

    dev = device()
    model = GPT(small_config(), seed=0).to(dev)
    opt = make_optimizer("adamw", model.parameters())
    for batch in ray.train.get_dataset_shard("train").iter_torch_batches(
        batch_size=batch_size, dtypes=torch.long
    ):
        train_step(model, opt, batch["x"].to(dev), batch["y"].to(dev))
    return {"backend": dist.get_backend(), "device": str(dev)}


def _ray_smoke(target: str, kwargs: dict, world: int, tmp: str) -> dict:
    """``target(**kwargs)`` on ``world`` Ray Train workers (``use_gpu`` when there is a GPU per worker)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from .. import ray_train
    from .ray_train import rank_function_loop, rank_results

    ray_train.start(num_cpus=max(2, world))
    use_gpu = ray_train.auto_use_gpu(world)
    per_worker = {"CPU": 1.0}
    config, datasets = {"fn": _run_one, "args": (target, kwargs, tmp)}, None
    if target == RAY_DATA:
        from .ray_data import build_dataset, write_corpus

        write_corpus(tmp, rows=kwargs["rows"], files=kwargs["files"])
        datasets, per_worker = (
            {"train": build_dataset(tmp, 0.0, kwargs["batch_size"])},
            {"CPU": 0.5},
        )
        config = {"fn": _ray_data_step, "args": (kwargs["batch_size"],)}
    ray_train.check_resources(world, per_worker, use_gpu=use_gpu)
    trainer = TorchTrainer(
        rank_function_loop,
        train_loop_config=config,
        datasets=datasets,
        scaling_config=ScalingConfig(
            num_workers=world, use_gpu=use_gpu, resources_per_worker=per_worker
        ),
        run_config=RunConfig(**ray_train.run_config_kwargs("smoke")),
    )
    return rank_results(trainer.fit(), world)[0]


def smoke_entries(chapters=None) -> list[tuple[str, str, dict, bool]]:
    """``(topic, target, kwargs, on_ray)`` of every entry, or of ``chapters``.

    ``chapters`` are topics or notebook numbers: ``"ddp"``, ``"02"``.
    """
    wanted = None if chapters is None else {chapter(key).topic for key in chapters}
    entries = [(c, t, k, False) for c, t, k in SMOKE] + [(c, t, k, True) for c, t, k in SMOKE_RAY]
    return [e for e in entries if wanted is None or e[0] in wanted]


def _timed(call, device=None) -> tuple[dict, float]:
    """``(what call() returned, its seconds)``: one untimed-warm-up-free round of ``timing.time_steps``.

    On ranks the seconds are the slowest rank's (``time_steps`` takes the max over ranks). A call that
    raises is timed too: ``got`` then holds the exception under ``"error"``.
    """
    got: dict = {}

    def attempt():
        try:
            got["value"] = call()
        except Exception as exc:  # noqa: BLE001 - handed back, the caller decides
            got["error"] = exc

    seconds = time_steps({"entry": attempt}, rounds=1, warmup=0, device=device)["entry"].median
    return got, seconds


def _run_many(entries: list[tuple[str, dict]], tmp: str) -> list[dict]:
    """Rank function: :func:`_run_one` for each ``(target, kwargs)`` in turn, each in its own temp folder."""
    import os

    import torch.distributed as dist

    out = []
    for i, (target, kwargs) in enumerate(entries):
        sub = os.path.join(tmp, str(i))
        os.makedirs(sub, exist_ok=True)
        got, seconds = _timed(lambda t=target, k=kwargs, d=sub: _run_one(t, k, d))
        if "error" in got:
            raise got["error"]
        dist.barrier()  # every rank has finished this entry before the next starts
        out.append({**got["value"], "seconds": seconds})
    return out


def _row(entry, world: int, got: dict, seconds: float) -> SmokeRow:
    topic, target, _, _ = entry
    return SmokeRow(
        topic, target.split(":")[-1], world, got["backend"], got["device"], "pass", seconds
    )


def _failed_row(entry, world: int, backend: str, exc: Exception, seconds: float) -> SmokeRow:
    topic, target, _, _ = entry
    first = str(exc).strip().splitlines()
    error = first[0][:160] if first else type(exc).__name__
    return SmokeRow(topic, target.split(":")[-1], world, backend, "?", "FAIL", seconds, error)


def _grouped(entries: list, world: int, timeout: float) -> list[SmokeRow] | None:
    """Every spawn entry in *one* spawn (each rank runs them in turn); ``None`` if anything failed.

    Starting two processes costs ~2.5 s, more than most entries; one spawn for all of them saves
    that per entry. A failure anywhere gives ``None``, and the caller runs each entry in a spawn of
    its own, which names the failing entries and keeps one from hanging the others.
    """
    if not entries:
        return []
    jobs = [(target, kwargs) for _, target, kwargs, _ in entries]
    try:
        with tempfile.TemporaryDirectory(prefix="course-smoke-") as tmp:
            got = spawn(
                _run_many,
                world,
                args=(jobs, tmp),
                backend="auto",
                timeout=min(timeout * len(jobs), timeout + 10 * len(jobs)),
            )[0]
    except Exception:  # noqa: BLE001 - RankError/RankTimeout: find the culprit entry by entry
        return None
    return [_row(e, world, g, g["seconds"]) for e, g in zip(entries, got, strict=True)]


def run_smoke(
    world_size: int | None = None,
    chapters=None,
    timeout: float = 180,
    progress=None,
    grouped: bool = True,
) -> list[SmokeRow]:
    """Run every :data:`SMOKE` and :data:`SMOKE_RAY` entry (of ``chapters``, default all); one row each.

    ``chapters``: topics (``"ddp"``) or notebook numbers (``"02"``, ``2``), as ``chapters.chapter``
    reads them. ``grouped``: first try all spawn entries in one spawn (:func:`_grouped`); on any
    failure, and with ``grouped=False``, each entry runs in a spawn of its own.
    """
    from ..launch import resolve_backend

    world = smoke_world() if world_size is None else world_size
    backend = resolve_backend("auto", world)
    entries = smoke_entries(chapters)
    too_few = [e for e in entries if e[2].get(MIN_WORLD, 1) > world]
    entries = [e for e in entries if e not in too_few]
    plain = [e for e in entries if not e[3]]
    rows = _grouped(plain, world, timeout) if grouped else None
    if rows is not None and progress is not None:
        for row in rows:
            progress(row)
    todo = [e for e in entries if e[3]] if rows is not None else entries
    rows = rows or []
    ray_started = False
    try:
        for entry in todo:
            _, target, kwargs, on_ray = entry

            def attempt(target=target, kwargs=kwargs, on_ray=on_ray):
                with tempfile.TemporaryDirectory(prefix="course-smoke-") as tmp:
                    if on_ray:
                        return _ray_smoke(target, kwargs, world, tmp)
                    return spawn(
                        _run_one, world, args=(target, kwargs, tmp), backend="auto", timeout=timeout
                    )[0]

            ray_started = ray_started or on_ray
            got, seconds = _timed(attempt, device="cpu")  # the parent: no accelerator to wait for
            if "error" in got:  # RankError/RankTimeout, Ray's TrainingFailedError: a row
                row = _failed_row(entry, world, backend, got["error"], seconds)
            else:
                row = _row(entry, world, got["value"], seconds)
            rows.append(row)
            if progress is not None:
                progress(row)
    finally:
        if ray_started:
            from .. import ray_train

            ray_train.stop()
    for topic, target, kwargs, _ in too_few:
        need = f"needs {kwargs[MIN_WORLD]} ranks, this machine runs {world}"
        rows.append(SmokeRow(topic, target.split(":")[-1], world, backend, "-", "skip", 0.0, need))
    return rows


def format_smoke(rows: list[SmokeRow]) -> str:
    w = max([len("chapter"), *(len(r.chapter) for r in rows)]) + 1
    lines = [
        f"{'chapter':<{w}}{'function':<34}{'world':>6}  {'backend':<8}{'device':<8}{'status':<7}{'s':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r.chapter:<{w}}{r.function:<34}{r.world_size:>6}  {r.backend:<8}{r.device:<8}"
            f"{r.status:<7}{r.seconds:>6.1f}" + (f"  {r.error}" if r.error else "")
        )
    failed = sum(r.status == "FAIL" for r in rows)
    skipped = sum(r.status == "skip" for r in rows)
    ran = len(rows) - skipped
    lines.append(f"{ran - failed}/{ran} passed" + (f", {skipped} skipped" if skipped else ""))
    return "\n".join(lines)
