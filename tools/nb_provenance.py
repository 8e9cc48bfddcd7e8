"""Provenance of a stored notebook: is the machine quiet, what did the notebook read, is it stale?

Used by ``tools/build_notebooks.py`` (the one executor) and ``tests/test_notebooks_fresh.py``.

* :func:`wait_until_quiet` -- before each notebook: no other test / notebook run alive (a
  process whose argv contains one of :data:`BUSY_PATTERNS`, outside this process's own tree),
  the CPUs idle now (at most :data:`MAX_CPU_USE` of all cores busy over the last 2 s, from
  ``/proc/stat``), and, before a build's first notebook, the 1-minute load average at most
  ``max_load`` (default :data:`LOAD_PER_CORE` x cores). Between notebooks of one build the load
  average still holds the previous notebook's own work (it decays over minutes), so there the
  CPU use now is the test. It polls up to ``wait_s``, then raises :class:`Busy` naming the load,
  the CPU use and every busy PID with its command line.
* :func:`module_closure` -- the ``course_lib`` modules a run may execute: those the kernel loaded,
  closed over every static import (``ast``; imports inside functions too) and every
  ``"course_lib.x:fn"``-style string, because rank processes (spawn, Ray workers) may import
  more than the kernel did.
* :func:`data_files` -- the files the code reads as data: the quiz bank when ``course_lib.quiz``
  runs, ``exercises/`` and ``solutions/`` when ``course_lib.check`` does.
* :func:`hashes` / :func:`stale_reasons` -- sha256 of the source (its opener's runtime line left
  out: every build rewrites that line), of each module and of each data file, then and now.
* :func:`ledger` -- the generated runtime table of ``docs/runtimes.md``.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("course_lib", "exercises", "solutions")  # code a notebook runs from this checkout

# The opener's runtime line: the first line of a notebook's first markdown cell that starts with
# MARKER. The executor rewrites it after every build; the source hash leaves it out.
MARKER = "**Stored build:**"

# Quiet = the 1-minute load at most LOAD_PER_CORE per core (0.5 on 2 cores). An idle machine sits
# at 0.0-0.2; one CPU-bound process drives the load to 1.0 (63 % of the way after one minute), so
# 0.5 means nothing has competed for a core for most of the last minute. A 2-rank notebook at
# load ~2 decays below 0.5 in 60 s x ln 4 = 83 s after it ends, which is why the load average is
# the test before a build's first notebook only; between notebooks the CPU use now decides.
LOAD_PER_CORE = 0.25
# Quiet now = at most 20 % of all cores' time busy over CPU_SAMPLE_S (an idle 2-core machine shows
# 0-5 %; one process spinning on one core of two shows 50 %).
MAX_CPU_USE = 0.20
CPU_SAMPLE_S = 2.0
BUSY_PATTERNS = ("pytest", "nbval", "ipykernel", "build_notebooks", "raylet")

RUNTIME_LIMIT_S = 120  # each notebook
RAY_RUNTIME_LIMIT_S = 180  # the Ray chapters (Ray's start-up and actors)
COURSE_LIMIT_S = 900  # the whole course


class Busy(RuntimeError):
    """The machine is not quiet enough to store timings: the message says what is busy."""


# --------------------------------------------------------------------------- a quiet machine


def default_max_load(cores: int | None = None) -> float:
    return LOAD_PER_CORE * (cores or os.cpu_count() or 1)


def _processes() -> dict[int, tuple[int, list[str]]]:
    """``{pid: (ppid, argv)}`` of every process /proc shows (kernel threads have no argv)."""
    procs = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = (d / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
        procs[int(d.name)] = (ppid, [a for a in argv if a])
    return procs


def own_tree(procs: dict[int, tuple[int, list[str]]]) -> set[int]:
    """This process, its ancestors (the make or pytest that started it) and its descendants."""
    mine, pid = set(), os.getpid()
    while pid > 0 and pid not in mine:
        mine.add(pid)
        pid = procs.get(pid, (0, []))[0]
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    todo = [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in mine:
                mine.add(child)
                todo.append(child)
    return mine


def busy_processes(patterns=BUSY_PATTERNS) -> list[tuple[int, str]]:
    """``(pid, command line)`` of each process outside our own tree whose argv has a pattern.

    A ``flock LOCK command`` process is skipped: it waits for the lock, or holds it while its child (the
    command itself, listed on its own) runs."""
    procs = _processes()
    mine = own_tree(procs)
    return [
        (pid, " ".join(argv))
        for pid, (_, argv) in sorted(procs.items())
        if pid not in mine
        and argv
        and Path(argv[0]).name != "flock"
        and any(p in a for a in argv for p in patterns)
    ]


def _cpu_times() -> tuple[int, int]:
    """``(busy, total)`` jiffies of all cores since boot, from the first line of /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_use(interval: float = CPU_SAMPLE_S) -> float:
    """The fraction of all cores' time that was busy over the next ``interval`` seconds."""
    busy0, total0 = _cpu_times()
    time.sleep(interval)
    busy1, total1 = _cpu_times()
    return (busy1 - busy0) / max(total1 - total0, 1)


def busy_reasons(
    max_load: float,
    patterns=BUSY_PATTERNS,
    check_load: bool = True,
    max_cpu: float = MAX_CPU_USE,
) -> tuple[float, list[str]]:
    """The 1-minute load now, and why the machine is busy (empty: quiet)."""
    load = os.getloadavg()[0]
    reasons = []
    if check_load and load > max_load:
        reasons.append(f"1-minute load {load:.2f} > {max_load:.2f}")
    use = cpu_use()
    if use > max_cpu:
        reasons.append(f"CPU use {use:.0%} of all cores over {CPU_SAMPLE_S:g} s > {max_cpu:.0%}")
    for pid, cmd in busy_processes(patterns):
        reasons.append(f"pid {pid} is running: {cmd[:200]}")
    return load, reasons


def wait_until_quiet(
    max_load: float,
    wait_s: float,
    patterns=BUSY_PATTERNS,
    poll_s: float = 5.0,
    say=print,
    check_load: bool = True,
    max_cpu: float = MAX_CPU_USE,
) -> float:
    """Return the 1-minute load once the machine is quiet; raise :class:`Busy` after ``wait_s``.

    ``check_load=False`` (between the notebooks of one build) leaves the load average out: it
    still holds the previous notebook's own work; the CPU use now and the processes decide."""
    start = time.monotonic()
    load, reasons = busy_reasons(max_load, patterns, check_load, max_cpu)
    if reasons and wait_s > 0:
        say(f"waiting up to {wait_s:.0f} s for a quiet machine: " + "; ".join(reasons))
    while reasons and time.monotonic() - start < wait_s:
        time.sleep(poll_s)
        load, reasons = busy_reasons(max_load, patterns, check_load, max_cpu)
    if reasons:
        waited = time.monotonic() - start
        raise Busy(
            f"the machine is busy (after waiting {waited:.0f} s; quiet means no other "
            f"{'/'.join(patterns)} process, CPU use <= {max_cpu:.0%}"
            + (f" and a 1-minute load <= {max_load:.2f}" if check_load else "")
            + "):\n  "
            + "\n  ".join(reasons)
            + "\nstop them or wait; --force builds anyway and records forced=True"
        )
    return load


# --------------------------------------------------------------------------- what a notebook runs

# A module named in a string ("course_lib.checks.ddp:check_x", "course_lib.bench"): resolved later.
_DOTTED = re.compile(r"(?:course_lib|exercises|solutions)(?:\.\w+)+(?::\w+)?")


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file that defines module ``name`` under ``root`` (a package: its ``__init__.py``)."""
    base = root.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _named(tree: ast.AST, package: list[str], root: Path, packages) -> set[str]:
    """Modules of ``packages`` that ``tree`` imports anywhere or names in a string constant."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names}  # kept where a module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _DOTTED.fullmatch(node.value):
                found.add(node.value.split(":")[0])
    out = set()
    for mod in found:
        parts = mod.split(".")
        if parts[0] not in packages:
            continue
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in out if module_file(m, root) is not None}


def static_imports(name: str, root: Path = ROOT, packages=PACKAGES) -> set[str]:
    """Modules of ``packages`` that module ``name`` imports (top level, in functions, in strings)."""
    path = module_file(name, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return _named(tree, package, root, packages)


def source_imports(cells: list[str], root: Path = ROOT, packages=PACKAGES) -> set[str]:
    """The same for a notebook's code cells (a subprocess's ``-m course_lib.x`` included).

    A cell that is not plain Python (IPython magics) is skipped."""
    found = set()
    for cell in cells:
        try:
            found |= _named(ast.parse(cell), [], root, packages)
        except SyntaxError:
            continue
    return found


def module_closure(names, root: Path = ROOT, packages=PACKAGES) -> set[str]:
    """``names`` and everything they import, transitively (only modules that exist under root)."""
    todo = [n for n in names if module_file(n, root) is not None]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += sorted(static_imports(name, root, packages) - seen)
    return seen


def chapter_topic(stem: str) -> str | None:
    """The topic of notebook ``stem`` (``"02_ddp"`` -> ``"ddp"``); None if not a chapter."""
    from course_lib.chapters import CHAPTERS

    return next((c.topic for c in CHAPTERS if c.notebook == stem), None)


def data_files(modules, topic: str | None = None, root: Path = ROOT) -> set[Path]:
    """The data files those modules read: the quiz bank, and the chapter's exercise files."""
    files = set()
    if any(m == "course_lib.quiz" or m.startswith("course_lib.quiz.") for m in modules):
        files |= set((root / "course_lib" / "quiz_bank").glob("*.yaml"))
    for m in modules:  # exercises / solutions modules the kernel (or an import) loaded
        if m.split(".")[0] in ("exercises", "solutions"):
            files.add(module_file(m, root))
    if topic and "course_lib.check" in modules:
        for package in ("exercises", "solutions"):
            path = root / package / f"{topic.replace('-', '_')}.py"
            if path.is_file():
                files.add(path)
    return files


# --------------------------------------------------------------------------- hashes


def runtime_line_index(lines: list[str]) -> int | None:
    """Index of the opener's runtime line in a percent-format source, or None."""
    if not lines or not lines[0].startswith("# %% [markdown]"):
        return None
    for i, line in enumerate(lines[1:], start=1):
        if line.startswith("# %%"):
            return None  # the first markdown cell ended without one
        if line.lstrip("#").lstrip().startswith(MARKER):
            return i
    return None


def with_runtime_line(text: str, words: str) -> str:
    """``text`` with the opener's runtime line saying ``MARKER words`` (unchanged if it has none)."""
    lines = text.split("\n")
    i = runtime_line_index(lines)
    if i is not None:
        lines[i] = f"# {MARKER} {words}"
    return "\n".join(lines)


def source_hash(text: str) -> str:
    """sha256 of a notebook source without its opener's runtime line."""
    lines = text.split("\n")
    i = runtime_line_index(lines)
    if i is not None:
        del lines[i]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path = ROOT, packages=PACKAGES) -> dict[Path, str]:
    """sha256 of every file of ``packages`` (code and data), taken before a run starts."""
    return {
        p: file_hash(p)
        for pkg in packages
        for p in (root / pkg).rglob("*")
        if p.suffix in (".py", ".yaml") and p.is_file()
    }


def hashes(source: str, modules, data, root: Path = ROOT, files: dict | None = None) -> dict:
    """The ``hashes`` record: source text, each ``course_lib`` module, each data file (by path).

    ``files`` (a :func:`snapshot`) gives each file's hash as it was when the run started."""
    files = files or {}

    def digest(path: Path) -> str:
        return files.get(path) or file_hash(path)

    return {
        "source": source_hash(source),
        "modules": {
            m: digest(module_file(m, root)) for m in sorted(modules) if m.startswith("course_lib")
        },
        "data": {str(p.relative_to(root)): digest(p) for p in sorted(data, key=str)},
    }


def _module_name(path: str) -> str:
    """``"exercises/ddp.py"`` -> ``"exercises.ddp"``; a package's ``__init__.py`` -> the package."""
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stale_reasons(record: dict, src: Path, root: Path = ROOT) -> list[str]:
    """What changed since the notebook was built from ``src`` (empty: it is fresh)."""
    then = record["hashes"]
    reasons = []
    if source_hash(src.read_text(encoding="utf-8")) != then["source"]:
        shown = src.relative_to(root) if src.is_relative_to(root) else src
        reasons.append(f"source {shown} changed")
    for name, digest in then["modules"].items():
        path = module_file(name, root)
        if path is None:
            reasons.append(f"module {name} is gone")
        elif file_hash(path) != digest:
            reasons.append(f"module {name} changed ({path.relative_to(root)})")
    names = set(then["modules"]) | {_module_name(p) for p in then["data"] if p.endswith(".py")}
    wanted = {str(p.relative_to(root)) for p in data_files(names, chapter_topic(src.stem), root)}
    for path in sorted(set(then["data"]) | wanted):
        if path not in then["data"]:
            reasons.append(f"data file {path} is new")
        elif not (root / path).is_file():
            reasons.append(f"data file {path} is gone")
        elif file_hash(root / path) != then["data"][path]:
            reasons.append(f"data file {path} changed")
    return reasons


# --------------------------------------------------------------------------- the checkout


def git_commit(root: Path = ROOT) -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    return out.stdout.strip() or None


def git_dirty(root: Path = ROOT) -> bool:
    """Whether tracked files differ from HEAD, other than what builds write.

    Builds write the stored notebooks, docs/runtimes.md and the runtime line of each source."""
    out = subprocess.run(
        ["git", "diff", "HEAD", "--name-only"], cwd=root, capture_output=True, text=True
    ).stdout.split()
    for path in out:
        if path == "docs/runtimes.md" or re.fullmatch(r"notebooks/\d\d_[^/]*\.ipynb", path):
            continue
        if re.fullmatch(r"notebooks/src/\d\d_[^/]*\.py", path) and (root / path).is_file():
            head = subprocess.run(
                ["git", "show", f"HEAD:{path}"], cwd=root, capture_output=True, text=True
            )
            now = (root / path).read_text(encoding="utf-8")
            if head.returncode == 0 and source_hash(head.stdout) == source_hash(now):
                continue
        return True
    return False


# --------------------------------------------------------------------------- the ledger


def runtime_limit(stem: str) -> int:
    return RAY_RUNTIME_LIMIT_S if "_ray_" in stem else RUNTIME_LIMIT_S


LEDGER_BEGIN = "<!-- ledger: generated by tools/build_notebooks.py --ledger; do not edit -->"
LEDGER_END = "<!-- ledger end -->"


def ledger(records: dict[str, dict | None]) -> str:
    """The generated table: ``records`` maps each notebook stem to its provenance (or None)."""
    rows = [
        "| notebook | stored runtime (s) | limit (s) | cores | load before / after | forced | commit |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    total, pending = 0.0, 0
    for stem, rec in sorted(records.items()):
        if rec is None:
            pending += 1
            rows.append(f"| {stem} | pending | {runtime_limit(stem)} | | | | |")
            continue
        total += rec["runtime_s"]
        dirty = " (dirty)" if rec["dirty"] else ""
        rows.append(
            f"| {stem} | {rec['runtime_s']:.1f} | {runtime_limit(stem)} | {rec['cores']} "
            f"| {rec['load_before']:.2f} / {rec['load_after']:.2f} | {rec['forced']} "
            f"| {(rec['commit'] or '?')[:10]}{dirty} |"
        )
    built = f"{total:.1f}" if pending < len(records) else "pending"
    built += f" ({pending} of {len(records)} pending)" if pending else ""
    rows.append(f"| **course** | {built} | {COURSE_LIMIT_S} | | | | |")
    return "\n".join([LEDGER_BEGIN, *rows, LEDGER_END])


def replace_ledger(text: str, table: str) -> str:
    """``text`` (docs/runtimes.md) with its generated block replaced by ``table``."""
    start, end = text.index(LEDGER_BEGIN), text.index(LEDGER_END) + len(LEDGER_END)
    return text[:start] + table + text[end:]


def stored_ledger(text: str) -> str:
    return text[text.index(LEDGER_BEGIN) : text.index(LEDGER_END) + len(LEDGER_END)]
