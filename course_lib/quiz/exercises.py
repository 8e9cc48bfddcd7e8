"""The exercise registry: data only, read by the checker (:mod:`course_lib.check`) and by progress.

Each exercise names its file (``exercises/<module>.py`` and ``solutions/<module>.py``), the function
or class the learner writes, and its checker as a ``"module:function"`` string. The checker is
imported only when :attr:`Exercise.runner` is read (importing the checkers imports torch and Ray),
so listing exercises or reading progress costs nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .. import chapters as course

__all__ = ["Exercise", "EXERCISES"]


@dataclass(frozen=True)
class Exercise:
    module: str  # file under exercises/ and solutions/; its chapter's topic with '_' for '-'
    function: str
    summary: str
    checker: str  # "course_lib.checks.<module>:<rank function(fn) -> list of failure strings>"
    world_sizes: tuple = (2, 3)
    # "spawn": the checker runs on every rank of ``spawn(world_size)`` for each of ``world_sizes``;
    # "parent": it is called once in the caller's process and starts its own run (e.g. a real Ray
    # ``TorchTrainer``), returning the list of failure strings (empty = ok).
    launcher: str = "spawn"

    @property
    def chapter(self) -> str:
        """The topic of the chapter this exercise belongs to."""
        return course.chapter(self.module.replace("_", "-")).topic

    @property
    def runner(self) -> Callable:
        """The checker function, imported now."""
        module, name = self.checker.split(":")
        return getattr(importlib.import_module(module), name)


def _ex(module: str, function: str, summary: str, checker: str, **kw) -> Exercise:
    return Exercise(module, function, summary, f"course_lib.checks.{module}:{checker}", **kw)


EXERCISES: dict[str, Exercise] = {
    "ring_all_reduce": _ex(
        "collectives",
        "ring_all_reduce",
        "sum a tensor over ranks with send/recv around a ring",
        "check_ring_all_reduce",
    ),
    "count_model_state_bytes": _ex(
        "single_device",
        "count_model_state_bytes",
        "bytes of params, grads and optimizer state over unique storages",
        "check_count_model_state_bytes",
        world_sizes=(1,),
    ),
    "allreduce_gradients": _ex(
        "ddp",
        "allreduce_gradients",
        "average every gradient over ranks after backward (naive DDP)",
        "check_allreduce_gradients",
    ),
    "bucketed_reducer": _ex(
        "ddp",
        "BucketedReducer",
        "async all-reduce of gradient buckets launched during backward",
        "check_bucketed_reducer",
    ),
    "overlapped_ddp": _ex(
        "ddp",
        "OverlappedDDP",
        "overlapped bucketed DDP: equal to one device after 3 AdamW steps, every all-reduce "
        "launched during backward",
        "check_overlapped_ddp",
        world_sizes=(2,),
    ),
    "zero1_step": _ex(
        "zero",
        "Zero1Step",
        "ZeRO-1 step: reduce-scatter gradients, step own shard, all-gather parameters",
        "check_zero1_step",
    ),
    "sharded_linear": _ex(
        "zero",
        "ShardedLinear",
        "ZeRO-3 for one nn.Linear: gather before use, free after, reduce-scatter the weight "
        "gradient",
        "check_sharded_linear",
    ),
    "flat_unit": _ex(
        "fsdp",
        "FlatUnit",
        "one FSDP unit from scratch: a flat sharded buffer, all-gathered for forward and again "
        "for backward, freed in between, its gradient reduce-scattered; 3 AdamW steps == one device",
        "check_flat_unit",
        world_sizes=(2,),
    ),
    "one_f_one_b_schedule": _ex(
        "pipeline",
        "one_f_one_b_schedule",
        "the 1F1B action order of one pipeline stage (compared, then run)",
        "check_one_f_one_b_schedule",
        world_sizes=(2,),
    ),
    "column_parallel_linear": _ex(
        "tensor_parallel",
        "column_parallel_linear",
        "y_i = x W_iᵀ + b_i, all-reduce of ∂L/∂x in backward (f)",
        "check_column_parallel_linear",
        world_sizes=(2, 4),
    ),
    "row_parallel_linear": _ex(
        "tensor_parallel",
        "row_parallel_linear",
        "y = Σ_i x_i W_iᵀ by all-reduce (g), bias once; no backward communication",
        "check_row_parallel_linear",
        world_sizes=(2, 4),
    ),
    "merge": _ex(
        "context_expert_parallel",
        "merge",
        "combine two attention blocks' (out, lse) with the log-sum-exp rule: attention over both",
        "check_merge",
        world_sizes=(2,),
    ),
    "dispatch_splits": _ex(
        "context_expert_parallel",
        "dispatch_splits",
        "rows per destination rank of the MoE dispatch all-to-all (experts sharded contiguously)",
        "check_dispatch_splits",
        world_sizes=(2, 4),
    ),
    "ray_train_loop": _ex(
        "ray_train",
        "ray_train_loop",
        "the plain PyTorch loop as a Ray Train train_loop_per_worker (prepare_model, "
        "prepare_data_loader, set_epoch, report + checkpoint), run in a real TorchTrainer",
        "check_ray_train_loop",
        world_sizes=(2,),
        launcher="parent",
    ),
    "ray_data_pipeline": _ex(
        "ray_data",
        "fit_with_ray_data",
        "a map_batches tokeniser streamed by Ray Data into a TorchTrainer "
        "(datasets=, resources_per_worker)",
        "check_ray_data_pipeline",
        world_sizes=(2,),
        launcher="parent",
    ),
}
