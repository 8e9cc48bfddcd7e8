"""Exercise checker: run the learner's function on real ranks against the reference behaviour.

``check("ring_all_reduce")`` imports ``exercises.ch00_collectives.ring_all_reduce``, runs it
on real gloo/nccl ranks with :func:`course_lib.launch.spawn`, compares every rank's result
with the library collective, and returns a :class:`CheckResult` whose text says which rank,
which tensor and how large the error was. An exercise still raising ``NotImplementedError``
is reported as *unsolved* (with its hint), never as a crash of the checker.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .checks import ch00_collectives, ch01_memory, ch02_ddp, ch03_zero, ch04_fsdp, ch05_pipeline
from .checks import ch06_tensor_parallel
from .launch import RankError, RankTimeout, spawn

__all__ = ["check", "CheckResult", "EXERCISES", "Exercise"]


@dataclass
class CheckResult:
    name: str
    status: str  # "passed" | "failed" | "unsolved" | "error"
    message: str
    details: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def __str__(self) -> str:
        mark = {"passed": "PASS", "failed": "FAIL", "unsolved": "UNSOLVED", "error": "ERROR"}[self.status]
        return f"[{mark}] {self.name}: {self.message}"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the sentence, not the dataclass
        p.text(str(self))


@dataclass(frozen=True)
class Exercise:
    module: str  # file under exercises/ and solutions/
    function: str
    summary: str
    runner: Callable  # rank function(fn) -> list of failure strings on this rank (empty = ok), in checks/
    world_sizes: tuple = (2, 3)


# --------------------------------------------------------------------------- the registry
# The rank-side checkers live in ``checks/chNN_<topic>.py``, one module per ``exercises/`` file.

EXERCISES: dict[str, Exercise] = {
    "ring_all_reduce": Exercise("ch00_collectives", "ring_all_reduce",
                                "ch00: sum a tensor over ranks with send/recv around a ring",
                                ch00_collectives.check_ring_all_reduce),
    "count_model_state_bytes": Exercise("ch01_memory", "count_model_state_bytes",
                                        "ch01: bytes of params, grads and optimizer state over unique storages",
                                        ch01_memory.check_count_model_state_bytes, world_sizes=(1,)),
    "allreduce_gradients": Exercise("ch02_ddp", "allreduce_gradients",
                                    "ch02: average every gradient over ranks after backward (naive DDP)",
                                    ch02_ddp.check_allreduce_gradients),
    "bucketed_reducer": Exercise("ch02_ddp", "BucketedReducer",
                                 "ch02: async all-reduce of gradient buckets launched during backward",
                                 ch02_ddp.check_bucketed_reducer),
    "zero1_step": Exercise("ch03_zero", "Zero1Step",
                           "ch03: ZeRO-1 step: reduce-scatter gradients, step own shard, all-gather parameters",
                           ch03_zero.check_zero1_step),
    "sharded_linear": Exercise("ch03_zero", "ShardedLinear",
                               "ch03: ZeRO-3 for one nn.Linear: gather before use, free after, reduce-scatter "
                               "the weight gradient", ch03_zero.check_sharded_linear),
    "fsdp2_wrap_blocks": Exercise("ch04_fsdp", "wrap_blocks",
                                  "ch04: FSDP2 units — fully_shard every block, then the root",
                                  ch04_fsdp.check_fsdp2_wrap_blocks),
    "sharded_checkpoint": Exercise("ch04_fsdp", "ShardedCheckpoint",
                                   "ch04: save and restore FSDP2 model + optimizer shards with DCP",
                                   ch04_fsdp.check_sharded_checkpoint),
    "one_f_one_b_schedule": Exercise("ch05_pipeline", "one_f_one_b_schedule",
                                     "ch05: the 1F1B action order of one pipeline stage (compared, then run)",
                                     ch05_pipeline.check_one_f_one_b_schedule, world_sizes=(2,)),
    "column_parallel_linear": Exercise("ch06_tensor_parallel", "column_parallel_linear",
                                       "ch06: y_i = x W_iᵀ + b_i, all-reduce of ∂L/∂x in backward (f)",
                                       ch06_tensor_parallel.check_column_parallel_linear, world_sizes=(2, 4)),
    "row_parallel_linear": Exercise("ch06_tensor_parallel", "row_parallel_linear",
                                    "ch06: y = Σ_i x_i W_iᵀ by all-reduce (g), bias once; no backward communication",
                                    ch06_tensor_parallel.check_row_parallel_linear, world_sizes=(2, 4)),
}


# --------------------------------------------------------------------------- parent side


def _course_root() -> Path:
    """The folder holding exercises/ and solutions/ (the repository root)."""
    return Path(__file__).resolve().parents[1]


def _load(package: str, ex: Exercise) -> Callable:
    root = str(_course_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    module = importlib.import_module(f"{package}.{ex.module}")
    module = importlib.reload(module)  # pick up the learner's latest edit
    import cloudpickle

    cloudpickle.register_pickle_by_value(module)  # ranks run exactly this code, whatever their sys.path
    return getattr(module, ex.function)


def check(name: str, package: str = "exercises", timeout: float = 120) -> CheckResult:
    """Check exercise ``name`` (from ``exercises/``, or ``package="solutions"``) on real ranks."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; available: {', '.join(sorted(EXERCISES))}")
    if package not in ("exercises", "solutions"):
        raise ValueError(f"package must be 'exercises' or 'solutions', got {package!r}")
    ex = EXERCISES[name]
    try:
        fn = _load(package, ex)
    except Exception as exc:  # noqa: BLE001 - a syntax error in the learner's file is a result, not a crash
        return CheckResult(name, "error", f"could not import {package}/{ex.module}.py: {type(exc).__name__}: {exc}")
    details = []
    for world in ex.world_sizes:
        try:
            per_rank = spawn(ex.runner, world, args=(fn,), timeout=timeout)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                hint = str(err.__cause__ or "").strip() or "still a TODO"
                return CheckResult(name, "unsolved", f"not implemented yet — {hint}")
            return CheckResult(name, "error", f"world_size={world}: rank {err.rank} raised {err.exc_type}: "
                                              f"{str(err.__cause__ or err).splitlines()[0]}")
        except RankTimeout as err:
            return CheckResult(name, "error", f"world_size={world}: {str(err).splitlines()[0]} "
                                              "(a send without a matching recv?)")
        problems = [p for rank_problems in per_rank for p in rank_problems]
        if problems:
            return CheckResult(name, "failed", f"world_size={world}: {problems[0]}", problems)
        details.append(world)
    return CheckResult(name, "passed", f"matches the reference on world sizes {', '.join(map(str, details))}")
