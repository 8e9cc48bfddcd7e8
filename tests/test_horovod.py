"""Chapter 10: Horovod for real — ``horovodrun -np 2 --gloo`` trains the tiny GPT to the same weights as the
course's DDP, torch DDP and one device; failures and hangs end with a clear error and no process left.

Horovod is built once per machine by ``make horovod`` (``make test`` does it first); the tests that run it
skip, with that command in the message, only where it is not installed. The bad-input and API-table tests
need no Horovod.
"""

import inspect
import os
import time

import psutil
import pytest

from course_lib.experiments import horovod as ex
from course_lib.results import ADAMW, EXACT, SGD

needs_horovod = pytest.mark.skipif(not ex.horovod_available(), reason=ex.BUILD_HINT)


def _processes_mentioning(token: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(token in part for part in (p.info["cmdline"] or [])):
                found.append(f"{p.info['pid']}: {' '.join(p.info['cmdline'])}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@needs_horovod
def test_horovod_course_ddp_torch_ddp_and_one_device_end_equal():
    res = ex.compare_frameworks(steps=5, global_batch=16, optimizer="sgd", world_size=2)
    pairs = {f"{a} vs {b}" for i, a in enumerate(ex.FRAMEWORKS) for b in ex.FRAMEWORKS[i + 1 :]}
    assert set(res.diffs) == pairs | {f"horovod vs {ex.INIT_STEP}"}
    assert res.tolerance is SGD and res.init_step_effect == 0.0, (
        "a zero-gradient step leaves SGD where it was"
    )
    for p in pairs:
        a, b = p.split(" vs ")
        SGD.assert_close(res.states[a], res.states[b], p)
    assert len(res.checks()) == len(res.diffs) + 1
    res.assert_passed()  # every pair within SGD, every run's ranks bit-identical
    for (
        name,
        losses,
    ) in res.losses.items():  # the same global-batch loss, step by step, and it learns
        SGD.assert_close(losses, res.losses["one device"], name)
    assert res.losses["one device"][-1] < res.losses["one device"][0]


@needs_horovod
def test_horovod_adamw_differs_by_broadcast_optimizer_states_zero_gradient_step():
    """hvd.broadcast_optimizer_state steps a fresh AdamW once on zero gradients (weight decay, step count):
    Horovod then misses one device by far more than rounding, and equals one device that took that step."""
    config = ex.small_config()
    hvd = ex.run_horovod(steps=3, global_batch=8, optimizer="adamw", timeout=120)
    plain, _ = ex.one_device(config, 3, 8, "adamw")
    stepped, _ = ex.one_device(config, 3, 8, "adamw", horovod_init_step=True)
    assert not ADAMW.ok(hvd["states"][0], plain), "the zero-gradient step moved AdamW (≈2e-3)"
    ADAMW.assert_close(hvd["states"][0], stepped, "Horovod vs one device after that step")
    EXACT.assert_close(hvd["states"][1], hvd["states"][0], "rank 1 vs rank 0")


@needs_horovod
def test_horovod_worker_that_raises_is_named_and_leaves_no_process():
    t0 = time.monotonic()
    with pytest.raises(ex.HorovodRunError) as info:
        ex.run_horovod(steps=3, fail_rank=1, timeout=120)
    assert info.value.rank == 1 and "failed on purpose" in str(info.value)
    assert "_horovod_train" in info.value.remote_traceback
    assert time.monotonic() - t0 < 100, "a failed worker must not wait for the timeout"
    assert not _processes_mentioning(info.value.run_dir)
    assert not os.path.exists(info.value.run_dir)


@needs_horovod
def test_horovod_hang_ends_at_timeout_and_kills_the_process_tree():
    """Rank 1 sleeps an hour at step 1 (a failing run reaches step 1 in ≈5 s): the run ends at 12 s."""
    t0 = time.monotonic()
    with pytest.raises(ex.HorovodTimeout, match="timeout=12s") as info:
        ex.run_horovod(steps=3, hang_rank=1, timeout=12)
    assert time.monotonic() - t0 < 32, "ended at the timeout, not after the hang"
    leftovers = _processes_mentioning(
        info.value.run_dir
    )  # horovodrun, its middlemen and workers all name it
    assert not leftovers, leftovers
    assert not os.path.exists(info.value.run_dir)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(global_batch=15, world_size=2), "global_batch=15 is not divisible by world_size = 2"),
        (dict(global_batch=16, world_size=3), "not divisible by world_size = 3"),
        (dict(world_size=0), "world_size must be an integer >= 1"),
        (dict(steps=0), "steps must be an integer >= 1"),
        (dict(optimizer="lamb"), "optimizer='lamb' is not one of"),
    ],
    ids=["batch15_world2", "batch16_world3", "world0", "steps0", "unknown_optimizer"],
)
def test_bad_input_is_refused_before_any_process_starts(kwargs, message):
    for fn in (ex.run_horovod, ex.compare_frameworks):
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            fn(**kwargs)


def test_missing_horovodrun_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))  # a venv without horovodrun
    monkeypatch.setenv("PATH", str(tmp_path))
    assert ex.horovodrun_path() is None and not ex.horovod_available()
    with pytest.raises(ex.HorovodNotAvailable, match="make horovod"):
        ex.run_horovod()


def test_api_table_names_real_deepspeed_keys_and_course_apis():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from course_lib import ddp, zero, zero3

    assert all(len(row) == len(ex.API_COLUMNS) for row in ex.API_TABLE)
    ds = {row[0]: row[4] for row in ex.API_TABLE}
    for stage in (1, 2, 3):
        assert any(f"stage: {stage}" in cell for cell in ds.values())
        DeepSpeedZeroConfig(
            stage=stage, offload_optimizer={"device": "cpu"}
        )  # valid at every stage
    cfg = DeepSpeedZeroConfig(
        stage=3,
        offload_param={"device": "cpu"},
        reduce_bucket_size=1000,
        allgather_bucket_size=1000,
    )
    assert cfg.offload_param.device == "cpu"
    assert {"comm_hook", "bucket_cap_mb"} <= set(
        inspect.signature(ddp.DDP).parameters
    ) and ddp.DDP.no_sync
    assert "stage" in inspect.signature(zero.ZeroOptimizer).parameters and zero3.Zero3
    table = ex.api_table_markdown()
    assert table.count("\n") == len(ex.API_TABLE) + 1 and "retired" in table
    average = {row[0]: row[1] for row in ex.API_TABLE}["average gradients"]
    assert "during backward" in average  # DistributedOptimizer's hooks start the all-reduces


@needs_horovod
def test_api_table_names_real_horovod_apis():
    import horovod
    import horovod.torch as hvd

    assert horovod.__version__ == ex.HOROVOD_VERSION
    for name in (
        "init",
        "rank",
        "size",
        "local_rank",
        "broadcast_parameters",
        "broadcast_optimizer_state",
        "DistributedOptimizer",
        "allreduce",
        "join",
    ):
        assert callable(getattr(hvd, name)), name
    assert hvd.Compression.fp16 and hvd.gloo_built()
    assert {"named_parameters", "compression", "backward_passes_per_step"} <= set(
        inspect.signature(hvd.DistributedOptimizer).parameters
    )


@needs_horovod
def test_ray_refuses_its_horovod_trainer_and_points_to_torch_trainer():
    pytest.importorskip("ray")
    assert "TorchTrainer" in ex.ray_on_horovod()
