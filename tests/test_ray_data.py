"""Chapter 09: Ray Data — splitting, order, shuffles, bad inputs, and streaming into Ray Train (one Ray session).

The driver-side facts use ``streaming_split`` directly (what Ray Train's ``DataConfig`` calls with
``equal=True``); one ``TorchTrainer`` fit then proves them inside Train and races streaming against serial.
"""

import os
import time
import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from course_lib import ray_data, ray_train  # noqa: E402
from course_lib.experiments import ray_data as E  # noqa: E402
from course_lib.results import REORDERED  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    r = ray_train.start(num_cpus=2, _system_config=ray_data.KEEP_WORKERS)
    ray_data.quiet()
    ctx = r.data.DataContext.get_current()
    before = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True  # deterministic block order (and split assignment)
    temp_dir = ray_train._state["temp_dir"]
    yield r
    ctx.execution_options.preserve_order = before
    ray_train.stop()
    assert not ray.is_initialized()
    assert not os.path.exists(temp_dir), "the course removes Ray's temp dir after ray.shutdown()"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return E.write_corpus(str(tmp_path_factory.mktemp("corpus")), rows=256, files=8)


def _flat(batches):
    return [i for b in batches for i in b]


def test_equal_split_drops_rows_mod_workers_and_keeps_a_short_last_batch(local_ray):
    ids = ray_data.split_ids(ray.data.range(101, override_num_blocks=4), 2, batch_size=16)[0]
    assert [len(_flat(s)) for s in ids] == [50, 50], (
        "equal=True truncates 101 rows to 2 × 50: 101 mod 2 dropped"
    )
    assert [len(b) for b in ids[0]] == [16, 16, 16, 2], (
        "50 rows in batches of 16: the last batch is short"
    )
    assert len(set(_flat(ids[0])) | set(_flat(ids[1]))) == 100


def test_each_epoch_covers_every_row_once_with_a_new_reproducible_local_shuffle(local_ray):
    ds = ray.data.range(96, override_num_blocks=6)
    kw = dict(
        batch_size=8,
        epochs=2,
        local_shuffle_buffer_size=32,
        local_shuffle_seed=lambda epoch: 7 + epoch,
    )
    run1, run2 = ray_data.split_ids(ds, 2, **kw), ray_data.split_ids(ds, 2, **kw)
    for epoch in run1:
        assert sorted(_flat(epoch[0]) + _flat(epoch[1])) == list(range(96)), (
            "every row once per epoch"
        )
    assert run1 == run2, (
        "same seeds + preserve_order: identical per-worker id sequences in two runs"
    )
    assert [_flat(s) for s in run1[0]] != [_flat(s) for s in run1[1]], (
        "seed + epoch: a new order every epoch"
    )
    assert [sorted(_flat(s)) for s in run1[0]] == [sorted(_flat(s)) for s in run1[1]], (
        "a local shuffle reorders rows inside each worker's share; the share itself stays"
    )


def test_random_shuffle_with_a_fixed_seed_repeats_the_order_every_epoch(local_ray):
    ds = ray.data.range(64, override_num_blocks=4)
    fixed = ray_data.split_ids(ds.random_shuffle(seed=3), 2, batch_size=8, epochs=2)
    assert fixed[0] == fixed[1], (
        "random_shuffle(seed=s) is re-executed with the same seed each epoch"
    )
    per_epoch = [
        ray_data.split_ids(ds.random_shuffle(seed=3 + e), 2, batch_size=8)[0] for e in range(2)
    ]
    assert per_epoch[0] != per_epoch[1] and per_epoch[0] == fixed[0]
    assert sorted(_flat(per_epoch[1][0]) + _flat(per_epoch[1][1])) == list(range(64))


def test_fewer_rows_than_workers_times_batch_is_refused_before_anything_runs(local_ray, tmp_path):
    small = E.write_corpus(
        str(tmp_path / "small"), rows=24, files=2, bad_id=0
    )  # tokenising it would raise
    ds = E.build_dataset(small["folder"], cost_ms=0.0, batch_size=16)
    assert ray_data.known_num_rows(ds) == 24, (
        "Arrow blocks know their rows; map_batches keeps the count"
    )
    rows = ray_data.parquet_num_rows(small["folder"])
    assert rows == 24, "the Parquet footers know the files' size"
    t0 = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"24 rows, fewer than num_workers × batch_size = 2 × 16 = 32"
    ):
        E.fit(
            {"train": ds},
            {"variants": {"train": {"source": "train"}}, "batch_size": 16, "step_sleep": 0.0},
        )
    with pytest.raises(
        ValueError, match=r"24 rows, fewer than .* = 32: split equally, each worker gets 12 rows"
    ):
        ray_data.check_enough_rows(
            ray.data.range(24).map_batches(lambda b: b, udf_modifying_row_count=False), 2, 16
        )
    assert time.perf_counter() - t0 < 10, (
        "refused from metadata, without running the pipeline or starting workers"
    )
    assert ray_data.check_enough_rows(rows, 2, 12) == 24


def test_a_raising_map_batches_function_names_the_operator_and_the_batch(local_ray, tmp_path):
    bad = E.write_corpus(str(tmp_path / "bad"), rows=64, files=2, bad_id=37)
    t0 = time.perf_counter()
    with pytest.raises(Exception) as info:
        E.build_dataset(bad["folder"], cost_ms=0.0, batch_size=16).materialize()
    text = str(info.value)
    assert "MapBatches(tokenize)" in text, text[-2000:]
    assert "tokenize failed on batch 2 (ids 32..47): ValueError: unknown word 'w??'" in text, text[
        -2000:
    ]
    assert time.perf_counter() - t0 < 120, "fails, does not hang"


def test_actor_pool_loads_the_tokenizer_once_per_actor(local_ray, corpus, capfd):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = E.build_actor_dataset(corpus["folder"], actors=2, cost_ms=0.0).take_all()
    assert not [w for w in caught if "ray_remote_args" in str(w.message)], "no deprecation warning"
    calls = {}
    for r in rows:
        calls[r["actor_pid"]] = max(calls.get(r["actor_pid"], 0), r["actor_call"])
    # ActorPoolStrategy(size=2) starts 2 actors; without wait_for_min_actors_s (notebook 09 sets it) one may
    # start too late to get a batch.
    assert 1 <= len(calls) <= 2, "at most 2 actors, each loading the tokenizer once"
    assert sum(calls.values()) == 256 // 16, "16 batches, each a call on an already-loaded actor"
    assert "max_restarts > 0" not in capfd.readouterr().err, (
        "max_restarts=0: no restart warning per actor"
    )
    plain = E.build_dataset(corpus["folder"], cost_ms=0.0).take_all()
    assert [r["id"] for r in rows] == [r["id"] for r in plain]
    assert all(np.array_equal(a["x"], b["x"]) for a, b in zip(rows, plain, strict=True))


def test_actor_pool_that_waits_for_its_actors_uses_both_and_counts_loads(
    local_ray, corpus, tmp_path
):
    """Notebook 09's demo: wait_for_min_actors_s + one batch in flight per actor → both actors work."""
    ctx = ray.data.DataContext.get_current()
    default, ctx.wait_for_min_actors_s = ctx.wait_for_min_actors_s, 60
    try:
        log = str(tmp_path / "loads.txt")
        rows = E.build_actor_dataset(
            corpus["folder"], actors=2, cost_ms=2.0, load_log=log
        ).take_all()
    finally:
        ctx.wait_for_min_actors_s = default
    calls = {}
    for r in rows:
        calls[r["actor_pid"]] = max(calls.get(r["actor_pid"], 0), r["actor_call"])
    with open(log) as f:
        loads = f.read().split()
    assert len(calls) == 2 and len(loads) == 2, (calls, loads)
    assert sorted(loads) == sorted(str(p) for p in calls), "each load is one of the working actors"
    assert sum(calls.values()) == 256 // 16


def test_standard_scaler_fits_on_train_and_transforms_another_dataset(local_ray, corpus):
    from ray.data.preprocessors import StandardScaler

    train = ray.data.read_parquet(corpus["folder"])
    scaler = StandardScaler(columns=["score"]).fit(train)
    scores = np.array([r["score"] for r in train.take_all()])
    # the same float64 statistics, summed in another order by Ray's aggregation
    REORDERED.assert_close(scaler.stats_["mean(score)"], scores.mean(), "mean")
    REORDERED.assert_close(scaler.stats_["std(score)"], scores.std(), "std")
    out = np.array([r["score"] for r in scaler.transform(train.limit(32)).take_all()])
    REORDERED.assert_close(out, (scores[:32] - scores.mean()) / scores.std(), "transformed scores")


@pytest.fixture(scope="module")
def overlap(local_ray, corpus):
    shuffled = {"epochs": 2, "shuffle_buffer": 32, "seed": 11}
    extra = {
        "serial_2ep": {"source": "materialized", **shuffled},
        "streaming_2ep": {"source": "streaming", **shuffled},
    }
    valid = ray.data.range(40)
    return E.overlap_run(
        corpus["folder"], cost_ms=4.0, step_sleep=0.06, extra=extra, unsplit={"valid": valid}
    )


def test_streaming_and_serial_see_every_row_once_per_epoch_and_end_equal(overlap, corpus):
    """Every variant covers every row once per epoch; the shuffled serial and streaming runs deal the same
    batches and end bit-identical; streaming equals one device (ADAMW); the unsplit set reaches each worker whole."""
    workers = overlap["workers"]
    result = E.overlap_result(overlap, corpus["folder"], same=(("serial_2ep", "streaming_2ep"),))
    claims = result.claims()
    for name in ("serial_2ep", "streaming_2ep", "serial", "streaming", "no_prefetch", "dataloader"):
        assert f"{name}: rows seen over the workers, per epoch" in claims
    assert (
        "serial_2ep vs streaming_2ep: final parameters" in claims
        and "streaming: final parameters" in claims
    )
    result.assert_passed()
    for w in workers:
        first = w["runs"]["streaming_2ep"]["ids"]
        assert first[: len(first) // 2] != first[len(first) // 2 :], (
            "the local shuffle changes every epoch"
        )
    assert [w["rows"]["valid"] for w in workers] == [40, 40], (
        "a dataset left out of datasets_to_split: whole"
    )


def test_streaming_overlaps_preprocessing_and_waits_less(overlap):
    """What a timed test can assert: lower bounds and large effects. Which of serial and streaming is
    quicker end to end is a benchmark's ratio (notebook 09, ``python -m course_lib.bench raydata``),
    not a test: it measured 1.01 (streaming / serial) in one quiet fresh-clone run on 2 cores."""
    s = E.summarize(overlap)
    f = s["floor"]
    assert f["tasks"] == 2 and f["cpu_s"] == pytest.approx(256 * 4e-3), (
        "2 CPUs - 2 workers × 0.5 = 1 CPU: two 0.5-CPU map tasks at once"
    )
    assert s["serial"]["wall_s"] >= f["preprocess_s"] + f["train_s"], (
        "serial preprocesses its whole epoch, then trains: no sooner than both lower bounds together"
    )
    assert s["serial"]["wait_share"] > s["streaming"]["wait_share"], (
        "serial's first step waits for the whole epoch's preprocessing"
    )
    assert s["streaming"]["steps"] == s["serial"]["steps"] == 256 // 32
    assert s["clock"].startswith("modelled accelerator clock"), "the shared clock costs the steps"
    for w in overlap["workers"]:
        for name, r in w["runs"].items():  # every step of both epochs: a full batch, 0.06 s
            assert r["slept_s"] == pytest.approx(len(r["steps"]) * 0.06, rel=1e-6), name
    assert "MapBatches(tokenize)" in overlap["stats"]
    text = E.format_summary(s)
    assert "lower bounds per epoch" in text and "streaming / serial wall time" in text
    rows, labels = E.timelines(overlap)
    assert len(rows) == 2 * len(E.RACED), "every raced variant drawn, one row per worker"
