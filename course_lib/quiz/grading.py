"""Grading: answers in, a result with the verdict, explanation and trap of every statement out.

``grade(chapter, answers)`` grades a chapter quiz and ``grade_exam(answers, n, seed)`` an exam form;
both record the score in the progress file unless ``record=False`` (notebooks pass it: a demo
answer sheet is not the learner's score). ``answers`` is ``{item_id: "O" | "X"}`` (any subset,
case-insensitive) or a list of answers for every statement in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .bank import ANSWERS, chapter_key, is_numeric, load_bank, number, section_of, statement_text
from .forms import DEFAULT_N, exam_items
from .language import UI, resolve_lang
from .progress import record_exam, record_score

__all__ = [
    "ItemResult",
    "QuizResult",
    "ExamResult",
    "normalize_answer",
    "normalize_number",
    "normalize_for",
    "format_number",
    "given_answers",
    "grade_items",
    "grade",
    "grade_exam",
]


def normalize_answer(value, item_id: str) -> str:
    """``"O"`` or ``"X"`` from a case-insensitive answer; anything else raises ``ValueError``."""
    if isinstance(value, str) and value.strip().upper() in ANSWERS:
        return value.strip().upper()
    raise ValueError(
        f"invalid answer {value!r} for item {item_id!r}: "
        "allowed values are 'O' or 'X' (case-insensitive)"
    )


def format_number(value: float) -> str:
    """A number as the quiz shows it: ``0.2``, ``1024``, ``2.5e+09`` (up to 6 significant digits)."""
    return f"{float(value):.6g}"


def normalize_number(value, item_id: str) -> str:
    """A numeric answer (a number, or a string such as ``"0.25"`` or ``"1,024"``) as its text;
    anything else raises ``ValueError`` naming the item."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format_number(value)
    if isinstance(value, str):
        try:
            return format_number(float(value.strip().replace(",", "").replace("_", "")))
        except ValueError:
            pass
    raise ValueError(f"invalid answer {value!r} for item {item_id!r}: a number is expected")


def normalize_for(item: Mapping, value) -> str:
    """The answer ``value`` to ``item`` normalized: a number's text, or ``"O"`` / ``"X"``."""
    if is_numeric(item):
        return normalize_number(value, item["id"])
    return normalize_answer(value, item["id"])


def given_answers(items: Sequence[Mapping], answers, what: str) -> dict[str, str]:
    """``{item_id: 'O'/'X'}`` from a dict (any subset of ``items``) or a list (all, in order).

    ``what`` names the quiz in messages ("chapter ddp", "the exam form n=40, seed=0").
    """
    ids = [item["id"] for item in items]
    by_id = {item["id"]: item for item in items}
    if isinstance(answers, Mapping):
        unknown = [key for key in answers if key not in ids]
        if unknown:
            raise ValueError(
                f"unknown item id {unknown[0]!r} for {what}; its ids are: {', '.join(ids)}"
            )
        given = {key: normalize_for(by_id[key], value) for key, value in answers.items()}
    elif isinstance(answers, Sequence) and not isinstance(answers, (str, bytes)):
        if len(answers) != len(ids):
            raise ValueError(
                f"{what} has {len(ids)} statements but {len(answers)} answers were "
                "given; pass a dict {item_id: 'O'/'X'} to answer a subset"
            )
        given = {
            item_id: normalize_for(by_id[item_id], v)
            for item_id, v in zip(ids, answers, strict=True)
        }
    else:
        raise ValueError("answers must be a dict {item_id: 'O'/'X'} or a list of 'O'/'X' in order")
    if not given:
        raise ValueError(f"no answers given for {what}")
    return given


@dataclass(frozen=True)
class ItemResult:
    """One graded statement."""

    id: str
    statement: str
    given: str
    answer: str
    explanation: str
    trap: str
    topic: str = ""
    chapter: str = ""
    tolerance: float | None = None  # a numeric question's absolute slack; None: an O/X statement

    @property
    def correct(self) -> bool:
        if self.tolerance is None:
            return self.given == self.answer
        return abs(float(self.given) - float(self.answer)) <= self.tolerance

    @property
    def answer_text(self) -> str:
        """``O`` / ``X``, or a numeric answer with its slack: ``0.2 (± 0.005)``."""
        if self.tolerance is None:
            return self.answer
        return f"{self.answer} (± {format_number(self.tolerance)})"


@dataclass(frozen=True)
class QuizResult:
    """A graded quiz: score, per-item correctness, explanations, the traps that caught you.

    ``repr()`` is the full text report (deterministic: no times, no paths).
    """

    chapter: str | None  # the chapter's topic; None: an exam form over every chapter
    lang: str
    items: tuple[ItemResult, ...] = field(default_factory=tuple)

    @property
    def score(self) -> int:
        return sum(item.correct for item in self.items)

    @property
    def total(self) -> int:
        return len(self.items)

    @property
    def correct(self) -> dict[str, bool]:
        """``{item_id: True/False}`` in quiz order."""
        return {item.id: item.correct for item in self.items}

    @property
    def explanations(self) -> dict[str, str]:
        """``{item_id: explanation}`` in the quiz language."""
        return {item.id: item.explanation for item in self.items}

    @property
    def missed(self) -> list[str]:
        """Ids of the statements answered wrongly."""
        return [item.id for item in self.items if not item.correct]

    @property
    def missed_traps(self) -> list[str]:
        """Trap tags of the wrong answers, each once, in quiz order."""
        return list(dict.fromkeys(item.trap for item in self.items if not item.correct))

    def by_topic(self) -> dict[str, tuple[int, int]]:
        """``{topic: (score, total)}`` in order of first appearance."""
        out: dict[str, list[int]] = {}
        for item in self.items:
            entry = out.setdefault(item.topic, [0, 0])
            entry[0] += item.correct
            entry[1] += 1
        return {topic: (score, total) for topic, (score, total) in out.items()}

    def _headline(self) -> str:
        ui = UI[self.lang]
        pct = round(100 * self.score / self.total) if self.total else 0
        if self.chapter is None:
            return ui["result_exam"].format(score=self.score, total=self.total, pct=pct)
        return ui["result"].format(
            ch=number(self.chapter), score=self.score, total=self.total, pct=pct
        )

    def _item_lines(self, position: int, item: ItemResult) -> list[str]:
        ui = UI[self.lang]
        verdict = ui["right"] if item.correct else ui["wrong"]
        detail = item.answer_text
        if not item.correct:
            detail = (
                ui["you_said"].format(given=item.given)
                + ", "
                + ui["answer_is"].format(answer=item.answer_text)
            )
        statement = item.statement.replace("\n", "\n    ")
        lines = [
            f"{position:2d}. {verdict} ({detail}) {statement}",
            f"    {ui['why']}: {item.explanation}",
        ]
        if not item.correct:
            lines.append(f"    {ui['trap']}: {item.trap}")
        return lines

    def report(self) -> str:
        ui = UI[self.lang]
        lines = [self._headline()]
        for position, item in enumerate(self.items, 1):
            lines += self._item_lines(position, item)
        lines.append(f"{ui['missed']}: {', '.join(self.missed_traps) or ui['none']}")
        if self.chapter is None:
            topics = ", ".join(f"{t} {s}/{n}" for t, (s, n) in self.by_topic().items())
            lines.append(f"{ui['topics']}: {topics}")
        return "\n".join(lines)

    __str__ = report

    def __repr__(self) -> str:
        return self.report()

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython: the report, not a dataclass repr
        printer.text(self.report())


MIN_TOPIC_ITEMS = 3  # an exam reports a topic's own score only from this many statements on


@dataclass(frozen=True)
class ExamResult(QuizResult):
    """A graded exam form: a :class:`QuizResult` plus ``reread``, ``(trap, "NN#anchor")`` of each
    missed statement (the notebook section that teaches it), and the form's ``seed``."""

    reread: tuple[tuple[str, str], ...] = ()
    seed: int = 0

    def reported_topics(self) -> dict[str, tuple[int, int]]:
        """:meth:`by_topic` with every topic of fewer than :data:`MIN_TOPIC_ITEMS` statements on
        the form folded into ``"<chapter> (other topics)"``: one or two answers say little."""
        sizes = self.by_topic()
        out: dict[str, list[int]] = {}
        for item in self.items:
            name = item.topic
            if sizes[item.topic][1] < MIN_TOPIC_ITEMS:
                name = f"{item.chapter or '?'} (other topics)"
            entry = out.setdefault(name, [0, 0])
            entry[0] += item.correct
            entry[1] += 1
        return {topic: (score, total) for topic, (score, total) in out.items()}

    def topic_table(self) -> str:
        """One line per reported topic (:meth:`reported_topics`): ``topic  score/total  pct``,
        weakest first (ties in order)."""
        rows = sorted(self.reported_topics().items(), key=lambda kv: kv[1][0] / kv[1][1])
        width = max((len(t) for t, _ in rows), default=0)
        return "\n".join(
            f"  {t:<{width}}  {s:>2}/{n:<2} {round(100 * s / n):>3}%" for t, (s, n) in rows
        )

    def reread_text(self) -> str:
        """``Reread: 02#anchor (trap), ...`` in the result's language ('' if nothing was missed)."""
        if not self.reread:
            return ""
        places = ", ".join(f"{where} ({trap})" for trap, where in self.reread)
        return f"{UI[self.lang]['reread']}: {places}"

    def report(self) -> str:
        base = super().report().rsplit("\n", 1)[0]  # its one-line topic summary becomes the table
        lines = [base, f"{UI[self.lang]['by_topic']}:", self.topic_table()]
        if self.reread:
            lines.append(self.reread_text())
        return "\n".join(lines)

    __str__ = report

    def __repr__(self) -> str:
        return self.report()


def grade_items(
    items: Sequence[Mapping], given: Mapping[str, str], lang: str, chapter: str | None = None
) -> QuizResult:
    """The :class:`QuizResult` of checked answers ``given`` (``{item_id: 'O'/'X'}``) for ``items``.

    Items without an answer are left out. Nothing is recorded.
    """
    graded = tuple(
        ItemResult(
            id=item["id"],
            statement=statement_text(item, lang),
            given=given[item["id"]],
            answer=format_number(item["answer"]) if is_numeric(item) else item["answer"],
            explanation=item["explanation"][lang],
            trap=item["trap"],
            topic=item.get("topic", ""),
            chapter=item.get("chapter", ""),
            tolerance=float(item["tolerance"]) if is_numeric(item) else None,
        )
        for item in items
        if item["id"] in given
    )
    return QuizResult(chapter=chapter, lang=lang, items=graded)


def exam_result(
    items: Sequence[Mapping], given: Mapping[str, str], lang: str, seed: int
) -> ExamResult:
    """:func:`grade_items` for an exam form, with the sections to reread."""
    base = grade_items(items, given, lang)
    where = {item["id"]: section_of(item) for item in items}
    reread = tuple(dict.fromkeys((i.trap, where[i.id]) for i in base.items if not i.correct))
    return ExamResult(chapter=None, lang=lang, items=base.items, reread=reread, seed=seed)


def grade(
    chapter, answers, lang: str | None = None, *, record: bool = True, bank_dir=None
) -> QuizResult:
    """Grade ``answers`` for ``chapter``'s quiz (in bank order) and record the score.

    Unknown ids, a list of the wrong length or a value other than O/X raise ``ValueError``
    naming the item and the allowed values. ``lang`` defaults to the course language.
    """
    lang = resolve_lang(lang)
    topic = chapter_key(chapter, bank_dir=bank_dir)
    items = load_bank(topic, bank_dir=bank_dir) + load_bank(
        topic, bank_dir=bank_dir, kind="numeric"
    )
    given = given_answers(items, answers, f"chapter {topic}")
    result = grade_items(items, given, lang, topic)
    if record:
        record_score(topic, result.score, result.total)
    return result


def grade_exam(
    answers,
    n: int = DEFAULT_N,
    seed: int = 0,
    lang: str | None = None,
    *,
    record: bool = True,
    bank_dir=None,
) -> ExamResult:
    """Grade ``answers`` for the form ``exam_items(n, seed)`` and record the score."""
    lang = resolve_lang(lang)
    items = exam_items(n, seed, bank_dir=bank_dir)
    given = given_answers(items, answers, f"the exam form n={n}, seed={seed}")
    result = exam_result(items, given, lang, seed)
    if record:
        record_exam(result)
    return result
