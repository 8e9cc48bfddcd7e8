"""The deterministic text of a quiz or exam: what a cell shows outside a kernel; nbval compares it.

The listing is the heading, the numbered statements, and one hint line: :data:`WIDGET_HINT` under
the widget, a how-to-answer line under the plain-text objects. Changing any of it changes every
stored quiz output in the notebooks.
"""

from __future__ import annotations

from typing import Sequence

from .bank import chapters, number, statement_text
from .language import UI

__all__ = [
    "WIDGET_HINT",
    "TEXT_HINT",
    "EXAM_TEXT_HINT",
    "quiz_heading",
    "exam_heading",
    "quiz_listing",
    "exam_listing",
    "QuizText",
    "ExamText",
]

WIDGET_HINT = "(interactive quiz: click O or X)"
TEXT_HINT = (
    "(answer with grade({chapter!r}, {{item_id: 'O' or 'X'}}) or: "
    "course-lib quiz --chapter {chapter})"
)
EXAM_TEXT_HINT = (
    "(answer with grade_exam({{item_id: 'O' or 'X'}}, n={n}, seed={seed}) or: "
    "course-lib exam -n {n} --seed {seed})"
)


def quiz_heading(topic: str, lang: str, title: str, n: int) -> str:
    return UI[lang]["title"].format(ch=number(topic), title=title, n=n)


def exam_heading(lang: str, n: int, seed: int, bank_dir=None) -> str:
    last = max(number(t) for t in chapters(bank_dir=bank_dir))
    return UI[lang]["exam_title"].format(last=last, n=n, seed=seed)


def _numbered(lines: list[str], position: int, prefix: str, text: str) -> None:
    lines.append(f"{position:2d}. {prefix}" + text.replace("\n", "\n    "))


def quiz_listing(topic: str, lang: str, title: str, items: Sequence[dict], hint: str) -> str:
    lines = [quiz_heading(topic, lang, title, len(items))]
    for position, item in enumerate(items, 1):
        _numbered(lines, position, "", statement_text(item, lang))
    lines.append(hint)
    return "\n".join(lines)


def exam_listing(items: Sequence[dict], lang: str, seed: int, hint: str, bank_dir=None) -> str:
    """Like a quiz listing, each statement tagged with its chapter's notebook number."""
    lines = [exam_heading(lang, len(items), seed, bank_dir)]
    for position, item in enumerate(items, 1):
        tag = f"[{number(item['chapter']):02d}] "
        _numbered(lines, position, tag, statement_text(item, lang))
    lines.append(hint)
    return "\n".join(lines)


class _Text:
    """A cell result that shows :meth:`text` (``repr``, ``str`` and IPython's pretty printer)."""

    def text(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.text()

    __str__ = __repr__

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.text())


class QuizText(_Text):
    """Plain-text quiz: the numbered statements and how to answer them (no widgets available)."""

    def __init__(self, chapter: str, items: Sequence[dict], lang: str, title: str):
        self.chapter, self.items, self.lang, self.title = chapter, list(items), lang, title

    def text(self) -> str:
        hint = TEXT_HINT.format(chapter=self.chapter)
        return quiz_listing(self.chapter, self.lang, self.title, self.items, hint)


class ExamText(_Text):
    """Plain-text exam: the numbered statements (with their chapter) and how to answer them."""

    def __init__(self, items: Sequence[dict], lang: str, seed: int, bank_dir=None):
        self.items, self.lang, self.seed, self._bank_dir = list(items), lang, seed, bank_dir

    def text(self) -> str:
        hint = EXAM_TEXT_HINT.format(n=len(self.items), seed=self.seed)
        return exam_listing(self.items, self.lang, self.seed, hint, self._bank_dir)
