"""Ray, the few lines around it that keep a notebook short: start, name runs, check resources, clean up.

The notebooks call the real Ray API (``@ray.remote``, ``ray.get``, ``TorchTrainer``, ``ScalingConfig``,
``ray.train.report``); this module only does what every Ray cell would otherwise repeat:

* :func:`start` — ``ray.init`` of a **local, single-machine** cluster (it never joins another one), with the
  settings this course needs on a laptop: ``num_cpus`` fixed (a known-size local cluster), **quiet**
  (:data:`QUIET_ENV` and below: no Ray log line reaches a notebook cell; errors still raise), no dashboard,
  and a *short* temp dir of its
  own (Ray puts Unix sockets there, and rejects socket paths longer than 107 bytes). Note: Ray's internal gRPC
  servers listen on all interfaces and Ray maps 127.0.0.1 to the machine's address on purpose (so other nodes
  could join); on an untrusted network keep the machine's firewall closed to incoming connections;
* :func:`run_config_kwargs` — a fresh ``RunConfig(name=..., storage_path=...)`` per run: a reused name
  silently *resumes* the old run from its last checkpoint;
* :func:`check_resources` — Ray waits forever for resources it does not have; on a fixed-size local
  cluster we say which one is missing *before* ``fit()`` hangs (on an autoscaling cluster: a warning);
* :func:`stop` — ``ray.shutdown()`` and remove the temp dir (Ray leaves its session dirs behind);
* :class:`ReportLog` — a ``ray.train.UserCallback`` that keeps *every* ``ray.train.report`` (Train v2's
  ``Result.metrics_dataframe`` keeps only those reported with a checkpoint) and drives a progress line.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import uuid
import warnings

__all__ = [
    "ENV",
    "QUIET_ENV",
    "start",
    "stop",
    "run_config_kwargs",
    "check_resources",
    "ReportLog",
    "auto_use_gpu",
]

# Environment for the driver and (through runtime_env) every Ray worker.
ENV = {
    "RAY_AUTH_MODE": "disabled",  # local cluster, nothing to authenticate against
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # no cloud preemption on a laptop
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",  # notice a dead worker within a fraction of a second
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "240",  # 60 s by default: too short for worker start-up on a busy laptop
    "RAY_TRAIN_V2_ENABLED": "1",  # Train v2 (the default in 2.60; v1 hangs on 2 CPUs here)
    "RAY_DEDUP_LOGS": "0",
    "OMP_NUM_THREADS": "1",  # one thread per worker: 2 workers × 2 threads on 2 cores is slow
    "PYTHONWARNINGS": "ignore",
}

# Ray's logs, silenced at their source (start(quiet=True)). Three paths reach a notebook cell:
# 1. workers' stdout/stderr, forwarded to the driver: ray.init(log_to_driver=False);
# 2. messages the raylet *pushes* to the driver ("(raylet) A worker died or was killed ...", "(raylet) WARNING:
#    N PYTHON worker processes have been started ..."): the driver's error-listener thread prints them through
#    ray._private.worker.print_worker_logs, which Ray's own switch _worker_logs_enabled turns off (ray.util.rpdb
#    flips it while a debugger is attached). They are notices: the error itself still raises (ray.get, fit());
# 3. the driver's C++ core worker writes ERROR lines ("[... E ...] core_worker.cc:...") to fd 2, which Jupyter
#    shows as a cell's stderr: RAY_BACKEND_LOG_LEVEL=fatal (Ray's C++ processes log fatal errors only).
# Python-side: logging_level="ERROR" for the "ray" loggers, warnings filtered.
QUIET_ENV = {"RAY_BACKEND_LOG_LEVEL": "fatal"}
# The one line RAY_BACKEND_LOG_LEVEL itself makes the driver print (before its logger exists) while ray.init runs.
_LEVEL_NOTE = "Set ray log level from environment variable RAY_BACKEND_LOG_LEVEL"

_state: dict = {}


def auto_use_gpu(num_workers: int = 2) -> bool:
    """``use_gpu`` for ``ScalingConfig``: True when this machine has a CUDA GPU per worker, else False (gloo on CPU).

    (With fewer GPUs than workers, ``use_gpu=True`` would leave workers pending forever on a local cluster.)
    """
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= num_workers


def start(num_cpus: int = 2, quiet: bool = True, **init_kwargs):
    """``ray.init`` a local, localhost-only Ray with ``num_cpus`` logical CPUs; returns the ``ray`` module.

    ``quiet`` (the default): no Ray log line reaches the notebook — worker output stays in Ray's files, the
    raylet's pushed notices are not printed, Ray's C++ logs only fatal errors (:data:`QUIET_ENV`); exceptions
    raise as always. ``quiet=False`` keeps Ray's own defaults (for debugging). Idempotent: a second call while
    this course's Ray runs returns it unchanged.
    """
    os.environ.update(ENV)
    for key, value in QUIET_ENV.items():
        if quiet:
            os.environ[key] = value
        elif os.environ.get(key) == value:
            del os.environ[key]  # Ray's default level again
    import ray

    if ray.is_initialized():
        return ray
    if not isinstance(num_cpus, int) or num_cpus < 1:
        raise ValueError(f"num_cpus must be an integer >= 1, got {num_cpus!r}")
    warnings.filterwarnings("ignore", module="ray")
    _worker_module()._worker_logs_enabled = not quiet  # the raylet's notices (see QUIET_ENV)
    for attempt in range(3):
        temp_dir = tempfile.mkdtemp(
            prefix="ray", dir="/tmp"
        )  # short: Ray's socket paths must stay < 108 bytes
        try:
            with _fd2_filtered(os.path.join(temp_dir, "driver-init.err"), quiet):
                ray.init(
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    log_to_driver=not quiet,
                    _temp_dir=temp_dir,
                    configure_logging=True,
                    logging_level="ERROR",
                    runtime_env={"env_vars": dict(ENV)},
                    **init_kwargs,
                )
            break
        except Exception as exc:  # noqa: BLE001
            # On a busy machine Ray's agents can miss the raylet's fixed 15 s start-up wait (ray-project/ray#65983):
            # the node "timed out during startup". A second try usually starts (files are in the page cache).
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    atexit.register(stop)  # a notebook that stops half-way still removes Ray's temp dir at exit
    _state.update(temp_dir=temp_dir, storage=tempfile.mkdtemp(prefix="course_ray_runs_"), runs=0)
    return ray


def _worker_module():
    """Ray's driver module (``ray._private.worker``); its switch ``_worker_logs_enabled`` must exist."""
    from ray._private import worker

    if not hasattr(worker, "_worker_logs_enabled"):
        raise RuntimeError(
            "ray._private.worker._worker_logs_enabled is gone in this Ray version: course_lib.ray_train "
            "cannot keep the raylet's notices out of the notebook (see QUIET_ENV's comment)"
        )
    return worker


@contextlib.contextmanager
def _fd2_filtered(path: str, active: bool):
    """While ray.init runs: fd 2 into ``path``; then every line but RAY_BACKEND_LOG_LEVEL's note goes to stderr."""
    if not active:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "wb") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        with open(path, errors="replace") as f:
            kept = [line for line in f.read().splitlines() if _LEVEL_NOTE not in line]
        if kept:  # anything else Ray wrote (an error while starting) still shows
            print("\n".join(kept), file=sys.stderr)


def stop() -> None:
    """``ray.shutdown()``, then remove Ray's temp dir and this session's run storage."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _worker_module()._worker_logs_enabled = True
    for key in ("temp_dir", "storage"):
        if _state.get(key):
            shutil.rmtree(_state.pop(key), ignore_errors=True)


def run_config_kwargs(prefix: str = "run") -> dict:
    """``dict(name=..., storage_path=...)`` for a *new* ``RunConfig``: a unique name under this session's storage."""
    if "storage" not in _state:
        raise RuntimeError("call course_lib.ray_train.start() first")
    _state["runs"] += 1
    return {
        "name": f"{prefix}-{_state['runs']}-{uuid.uuid4().hex[:6]}",
        "storage_path": _state["storage"],
    }


def check_resources(
    num_workers: int,
    resources_per_worker: dict | None = None,
    use_gpu: bool = False,
    autoscaling: bool = False,
) -> None:
    """Raise (or, on an autoscaling cluster, warn) if ``num_workers`` cannot all be placed.

    Ray does not fail on an impossible request: the workers stay *pending* and ``fit()`` waits forever.
    A Train worker asks for 1 CPU (plus 1 GPU with ``use_gpu``) unless ``resources_per_worker`` says otherwise.
    """
    import ray

    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
    per = dict(resources_per_worker or {})
    per.setdefault("CPU", 1.0)
    if use_gpu:
        per.setdefault("GPU", 1.0)
    have = ray.cluster_resources()
    for resource, amount in per.items():
        need, avail = num_workers * amount, have.get(resource, 0.0)
        if need > avail + 1e-9:
            msg = (
                f"num_workers={num_workers} × {amount:g} {resource} per worker = {need:g} {resource}, but this "
                f"Ray cluster has {avail:g} {resource}: the workers would wait for resources forever. Use fewer "
                f"workers, a smaller resources_per_worker={{'{resource}': ...}}, or a bigger cluster"
            )
            if autoscaling:
                warnings.warn(msg + " (an autoscaling cluster may add nodes)", stacklevel=2)
            else:
                raise ValueError(msg)


def _user_callback_base():
    from ray.train import UserCallback

    return UserCallback


class ReportLog(_user_callback_base()):
    """A ``ray.train.UserCallback`` that keeps every ``ray.train.report`` of a run.

    Train v2 runs its callbacks in the Train *controller*, a Ray actor of its own, not in the notebook's
    process: so the reports go to a tiny Ray **actor** (:class:`_Reports`) that the driver asks with
    :meth:`history`. A restarted run reports again from its checkpoint: the history shows the redone steps.
    """

    def __init__(self):
        import ray

        self._store = ray.remote(num_cpus=0)(_Reports).remote()

    def after_report(self, run_context, metrics, checkpoint):
        self._store.add.remote(dict(metrics[0]), checkpoint is not None)

    def after_exception(self, run_context, worker_exceptions):
        # Ray hands callbacks the worker's exception *without* its traceback (only fit()'s TrainingFailedError
        # carries the traceback text), so keep its type and message.
        self._store.failed.remote(
            {r: f"{type(e).__name__}: {e}" for r, e in worker_exceptions.items()}
        )

    def history(self) -> list[dict]:
        """Rank 0's reported metrics in order, each with ``"checkpoint": bool`` added."""
        import ray

        return ray.get(self._store.get.remote())[0]

    def wait_for_report(self, epoch: int, step: int, timeout: float = 60.0) -> None:
        """Block until the report just before ``(epoch, step)`` has reached this log (or ``timeout`` s).

        A worker that fails on purpose calls it first (``fail_once`` with ``"after_report": log``):
        a crash can lose the reports still in flight to the controller, so a demonstration that
        wants to show the redone step waits for the last one to land. Before step 0 that is the
        previous epoch's checkpoint report.
        """
        import time

        def landed(h: dict) -> bool:
            if step > 0:
                return (h.get("epoch"), h.get("step")) == (epoch, step - 1)
            return h.get("epoch") == epoch - 1 and h["checkpoint"]

        deadline = time.monotonic() + timeout
        while not any(landed(h) for h in self.history()):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the report before (epoch {epoch}, step {step}) did not reach the log "
                    f"in {timeout:g} s"
                )
            time.sleep(0.05)

    def failures(self) -> list[dict]:
        """One ``{rank: "ExceptionType: message"}`` per failure the controller saw."""
        import ray

        return ray.get(self._store.get.remote())[1]

    def fit(self, trainer, total: int | None = None, key: str = "loss", every: float = 0.5):
        """``trainer.fit()`` while one text line shows the reports so far (reported metrics, not worker logs).

        ``fit`` stays in the calling thread (Ray Train installs a SIGINT handler, which only the main
        thread may do); a background thread polls the reports.
        """
        import threading

        done = threading.Event()

        def show():
            shown = 0
            while not done.wait(every):
                hist = self.history()
                if len(hist) > shown:
                    n = shown = len(hist)
                    bar = "#" * int(20 * min(n, total) / total) if total else ""
                    print(
                        f"\rreport {n}{'/' + str(total) if total else ''} [{bar:<20}] "
                        f"{key}={hist[-1].get(key, 0):.4f}",
                        end="",
                        flush=True,
                    )

        thread = threading.Thread(target=show, daemon=True)
        thread.start()
        try:
            return trainer.fit()
        finally:
            done.set()
            thread.join()
            print()


class _Reports:
    """The actor behind :class:`ReportLog`: a list of reports and a list of failures."""

    def __init__(self):
        self.reports, self.failures = [], []

    def add(self, metrics: dict, has_checkpoint: bool) -> None:
        self.reports.append({**metrics, "checkpoint": has_checkpoint})

    def failed(self, ranks: dict) -> None:
        self.failures.append(ranks)

    def get(self):
        return self.reports, self.failures
