"""Exercise checker: run the learner's function on real ranks against the reference behaviour.

``check("ring_all_reduce")`` imports ``exercises.collectives.ring_all_reduce``, runs it
on real gloo/nccl ranks with :func:`course_lib.launch.spawn`, compares every rank's result
with the library collective, and returns a :class:`CheckResult` whose text says which rank,
which tensor and how large the error was. An exercise still raising ``NotImplementedError``
is reported as *unsolved* (with its hint), never as a crash of the checker.

An exercise registered with ``launcher="parent"`` (chapters 08–09: Ray) is checked by calling its runner
here, in the caller's process: the runner starts its own run (a real ``TorchTrainer``) and returns the
problems it found. An exception from that run — Ray wraps a worker's — is reported the same way.

The registry, :data:`EXERCISES`, is data (:mod:`course_lib.quiz.exercises`): each checker is named
``"course_lib.checks.<module>:<function>"`` and imported only when its exercise is checked.
A pass of the learner's own code is recorded in the progress file (:mod:`course_lib.quiz.progress`).
"""

from __future__ import annotations

import importlib
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .quiz.exercises import EXERCISES, Exercise
from .quiz.progress import record_exercise

__all__ = ["check", "CheckResult", "EXERCISES", "Exercise", "worker_error"]


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
        mark = {"passed": "PASS", "failed": "FAIL", "unsolved": "UNSOLVED", "error": "ERROR"}[
            self.status
        ]
        return f"[{mark}] {self.name}: {self.message}"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the sentence, not the dataclass
        p.text(str(self))


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

    cloudpickle.register_pickle_by_value(
        module
    )  # ranks run exactly this code, whatever their sys.path
    if (
        ex.launcher == "parent"
    ):  # Ray pickles with its own copy of cloudpickle (a registry of its own)
        from ray import cloudpickle as ray_cloudpickle

        ray_cloudpickle.register_pickle_by_value(module)
    return getattr(module, ex.function)


def _unsolved(name: str, text: str) -> CheckResult:
    """A stub's ``NotImplementedError``: the status line names the exercise, so its own prefix goes."""
    text = text.strip().removeprefix(f"{name}: ") or "still a TODO"
    return CheckResult(name, "unsolved", f"not implemented yet — {text}")


def check(
    name: str, package: str = "exercises", timeout: float = 120, world_sizes=None
) -> CheckResult:
    """Check exercise ``name`` (from ``exercises/``, or ``package="solutions"``) on real ranks.

    ``timeout`` bounds each ``spawn`` (launcher="spawn"); a launcher="parent" runner bounds its own run.
    ``world_sizes`` (default: the exercise's own, e.g. ``(2, 4)``) picks a subset of them, e.g.
    ``(2,)`` for a quick check; a size the exercise is not defined for is an error.
    """
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}; available: {', '.join(sorted(EXERCISES))}")
    if package not in ("exercises", "solutions"):
        raise ValueError(f"package must be 'exercises' or 'solutions', got {package!r}")
    ex = EXERCISES[name]
    if ex.launcher not in ("spawn", "parent"):
        raise ValueError(
            f"exercise {name!r}: launcher must be 'spawn' or 'parent', got {ex.launcher!r}"
        )
    try:
        fn = _load(package, ex)
    except Exception as exc:  # noqa: BLE001 - a syntax error in the learner's file is a result, not a crash
        return CheckResult(
            name, "error", f"could not import {package}/{ex.module}.py: {type(exc).__name__}: {exc}"
        )
    if ex.launcher == "parent":
        return _recorded(_check_in_parent(name, ex, fn), package)
    from .launch import RankError, RankTimeout, spawn  # torch: imported when a check runs

    sizes = ex.world_sizes if world_sizes is None else tuple(world_sizes)
    unknown = sorted(set(sizes) - set(ex.world_sizes))
    if unknown or not sizes:
        raise ValueError(
            f"exercise {name!r} is checked on world sizes {ex.world_sizes}, not {sizes}"
        )
    runner, details = ex.runner, []
    for world in sizes:
        try:
            per_rank = spawn(runner, world, args=(fn,), timeout=timeout)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                return _unsolved(name, str(err.__cause__ or ""))
            return CheckResult(
                name,
                "error",
                f"world_size={world}: rank {err.rank} raised {err.exc_type}: "
                f"{str(err.__cause__ or err).splitlines()[0]}",
            )
        except RankTimeout as err:
            return CheckResult(
                name,
                "error",
                f"world_size={world}: {str(err).splitlines()[0]} (a send without a matching recv?)",
            )
        problems = [p for rank_problems in per_rank for p in rank_problems]
        if problems:
            return CheckResult(name, "failed", f"world_size={world}: {problems[0]}", problems)
        details.append(world)
    sizes = ", ".join(map(str, details))
    return _recorded(
        CheckResult(name, "passed", f"matches the reference on world sizes {sizes}"), package
    )


def _recorded(result: CheckResult, package: str) -> CheckResult:
    """A pass of the learner's own code (``exercises/``) goes into the progress file: ``course-lib progress``."""
    if result.passed and package == "exercises":
        try:
            record_exercise(result.name)
        except OSError:
            pass  # an unwritable progress file never turns a pass into a failure
    return result


# --------------------------------------------------------------------------- launcher="parent" (e.g. Ray)


def _check_in_parent(name: str, ex: Exercise, fn: Callable) -> CheckResult:
    """Call ``ex.runner(fn)`` here; the runner starts its own run (a Ray ``TorchTrainer``, a Ray Data pipeline)."""
    try:
        problems = list(ex.runner(fn) or [])
    except Exception as exc:  # noqa: BLE001 - the learner's error (Ray wraps a worker's) is a result
        kind, message, where = worker_error(exc)
        if kind == "NotImplementedError":
            return _unsolved(name, message or "")
        return CheckResult(name, "error", f"{kind}: {message}" + (f" ({where})" if where else ""))
    if problems:
        return CheckResult(name, "failed", problems[0], problems)
    return CheckResult(name, "passed", "matches the reference in the checker's real run")


_FRAME = re.compile(
    r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)', re.MULTILINE
)
_NOT_IMPLEMENTED = re.compile(r"^(?:[\w.]*\.)?NotImplementedError: (?P<msg>.*)$", re.MULTILINE)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception inside it: causes, contexts, Ray Train's per-worker failures, Ray's wrappers."""
    seen, todo, out = set(), [exc], []
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        out.append(e)
        todo += [
            e.__cause__,
            e.__context__,
            getattr(e, "cause", None),
            getattr(e, "_base_exc", None),
            getattr(e, "controller_failure", None),
            *dict(getattr(e, "worker_failures", None) or {}).values(),
        ]
    return out


def worker_error(exc: BaseException) -> tuple[str, str, str]:
    """``(type name, first message line, "at <file>, line N, in <function>")`` of the learner's error in ``exc``.

    Ray hands a worker's exception back wrapped (``TrainingFailedError`` / ``WorkerGroupError`` with
    ``worker_failures``, ``RayTaskError(...)``) and keeps the worker's traceback only as text in the
    message: the type is found among the wrapped exceptions (or, failing that, in that text), and the place
    is the innermost frame in ``exercises/`` or ``solutions/`` (else the innermost frame) of that text.
    """
    chain = _chain(exc)
    text = "\n".join([str(e) for e in chain] + traceback.format_exception(exc))
    found = next((e for e in chain if isinstance(e, NotImplementedError)), None)
    if found is not None:
        kind, message = "NotImplementedError", str(found)
    elif (m := _NOT_IMPLEMENTED.search(text)) is not None:
        kind, message = "NotImplementedError", m["msg"]
    else:
        workers = [e for e in chain if e is not exc and not type(e).__module__.startswith("ray.")]
        inner = workers[0] if workers else exc
        kind, message = type(inner).__name__, str(inner)
    kind = kind.removeprefix("RayTaskError(").removesuffix(")")
    frames = list(_FRAME.finditer(text))
    mine = [f for f in frames if re.search(r"[/\\](exercises|solutions)[/\\]", f["path"])] or frames
    where = ""
    if mine:
        f = mine[-1]
        short = "/".join(re.split(r"[/\\]", f["path"])[-2:])
        where = f"at {short}, line {f['line']}, in {f['func']}"
    return kind, (message.strip().splitlines() or [""])[0], where
