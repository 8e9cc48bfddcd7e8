"""Ray Data, the few lines around it that a notebook would otherwise repeat: checks, an error wrapper, timing.

The notebooks call the real Ray Data API (``ray.data.read_parquet``, ``Dataset.map_batches``,
``ray.data.ActorPoolStrategy``, ``streaming_split``, ``iter_torch_batches``, ``ray.train.get_dataset_shard``);
this module only adds what Ray Data does not say by itself:

* :func:`known_num_rows` / :func:`check_enough_rows` — a dataset with fewer rows than
  ``num_workers × batch_size`` leaves a worker without a single full batch (Ray Train splits with
  ``equal=True``, so it truncates to a multiple of the workers). We say so *before* ``fit()`` starts
  workers, from a row count known without executing anything (Ray's metadata, or Parquet footers),
  never by running the whole pipeline just to count it;
* :func:`name_batches` — Ray reports a failing ``map_batches`` function with the operator's name
  (``MapBatches(tokenize)``) and the row that broke it is lost; this wrapper adds *which batch*
  (its index, from the first ``id`` in it) and the ids it held;
* :func:`timed` — wraps any batch iterator and yields ``(seconds waited for this batch, batch)``:
  the worker's idle time per step, measured where it happens, inside the training loop;
* :func:`split_ids` — every split of a ``streaming_split`` consumed at once (each in its own thread, as
  Train workers do: a split's epoch starts only when *all* splits ask for it), returning the ids each saw;
* :func:`operator_times` — the per-operator remote wall time from ``Dataset.stats()``' text, to name the
  bottleneck operator.
"""

from __future__ import annotations

import functools
import re
import threading
import time

__all__ = [
    "known_num_rows",
    "parquet_num_rows",
    "check_enough_rows",
    "name_batches",
    "timed",
    "split_ids",
    "operator_times",
    "operator_concurrency",
    "quiet",
    "KEEP_WORKERS",
]

# ``ray.init(_system_config=KEEP_WORKERS)``: keep idle task worker processes alive instead of killing those above
# ``num_cpus`` after 1 s. Ray Data's 0.5-CPU tasks run 4 at a time on 2 CPUs; on a busy 2-core laptop starting a
# worker process takes seconds, and every Ray Data run would pay it again (measured: ~20 s per run at load 15).
# (The raylet's "N PYTHON worker processes have been started" notice, which 0.5-CPU tasks, two Train workers,
# their controller and the dataset coordinator trigger on 2 CPUs, is kept out of the notebook by
# ``ray_train.start(quiet=True)``; Ray still starts at most 2 worker processes at once, its default here.)
KEEP_WORKERS = {
    "num_workers_soft_limit": 8,
    "idle_worker_killing_time_threshold_ms": 600_000,
}


def quiet() -> None:
    """No progress bars and no driver-side log lines from Ray Data (errors still raise): notebook outputs stay
    deterministic. Ray Data's own log file (in the session's ``logs/ray-data``) is unaffected."""
    import logging

    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    logging.getLogger("ray.data").setLevel(logging.CRITICAL)


def known_num_rows(ds) -> int | None:
    """The dataset's row count if Ray knows it *without executing* the pipeline, else None.

    Known up front for ``ray.data.range``/``from_items``/materialized datasets; (``Dataset.count()`` would fall back to
    running every transformation just to count). Uses Ray's metadata-only count, ``Dataset._meta_count()``,
    which never triggers computation. For files, Ray 2.60's Parquet reader does not know the count before
    reading: take it from the files' footers with :func:`parquet_num_rows`.
    """
    return ds._meta_count()


def parquet_num_rows(folder: str) -> int:
    """Rows in a folder of Parquet files, read from their footers only (no data, no Ray)."""
    import os

    import pyarrow.parquet as pq

    files = sorted(f for f in os.listdir(folder) if f.endswith(".parquet"))
    return sum(pq.ParquetFile(os.path.join(folder, f)).metadata.num_rows for f in files)


def check_enough_rows(ds_or_rows, num_workers: int, batch_size: int) -> int | None:
    """Raise ``ValueError`` if there are fewer rows than ``num_workers × batch_size``; returns the row count.

    ``ds_or_rows`` is a row count or a ``Dataset`` (its :func:`known_num_rows`; ``None`` — unknown without
    running it — is returned unchecked). The error says how many rows each worker would get and what to change.
    """
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    rows = ds_or_rows if isinstance(ds_or_rows, int) else known_num_rows(ds_or_rows)
    if rows is not None and rows < num_workers * batch_size:
        raise ValueError(
            f"the dataset has {rows} rows, fewer than num_workers × batch_size = {num_workers} × {batch_size} = "
            f"{num_workers * batch_size}: split equally, each worker gets {rows // num_workers} rows, less than "
            f"one batch of {batch_size}. Use more data, fewer workers or a smaller batch_size"
        )
    return rows


def name_batches(fn, batch_size: int, id_column: str = "id"):
    """Wrap a ``map_batches`` function so that an exception names the batch it happened in.

    The batch index is ``first id // batch_size`` (ids numbered 0, 1, 2, … in file order, batches of
    ``batch_size`` rows); the message keeps the original exception's type and text, and ``functools.wraps``
    keeps the function's name, so Ray's operator is still called ``MapBatches(<name>)``.
    """

    @functools.wraps(fn)
    def wrapped(batch, *args, **kwargs):
        try:
            return fn(batch, *args, **kwargs)
        except Exception as exc:
            ids = batch[id_column] if id_column in batch else None
            where = (
                "a batch without an id column"
                if ids is None or len(ids) == 0
                else (f"batch {int(ids[0]) // batch_size} (ids {int(ids[0])}..{int(ids[-1])})")
            )
            raise RuntimeError(
                f"{fn.__name__} failed on {where}: {type(exc).__name__}: {exc}"
            ) from exc

    return wrapped


def timed(batches):
    """Yield ``(wait_s, batch)``: how long ``next()`` blocked before each batch arrived (the idle time)."""
    iterator = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield time.perf_counter() - t0, batch


def split_ids(
    ds,
    n: int,
    *,
    equal: bool = True,
    batch_size: int = 8,
    epochs: int = 1,
    id_column: str = "id",
    **iter_kwargs,
) -> list[list[list[list[int]]]]:
    """``ids[epoch][split]`` = the batches (lists of ids) split ``split`` of ``ds.streaming_split(n)`` saw.

    The splits are consumed concurrently, one thread each, like ``n`` Train workers (a split's epoch waits
    at a barrier for all of them). ``iter_kwargs`` go to ``iter_batches`` (e.g. ``local_shuffle_buffer_size``);
    ``local_shuffle_seed`` may be a function of the epoch: ``local_shuffle_seed=lambda epoch: 7 + epoch``.
    """
    splits = ds.streaming_split(n, equal=equal)
    out = [[[] for _ in range(n)] for _ in range(epochs)]
    errors = []

    def consume(i):
        try:
            for epoch in range(epochs):
                kw = dict(iter_kwargs)
                if callable(kw.get("local_shuffle_seed")):
                    kw["local_shuffle_seed"] = kw["local_shuffle_seed"](epoch)
                for batch in splits[i].iter_batches(batch_size=batch_size, **kw):
                    out[epoch][i].append([int(v) for v in batch[id_column]])
        except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


_TIME = r"([\d.]+)(us|ms|s)"
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def operator_times(stats_text: str) -> dict[str, float]:
    """``{operator: total remote wall seconds}`` parsed from ``Dataset.stats()``' text (its Operator sections)."""
    times, name = {}, None
    for line in stats_text.splitlines():
        if m := re.match(r"\s*Operator \d+ (.+?): \d+ tasks executed", line):
            name = m.group(1)
        elif name and (m := re.match(rf"\s*\* Remote wall time: .*?{_TIME} total", line)):
            times[name] = float(m.group(1)) * _UNITS[m.group(2)]
            name = None
    return times


def operator_concurrency(stats_text: str) -> dict[str, tuple[float, float]]:
    """``{operator: (wall seconds from its first to its last block, total remote wall seconds of its tasks)}``
    from ``Dataset.stats()``' text. Their ratio is how many of the operator's tasks ran at once on average."""
    spans, name, wall = {}, None, None
    for line in stats_text.splitlines():
        if m := re.match(
            rf"\s*Operator \d+ (.+?): \d+ tasks executed, .*produced in {_TIME}", line
        ):
            name, wall = m.group(1), float(m.group(2)) * _UNITS[m.group(3)]
        elif name and (m := re.match(rf"\s*\* Remote wall time: .*?{_TIME} total", line)):
            spans[name] = (wall, float(m.group(1)) * _UNITS[m.group(2)])
            name = None
    return spans
