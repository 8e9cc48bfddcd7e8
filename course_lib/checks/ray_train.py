"""Chapter 08 checker: the learner's ``ray_train_loop`` run in a real ``TorchTrainer`` with 2 workers.

Registered with ``launcher="parent"``: ``check()`` calls :func:`check_ray_train_loop` in its own process
(the notebook's), which uses the Ray session already running there (notebook 08's) or starts one and stops
it afterwards, runs ``fit()`` and reads the run's last checkpoint. The checkpointed weights must equal one
device trained on the same global batches in the same order — ``DistributedSampler``'s permutation of each
epoch, :func:`~course_lib.experiments.ray_train.reference_params` — within ``results.ADAMW``
(``for_optimizer("adamw")``: rtol 1e-5, atol 5e-5).
An exception in the training function makes ``fit()`` raise ``TrainingFailedError`` with the worker's
traceback; it propagates, and ``check()`` reports it (``NotImplementedError`` → unsolved).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import torch

from .. import ray_train
from ..experiments.ray_train import reference_params
from ..results import for_optimizer

__all__ = ["CONFIG", "WORKERS", "check_ray_train_loop"]

CONFIG = {"epochs": 2, "samples": 32, "global_batch": 8, "optimizer": "adamw"}  # 4 steps per epoch
WORKERS = 2


def check_ray_train_loop(fn) -> list[str]:
    """Run ``fn`` as ``train_loop_per_worker`` of a 2-worker ``TorchTrainer``; problems found (empty = ok)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    own_session = not ray.is_initialized()
    ray_train.start(num_cpus=WORKERS)
    storage = tempfile.mkdtemp(prefix="ch07_check_")
    try:
        use_gpu = ray_train.auto_use_gpu(WORKERS)
        ray_train.check_resources(
            WORKERS, use_gpu=use_gpu
        )  # a clear error instead of a pending hang
        trainer = TorchTrainer(
            fn,
            train_loop_config=dict(CONFIG),
            scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=use_gpu),
            run_config=RunConfig(
                name=f"check-ray-train-loop-{uuid.uuid4().hex[:6]}",
                storage_path=storage,
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        return _compare(trainer.fit())
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        if own_session:
            ray_train.stop()


def _compare(result) -> list[str]:
    last = CONFIG["epochs"] - 1
    if result.checkpoint is None:
        return [
            "fit() ended without a checkpoint: after every epoch, rank 0 must pass checkpoint="
            "Checkpoint.from_directory(d) (with model.pt in d) to ray.train.report"
        ]
    with result.checkpoint.as_directory() as d:
        files = sorted(os.listdir(d))
        if "model.pt" not in files:
            return [
                f"the last checkpoint holds {files}, not model.pt: on rank 0, torch.save(model.module."
                "state_dict(), os.path.join(d, 'model.pt')) before Checkpoint.from_directory(d)"
            ]
        state = torch.load(os.path.join(d, "model.pt"), map_location="cpu", weights_only=True)
    state = {
        k.removeprefix("module."): v for k, v in state.items()
    }  # DDP's own state_dict is accepted too
    problems = []
    metrics = result.metrics or {}
    if metrics.get("epoch") != last or "loss" not in metrics:
        problems.append(
            f"the last report with a checkpoint has metrics {metrics}: report {{'epoch': epoch, "
            f"'loss': loss}} after every epoch (the last one is epoch {last})"
        )
    reference = reference_params(dict(CONFIG), world=WORKERS)
    wrong = sorted(
        k for k in reference if k not in state or tuple(state[k].shape) != tuple(reference[k].shape)
    )
    if wrong:
        return problems + [
            f"model.pt does not hold the GPT's parameters ({wrong[:3]} missing or of another "
            "shape): save the (unwrapped) model's state_dict()"
        ]
    tol = for_optimizer(CONFIG["optimizer"])
    err, key = max(
        ((state[k].float() - reference[k].float()).abs().max().item(), k) for k in reference
    )
    if not tol.ok({k: state[k].float() for k in reference}, reference):
        problems.append(
            f"the checkpointed weights differ from one device trained on the same global batches by "
            f"max |Δ| = {err:.3g} (in {key}), beyond {tol}: does every worker train on its own shard "
            f"(prepare_data_loader) with the per-worker batch global_batch // world_size, do the "
            f"gradients get averaged (prepare_model), and is set_epoch(epoch) called every epoch?"
        )
    return problems
