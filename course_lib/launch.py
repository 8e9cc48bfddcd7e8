"""Run one function on N real processes with ``torch.distributed`` initialised.

``spawn(fn, world_size)`` is the course's launcher. Each rank is a fresh Python
process (``multiprocessing`` *spawn*, never *fork*: forking a running Jupyter
kernel that already started torch threads is deadlock-prone). The function and
its arguments travel **by value** with cloudpickle, so a rank function defined in
a notebook cell works too (plain ``mp.spawn`` cannot import ``__main__`` there).

Inside a rank the process group is already initialised (gloo on CPU, nccl with
one GPU per rank); ``device()`` gives the rank's device. Rank functions never
create or destroy the process group themselves, which is what lets the very same
function run under ``torchrun`` (``python -m course_lib.launch module:function``)
and inside a Ray Train worker.

What comes back: each rank's return value, in rank order, serialised to bytes on
the rank before it travels (a tensor passed through a queue by shared memory
breaks when the rank exits first). What goes wrong comes back too: a rank's
exception is re-raised here as :class:`RankError` naming the rank, with the
remote traceback; a rank that hangs is ended at ``timeout``; in every case no
child process outlives the call. Ranks never print to the notebook: their stdout
and stderr go to a per-rank log whose tail is attached to errors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable, Sequence

__all__ = [
    "spawn",
    "device",
    "hello",
    "resolve_backend",
    "RankError",
    "RankTimeout",
    "free_port",
    "gpu_count",
    "write_atomic",
]

DEFAULT_TIMEOUT = 300.0  # seconds for the whole call
_LOG_TAIL = 3000


class RankError(RuntimeError):
    """A rank raised (or died). ``.rank``, ``.exc_type`` (name), ``.remote_traceback``."""

    def __init__(
        self, rank: int, exc_type: str, message: str, remote_traceback: str, log_tail: str = ""
    ):
        self.rank, self.exc_type, self.remote_traceback, self.log_tail = (
            rank,
            exc_type,
            remote_traceback,
            log_tail,
        )
        text = f"rank {rank} raised {exc_type}: {message}\n\n--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        if log_tail.strip():
            text += f"\n--- rank {rank} output (tail) ---\n{log_tail}"
        super().__init__(text)


class RankTimeout(TimeoutError):
    """Ranks did not finish within ``timeout``; ``.ranks`` lists the ones still running."""

    def __init__(self, ranks: Sequence[int], timeout: float, log_tails: dict[int, str]):
        self.ranks = list(ranks)
        text = (
            f"rank(s) {self.ranks} did not finish within timeout={timeout:g}s and were terminated "
            f"(a rank waiting in a collective that another rank never called hangs until then)"
        )
        for r, tail in log_tails.items():
            if tail.strip():
                text += f"\n--- rank {r} output (tail) ---\n{tail}"
        super().__init__(text)


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """Ask the OS for a free TCP port on localhost (never a fixed one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` → nccl when there is one GPU per rank, else gloo."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not one of 'auto', 'gloo', 'nccl'")
    gpus = gpu_count()
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) visible"
        )
    return backend


def device():
    """This rank's device: ``cuda:<local_rank>`` under nccl, else ``cpu``."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        )
    return torch.device("cpu")


def _silence_rank_warnings() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")


# --------------------------------------------------------------------------- the rank side
#
# Ranks are started as ``python -c "...; _rank_entry()"`` subprocesses rather than with
# ``multiprocessing``: a spawn-mode child re-runs the parent's ``__main__`` script (which
# breaks scripts without an ``if __name__ == "__main__"`` guard), and fork is unsafe in a
# kernel. The function arrives by value in a file; the result leaves as bytes in a file.


def _watch_parent(parent_pid: int) -> None:
    """End this rank if the launching process disappears (no orphans, even if the kernel is killed)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def write_atomic(path: str, blob: bytes) -> None:
    """Write ``blob`` to ``path`` so that a reader sees the whole file or none (tmp file + rename)."""
    with open(path + ".tmp", "wb") as f:
        f.write(blob)
    os.replace(path + ".tmp", path)


def _rank_entry() -> None:
    run_dir, rank = os.environ["COURSE_LIB_RUN_DIR"], int(os.environ["RANK"])
    world_size, backend = int(os.environ["WORLD_SIZE"]), os.environ["COURSE_LIB_BACKEND"]
    threading.Thread(
        target=_watch_parent, args=(int(os.environ["COURSE_LIB_PARENT_PID"]),), daemon=True
    ).start()
    _silence_rank_warnings()
    import cloudpickle

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # one thread per rank: N ranks on N cores, no oversubscription
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=float(os.environ["COURSE_LIB_PG_TIMEOUT"])),
            **kwargs,
        )
        with open(os.path.join(run_dir, "payload.pkl"), "rb") as f:
            fn, args, kw = cloudpickle.load(f)
        out = fn(*args, **kw)
        blob = cloudpickle.dumps(out)  # serialise on the rank, before anything exits
        dist.barrier()
        dist.destroy_process_group()
        write_atomic(os.path.join(run_dir, f"rank{rank}.ok"), blob)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        tb = traceback.format_exc()
        try:
            exc_blob = cloudpickle.dumps(exc)
        except Exception:  # noqa: BLE001
            exc_blob = None
        write_atomic(
            os.path.join(run_dir, f"rank{rank}.err"),
            pickle.dumps((type(exc).__name__, str(exc), tb, exc_blob)),
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# --------------------------------------------------------------------------- the parent side


def _kill_tree(procs) -> None:
    """Terminate each rank and anything it started; wait until they are gone."""
    import psutil

    victims = []
    for p in procs:
        try:
            parent = psutil.Process(p.pid)
            victims += parent.children(recursive=True) + [parent]
        except psutil.NoSuchProcess:
            pass
    for v in victims:
        try:
            v.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(victims, timeout=3)
    for v in alive:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=3)
    for p in procs:
        try:
            p.wait(timeout=1)
        except Exception:  # noqa: BLE001
            pass


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-_LOG_TAIL:]
    except OSError:
        return ""


def _raise_first_failure(procs, ok: list[str], err: list[str], logs: list[str]) -> None:
    """Raise the failure that caused the others.

    A rank that died without a word (segfault, ``os._exit``, OOM kill) comes first: its
    peers' "connection reset" errors are echoes of it. Otherwise the earliest exception.
    """
    for r, p in enumerate(procs):
        if p.poll() is not None and not os.path.exists(ok[r]) and not os.path.exists(err[r]):
            raise RankError(
                r, "ProcessDied", f"exit code {p.returncode} without a result", "", _tail(logs[r])
            )
    _, r = min((os.stat(e).st_mtime_ns, r) for r, e in enumerate(err) if os.path.exists(e))
    with open(err[r], "rb") as f:
        name, msg, tb, exc_blob = pickle.load(f)
    cause = None
    if exc_blob is not None:
        try:
            cause = pickle.loads(exc_blob)
        except Exception:  # noqa: BLE001
            cause = None
    raise RankError(r, name, msg, tb, _tail(logs[r])) from cause


def spawn(
    fn: Callable,
    world_size: int = 2,
    *,
    args: Sequence = (),
    kwargs: dict | None = None,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return ``[result_rank0, result_rank1, ...]``.

    Raises :class:`RankError` if a rank raises or dies (the first failure, with its
    remote traceback), :class:`RankTimeout` if ranks are still running after
    ``timeout`` seconds. Either way every rank process is gone when this returns.
    """
    import subprocess

    import cloudpickle

    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    backend = resolve_backend(backend, world_size)
    try:
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:  # noqa: BLE001
        raise TypeError(
            f"the function or its arguments cannot be sent to a rank (cloudpickle failed: {exc}); "
            "pass picklable values (tensors, numbers, configs), not open files, locks or processes"
        ) from exc

    run_dir = tempfile.mkdtemp(prefix="course_lib_run_")
    write_atomic(os.path.join(run_dir, "payload.pkl"), payload)
    port = free_port()
    path = os.pathsep.join([p or os.getcwd() for p in sys.path])
    base_env = dict(
        os.environ,
        PYTHONPATH=path,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        COURSE_LIB_RUN_DIR=run_dir,
        COURSE_LIB_BACKEND=backend,
        COURSE_LIB_PG_TIMEOUT=str(timeout),
        COURSE_LIB_PARENT_PID=str(os.getpid()),
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    logs = [os.path.join(run_dir, f"rank{r}.log") for r in range(world_size)]
    procs: list = []
    try:
        for r in range(world_size):
            with open(logs[r], "wb") as log:  # ranks never print into the notebook
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            "from course_lib.launch import _rank_entry; _rank_entry()",
                        ],
                        env=dict(base_env, RANK=str(r), LOCAL_RANK=str(r)),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=os.getcwd(),
                    )
                )
        deadline = time.monotonic() + timeout
        ok = [os.path.join(run_dir, f"rank{r}.ok") for r in range(world_size)]
        err = [os.path.join(run_dir, f"rank{r}.err") for r in range(world_size)]
        while not all(os.path.exists(f) for f in ok):
            failed = [
                r
                for r in range(world_size)
                if os.path.exists(err[r])
                or (procs[r].poll() is not None and not os.path.exists(ok[r]))
            ]
            if failed:
                time.sleep(
                    0.3
                )  # let the other ranks' echoes and last writes land, then name the cause
                _raise_first_failure(procs, ok, err, logs)
            if time.monotonic() > deadline:
                running = [r for r in range(world_size) if not os.path.exists(ok[r])]
                raise RankTimeout(running, timeout, {r: _tail(logs[r]) for r in running})
            time.sleep(0.02)
        for p in procs:
            p.wait(timeout=30)
        results = []
        for r in range(world_size):
            with open(os.path.join(run_dir, f"rank{r}.ok"), "rb") as f:
                results.append(cloudpickle.loads(f.read()))
        return results
    finally:
        _kill_tree(procs)
        shutil.rmtree(run_dir, ignore_errors=True)


def hello() -> dict:
    """A minimal rank function: who am I, where, on which backend (used by ``course-lib doctor``)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())], device=device())
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "device": str(device()),
        "sum_of_ranks": int(t.item()),
    }


# --------------------------------------------------------------------------- torchrun entry point


def _load(target: str) -> Callable:
    if ":" not in target:
        raise SystemExit(f"expected module:function, got {target!r}")
    mod, _, name = target.partition(":")
    return getattr(importlib.import_module(mod), name)


def main(argv: Sequence[str] | None = None) -> None:
    """``torchrun --nproc-per-node 2 -m course_lib.launch pkg.module:function [--arg VALUE ...]``.

    Uses the env:// rendezvous that torchrun (single- or multi-node) provides,
    initialises the process group, runs the function and prints every rank's
    return value from rank 0.
    """
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(prog="python -m course_lib.launch", description=main.__doc__)
    parser.add_argument("target", help="module:function to run on every rank")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    parser.add_argument(
        "--arg", action="append", default=[], help="positional argument (Python literal)"
    )
    ns = parser.parse_args(argv)
    import ast

    args = [ast.literal_eval(a) for a in ns.arg]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    backend = ns.backend
    if backend == "auto":
        backend = "nccl" if gpu_count() >= local_world else "gloo"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    kwargs = {}
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, timeout=timedelta(seconds=ns.timeout), **kwargs)
    try:
        result = _load(ns.target)(*args)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            for r, value in enumerate(gathered):
                print(f"rank {r}: {value!r}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Success: leave without the interpreter's teardown. After destroy_process_group a C++
    # thread (gloo's or the store's) can still be joinable while static objects are destroyed,
    # and std::terminate then aborts a rank that finished its work ("terminate called without an
    # active exception", exit code -6 under torchrun, seen on a busy machine). Output is flushed
    # first; a failure never gets here (the exception exits with its traceback and code 1).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Older names, kept until every caller uses the public ones.
_gpu_count, _write_atomic = gpu_count, write_atomic
