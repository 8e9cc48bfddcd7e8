"""Chapter 09's runs: a Ray Data pipeline (Parquet files → CPU-heavy ``map_batches``) streamed into Ray Train.

Data: :func:`write_corpus` writes the tiny GPT's sequences (chapter 01's counter task) as *text* —
``"w05 w17 w06 …"`` — into Parquet files, with an ``id`` per row; :func:`tokenize` turns a batch of text into
the model's ``x``/``y`` token ids and burns ``cost_ms`` of CPU time per row (what a real tokenizer, image
decoder or augmentation costs). :class:`Tokenizer` is the same step as a callable class (a "tokenizer" loaded
once per actor) for ``compute=ray.data.ActorPoolStrategy(size=n)``.

Training: :func:`data_loop` is the ``train_loop_per_worker``: for each *variant* (a data source, a prefetch
depth, epochs, a shuffle) it trains a fresh tiny GPT, one real (small) step per batch under the shared
modelled accelerator clock (:func:`step_clock`: its forward and backward sleep ``step_sleep`` seconds at a
full batch) — an accelerator step, which leaves the CPU free while the GPU works. It times, inside the loop,
how long each step waited for its batch; each worker's result names the clock (``"clock"``). Sources: a
Ray Data shard (``get_dataset_shard(name).iter_torch_batches``) or a torch ``DataLoader(num_workers=1)``
doing the same tokenisation.

Parent side: :func:`build_dataset`, :func:`fit` (the early checks, then one ``TorchTrainer.fit``),
:func:`overlap_run` (serial = the whole epoch preprocessed, then trained, vs streaming, vs ``prefetch_batches=0``,
vs the ``DataLoader``, in one fit, under the same CPU budget), :func:`floors` (the work's lower bounds),
:func:`summarize` (timing), :func:`reference_state` (one device, the same batches)
and :func:`overlap_result` (the race's correctness as a ``results.Result``: every row once per epoch, equal
pipelines, equal to one device).

The loop is Ray Train's (``train_loop_per_worker`` over dataset shards); each step inside it, and the one-device
reference, is ``course_lib.train.train_step``.
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .. import ray_data, ray_train
from ..clock import BACKWARD_FACTOR, AcceleratorClock
from ..data import counter_sequences
from ..models import GPT
from ..results import ADAMW, EXACT
from ..step_time import part_flops
from .common import Result, make_optimizer, small_config, train_step
from .ray_train import rank_results

__all__ = [
    "write_corpus",
    "read_corpus",
    "tokenize",
    "Tokenizer",
    "build_dataset",
    "build_actor_dataset",
    "FileBatches",
    "step_clock",
    "data_loop",
    "fit",
    "overlap_run",
    "summarize",
    "timelines",
    "floors",
    "RACED",
    "SOURCES",
    "reference_state",
    "overlap_result",
    "format_summary",
    "benchmark",
    "VARIANTS",
    "PARQUET_ENV",
]

VOCAB = {
    f"w{i:02d}": i for i in range(small_config().vocab_size)
}  # the "tokenizer": word -> token id

# ``os.environ.update(PARQUET_ENV)`` before Ray starts (its processes inherit it): Ray 2.60's ``read_parquet``
# reads the files' footers on a pool of 32 new actor processes per run (``RAY_DATA_PARQUET_FOOTER_NUM_ACTORS``),
# seconds of process start-up on 2 cores for a handful of small files; one actor reads them all.
PARQUET_ENV = {"RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": "1"}


# =========================================================================== data


def write_corpus(
    folder: str, rows: int = 512, files: int = 16, seed: int = 0, bad_id: int | None = None
) -> dict:
    """Write ``rows`` sequences as text into ``files`` Parquet files (ids in file order); returns a summary.

    Columns: ``id`` (int64), ``text`` (T+1 words), ``score`` (a float feature for the StandardScaler demo).
    ``bad_id``: that row gets an unknown word, so tokenising it raises (the bad-input demo).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if rows < 1 or files < 1 or rows % files:
        raise ValueError(f"rows={rows} must be a positive multiple of files={files}")
    config = small_config()
    seqs = counter_sequences(
        rows, config.block_size + 1, config.vocab_size, torch.Generator().manual_seed(seed)
    )
    texts = [" ".join(f"w{t:02d}" for t in s) for s in seqs.tolist()]
    if bad_id is not None:
        texts[bad_id] = "w?? " + texts[bad_id].split(" ", 1)[1]
    score = seqs.float().mean(dim=1).numpy() * 0.5 + 3.0
    os.makedirs(folder, exist_ok=True)
    per = rows // files
    for f in range(files):
        sl = slice(f * per, (f + 1) * per)
        table = pa.table(
            {"id": np.arange(rows, dtype=np.int64)[sl], "text": texts[sl], "score": score[sl]}
        )
        pq.write_table(table, os.path.join(folder, f"part-{f:03d}.parquet"))
    return {"folder": folder, "rows": rows, "files": files, "rows_per_file": per}


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (not wall time: on a busy machine it takes longer)."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        for i in range(200):
            x = (x * 31 + i) % 1_000_003


def tokenize(batch: dict, cost_ms: float = 0.0, vocab: dict | None = None) -> dict:
    """``{"id", "text"}`` → ``{"id", "x", "y"}``: words to token ids, x = ids[:-1], y = ids[1:]; CPU cost per row."""
    vocab = VOCAB if vocab is None else vocab
    rows = []
    for text in batch["text"]:
        words = str(text).split()
        unknown = [w for w in words if w not in vocab]
        if unknown:
            raise ValueError(f"unknown word {unknown[0]!r} in {str(text)[:24]!r}…")
        rows.append([vocab[w] for w in words])
    _burn(cost_ms * 1e-3 * len(rows))
    ids = np.asarray(rows, dtype=np.int64).reshape(len(rows), -1)
    return {"id": np.asarray(batch["id"], dtype=np.int64), "x": ids[:, :-1], "y": ids[:, 1:]}


class Tokenizer:
    """:func:`tokenize` as a callable class: ``__init__`` "loads the tokenizer" once per actor (``load_s``).

    Each output row also carries the actor's pid and how many batches that actor had seen, so the notebook
    can count actors and calls; with ``load_log`` (a file path) every ``__init__`` appends its pid there, so
    the loads are counted, not inferred.
    """

    def __init__(self, cost_ms: float = 0.0, load_s: float = 0.2, load_log: str | None = None):
        time.sleep(load_s)  # e.g. reading a vocabulary / model file from disk
        self.vocab, self.cost_ms, self.calls = dict(VOCAB), cost_ms, 0
        if load_log:  # one line per load: the notebook counts them
            with open(load_log, "a") as f:
                f.write(f"{os.getpid()}\n")

    def __call__(self, batch: dict) -> dict:
        self.calls += 1
        out = tokenize(batch, self.cost_ms, self.vocab)
        n = len(out["id"])
        return {**out, "actor_pid": np.full(n, os.getpid()), "actor_call": np.full(n, self.calls)}


def read_corpus(folder: str):
    """The corpus as a Ray ``Dataset`` of one block per Parquet file (``ray.data.from_arrow`` of each file).

    ``ray.data.read_parquet(folder)`` works too, but Ray 2.60's Parquet reader packs small files into blocks
    of up to 128 MiB: this whole corpus would be *one* block, so one ``map_batches`` task would preprocess it
    all — no parallelism, nothing to stream. (Large real files are many blocks.) Blocks from Arrow tables also
    carry their row counts, so the dataset's size is known without running anything.
    """
    import pyarrow.parquet as pq
    import ray.data

    files = sorted(f for f in os.listdir(folder) if f.endswith(".parquet"))
    return ray.data.from_arrow([pq.read_table(os.path.join(folder, f)) for f in files])


# Notebook 09 prints this function's source: it stays as written.
# fmt: off
def build_dataset(folder, cost_ms: float = 4.0, batch_size: int = 16, num_cpus: float = 0.5):
    """``read_corpus(folder).map_batches(tokenize, ...)`` with the course's batch-naming wrapper. Lazy.

    ``folder`` may also be an already-read ``Dataset``."""
    fn = ray_data.name_batches(tokenize, batch_size)
    base = read_corpus(folder) if isinstance(folder, str) else folder
    return base.map_batches(fn, batch_size=batch_size, num_cpus=num_cpus, fn_kwargs={"cost_ms": cost_ms},
                            udf_modifying_row_count=False)
# fmt: on


# Notebook 09 prints this function's source: it stays as written.
# fmt: off
def build_actor_dataset(folder, actors: int = 2, cost_ms: float = 4.0, batch_size: int = 16,
                        num_cpus: float = 0.5, load_log: str | None = None):
    """The same step on an actor pool: ``map_batches(Tokenizer, compute=ActorPoolStrategy(size=actors))``.

    ``max_restarts=0`` goes to the pool's actors: Ray Data restarts a dead pool actor by default, and Ray then
    logs, for every actor, that a restart could fail since its constructor arguments sit in the object store.
    Ray 2.60 takes it only through ``map_batches``' ``**ray_remote_args`` (its own comment says so), which it
    also marks deprecated without a named replacement: that one warning is caught here.
    ``max_tasks_in_flight_per_actor=1``: a batch goes to an idle actor, not into a busy actor's queue.
    """
    import ray.data

    base = read_corpus(folder) if isinstance(folder, str) else folder
    with warnings.catch_warnings():  # Ray 2.60 takes max_restarts only as a (deprecated) extra keyword
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        pool = ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1)
        return base.map_batches(Tokenizer, compute=pool, num_cpus=num_cpus, batch_size=batch_size, max_restarts=0,
                                fn_constructor_kwargs={"cost_ms": cost_ms, "load_log": load_log},
                                udf_modifying_row_count=False)
# fmt: on


class FileBatches(Dataset):
    """The torch baseline: worker ``rank``'s batches of the same files, tokenised in ``__getitem__``.

    Batch k of worker r holds rows ``[(k·world + r)·b, … + b)``; a ``DataLoader(num_workers=1,
    batch_size=None)`` runs ``__getitem__`` in one child process, ahead of the training loop.
    """

    def __init__(self, folder: str, rank: int, world: int, batch_size: int, cost_ms: float):
        import pyarrow.parquet as pq

        table = pq.read_table(folder, columns=["id", "text"])
        self.ids, self.texts = table["id"].to_pylist(), table["text"].to_pylist()
        self.rank, self.world, self.b, self.cost_ms = rank, world, batch_size, cost_ms

    def __len__(self) -> int:
        return len(self.ids) // (self.world * self.b)

    def __getitem__(self, k: int) -> dict:
        lo = (k * self.world + self.rank) * self.b
        out = tokenize(
            {"id": self.ids[lo : lo + self.b], "text": self.texts[lo : lo + self.b]}, self.cost_ms
        )
        return {key: torch.from_numpy(v) for key, v in out.items()}


# =========================================================================== the training loop


# What overlap_run races, in this order, in one fit: name -> variant settings. Two epochs each, the second
# timed: the first starts the pipeline's processes (seconds on a busy laptop, once per run). Serial and
# streaming read the same lazy dataset under the same CPU budget (the trainers hold the same CPUs): serial
# collects the whole epoch's batches first ("collect"), then trains on them.
VARIANTS = {
    "serial": {"source": "streaming", "collect": True, "epochs": 2},  # preprocess all, then train
    "streaming": {"source": "streaming", "epochs": 2},  # streams into the loop (prefetch_batches=1)
    "no_prefetch": {"source": "streaming", "prefetch": 0, "epochs": 2},
    "dataloader": {
        "source": "loader",
        "epochs": 2,
    },  # torch DataLoader(num_workers=1), same tokenisation
}
SOURCES = ("streaming", "materialized")  # the lazy dataset; the driver's materialize() of it


def _batches(v: dict, cfg: dict, rank: int, world: int, epoch: int, shard):
    if v["source"] == "loader":
        data = FileBatches(cfg["folder"], rank, world, cfg["batch_size"], cfg["cost_ms"])
        return DataLoader(data, batch_size=None, num_workers=1)
    kwargs = {}
    if v.get("shuffle_buffer"):
        kwargs = {
            "local_shuffle_buffer_size": v["shuffle_buffer"],
            "local_shuffle_seed": v["seed"] + epoch,
        }
    return shard.iter_torch_batches(
        batch_size=cfg["batch_size"],
        prefetch_batches=v.get("prefetch", 1),
        dtypes=torch.long,
        drop_last=cfg.get("drop_last", False),
        **kwargs,
    )


def step_clock(model: GPT, batch_size: int, step_sleep: float, dev) -> AcceleratorClock:
    """The shared clock at the rate where one training step of ``model`` on a full batch
    (forward + 2× backward, FLOPs counted as the clock counts them) sleeps ``step_sleep`` seconds.

    Forced on any device: ``step_sleep`` is the modelled accelerator step, also beside a GPU."""
    x = torch.zeros(batch_size, model.config.block_size, dtype=torch.long)
    flops = sum(f for *_, f in part_flops(model, x))
    rate = (1 + BACKWARD_FACTOR) * flops / step_sleep
    return AcceleratorClock(rate, device=dev, force=True)


def data_loop(cfg: dict) -> None:
    """``train_loop_per_worker``: each variant trains a fresh GPT from the same init, timed inside the loop.

    Per step it records ``(epoch, t_wait_start, t_batch_ready, t_step_end)`` (seconds since the variant's
    start) and the batch's ids; rank 0 also keeps the final parameters. Every rank's results go into the
    run's checkpoint as ``rank<r>.pkl`` (read back with ``ray_train.rank_results``). Workers never print.
    """
    import pickle
    import tempfile

    import ray.train
    import torch.distributed as dist
    from ray.train import Checkpoint
    from ray.train.torch import get_device, prepare_model

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world, dev = ctx.get_world_rank(), ctx.get_world_size(), get_device()
    out = {"rank": rank, "runs": {}, "clock": "real clock"}
    clock = None
    for name, v in cfg["variants"].items():
        model = GPT(small_config(), seed=0)
        if cfg["step_sleep"] > 0:  # the accelerator's step: the shared clock on the model
            clock = clock or step_clock(model, cfg["batch_size"], cfg["step_sleep"], dev)
            clock.apply(model)
            clock.reset()
            out["clock"] = clock.name
        model = prepare_model(model)
        opt = make_optimizer("adamw", model.parameters())
        if world > 1:
            dist.barrier()  # every variant starts together on all workers
        shard = None if v["source"] == "loader" else ray.train.get_dataset_shard(v["source"])
        steps, ids, t0 = [], [], time.perf_counter()
        for epoch in range(v.get("epochs", 1)):
            batches, collected = _batches(v, cfg, rank, world, epoch, shard), 0.0
            if v.get("collect"):  # serial: the whole epoch preprocessed before the first step
                t_collect = time.perf_counter()
                batches = list(batches)
                collected = time.perf_counter() - t_collect
            for wait, batch in ray_data.timed(batches):
                wait, collected = wait + collected, 0.0  # the first step waited for the collection
                ready = time.perf_counter()
                # a real (tiny) step, whose forward and backward the clock costs as an accelerator's
                train_step(model, opt, batch["x"].to(dev), batch["y"].to(dev))
                steps.append((epoch, ready - wait - t0, ready - t0, time.perf_counter() - t0))
                ids.append(batch["id"].tolist())
        module = model.module if hasattr(model, "module") else model
        out["runs"][name] = {
            "steps": steps,
            "ids": ids,
            "loop_s": time.perf_counter() - t0,
            "slept_s": sum(clock.slept.values()) if clock else 0.0,
            "state": {k: t.detach().cpu() for k, t in module.state_dict().items()}
            if rank == 0
            else None,
            "stats": shard.stats() if shard is not None else "",
        }
        if clock is not None:
            clock.remove()  # the next variant's fresh model gets it
    out["rows"] = {
        name: sum(len(b["id"]) for b in ray.train.get_dataset_shard(name).iter_batches())
        for name in cfg.get("count", ())
    }  # e.g. an unsplit validation set: all of it
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
        ray.train.report({"done": 1}, checkpoint=Checkpoint.from_directory(d))


# =========================================================================== parent side


def fit(
    datasets: dict,
    cfg: dict,
    num_workers: int = 2,
    datasets_to_split="all",
    loop=data_loop,
    rows: dict | None = None,
) -> list[dict]:
    """Check, then run one ``TorchTrainer`` fit; returns each worker's results (index = rank).

    Before any worker starts: the workers must fit in the cluster (``ray_train.check_resources``) and every
    split dataset must hold at least ``num_workers × batch_size`` rows (``ray_data.check_enough_rows``, from
    a row count known without running the pipeline: ``rows[name]``, e.g. from the Parquet footers, or Ray's
    metadata).
    """
    from ray.train import DataConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    per_worker = {"CPU": 0.5}  # leave CPUs for Ray Data's tasks (2-CPU caveat)
    use_gpu = ray_train.auto_use_gpu(num_workers)
    ray_train.check_resources(num_workers, per_worker, use_gpu=use_gpu)
    for name, ds in datasets.items():
        if datasets_to_split == "all" or name in datasets_to_split:
            ray_data.check_enough_rows((rows or {}).get(name, ds), num_workers, cfg["batch_size"])
    trainer = TorchTrainer(
        loop,
        train_loop_config=cfg,
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=datasets_to_split),
        scaling_config=ScalingConfig(
            num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=per_worker
        ),
        run_config=RunConfig(**ray_train.run_config_kwargs("ch09")),
    )
    return rank_results(trainer.fit(), num_workers)


def overlap_run(
    folder: str,
    *,
    cost_ms: float = 4.0,
    step_sleep: float = 0.06,
    batch_size: int = 16,
    num_workers: int = 2,
    variants: dict | None = None,
    extra: dict | None = None,
    unsplit: dict | None = None,
) -> dict:
    """Serial vs streaming (vs ``prefetch_batches=0``, vs ``DataLoader``) in one fit, timed inside the loops.

    Serial and streaming read the same lazy dataset (source ``"streaming"``) with the trainers holding the same
    CPUs; serial collects each epoch before its first step. Source ``"materialized"`` is the driver's
    ``ds.materialize()`` of it (timed: ``materialize_s``, with every CPU free, no trainer running), for
    variants that train on stored blocks. ``extra`` adds variants (e.g. shuffled epochs); ``unsplit`` adds
    datasets that ``DataConfig`` gives *whole* to every worker (each counts its rows).
    Returns ``{"materialize_s", "stats", "workers", "cfg", "floor"}``; ``floor``: the CPU-work lower bounds.
    """
    variants = dict(VARIANTS if variants is None else variants, **(extra or {}))
    build_dataset(
        folder, 0.0, batch_size
    ).materialize()  # warm-up: start Ray's task worker processes
    t0 = time.perf_counter()
    materialized = build_dataset(folder, cost_ms, batch_size).materialize()
    materialize_s = time.perf_counter() - t0
    sources = {v["source"] for v in variants.values()} - {"loader"}
    unknown = sources - set(SOURCES)
    if unknown:
        raise ValueError(f"variant sources must be in {SOURCES} or 'loader', got {sorted(unknown)}")
    datasets = {
        s: materialized if s == "materialized" else build_dataset(folder, cost_ms, batch_size)
        for s in sources
    }
    cfg = {
        "variants": variants,
        "batch_size": batch_size,
        "step_sleep": step_sleep,
        "folder": folder,
        "cost_ms": cost_ms,
        "count": sorted(unsplit or {}),
    }
    workers = fit(
        {**datasets, **(unsplit or {})}, cfg, num_workers, datasets_to_split=sorted(datasets)
    )
    return {
        "materialize_s": materialize_s,
        "stats": materialized.stats(),
        "workers": workers,
        "cfg": cfg,
        "floor": floors(folder, cost_ms, step_sleep, batch_size, num_workers),
    }


def floors(
    folder: str, cost_ms: float, step_sleep: float, batch_size: int, num_workers: int
) -> dict:
    """Lower bounds of one epoch from the work alone: ``preprocess_s`` = rows × ``cost_ms`` of CPU over the map
    tasks that run at once (the CPUs the trainers leave, 0.5 each, and at most this machine's cores), ``train_s``
    = steps × ``step_sleep``. Serial can finish no sooner than their sum, streaming than the larger one."""
    import ray

    rows = ray_data.parquet_num_rows(folder)
    free = ray.cluster_resources().get("CPU", 0.0) - 0.5 * num_workers
    tasks = max(1, min(int(free / 0.5), os.cpu_count() or 1))
    return {
        "cpu_s": rows * cost_ms * 1e-3,
        "tasks": tasks,
        "preprocess_s": rows * cost_ms * 1e-3 / tasks,
        "train_s": rows // (num_workers * batch_size) * step_sleep,
    }


def _last_epoch(steps: list) -> list:
    last = max(s[0] for s in steps)
    return [s for s in steps if s[0] == last]


def summarize(run: dict) -> dict:
    """Per variant, over its *last* epoch: wall time (first wait → last step end over the workers), the time
    waited (mean per step, and the share of the wall time a worker waited), rows/s; the streaming/serial
    ratio; ``clock``: the steps' clock; ``floor``: the run's lower bounds (:func:`floors`)."""
    out = {"clock": run["workers"][0]["clock"], "floor": run.get("floor", {})}
    b = run["cfg"]["batch_size"]
    for name in run["workers"][0]["runs"]:
        per = [_last_epoch(w["runs"][name]["steps"]) for w in run["workers"]]
        wall = max(s[-1][3] for s in per) - min(s[0][1] for s in per)
        waits = [s[2] - s[1] for p in per for s in p]
        out[name] = {
            "wall_s": wall,
            "mean_wait_s": float(np.mean(waits)),
            "median_wait_s": float(np.median(waits)),
            "wait_share": float(np.sum(waits)) / (wall * len(per)),
            "steps": len(per[0]),
            "rows_per_s": sum(len(p) for p in per) * b / wall,
        }
    if "serial" in out and "streaming" in out:
        out["ratio"] = out["streaming"]["wall_s"] / out["serial"]["wall_s"]
    return out


RACED = ("serial", "streaming", "no_prefetch", "dataloader")


def timelines(run: dict, names=RACED) -> tuple[list, list]:
    """Rows for ``viz.gantt`` over each variant's timed (last) epoch: per (variant, worker) the waits (grey)
    and steps (blue), from the variant's first wait (serial's first wait is its whole epoch's preprocessing)."""
    rows, labels = [], []
    for name in names:
        if name not in run["workers"][0]["runs"]:
            continue
        per = [_last_epoch(w["runs"][name]["steps"]) for w in run["workers"]]
        shift = -min(s[0][1] for s in per)
        for w, steps in zip(run["workers"], per, strict=True):
            ev = []
            for _, start, ready, end in steps:
                ev += [
                    ("wait", "", 0, start + shift, ready + shift),
                    ("F", "", 0, ready + shift, end + shift),
                ]
            rows.append(ev)
            labels.append(f"{name} · worker {w['rank']}")
    return rows, labels


def reference_state(folder: str, per_worker_ids: list[list[list[int]]]) -> dict:
    """One device trained on the global batches the workers saw: step k = the union of every worker's k-th batch.

    DDP averages the workers' mean gradients, which equals the global batch's mean gradient when the
    workers' batches are equally large, so the final parameters must match the Train run's.
    """
    import pyarrow.parquet as pq

    table = pq.read_table(folder, columns=["id", "text"])
    text = dict(zip(table["id"].to_pylist(), table["text"].to_pylist(), strict=True))
    model = GPT(small_config(), seed=0)
    opt = make_optimizer("adamw", model.parameters())
    for step in zip(*per_worker_ids, strict=True):
        idx = [i for batch in step for i in batch]
        tok = tokenize({"id": np.asarray(idx), "text": [text[i] for i in idx]})
        train_step(model, opt, torch.from_numpy(tok["x"]), torch.from_numpy(tok["y"]))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def overlap_result(
    run: dict, folder: str, same: tuple = (), reference: str = "streaming"
) -> Result:
    """The race's correctness as rows (its timing is :func:`summarize`'s): every variant saw every row exactly
    once per epoch; each pair in ``same`` (e.g. ``("serial_2ep", "streaming_2ep")``, both shuffled with the
    same seeds) dealt each worker the same batches in the same order and ended with bit-identical weights;
    ``reference`` equals one device on the same global batches (:func:`reference_state`, AdamW).

    Equal batches need ``preserve_order`` (Ray Data's execution option): otherwise blocks may arrive in
    another order in each pipeline.
    """
    workers = sorted(run["workers"], key=lambda w: w["rank"])
    rows = ray_data.parquet_num_rows(folder)
    out = Result(title=f"Ray Data into Ray Train: {len(workers)} workers, {rows} rows")
    for name in workers[0]["runs"]:
        epochs = sorted({s[0] for s in workers[0]["runs"][name]["steps"]})
        seen = [
            sorted(
                i
                for w in workers
                for (e, *_), b in zip(w["runs"][name]["steps"], w["runs"][name]["ids"], strict=True)
                if e == epoch
                for i in b
            )
            for epoch in epochs
        ]
        out.condition(
            f"{name}: rows seen over the workers, per epoch",
            ", ".join(str(len(ids)) for ids in seen),
            all(ids == list(range(rows)) for ids in seen),
            f"each of the {rows} ids exactly once per epoch",
        )
    for a, b in same:
        for w in workers:
            out.condition(
                f"worker {w['rank']}: {a} and {b} deal the same batches (batches compared)",
                len(w["runs"][a]["ids"]),
                w["runs"][a]["ids"] == w["runs"][b]["ids"],
                "same ids, same order",
            )
        out.equal(
            f"{a} vs {b}: final parameters",
            workers[0]["runs"][a]["state"],
            workers[0]["runs"][b]["state"],
            EXACT,
            against=b,
        )
    ids = [w["runs"][reference]["ids"] for w in workers]
    out.equal(
        f"{reference}: final parameters",
        workers[0]["runs"][reference]["state"],
        reference_state(folder, ids),
        ADAMW,
        against="one device, same global batches",
    )
    return out


def format_summary(summary: dict) -> str:
    """The race as text: the lower bounds, then per variant wall time, waits and rows/s, then what the numbers
    say — each sentence chosen from the measurement (which variant is faster, how much of its time it waited)."""
    lines = [f"steps under the {summary['clock']}"] if "clock" in summary else []
    f = summary.get("floor") or {}
    if f:
        lines.append(
            f"lower bounds per epoch: preprocessing {f['cpu_s']:.2f} s of CPU / {f['tasks']} tasks at once = "
            f"{f['preprocess_s']:.2f} s, training {f['train_s']:.2f} s → serial ≥ "
            f"{f['preprocess_s'] + f['train_s']:.2f} s, streaming ≥ {max(f['preprocess_s'], f['train_s']):.2f} s"
        )
    for name in RACED:
        if name in summary:
            s = summary[name]
            lines.append(
                f"{name:>12}: wall {s['wall_s']:5.2f} s | waited {s['wait_share']:4.0%} of it, mean "
                f"{s['mean_wait_s'] * 1e3:4.0f} ms/step, median {s['median_wait_s'] * 1e3:4.0f} ms | "
                f"{s['rows_per_s']:5.0f} rows/s"
            )
    if "ratio" in summary:
        r, st, se = summary["ratio"], summary["streaming"], summary["serial"]
        verdict = "faster than" if r < 1 else "not faster than"
        lines.append(f"streaming / serial wall time {r:.2f}: streaming was {verdict} serial here")
        lines.append(
            f"streaming's workers {'mostly trained' if st['wait_share'] < 0.5 else 'mostly waited'} "
            f"(waited {st['wait_share']:.0%} of the epoch); serial's waited {se['wait_share']:.0%}"
        )
    base = summary.get("streaming", {}).get("wall_s")
    for n in ("no_prefetch", "dataloader"):
        if n in summary and base:
            lines.append(f"{n} / streaming wall time: {summary[n]['wall_s'] / base:.2f}")
    return "\n".join(lines)


def benchmark(
    rows: int = 512, cost_ms: float = 4.0, step_sleep: float = 0.06, batch_size: int = 16
) -> str:
    """``python -m course_lib.bench raydata``: start Ray, write a corpus, race the variants, clean up; the text."""
    import shutil
    import tempfile

    ray_train.start(num_cpus=2, _system_config=ray_data.KEEP_WORKERS)
    ray_data.quiet()
    folder = tempfile.mkdtemp(prefix="ch08bench_")
    try:
        write_corpus(folder, rows=rows, files=16)
        run = overlap_run(folder, cost_ms=cost_ms, step_sleep=step_sleep, batch_size=batch_size)
    finally:
        ray_train.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return (
        f"{rows} rows, tokenising {cost_ms:g} ms CPU/row, step {step_sleep * 1e3:.0f} ms (tiny real step "
        f"costed by the clock), 2 workers × batch {batch_size}, "
        f"driver materialize {run['materialize_s']:.2f} s\n" + format_summary(summarize(run))
    )
