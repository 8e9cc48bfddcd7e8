"""Chapter 09 checker (parent side): the learner's ``map_batches`` step and trainer, run on real Ray workers.

``check_ray_data_pipeline(fit_with_ray_data)`` runs in the notebook's (or ``course-lib``'s) own process:

1. the learner's ``tokenize_batch`` (from the same file) is compared with the course's tokenisation on a
   small batch — no Ray yet, so an unfinished exercise is reported at once;
2. Parquet files are written into a temporary folder, Ray is started if it is not running (and stopped
   again afterwards, with its temp dir), and ``fit_with_ray_data(folder, train_loop, 2)`` runs the learner's
   ``TorchTrainer``; :func:`train_loop` trains the tiny GPT on ``get_dataset_shard("train")`` and reports what
   each worker saw;
3. every row must reach a worker exactly once, the dataset must contain a ``MapBatches`` step, and the final
   weights must equal one device trained on the correct tokens of the same global batches, within
   ``results.ADAMW`` (the loop's optimizer is AdamW).

Returns a list of failure strings (empty = passed).
"""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile

import numpy as np

from .. import ray_train
from ..experiments import ray_data as E
from ..results import ADAMW

__all__ = ["check_ray_data_pipeline", "train_loop"]

ROWS, FILES, BATCH = 128, 4, 16


def train_loop(config: dict | None = None) -> None:
    """The trainer's ``train_loop_per_worker``: one epoch over the "train" shard with chapter 09's loop."""
    E.data_loop(
        {
            "variants": {"train": {"source": "train"}},
            "batch_size": BATCH,
            "step_sleep": 0.0,
            **(config or {}),
        }
    )


def _compare_tokens(tokenize_batch) -> list[str]:
    texts = np.array(["w05 w17 w06 w18 w07", "w31 w00 w00 w01 w01"], dtype=object)
    batch = {"id": np.array([7, 8], dtype=np.int64), "text": texts}
    want = E.tokenize(batch)
    got = tokenize_batch(batch)
    if not isinstance(got, dict) or any(k not in got for k in ("id", "x", "y")):
        return [
            f"tokenize_batch must return a dict with 'id', 'x' and 'y', got {type(got).__name__} "
            f"{sorted(got) if isinstance(got, dict) else ''}"
        ]
    for key in ("id", "x", "y"):
        g = np.asarray(got[key])
        if g.shape != want[key].shape or not np.array_equal(g, want[key]):
            return [
                f"tokenize_batch: {key!r} is {g.tolist()} (shape {g.shape}), expected {want[key].tolist()} "
                f"for texts {texts.tolist()}"
            ]
    return []


def check_ray_data_pipeline(fn) -> list[str]:
    problems = _compare_tokens(inspect.getmodule(fn).tokenize_batch)
    if problems:
        return problems
    import ray

    folder = tempfile.mkdtemp(prefix="ch08chk_")
    started = not ray.is_initialized()
    try:
        E.write_corpus(folder, rows=ROWS, files=FILES)
        if started:
            for key, value in E.PARQUET_ENV.items():  # one footer-reading actor, not 32
                os.environ.setdefault(key, value)
            ray_train.start(num_cpus=2)
        workers = E.rank_results(fn(folder, train_loop, 2), 2)
        runs = [w["runs"]["train"] for w in workers]
        seen = sorted(i for r in runs for batch in r["ids"] for i in batch)
        if seen != list(range(ROWS)):
            missing, repeated = sorted(set(range(ROWS)) - set(seen)), len(seen) - len(set(seen))
            return [
                f"the workers saw {len(seen)} rows, expected each of the {ROWS} ids once (missing "
                f"{missing[:8]}{'…' if len(missing) > 8 else ''}, {repeated} repeated)"
            ]
        if not any("MapBatches" in r["stats"] for r in runs):
            return [
                "the dataset the workers read has no map_batches step (its stats show no MapBatches operator)"
            ]
        want = E.reference_state(folder, [r["ids"] for r in runs])
    finally:
        if started:
            ray_train.stop()
        shutil.rmtree(folder, ignore_errors=True)
    got = runs[0]["state"]
    for name, ref in want.items():
        if not ADAMW.ok(got[name], ref):
            err = (got[name] - ref).abs().max().item()
            return [
                f"after training on your dataset, {name} differs from one device trained on the correct "
                f"tokens of the same batches by {err:.3g}, beyond {ADAMW}"
            ]
    return []
