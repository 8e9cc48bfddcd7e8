"""The deterministic text of a quiz or exam: what a cell shows outside a kernel; nbval compares it.

The listing is the heading, the numbered statements, one hint line (:data:`WIDGET_HINT` under
the widget, a how-to-answer line under the plain-text objects), then the answer key: each answer
with its explanation, for a reader without a kernel. Changing any of it changes every
stored quiz output in the notebooks.

The listing is what a reader without a kernel sees (GitHub, nbviewer), so it is bilingual whatever
the display language: every statement and every explanation in Korean, then the English in
parentheses on its own line (:func:`bilingual_text`). The heading and the hint follow the display
language; the widget and the terminal show one language, the learner's choice.
"""

from __future__ import annotations

from typing import Sequence

from .bank import chapters, is_numeric, number, statement_text
from .language import UI

__all__ = [
    "WIDGET_HINT",
    "TEXT_HINT",
    "EXAM_TEXT_HINT",
    "quiz_heading",
    "exam_heading",
    "quiz_listing",
    "exam_listing",
    "bilingual_text",
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


def quiz_heading(topic: str, lang: str, title: str, items) -> str:
    """A chapter quiz's title: its O/X statement count, then its numeric questions."""
    k = sum(is_numeric(item) for item in items)
    text = UI[lang]["title"].format(ch=number(topic), title=title, n=len(items) - k)
    return text + (UI[lang]["exam_computations"].format(k=k) if k else "")


def exam_heading(lang: str, items, seed: int, bank_dir=None) -> str:
    """The exam's title: its O/X statement count ``n`` (what ``grade_exam(n=...)`` takes), the
    form's seed, and the numeric questions after the statements."""
    last = max(number(t) for t in chapters(bank_dir=bank_dir))
    k = sum(is_numeric(item) for item in items)
    title = UI[lang]["exam_title"].format(last=last, n=len(items) - k, seed=seed)
    return title + (UI[lang]["exam_computations"].format(k=k) if k else "")


def _numbered(lines: list[str], position: int, prefix: str, text: str) -> None:
    lines.append(f"{position:2d}. {prefix}" + text.replace("\n", "\n    "))


def shown_text(item: dict, lang: str) -> str:
    """The statement as listed: a numeric question says it wants a number."""
    text = statement_text(item, lang)
    return f"{text} {UI[lang]['compute']}" if is_numeric(item) else text


def _both(ko: str, en: str) -> str:
    return f"{ko}\n({en})"


def bilingual_text(item: dict) -> str:
    """The statement as the plain-text listing shows it: Korean, then the English in parentheses
    on its own line; a numeric question says in each language that it wants a number."""
    ko, en = item["statement"]["ko"], item["statement"]["en"]
    if is_numeric(item):
        ko, en = f"{ko} {UI['ko']['compute']}", f"{en} {UI['en']['compute']}"
    return _both(ko, en)


def _key_answer(item: dict) -> str:
    if not is_numeric(item):
        return item["answer"]
    return f"{float(item['answer']):.6g} (± {float(item['tolerance']):.6g})"


def _answer_key(lines: list[str], items: Sequence[dict], lang: str) -> None:
    """After the statements: each answer and its explanation (Korean, then the English in
    parentheses), so that a reader without a kernel (GitHub, nbviewer, a PDF) can check
    themselves once they have answered every statement."""
    lines += ["", UI[lang]["key"] + ":"]
    for position, item in enumerate(items, 1):
        why = _both(item["explanation"]["ko"], item["explanation"]["en"])
        _numbered(lines, position, f"{_key_answer(item)} — ", why)


def quiz_listing(topic: str, lang: str, title: str, items: Sequence[dict], hint: str) -> str:
    """The heading, the numbered statements (both languages), ``hint``, then the answer key."""
    lines = [quiz_heading(topic, lang, title, items)]
    for position, item in enumerate(items, 1):
        _numbered(lines, position, "", bilingual_text(item))
    lines.append(hint)
    _answer_key(lines, items, lang)
    return "\n".join(lines)


def exam_listing(items: Sequence[dict], lang: str, seed: int, hint: str, bank_dir=None) -> str:
    """Like a quiz listing, each statement tagged with its chapter's notebook number."""
    lines = [exam_heading(lang, items, seed, bank_dir)]
    for position, item in enumerate(items, 1):
        tag = f"[{number(item['chapter']):02d}] "
        _numbered(lines, position, tag, bilingual_text(item))
    lines.append(hint)
    _answer_key(lines, items, lang)
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
        n = sum(not is_numeric(item) for item in self.items)  # grade_exam's n: the O/X count
        hint = EXAM_TEXT_HINT.format(n=n, seed=self.seed)
        return exam_listing(self.items, self.lang, self.seed, hint, self._bank_dir)
