"""The learner layer: O/X quizzes, the final exam, progress, and the exercise registry.

Every notebook ends with ``quiz(chapter)``; notebook 10 adds ``final_exam()``. A chapter is named
by its topic (``quiz("ddp")``) or its notebook number (``quiz(2)``). One bank, several views:

* ``quiz(chapter)`` / ``final_exam(n, seed)`` -- in a Jupyter kernel an ipywidgets view
  (:mod:`.widget`); elsewhere a plain-text listing (:mod:`.text`). Both share one deterministic
  ``text/plain`` listing (except its last line), which nbval compares.
* ``grade(chapter, answers)`` / ``grade_exam(answers, n, seed)`` -- answers in, a result with
  explanations out (:mod:`.grading`).
* ``run_terminal_quiz`` / ``run_terminal_exam`` -- the same on a terminal (:mod:`.terminal`).
* ``load_bank`` / ``validate_bank`` -- the YAML data itself, checked (:mod:`.bank`);
  ``exam_items`` -- which statements an exam form asks (:mod:`.forms`).
* ``progress()`` / ``course_progress()`` / ``progress_report()`` -- what the learner has done, in
  one file (:mod:`.progress`); ``EXERCISES`` -- the exercises ``check()`` knows (:mod:`.exercises`).

Language: English by default; ``COURSE_LANG=ko`` or ``set_language("ko")`` switches every view to
Korean, ``lang=`` on a call overrides it for that call (:mod:`.language`). The ``text/plain``
listing (what GitHub shows of a quiz cell) lists every statement and explanation in both languages,
Korean first; only its heading and hint follow the language.
"""

from __future__ import annotations

from .bank import (
    BANK_DIR,
    QuizBankError,
    anchor_of,
    chapter_key,
    chapter_title,
    chapters,
    load_bank,
    section_of,
    statement_text,
    validate_bank,
)
from .exercises import EXERCISES, Exercise
from .forms import DEFAULT_N, exam_items, quiz_items
from .grading import ExamResult, ItemResult, QuizResult, grade, grade_exam
from .language import LANGS, UI, get_language, resolve_lang, set_language
from .progress import (
    CourseProgress,
    course_progress,
    exercise_chapters,
    progress,
    progress_path,
    progress_report,
    record_exam,
    record_exercise,
    record_score,
    write_progress,
)
from .terminal import ask_items, run_terminal_exam, run_terminal_quiz
from .text import TEXT_HINT, WIDGET_HINT, ExamText, QuizText
from .widget import ExamWidget, QuizWidget, in_kernel, widgets_available

__all__ = [
    "quiz",
    "final_exam",
    "grade",
    "grade_exam",
    "exam_items",
    "quiz_items",
    "run_terminal_quiz",
    "run_terminal_exam",
    "ask_items",
    "load_bank",
    "validate_bank",
    "chapters",
    "chapter_key",
    "chapter_title",
    "statement_text",
    "anchor_of",
    "section_of",
    "QuizBankError",
    "BANK_DIR",
    "ItemResult",
    "QuizResult",
    "ExamResult",
    "QuizText",
    "ExamText",
    "QuizWidget",
    "ExamWidget",
    "WIDGET_HINT",
    "TEXT_HINT",
    "DEFAULT_N",
    "LANGS",
    "UI",
    "get_language",
    "set_language",
    "progress",
    "progress_path",
    "write_progress",
    "record_score",
    "record_exam",
    "record_exercise",
    "CourseProgress",
    "course_progress",
    "progress_report",
    "exercise_chapters",
    "EXERCISES",
    "Exercise",
]

_MODES = ("auto", "widget", "text")


def _use_widget(mode: str) -> bool:
    if mode not in _MODES:
        raise ValueError(f"mode must be 'auto', 'widget' or 'text', got {mode!r}")
    return mode == "widget" or (mode == "auto" and in_kernel() and widgets_available())


def quiz(
    chapter,
    lang: str | None = None,
    n: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    *,
    mode: str = "auto",
    record: bool = True,
    bank_dir=None,
):
    """The chapter's O/X quiz, to be displayed as a cell's result.

    A :class:`QuizWidget` in a Jupyter kernel with ipywidgets, else a :class:`QuizText`
    (``mode="widget"`` / ``"text"`` forces one). ``n`` keeps the first ``n`` statements after an
    optional deterministic ``shuffle`` (``random.Random(seed)``). ``lang`` defaults to the course
    language.
    """
    lang = resolve_lang(lang)
    widget = _use_widget(mode)
    topic, items = quiz_items(chapter, n, shuffle, seed, bank_dir=bank_dir)
    if widget:
        return QuizWidget(topic, items, lang, record=record, bank_dir=bank_dir)
    return QuizText(topic, items, lang, chapter_title(topic, lang, bank_dir=bank_dir))


def final_exam(
    lang: str | None = None,
    n: int = DEFAULT_N,
    seed: int = 0,
    *,
    mode: str = "auto",
    record: bool = True,
    bank_dir=None,
):
    """The final exam over every chapter (the form ``exam_items(n, seed)``) as a cell's result:
    an :class:`ExamWidget` in a Jupyter kernel with ipywidgets, else an :class:`ExamText`."""
    lang = resolve_lang(lang)
    widget = _use_widget(mode)
    items = exam_items(n, seed, bank_dir=bank_dir)
    if widget:
        return ExamWidget(items, lang, seed, record=record, bank_dir=bank_dir)
    return ExamText(items, lang, seed, bank_dir)
