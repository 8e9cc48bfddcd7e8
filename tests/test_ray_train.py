"""Chapter 08: Ray Core and Ray Train, on one local Ray session for the whole module.

Each ``TorchTrainer.fit`` starts a worker group (tens of seconds on 2 busy CPUs), so the few fits here each
prove several things: equality with one device, resume after a failure, the callback's reports, and that the
quiet session (``ray_train.start``) lets no Ray log line through to the output while the errors still raise.
"""

import inspect
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from course_lib import ray_train  # noqa: E402
from course_lib.experiments import ray_train as ex  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    r = ray_train.start(num_cpus=2)
    temp_dir = ray_train._state["temp_dir"]
    yield r
    ray_train.stop()
    assert not ray.is_initialized()
    assert not os.path.exists(temp_dir), "the course removes Ray's temp dir after ray.shutdown()"


# What Ray prints into a notebook when it is not quiet (tests/test_notebook_outputs.py reads the stored ones).
RAY_LOG = re.compile(
    r"\((raylet|pid=\d+|RayTrainWorker|TrainController)[^)]*\)|core_worker\.cc|\.cc:\d+:"
)


def _assert_quiet(capfd):
    out, err = capfd.readouterr()
    logs = [line for line in (out + err).splitlines() if RAY_LOG.search(line)]
    assert not logs, "Ray log lines reached the output:\n" + "\n".join(logs[:5])


def _trainer(loop, cfg, callbacks=(), max_failures=0, num_workers=2):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        loop,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=ray_train.auto_use_gpu()),
        run_config=RunConfig(
            **ray_train.run_config_kwargs("test"),
            callbacks=list(callbacks),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )


def test_ray_core_tasks_actor_object_store(local_ray, capfd):
    nap = ray.remote(ex.nap)
    ray.get(
        [nap.remote(0.0) for _ in range(2)]
    )  # start the 2 worker processes (seconds on a busy machine)
    spans = ray.get([ray.remote(ex.nap_span).remote(1.0) for _ in range(4)])
    assert ex.peak_concurrency(spans) == 2, f"4 × 1 s tasks on 2 CPUs: two at a time, got {spans}"
    assert ex.peak_concurrency([(0, 1), (1, 2), (0.5, 3)]) == 2  # touching spans do not overlap

    big = np.arange(2_000_000, dtype=np.float64)
    ref = ray.put(big)
    total, writeable = ray.get(ray.remote(ex.checksum).remote(ref))
    assert total == float(big[:1000].sum()) and writeable is False, (
        "object-store numpy arrays are zero-copy views"
    )

    rng = np.random.default_rng(0)
    X, w_true = rng.normal(size=(64, 3)), np.array([1.0, -2.0, 0.5])
    y = X @ w_true
    ps = ray.remote(ex.ParameterServer).remote(3, lr=0.3)
    grad = ray.remote(ex.shard_gradient)
    shards = [(ray.put(X[i::2]), ray.put(y[i::2])) for i in range(2)]
    for _ in range(60):
        w = ps.get_weights.remote()
        ray.get(ps.apply.remote(*[grad.remote(w, xs, ys) for xs, ys in shards]))
    assert ray.get(ps.apply.remote(np.zeros(3))) == 61, (
        "the actor kept its state (update count) between calls"
    )
    # gradient descent converges (not an equality between two computations: no named tolerance applies)
    assert np.abs(ray.get(ps.get_weights.remote()) - w_true).max() < 1e-3

    # Quiet: a restartable actor with its constructor argument in the object store makes the driver's core
    # worker log an ERROR line to fd 2; a SIGKILLed task makes the raylet push "A worker died ..." to the
    # driver. Neither may reach the output; the task's death still raises.
    class Holder:  # defined here: Ray ships it by value (workers cannot import this test module)
        def __init__(self, array):
            self.n = len(array)

        def size(self):
            return self.n

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    holder = ray.remote(max_restarts=1)(Holder).remote(np.zeros(300_000))
    assert ray.get(holder.size.remote()) == 300_000
    with pytest.raises(ray.exceptions.WorkerCrashedError):
        ray.get(ray.remote(max_retries=0)(die).remote())
    time.sleep(0.5)  # the raylet's notice arrives asynchronously
    _assert_quiet(capfd)


def test_too_many_workers_is_refused_before_a_pending_hang(local_ray):
    with pytest.raises(ValueError, match=r"num_workers=3 .* 3 CPU, but this Ray cluster has 2 CPU"):
        ray_train.check_resources(3)
    with pytest.warns(UserWarning, match="autoscaling"):
        ray_train.check_resources(3, autoscaling=True)
    with pytest.raises(ValueError, match="GPU"):
        ray_train.check_resources(
            2, use_gpu=True
        ) if not ray_train.auto_use_gpu() else ray_train.check_resources(99)
    ray_train.check_resources(2)  # fits: no error


def test_ddp_fit_survives_a_raising_worker_and_equals_one_device(local_ray, tmp_path):
    """A worker raises in epoch 1; Ray restarts the group, it resumes from epoch 0's checkpoint, ends equal."""
    log = ray_train.ReportLog()
    fail = {"rank": 1, "epoch": 1, "step": 1, "how": "raise", "marker": str(tmp_path / "raised")}
    cfg = ex.train_config(fail={**fail, "after_report": log})
    result = _trainer(ex.ddp_loop, cfg, callbacks=[log], max_failures=1).fit()
    assert (tmp_path / "raised").exists(), "the failure was injected"
    ex.equal_to_one_device(result, cfg).assert_passed()  # within for_optimizer("adamw") = ADAMW
    hist = log.history()
    steps = [(h["epoch"], h["step"]) for h in hist if "step" in h]
    assert steps.count((1, 0)) == 2, (
        "epoch 1's first step ran, was lost with the failure, and was redone"
    )
    assert steps[-1] == (2, 2) and len(log.failures()) == 1
    text = log.failures()[0][1]
    assert text == "RuntimeError: injected failure on rank 1 in epoch 1, step 1", text
    assert result.metrics["epoch"] == 2 and result.error is None


def test_fsdp2_dcp_survives_a_killed_worker_and_equals_one_device(local_ray, tmp_path, capfd):
    """FSDP2 on Ray's process group; a worker process is SIGKILLed; DCP shards restore; ends equal."""
    cfg = ex.train_config(
        fail={"rank": 0, "epoch": 1, "step": 2, "how": "kill", "marker": str(tmp_path / "killed")}
    )
    result = _trainer(ex.fsdp_loop, cfg, max_failures=1).fit()
    assert (tmp_path / "killed").exists()
    with result.checkpoint.as_directory() as d:
        shards = sorted(f for f in os.listdir(os.path.join(d, "dcp")) if f.endswith(".distcp"))
    assert len(shards) == 2, f"each worker wrote its own DCP shard: {shards}"
    ex.equal_to_one_device(result, cfg).assert_passed()
    # no "(raylet) A worker died or was killed ..." line (notebook 08, section 7)
    _assert_quiet(capfd)


def _line_of(fn, needle: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if needle in line)


def test_a_raising_training_function_shows_the_worker_traceback(local_ray, tmp_path):
    """No retries left: fit() raises WorkerGroupError whose text ends with the worker's traceback (notebook §9)."""
    from ray.train import TrainingFailedError, WorkerGroupError

    cfg = ex.train_config(
        epochs=1,
        fail={"rank": 1, "epoch": 0, "step": 0, "how": "raise", "marker": str(tmp_path / "raised")},
    )
    with pytest.raises(TrainingFailedError) as info:
        _trainer(ex.ddp_loop, cfg).fit()
    err = info.value
    assert isinstance(err, WorkerGroupError)
    assert {r: (type(e).__name__, str(e)) for r, e in err.worker_failures.items()} == {
        1: ("RuntimeError", "injected failure on rank 1 in epoch 0, step 0")
    }, "only rank 1 failed"
    lines = str(err).splitlines()
    where = ex.__file__
    assert lines[-6:] == [
        "Traceback (most recent call last):",
        f'  File "{where}", line {_line_of(ex.ddp_loop, "fail_once(cfg, rank, epoch, step)")}, in ddp_loop',
        "    fail_once(cfg, rank, epoch, step)",
        f'  File "{where}", line {_line_of(ex.fail_once, "raise RuntimeError")}, in fail_once',
        '    raise RuntimeError(f"injected failure on rank {rank} in epoch {epoch}, step {step}")',
        "RuntimeError: injected failure on rank 1 in epoch 0, step 0",
    ], "\n".join(lines)
    assert lines[:2] == ["Training failed due to worker errors:", "[Rank 1 Error Snippet]:"], lines


def test_a_chapter02_rank_function_runs_unchanged_under_spawn_torchrun_and_ray(local_ray):
    """The README's promise: one rank function, three launchers (Ray creates the process group itself)."""
    from course_lib.experiments.ddp import equality_with_single_device
    from course_lib.launch import spawn

    args = ("torch_ddp", "adamw", 3)
    by_spawn = spawn(equality_with_single_device, 2, args=args, backend="gloo")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "course_lib.launch",
            "course_lib.experiments.ddp:equality_with_single_device",
            "--backend",
            "gloo",
            *[a for v in args for a in ("--arg", repr(v))],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = _trainer(
        ex.rank_function_loop, {"fn": equality_with_single_device, "args": args}
    ).fit()
    by_ray = ex.rank_results(result, 2)
    for r in range(2):
        assert all(by_spawn[r].claims().values()), by_spawn[r]
        assert by_ray[r] == by_spawn[r], f"rank {r}: Ray {by_ray[r]} vs spawn {by_spawn[r]}"
        assert f"rank {r}: {by_spawn[r]!r}" in proc.stdout, proc.stdout
