"""``course-lib`` command line: doctor | quiz | exam | progress | check | smoke.

Notebooks are executed by one executor, ``tools/build_notebooks.py`` (``make notebooks``, ``make
course``), which needs the repository's notebook sources; the package has no command of its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path


def doctor() -> int:
    """Print the environment facts the course depends on; exit 1 if ranks cannot run."""
    import torch

    from .launch import hello, resolve_backend, spawn

    ok = True
    try:
        import ray

        ray_version = ray.__version__
    except Exception as exc:  # noqa: BLE001
        ray_version, ok = f"not importable ({exc})", False
    cores = os.cpu_count() or 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = resolve_backend("auto", 2)
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    print(f"python        {sys.version.split()[0]} ({sys.executable})")
    print(f"torch         {torch.__version__}")
    print(f"ray           {ray_version}")
    print(f"cpu cores     {cores}")
    print(f"gpus          {gpus}")
    print(f"backend       {backend} (auto, 2 ranks)")
    if gpus:
        print(
            f"ranks         up to {gpus} on nccl (one GPU each); up to {cores} on gloo without oversubscription"
        )
    else:
        print(
            f"ranks         up to {cores} on gloo without oversubscribing the cores "
            "(more run, but then measure contention)"
        )
    print(f"c++ compiler  {cxx or 'MISSING (DeepSpeed JIT-built ops will be skipped)'}")
    print(f"Python.h      {'present' if header.exists() else 'MISSING'} ({header})")
    t0 = time.perf_counter()
    try:
        res = spawn(hello, 2, timeout=120)
        assert [r["sum_of_ranks"] for r in res] == [1, 1], res
        print(f"spawn         2 ranks, all_reduce ok ({time.perf_counter() - t0:.1f} s)")
    except Exception as exc:  # noqa: BLE001
        print(f"spawn         FAILED: {exc}")
        ok = False
    print("doctor:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="course-lib", description="Hands-On Distributed Training companion CLI"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="check torch/ray, backend, cores, compiler; spawn 2 ranks")
    q = sub.add_parser("quiz", help="O/X quiz in the terminal")
    q.add_argument("--chapter", required=True, help="a topic (ddp) or a notebook number (2)")
    q.add_argument(
        "--lang", choices=["ko", "en"], default=None, help="default: $COURSE_LANG, else English"
    )
    q.add_argument("-n", type=int, default=None, help="number of statements")
    q.add_argument("--shuffle", action="store_true")
    e = sub.add_parser("exam", help="the final O/X exam over all chapters, in the terminal")
    e.add_argument(
        "--lang", choices=["ko", "en"], default=None, help="default: $COURSE_LANG, else English"
    )
    e.add_argument(
        "-n",
        type=int,
        default=40,
        help="number of statements (the 14 seed statements always included)",
    )
    e.add_argument(
        "--seed", type=int, default=0, help="which exam form (same seed, same statements)"
    )
    p = sub.add_parser(
        "progress", help="which chapter quizzes, exercises and the final exam you have done"
    )
    p.add_argument(
        "--lang", choices=["ko", "en"], default=None, help="default: $COURSE_LANG, else English"
    )
    c = sub.add_parser("check", help="check an exercise against its reference on real ranks")
    c.add_argument("name", nargs="?", help="exercise name (omit to list them)")
    c.add_argument("--solutions", action="store_true", help="check the reference solutions instead")
    s = sub.add_parser(
        "smoke", help="run every chapter's rank functions once, small, with backend=auto"
    )
    s.add_argument(
        "--world", type=int, default=None, help="ranks (default: one per GPU, else 2 on CPU)"
    )
    s.add_argument(
        "--chapter",
        action="append",
        help="only these chapters, by topic or number (e.g. --chapter ddp or --chapter 02)",
    )
    ns = parser.parse_args(argv)

    if ns.cmd == "doctor":
        return doctor()
    if ns.cmd == "quiz":
        from .quiz import run_terminal_quiz

        try:
            run_terminal_quiz(ns.chapter, lang=ns.lang, n=ns.n, shuffle=ns.shuffle)
        except ValueError as exc:  # an unknown chapter, or -n out of range
            parser.error(str(exc))
        return 0
    if ns.cmd == "exam":
        from .quiz import run_terminal_exam

        try:
            run_terminal_exam(lang=ns.lang, n=ns.n, seed=ns.seed)
        except ValueError as exc:  # e.g. -n below the 14 seed statements
            parser.error(str(exc))
        return 0
    if ns.cmd == "progress":
        from .quiz import progress_report

        print(progress_report(lang=ns.lang))
        return 0
    if ns.cmd == "check":
        from .quiz import EXERCISES

        if not ns.name:
            for name, ex in EXERCISES.items():
                print(f"{name:<24} {ex.chapter}: {ex.summary}")
            return 0
        from .check import check

        result = check(ns.name, package="solutions" if ns.solutions else "exercises")
        print(result)
        return 0 if result.passed else 1
    if ns.cmd == "smoke":
        from .experiments.smoke import format_smoke, run_smoke

        rows = run_smoke(
            ns.world,
            chapters=ns.chapter,
            progress=lambda r: print(
                f"  {r.chapter} {r.function}: {r.status} ({r.seconds:.1f} s)", flush=True
            ),
        )
        print(format_smoke(rows))
        return 0 if all(r.status != "FAIL" for r in rows) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
