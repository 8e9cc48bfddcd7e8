"""A learner's progress, in one file: chapter quizzes, exercises that passed ``check()``, the exam.

``$COURSE_LIB_HOME/progress.json`` (default ``~/.cache/course_lib``) holds three sections::

    {"quiz": {"ddp": {"last": {"score": 15, "total": 17}, "best": {...}, "attempts": 2}},
     "exam": {"last": {"score": 30, "total": 40, "seed": 0}, "best": {...}, "attempts": 1},
     "exercises": {"ring_all_reduce": {"passed": true, "passes": 1}}}

Quiz records are keyed by chapter topic. Files written before chapters had topics key them by
number (``"ch02"``); :func:`progress` reads those as their topic: nothing a learner saved is lost.
Exercises are recorded when ``check(name)`` passes on the learner's own ``exercises/`` file;
nothing is re-run on demand.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .. import chapters as course
from .bank import chapter_key, chapter_title, chapters, number
from .exercises import EXERCISES
from .language import UI, resolve_lang

__all__ = [
    "progress_path",
    "progress",
    "write_progress",
    "record_score",
    "record_exam",
    "record_exercise",
    "CourseProgress",
    "course_progress",
    "progress_report",
    "exercise_chapters",
]

_OLD_KEY = re.compile(r"^ch(\d{2})$")


def progress_path() -> Path:
    """``$COURSE_LIB_HOME/progress.json`` (default ``~/.cache/course_lib/progress.json``)."""
    home = os.environ.get("COURSE_LIB_HOME")
    root = Path(home).expanduser() if home else Path.home() / ".cache" / "course_lib"
    return root / "progress.json"


def better(new: Mapping, old: Mapping | None) -> bool:
    """Is score ``new`` better than ``old``? Fractions compared exactly; ties go to the longer."""
    if not old or not old.get("total"):
        return True
    lhs, rhs = new["score"] * old["total"], old["score"] * new["total"]
    return lhs > rhs or (lhs == rhs and new["total"] > old["total"])


def _merge(entry: Mapping, older: Mapping) -> dict:
    """One record from a topic-keyed ``entry`` and a number-keyed ``older`` one of the same quiz."""
    best = entry.get("best")
    if older.get("best") and better(older["best"], best):
        best = older["best"]
    return {
        "last": entry.get("last") or older.get("last"),
        "best": best,
        "attempts": int(entry.get("attempts", 0)) + int(older.get("attempts", 0)),
    }


def _migrate(quizzes: dict) -> dict:
    """Quiz records keyed by topic; number-keyed ones (``"ch02"``) moved to their topic."""
    out = {key: entry for key, entry in quizzes.items() if not _OLD_KEY.match(key)}
    for key, entry in quizzes.items():
        match = _OLD_KEY.match(key)
        if not match or not isinstance(entry, dict):
            continue
        try:
            topic = course.chapter(int(match.group(1))).topic
        except ValueError:
            out[key] = entry  # no such chapter: kept as it was
            continue
        new = out.get(topic)
        out[topic] = _merge(new, entry) if isinstance(new, dict) else entry
    return out


def progress() -> dict:
    """The progress file's content (see the module docstring), quiz records keyed by topic.

    A missing file gives ``{"quiz": {}}``; an unreadable one warns and is treated as empty.
    """
    path = progress_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        data = {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"ignoring unreadable progress file {path}: {exc}", stacklevel=2)
        data = {}
    if not isinstance(data, dict):
        data = {}
    quizzes = data.get("quiz")
    data["quiz"] = _migrate(quizzes) if isinstance(quizzes, dict) else {}
    return data


def write_progress(data: Mapping) -> Path:
    """Write the whole progress file (every section of ``data``); return its path."""
    path = progress_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename: an interrupted write never leaves a half-written file behind.
    fd, tmp = tempfile.mkstemp(prefix=".progress-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, ensure_ascii=False, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _recorded(old, last: dict) -> dict:
    old = old if isinstance(old, dict) else {}
    best = last if better(last, old.get("best")) else old["best"]
    return {"last": last, "best": best, "attempts": int(old.get("attempts", 0)) + 1}


def record_score(chapter, score: int, total: int) -> dict:
    """Store ``score/total`` as the chapter quiz's last score (and best, if better)."""
    data = progress()
    topic = chapter_key(chapter)
    last = {"score": int(score), "total": int(total)}
    data["quiz"][topic] = entry = _recorded(data["quiz"].get(topic), last)
    write_progress(data)
    return entry


def record_exam(result) -> dict:
    """Store an exam result's score as last (and best, if better) in the ``exam`` section."""
    data = progress()
    last = {"score": result.score, "total": result.total, "seed": result.seed}
    data["exam"] = entry = _recorded(data.get("exam"), last)
    write_progress(data)
    return entry


def record_exercise(name: str) -> dict:
    """Mark exercise ``name`` as passed (``check()`` calls it when the learner's code passes)."""
    data = progress()
    section = data.get("exercises") if isinstance(data.get("exercises"), dict) else {}
    old = section.get(name) if isinstance(section.get(name), dict) else {}
    section[name] = {"passed": True, "passes": int(old.get("passes", 0)) + 1}
    data["exercises"] = section
    write_progress(data)
    return section[name]


# ------------------------------------------------------------------------------------- report


def exercise_chapters() -> dict[str, str]:
    """``{exercise name: chapter topic}`` in registry order."""
    return {name: ex.chapter for name, ex in EXERCISES.items()}


@dataclass(frozen=True)
class CourseProgress:
    """What a learner has done, by chapter topic.

    ``quizzes``: ``{topic: (best score, total, attempts) or None}``; ``exercises``:
    ``{name: (topic, passed)}`` for every registered exercise; ``exam``:
    ``(best score, total, attempts)`` or None.
    """

    quizzes: dict
    exercises: dict
    exam: tuple | None

    def report(self, lang: str | None = None) -> str:
        return progress_report(self, lang)

    def __repr__(self) -> str:
        return self.report()


def _best(entry) -> tuple | None:
    best = entry.get("best") if isinstance(entry, dict) else None
    return (best["score"], best["total"], int(entry.get("attempts", 0))) if best else None


def course_progress(*, bank_dir=None) -> CourseProgress:
    """Each chapter quiz's best score, which exercises passed, the best exam score."""
    data = progress()
    quizzes = {topic: _best(data["quiz"].get(topic)) for topic in chapters(bank_dir=bank_dir)}
    passed = data.get("exercises") if isinstance(data.get("exercises"), dict) else {}
    exercises = {
        name: (topic, bool((passed.get(name) or {}).get("passed")))
        for name, topic in exercise_chapters().items()
    }
    return CourseProgress(quizzes, exercises, _best(data.get("exam")))


def _pct(score: int, total: int) -> str:
    return f"{score}/{total} ({round(100 * score / total)}%)"


def progress_report(
    state: CourseProgress | None = None, lang: str | None = None, *, bank_dir=None
) -> str:
    """``course-lib progress``: chapter quizzes (best score), exercises (passed?) and the exam."""
    lang = resolve_lang(lang)
    state = course_progress(bank_dir=bank_dir) if state is None else state
    ui = UI[lang]
    lines = [ui["progress"].format(path=progress_path()), f"{ui['quizzes']}:"]
    titles = {t: chapter_title(t, lang, bank_dir=bank_dir) for t in state.quizzes}
    width = max((len(t) for t in titles.values()), default=0)
    for topic, best in state.quizzes.items():
        shown = ui["not_yet"]
        if best:
            shown = f"{_pct(best[0], best[1])}, {ui['attempts'].format(n=best[2])}"
        lines.append(f"  {number(topic):02d} {titles[topic]:<{width}}  {shown}")
    lines.append(f"{ui['exercises']}:")
    width = max((len(name) for name in state.exercises), default=0)
    for name, (topic, ok) in state.exercises.items():
        shown = ui["passed"] if ok else ui["not_yet"]
        lines.append(f"  {number(topic):02d} {name:<{width}}  {shown}")
    exam = state.exam
    shown = ui["not_yet"]
    if exam:
        shown = f"{_pct(exam[0], exam[1])}, {ui['attempts'].format(n=exam[2])}"
    lines.append(f"{ui['exam']}: {shown}")
    lines.append(
        ui["done"].format(
            q=sum(b is not None for b in state.quizzes.values()),
            qt=len(state.quizzes),
            e=sum(ok for _, ok in state.exercises.values()),
            et=len(state.exercises),
            x=ui["yes"] if exam else ui["no"],
        )
    )
    return "\n".join(lines)
