"""O/X (true/false) quiz engine: the bank, grading, a JupyterLab widget, a terminal quiz, progress.

Every notebook ends with ``quiz(chapter)``. The statements live as YAML data in ``quiz_bank/chNN.yaml``
(one file per chapter), each item with a Korean and an English statement, the answer ``O`` (true) or
``X`` (false), an explanation that says *why*, a short ``trap`` tag naming the misconception it tests,
a ``source``, a ``topic`` (the final exam scores per topic), ``teaches`` (the notebook anchor that teaches
it, ``"NN#anchor"`` in chapter NN's notebook, NN ≤ the item's chapter) and, for items that give each other
away, a ``group`` (an exam form draws at most one item per group). Items marked ``seed: true`` are the exam
statements of ``shared/seeds/003_*.txt``, kept verbatim: their Korean text is shown in both languages (in
English with the translation under it).

Language: one course-wide setting, English by default like the prose. ``COURSE_LANG=ko`` in the
environment or ``set_language("ko")`` switches every quiz to Korean; ``lang=`` on a call overrides it for
that call; the widget has its own ko/en toggle.

Five ways in, one bank:

* ``quiz(chapter)`` -- in a Jupyter kernel an ipywidgets quiz (O / X buttons, immediate feedback with
  the explanation, running score, missed traps at the end); elsewhere a plain-text listing.
  The object it returns has a deterministic ``text/plain`` representation (the numbered statements),
  so a quiz cell gives the same comparable output on every run under nbval, which skips
  ``application/vnd.jupyter.widget-view+json`` (its model id is random).
* ``grade(chapter, answers)`` -- the programmatic path: answers in, a result with explanations out.
* ``run_terminal_quiz(chapter, ...)`` -- the same quiz on a terminal (``course-lib quiz --chapter N``).
* ``exam_form(chapters, n, seed)`` + ``grade_items(form, answers)`` -- a final-exam form over several
  chapters (all seed items, never two items of one group) and its per-topic scores (``by_topic()``).
* ``load_bank(chapter)`` / ``validate_bank(items)`` -- the data itself, checked.

Finished quizzes and ``grade`` calls record the last and best score per chapter in
``$COURSE_LIB_HOME/progress.json`` (default ``~/.cache/course_lib``); ``progress()`` reads it back.
"""

from __future__ import annotations

import copy
import html
import json
import os
import random
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import yaml

__all__ = [
    "QuizBankError",
    "ItemResult",
    "QuizResult",
    "QuizText",
    "QuizWidget",
    "get_language",
    "set_language",
    "exam_form",
    "grade_items",
    "anchor_of",
    "statement_text",
    "load_bank",
    "validate_bank",
    "chapters",
    "grade",
    "quiz",
    "run_terminal_quiz",
    "ask_items",
    "progress",
    "progress_path",
    "record_score",
    "write_progress",
    "BANK_DIR",
]

#: Where the bank ships: next to this module, so it works from a source tree and an installed wheel
#: (pyproject's package-data must include ``quiz_bank/*.yaml``).
BANK_DIR = Path(__file__).resolve().parent / "quiz_bank"

ANSWERS = ("O", "X")
LANGS = ("ko", "en")
REQUIRED_FIELDS = ("id", "chapter", "statement", "answer", "explanation", "trap", "source", "topic", "teaches")
OPTIONAL_FIELDS = ("seed", "group")
DEFAULT_LANG = "en"
_TEACHES_RE = re.compile(r"^(\d{2})#([A-Za-z0-9][A-Za-z0-9_-]*)$")
_SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_language: str | None = None  # set_language(); None: $COURSE_LANG, else DEFAULT_LANG
_FILE_RE = re.compile(r"^ch(\d{2})\.yaml$")
_ID_RE = re.compile(r"^ch(\d{2})-[a-z0-9][a-z0-9-]*$")

# The one line that tells a reader of the stored output what kind of object this was. It is part of
# the deterministic text/plain representation, so changing it changes every stored quiz output.
WIDGET_HINT = "(interactive quiz: click O or X)"
TEXT_HINT = "(answer with grade({chapter}, {{item_id: 'O' or 'X'}}) or: course-lib quiz --chapter {chapter})"

_UI = {
    "ko": {
        "title": "{ch:02d}장 O/X 퀴즈 — {title} ({n}문항)",
        "topics": "주제별",
        "result": "{ch:02d}장 O/X 결과: {score}/{total} 정답 ({pct}%)",
        "result_exam": "O/X 시험 결과: {score}/{total} 정답 ({pct}%)",
        "right": "✔ 정답",
        "wrong": "✘ 오답",
        "answer_is": "정답 {answer}",
        "you_said": "내 답 {given}",
        "why": "해설",
        "trap": "함정",
        "missed": "놓친 함정",
        "none": "없음",
        "score": "점수 {score}/{answered} · 남은 문항 {left}",
        "final": "최종 점수 {score}/{total}",
        "saved": "진행 상황을 저장했습니다: {path}",
        "not_saved": "진행 상황을 저장하지 못했습니다: {err}",
        "prompt": "O/X (q: 그만) > ",
        "invalid": "O 또는 X로 답하세요 (q: 그만).",
        "stopped": "중단했습니다. 답한 문항만 채점합니다.",
        "nothing": "답한 문항이 없어 기록하지 않습니다.",
    },
    "en": {
        "title": "Chapter {ch:02d} O/X quiz — {title} ({n} statements)",
        "topics": "By topic",
        "result": "Chapter {ch:02d} O/X result: {score}/{total} correct ({pct}%)",
        "result_exam": "O/X exam result: {score}/{total} correct ({pct}%)",
        "right": "✔ correct",
        "wrong": "✘ wrong",
        "answer_is": "answer {answer}",
        "you_said": "you said {given}",
        "why": "why",
        "trap": "trap",
        "missed": "Missed traps",
        "none": "none",
        "score": "Score {score}/{answered} · {left} left",
        "final": "Final score {score}/{total}",
        "saved": "Progress saved: {path}",
        "not_saved": "Could not save progress: {err}",
        "prompt": "O/X (q: quit) > ",
        "invalid": "Please answer O or X (q: quit).",
        "stopped": "Stopped. Only the answered statements are graded.",
        "nothing": "Nothing answered; nothing recorded.",
    },
}


class QuizBankError(ValueError):
    """The quiz bank (a YAML file or a list of items) is malformed; the message names file and item."""


# --------------------------------------------------------------------------------------------------
# The bank
# --------------------------------------------------------------------------------------------------


def _bank_dir(bank_dir) -> Path:
    return BANK_DIR if bank_dir is None else Path(bank_dir)


def _bank_files(bank_dir) -> dict[int, Path]:
    root = _bank_dir(bank_dir)
    if not root.is_dir():
        raise QuizBankError(f"quiz bank directory not found: {root}")
    files = {}
    for path in sorted(root.iterdir()):
        m = _FILE_RE.match(path.name)
        if m:
            files[int(m.group(1))] = path
    return files


def chapters(*, bank_dir=None) -> list[int]:
    """The chapters that have a bank file, e.g. ``[0, 1, ..., 9]``."""
    return sorted(_bank_files(bank_dir))


def _normalize_chapter(chapter, available: Sequence[int]) -> int:
    listing = ", ".join(str(c) for c in available) or "none"
    if isinstance(chapter, bool) or not isinstance(chapter, (int, str)):
        raise ValueError(f"unknown chapter {chapter!r}; available chapters: {listing}")
    try:
        number = int(chapter)
    except ValueError:
        raise ValueError(f"unknown chapter {chapter!r}; available chapters: {listing}") from None
    if number not in available:
        raise ValueError(f"unknown chapter {chapter!r}; available chapters: {listing}")
    return number


def _check_item(item, where: str, chapter: int | None) -> str:
    """Check one item; return its id. ``where`` names the file (or source) for messages."""
    if not isinstance(item, Mapping):
        raise QuizBankError(f"{where}: expected a mapping (one item), got {type(item).__name__}")
    item_id = item.get("id")
    label = f"{where}, item {item_id!r}" if isinstance(item_id, str) and item_id else f"{where}, item without id"
    for name in REQUIRED_FIELDS:
        if name not in item or item[name] is None:
            raise QuizBankError(f"{label}: missing field {name!r}")
    unknown = sorted(set(item) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise QuizBankError(
            f"{label}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(REQUIRED_FIELDS + OPTIONAL_FIELDS)}"
        )
    if not isinstance(item_id, str) or not _ID_RE.match(item_id):
        raise QuizBankError(f"{label}: id must look like 'ch02-short-name' (lower case, digits, dashes)")
    item_chapter = item["chapter"]
    if isinstance(item_chapter, bool) or not isinstance(item_chapter, int):
        raise QuizBankError(f"{label}: chapter must be an integer, got {item_chapter!r}")
    if chapter is not None and item_chapter != chapter:
        raise QuizBankError(f"{label}: chapter {item_chapter} does not match the file's chapter {chapter}")
    if int(_ID_RE.match(item_id).group(1)) != item_chapter:
        raise QuizBankError(f"{label}: id must start with 'ch{item_chapter:02d}-' (its chapter is {item_chapter})")
    answer = item["answer"]
    if answer not in ANSWERS:
        raise QuizBankError(f"{label}: answer must be 'O' or 'X', got {answer!r}")
    for name in ("statement", "explanation"):
        texts = item[name]
        if not isinstance(texts, Mapping):
            raise QuizBankError(f"{label}: {name} must be a mapping with 'ko' and 'en' texts")
        for lang in LANGS:
            text = texts.get(lang)
            if not isinstance(text, str) or not text.strip():
                raise QuizBankError(f"{label}: {name} is missing its {lang!r} text")
    for name in ("trap", "source"):
        if not isinstance(item[name], str) or not item[name].strip():
            raise QuizBankError(f"{label}: {name} must be a non-empty string")
    if "seed" in item and not isinstance(item["seed"], bool):
        raise QuizBankError(f"{label}: seed must be true or false, got {item['seed']!r}")
    for name in ("topic", "group"):
        if name in item and (not isinstance(item[name], str) or not _SLUG_RE.match(item[name])):
            raise QuizBankError(f"{label}: {name} must be a short lower-case name (letters, digits, dashes), "
                                f"got {item[name]!r}")
    teaches = item["teaches"]
    match = _TEACHES_RE.match(teaches) if isinstance(teaches, str) else None
    if not match:
        raise QuizBankError(f"{label}: teaches must look like '02#anchor' (chapter, '#', the notebook anchor), "
                            f"got {teaches!r}")
    if int(match.group(1)) > item_chapter:
        raise QuizBankError(f"{label}: teaches {teaches!r} points at a later chapter than the item's ({item_chapter}); "
                            "an item must be answerable from its chapter or an earlier one")
    return item_id


def _check_items(pairs: Iterable[tuple[str, object]], chapter_of: Mapping[str, int | None]) -> None:
    seen: dict[str, str] = {}
    for where, item in pairs:
        item_id = _check_item(item, where, chapter_of.get(where))
        if item_id in seen:
            first = seen[item_id]
            also = f" (first in {first})" if first != where else ""
            raise QuizBankError(f"{where}, item {item_id!r}: duplicate id{also}")
        seen[item_id] = where


def validate_bank(items, *, source: str = "<items>", chapter: int | None = None) -> list[dict]:
    """Check a list of items against the schema; return it unchanged.

    Raises :class:`QuizBankError` naming ``source`` and the item id for a missing field, an answer
    other than O/X, a missing ko/en text, a duplicate id, or (when ``chapter`` is given) a chapter
    that does not match.
    """
    if not isinstance(items, list):
        raise QuizBankError(f"{source}: expected a list of items, got {type(items).__name__}")
    _check_items(((source, item) for item in items), {source: chapter})
    return items


def _read_file(path: Path, chapter: int) -> tuple[dict, list]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuizBankError(f"{path}: cannot read quiz bank file: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise QuizBankError(f"{path}: malformed YAML: {exc}") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get("items"), list):
        raise QuizBankError(f"{path}: expected a mapping with 'chapter', 'title' and an 'items' list")
    if data.get("chapter") != chapter:
        raise QuizBankError(f"{path}: top-level chapter {data.get('chapter')!r} does not match the file name")
    title = data.get("title")
    if not isinstance(title, Mapping) or not all(isinstance(title.get(k), str) and title[k] for k in LANGS):
        raise QuizBankError(f"{path}: title must be a mapping with 'ko' and 'en' texts")
    return dict(title), data["items"]


_CACHE: dict[tuple, tuple[dict, list]] = {}


def _load_all(bank_dir) -> tuple[dict[int, dict], list[dict]]:
    """All files of a bank directory, validated together (ids unique across files). Cached by mtime."""
    files = _bank_files(bank_dir)
    key = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files.values())
    if key not in _CACHE:
        titles, pairs, chapter_of = {}, [], {}
        for chapter, path in files.items():
            titles[chapter], items = _read_file(path, chapter)
            chapter_of[str(path)] = chapter
            pairs.extend((str(path), item) for item in items)
        _check_items(pairs, chapter_of)
        _CACHE.clear()
        _CACHE[key] = (titles, [dict(item) for _, item in pairs])
    titles, items = _CACHE[key]
    return copy.deepcopy(titles), copy.deepcopy(items)


def load_bank(chapter=None, *, bank_dir=None) -> list[dict]:
    """The validated items of one chapter (in file order), or of all chapters when ``chapter`` is None.

    ``bank_dir`` points at another directory of ``chNN.yaml`` files (tests use it). Malformed YAML or
    items raise :class:`QuizBankError`; an unknown chapter raises ``ValueError`` listing the chapters.
    """
    available = chapters(bank_dir=bank_dir)
    number = None if chapter is None else _normalize_chapter(chapter, available)
    _, items = _load_all(bank_dir)
    return items if number is None else [item for item in items if item["chapter"] == number]


def chapter_title(chapter, lang: str | None = None, *, bank_dir=None) -> str:
    """The chapter's title from its bank file, in ``lang`` (default: :func:`get_language`)."""
    lang = _resolve_lang(lang)
    number = _normalize_chapter(chapter, chapters(bank_dir=bank_dir))
    titles, _ = _load_all(bank_dir)
    return titles[number][lang]


def _check_lang(lang: str) -> None:
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}; choose one of: {', '.join(LANGS)}")


def get_language() -> str:
    """The course-wide quiz language: :func:`set_language`'s choice, else ``$COURSE_LANG``, else English.

    An unknown ``$COURSE_LANG`` (e.g. ``fr``) warns and falls back to English.
    """
    if _language is not None:
        return _language
    env = os.environ.get("COURSE_LANG", "").strip().lower()
    if not env:
        return DEFAULT_LANG
    if env not in LANGS:
        warnings.warn(f"ignoring COURSE_LANG={env!r}; choose one of: {', '.join(LANGS)}", stacklevel=3)
        return DEFAULT_LANG
    return env


def set_language(lang: str | None) -> str:
    """Set the language of every later quiz in this process (``"ko"`` or ``"en"``); ``None`` goes back
    to ``$COURSE_LANG`` / English. Returns the language now in effect."""
    global _language
    if lang is not None:
        _check_lang(lang)
    _language = lang
    return get_language()


def _resolve_lang(lang: str | None) -> str:
    if lang is None:
        return get_language()
    _check_lang(lang)
    return lang


def statement_text(item: Mapping, lang: str) -> str:
    """The statement as shown: a seed item's Korean text verbatim in both languages (in English mode the
    English translation follows on its own line, in parentheses); other items in ``lang``."""
    if item.get("seed") and lang != "ko":
        return f"{item['statement']['ko']}\n({item['statement'][lang]})"
    return item["statement"][lang]


def anchor_of(item: Mapping) -> tuple[int, str]:
    """``(chapter, anchor)`` of the notebook section that teaches ``item`` (its ``teaches`` field)."""
    match = _TEACHES_RE.match(item["teaches"])
    return int(match.group(1)), match.group(2)


def _select(chapter, n, shuffle, seed, bank_dir) -> tuple[int, list[dict]]:
    items = load_bank(chapter, bank_dir=bank_dir)
    number = items[0]["chapter"] if items else _normalize_chapter(chapter, chapters(bank_dir=bank_dir))
    if shuffle:
        random.Random(seed).shuffle(items)
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(items):
            raise ValueError(f"n must be an integer between 1 and {len(items)} (chapter {number}), got {n!r}")
        items = items[:n]
    return number, items


# --------------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------------


def _normalize_answer(value, item_id: str) -> str:
    if isinstance(value, str) and value.strip().upper() in ANSWERS:
        return value.strip().upper()
    raise ValueError(f"invalid answer {value!r} for item {item_id!r}: allowed values are 'O' or 'X' (case-insensitive)")


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

    @property
    def correct(self) -> bool:
        return self.given == self.answer


@dataclass(frozen=True)
class QuizResult:
    """The outcome of a quiz: score, per-item correctness, explanations and the traps that caught you.

    ``repr()`` is the full text report (deterministic: no times, no paths).
    """

    chapter: int | None  # None: an exam form over several chapters
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
        """``{topic: (score, total)}`` in order of first appearance (the final exam scores per topic)."""
        out: dict[str, list[int]] = {}
        for item in self.items:
            entry = out.setdefault(item.topic, [0, 0])
            entry[0] += item.correct
            entry[1] += 1
        return {topic: (score, total) for topic, (score, total) in out.items()}

    def report(self) -> str:
        ui = _UI[self.lang]
        pct = round(100 * self.score / self.total) if self.total else 0
        if self.chapter is None:
            lines = [ui["result_exam"].format(score=self.score, total=self.total, pct=pct)]
        else:
            lines = [ui["result"].format(ch=self.chapter, score=self.score, total=self.total, pct=pct)]
        for number, item in enumerate(self.items, 1):
            verdict = ui["right"] if item.correct else ui["wrong"]
            if item.correct:
                detail = item.answer
            else:
                detail = ui["you_said"].format(given=item.given) + ", " + ui["answer_is"].format(answer=item.answer)
            lines.append(f"{number:2d}. {verdict} ({detail}) " + item.statement.replace("\n", "\n    "))
            lines.append(f"    {ui['why']}: {item.explanation}")
            if not item.correct:
                lines.append(f"    {ui['trap']}: {item.trap}")
        lines.append(f"{ui['missed']}: {', '.join(self.missed_traps) or ui['none']}")
        if self.chapter is None:
            lines.append(f"{ui['topics']}: " + ", ".join(f"{t} {s}/{n}" for t, (s, n) in self.by_topic().items()))
        return "\n".join(lines)

    __str__ = report

    def __repr__(self) -> str:
        return self.report()

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython: print the report, not a dataclass repr
        printer.text(self.report())


def _result(chapter: int | None, lang: str, items: Sequence[dict], given: Mapping[str, str]) -> QuizResult:
    graded = tuple(
        ItemResult(
            id=item["id"],
            statement=statement_text(item, lang),
            given=given[item["id"]],
            answer=item["answer"],
            explanation=item["explanation"][lang],
            trap=item["trap"],
            topic=item.get("topic", ""),
        )
        for item in items
        if item["id"] in given
    )
    return QuizResult(chapter=chapter, lang=lang, items=graded)


def grade(chapter, answers, lang: str | None = None, *, record: bool = True, bank_dir=None) -> QuizResult:
    """Grade ``answers`` for ``chapter`` and (by default) record the score in the progress file.

    ``answers`` is ``{item_id: "O" | "X"}`` (any subset of the chapter's items; case-insensitive) or a
    list of answers for all of the chapter's items in bank order. Unknown ids, a list of the wrong
    length, or a value other than O/X raise ``ValueError`` naming the item and the allowed values.
    ``lang`` defaults to :func:`get_language`.
    """
    lang = _resolve_lang(lang)
    items = load_bank(chapter, bank_dir=bank_dir)
    number = items[0]["chapter"] if items else _normalize_chapter(chapter, chapters(bank_dir=bank_dir))
    ids = [item["id"] for item in items]
    if isinstance(answers, Mapping):
        unknown = [key for key in answers if key not in ids]
        if unknown:
            raise ValueError(
                f"unknown item id {unknown[0]!r} for chapter {number}; its ids are: {', '.join(ids)}"
            )
        given = {key: _normalize_answer(value, key) for key, value in answers.items()}
    elif isinstance(answers, Sequence) and not isinstance(answers, (str, bytes)):
        if len(answers) != len(ids):
            raise ValueError(
                f"chapter {number} has {len(ids)} statements but {len(answers)} answers were given; "
                "pass a dict {item_id: 'O'/'X'} to answer a subset"
            )
        given = {item_id: _normalize_answer(value, item_id) for item_id, value in zip(ids, answers)}
    else:
        raise ValueError("answers must be a dict {item_id: 'O'/'X'} or a list of 'O'/'X' in bank order")
    if not given:
        raise ValueError(f"no answers given for chapter {number}")
    result = _result(number, lang, items, given)
    if record:
        record_score(number, result.score, result.total)
    return result


def exam_form(from_chapters=None, n: int | None = None, seed: int = 0, *, bank_dir=None) -> list[dict]:
    """One exam form: items drawn from ``from_chapters`` (default: all), in bank order.

    Every seed item of those chapters is on the form (the final exam always includes all 14); the other
    items are drawn in a ``random.Random(seed)`` order, **never two of one group** (items that give each
    other away share a ``group``), and none from a group that a seed item belongs to. ``n`` is the size of
    the form, seeds included (default: every item the group rule allows).
    """
    available = chapters(bank_dir=bank_dir)
    wanted = available if from_chapters is None else [_normalize_chapter(c, available) for c in from_chapters]
    pool = [item for item in load_bank(bank_dir=bank_dir) if item["chapter"] in wanted]
    order = {item["id"]: index for index, item in enumerate(pool)}
    seeds = [item for item in pool if item.get("seed")]
    taken = {item["group"] for item in seeds if item.get("group")}
    others = [item for item in pool if not item.get("seed")]
    random.Random(seed).shuffle(others)
    drawn = []
    for item in others:
        group = item.get("group")
        if group in taken:
            continue
        if group:
            taken.add(group)
        drawn.append(item)
    if n is not None:
        low, high = len(seeds), len(seeds) + len(drawn)
        if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
            raise ValueError(f"n must be an integer between {low} (the seed items) and {high}, got {n!r}")
        drawn = drawn[: n - len(seeds)]
    return sorted(seeds + drawn, key=lambda item: order[item["id"]])


def grade_items(items: Sequence[Mapping], answers: Mapping[str, str], lang: str | None = None) -> QuizResult:
    """Grade ``answers`` (``{item_id: 'O'/'X'}``) for a list of items from any chapters, e.g. an
    :func:`exam_form`; the result's :meth:`QuizResult.by_topic` gives the per-topic scores. Nothing is
    recorded."""
    lang = _resolve_lang(lang)
    ids = [item["id"] for item in items]
    unknown = [key for key in answers if key not in ids]
    if unknown:
        raise ValueError(f"unknown item id {unknown[0]!r}; this form has: {', '.join(ids)}")
    given = {key: _normalize_answer(value, key) for key, value in answers.items()}
    if not given:
        raise ValueError("no answers given")
    return _result(None, lang, list(items), given)


# --------------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------------


def progress_path() -> Path:
    """``$COURSE_LIB_HOME/progress.json`` (default ``~/.cache/course_lib/progress.json``)."""
    home = os.environ.get("COURSE_LIB_HOME")
    root = Path(home).expanduser() if home else Path.home() / ".cache" / "course_lib"
    return root / "progress.json"


def progress() -> dict:
    """The progress file's content: ``{"quiz": {"ch02": {"last": {...}, "best": {...}, "attempts": n}}}``.

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
    if not isinstance(data.get("quiz"), dict):
        data["quiz"] = {}
    return data


def _better(new: Mapping, old: Mapping | None) -> bool:
    if not old or not old.get("total"):
        return True
    # Compare fractions exactly (score_a/total_a > score_b/total_b); on a tie the longer quiz wins.
    lhs, rhs = new["score"] * old["total"], old["score"] * new["total"]
    return lhs > rhs or (lhs == rhs and new["total"] > old["total"])


def record_score(chapter: int, score: int, total: int) -> dict:
    """Store ``score/total`` as the chapter's last score (and best, if better); return the entry."""
    data = progress()
    key = f"ch{int(chapter):02d}"
    entry = data["quiz"].get(key) if isinstance(data["quiz"].get(key), dict) else {}
    last = {"score": int(score), "total": int(total)}
    entry = {
        "last": last,
        "best": last if _better(last, entry.get("best")) else entry["best"],
        "attempts": int(entry.get("attempts", 0)) + 1,
    }
    data["quiz"][key] = entry
    write_progress(data)
    return entry


def write_progress(data: Mapping) -> Path:
    """Write the whole progress file (``progress()``'s dict, other sections such as the exam's kept); return it."""
    path = progress_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so an interrupted write never leaves a half-written file behind.
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


# --------------------------------------------------------------------------------------------------
# Displays: text listing (fallback) and the ipywidgets quiz
# --------------------------------------------------------------------------------------------------


def _listing(chapter: int, lang: str, title: str, items: Sequence[dict], hint: str) -> str:
    lines = [_UI[lang]["title"].format(ch=chapter, title=title, n=len(items))]
    for number, item in enumerate(items, 1):
        lines.append(f"{number:2d}. " + statement_text(item, lang).replace("\n", "\n    "))
    lines.append(hint)
    return "\n".join(lines)


class QuizText:
    """Plain-text quiz: the numbered statements and how to answer them (no widgets available)."""

    def __init__(self, chapter: int, items: Sequence[dict], lang: str, title: str):
        self.chapter, self.items, self.lang, self.title = chapter, list(items), lang, title

    def text(self) -> str:
        return _listing(self.chapter, self.lang, self.title, self.items, TEXT_HINT.format(chapter=self.chapter))

    def __repr__(self) -> str:
        return self.text()

    __str__ = __repr__

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.text())


class QuizWidget:
    """The interactive quiz: one row per statement with O / X buttons and feedback, a running score,
    and a summary of missed traps once every statement is answered (then progress is recorded).

    Displaying it gives two MIME types: ``application/vnd.jupyter.widget-view+json`` (the live widget;
    nbval skips it because the model id is random) and ``text/plain``, the numbered statements
    followed by :data:`WIDGET_HINT` -- deterministic, so nbval compares it.

    A ko/en toggle (``language``, a ``ToggleButtons``) re-renders statements, feedback and score in the
    other language; ``set_lang("ko")`` does the same from code. Seed items show their Korean text in both.

    Tests and scripts can drive it without a browser: ``answer(i, "O")`` or ``buttons[i][0].click()``.
    """

    def __init__(self, chapter: int, items: Sequence[dict], lang: str, title: str | None = None, *,
                 record: bool = True, bank_dir=None):
        import ipywidgets as w

        self.chapter, self.items, self.lang, self.record = chapter, list(items), lang, record
        self._titles = self._load_titles(bank_dir)
        if title is not None:
            self._titles[lang] = title
        self.answers: dict[str, str] = {}
        self.saved_entry: dict | None = None
        self._save_error: OSError | None = None
        self.header = w.HTML("")
        self.language = w.ToggleButtons(options=[("English", "en"), ("한국어", "ko")], value=lang,
                                         layout=w.Layout(width="auto"),
                                         style={"button_width": "5.5em"})
        self.language.observe(lambda change: self.set_lang(change["new"]), names="value")
        self.buttons: list[tuple] = []
        self.feedback: list = []
        self.statements: list = []
        rows = []
        for number in range(1, len(self.items) + 1):
            statement = w.HTML("")
            self.statements.append(statement)
            o_button = w.Button(description="O", layout=w.Layout(width="3.5em"))
            x_button = w.Button(description="X", layout=w.Layout(width="3.5em"))
            o_button.on_click(self._handler(number - 1, "O"))
            x_button.on_click(self._handler(number - 1, "X"))
            feedback = w.HTML("")
            self.buttons.append((o_button, x_button))
            self.feedback.append(feedback)
            rows.append(w.VBox([statement, w.HBox([o_button, x_button]), feedback]))
        self.score_label = w.HTML("")
        self.summary = w.HTML("")
        self.box = w.VBox([w.HBox([self.header, self.language]), *rows, self.score_label, self.summary])
        self._render()

    @property
    def title(self) -> str:
        return self._titles[self.lang]

    # Hooks a subclass overrides (course_lib.exam's final-exam widget): titles, heading line, where a score goes.
    def _load_titles(self, bank_dir) -> dict[str, str]:
        return {code: chapter_title(self.chapter, code, bank_dir=bank_dir) for code in LANGS}

    def _heading(self) -> str:
        return _UI[self.lang]["title"].format(ch=self.chapter, title=self.title, n=len(self.items))

    def _save(self, result: QuizResult) -> dict:
        return record_score(self.chapter, result.score, result.total)

    def set_lang(self, lang: str) -> None:
        """Show the quiz in ``lang`` (``"ko"`` / ``"en"``): what the toggle does."""
        _check_lang(lang)
        self.lang = lang
        if self.language.value != lang:
            self.language.value = lang  # calls set_lang again through the observer; harmless
        self._render()

    def _render(self) -> None:
        self.header.value = f"<b>{html.escape(self._heading())}</b>"
        for number, (item, label) in enumerate(zip(self.items, self.statements), 1):
            text = html.escape(statement_text(item, self.lang)).replace("\n", "<br><i>", 1)
            if "<i>" in text:
                text += "</i>"
            label.value = f"<b>{number}.</b> {text}"
        for index, item in enumerate(self.items):
            if item["id"] in self.answers:
                self._show_feedback(index)
        self.score_label.value = self._score_text()
        if self.finished:
            self._summarize()

    # -- state ------------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return len(self.answers) == len(self.items)

    def result(self) -> QuizResult:
        """The answered statements so far, graded."""
        return _result(self.chapter, self.lang, self.items, self.answers)

    def answer(self, index: int | str, value: str) -> None:
        """Answer statement ``index`` (0-based position, or its id) as if its button were clicked."""
        if isinstance(index, str):
            ids = [item["id"] for item in self.items]
            if index not in ids:
                raise ValueError(f"unknown item id {index!r}; this quiz has: {', '.join(ids)}")
            index = ids.index(index)
        self._on_answer(index, _normalize_answer(value, self.items[index]["id"]))

    # -- event handling ---------------------------------------------------------------------------

    def _handler(self, index: int, value: str) -> Callable:
        return lambda _button: self._on_answer(index, value)

    def _on_answer(self, index: int, value: str) -> None:
        item = self.items[index]
        if item["id"] in self.answers:  # one attempt per statement; buttons are disabled anyway
            return
        self.answers[item["id"]] = value
        correct = value == item["answer"]
        o_button, x_button = self.buttons[index]
        for button in (o_button, x_button):
            button.disabled = True
        chosen = o_button if value == "O" else x_button
        chosen.button_style = "success" if correct else "danger"
        self._show_feedback(index)
        self.score_label.value = self._score_text()
        if self.finished:
            self._finish()

    def _show_feedback(self, index: int) -> None:
        ui, item = _UI[self.lang], self.items[index]
        correct = self.answers[item["id"]] == item["answer"]
        verdict = ui["right"] if correct else f"{ui['wrong']} — {ui['answer_is'].format(answer=item['answer'])}"
        color = "#1a7f37" if correct else "#cf222e"
        self.feedback[index].value = (
            f"<span style='color:{color}'><b>{html.escape(verdict)}</b></span> "
            f"{html.escape(item['explanation'][self.lang])}"
        )

    def _score_text(self) -> str:
        score = sum(self.answers[i["id"]] == i["answer"] for i in self.items if i["id"] in self.answers)
        text = _UI[self.lang]["score"].format(
            score=score, answered=len(self.answers), left=len(self.items) - len(self.answers)
        )
        return f"<b>{html.escape(text)}</b>"

    def _finish(self) -> None:
        self._save_error = None
        if self.record:
            result = self.result()
            try:
                self.saved_entry = self._save(result)
            except OSError as exc:
                self._save_error = exc
        self._summarize()

    def _summarize(self) -> None:
        ui = _UI[self.lang]
        result = self.result()
        parts = [
            f"<b>{html.escape(ui['final'].format(score=result.score, total=result.total))}</b>",
            html.escape(f"{ui['missed']}: {', '.join(result.missed_traps) or ui['none']}"),
        ]
        if self.record and getattr(self, "_save_error", None) is not None:
            parts.append(html.escape(ui["not_saved"].format(err=self._save_error)))
        elif self.record and self.saved_entry is not None:
            parts.append(html.escape(ui["saved"].format(path=progress_path())))
        self.summary.value = "<br>".join(parts)

    # -- display ----------------------------------------------------------------------------------

    def text(self) -> str:
        return _listing(self.chapter, self.lang, self.title, self.items, WIDGET_HINT)

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = dict(self.box._repr_mimebundle_())
        data["text/plain"] = self.text()
        return data


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def quiz(chapter, lang: str | None = None, n: int | None = None, shuffle: bool = False, seed: int = 0, *,
         mode: str = "auto", record: bool = True, bank_dir=None):
    """The chapter's O/X quiz, to be displayed as a cell's result, in ``lang`` (default: the course-wide
    :func:`get_language`, English unless ``COURSE_LANG=ko`` or ``set_language("ko")``).

    In a Jupyter kernel with ipywidgets it returns a :class:`QuizWidget`; elsewhere a :class:`QuizText`
    listing (``mode="widget"`` / ``"text"`` forces one). ``n`` keeps the first ``n`` statements after
    an optional deterministic ``shuffle`` (``random.Random(seed)``). Both objects have the same
    deterministic ``text/plain`` listing except for its last line.
    """
    lang = _resolve_lang(lang)
    if mode not in ("auto", "widget", "text"):
        raise ValueError(f"mode must be 'auto', 'widget' or 'text', got {mode!r}")
    number, items = _select(chapter, n, shuffle, seed, bank_dir)
    title = chapter_title(number, lang, bank_dir=bank_dir)
    use_widget = mode == "widget" or (mode == "auto" and _in_kernel() and _widgets_available())
    if use_widget:
        return QuizWidget(number, items, lang, record=record, bank_dir=bank_dir)
    return QuizText(number, items, lang, title)


# --------------------------------------------------------------------------------------------------
# Terminal
# --------------------------------------------------------------------------------------------------


def run_terminal_quiz(chapter, lang: str | None = None, n: int | None = None, shuffle: bool = False, seed: int = 0, *,
                      input_fn: Callable[[str], str] = input, print_fn: Callable[..., None] = print,
                      record: bool = True, bank_dir=None) -> QuizResult:
    """Ask each statement on a terminal, read O/X (re-asking on anything else; ``q`` or end of input
    stops early), print feedback with the explanation, then the score and missed traps, and record
    the score. Returns the :class:`QuizResult` of the answered statements. ``lang`` defaults to
    :func:`get_language`."""
    lang = _resolve_lang(lang)
    number, items = _select(chapter, n, shuffle, seed, bank_dir)
    ui = _UI[lang]
    print_fn(ui["title"].format(ch=number, title=chapter_title(number, lang, bank_dir=bank_dir), n=len(items)))
    given = ask_items(items, lang, input_fn, print_fn)
    result = _result(number, lang, items, given)
    print_fn("")
    if not result.total:
        print_fn(ui["nothing"])
        return result
    print_fn(ui["final"].format(score=result.score, total=result.total))
    print_fn(f"{ui['missed']}: {', '.join(result.missed_traps) or ui['none']}")
    if record:
        try:
            record_score(number, result.score, result.total)
            print_fn(ui["saved"].format(path=progress_path()))
        except OSError as exc:
            print_fn(ui["not_saved"].format(err=exc))
    return result


def ask_items(items: Sequence[Mapping], lang: str, input_fn: Callable[[str], str] = input,
              print_fn: Callable[..., None] = print) -> dict[str, str]:
    """Ask ``items`` one by one on a terminal and return ``{item_id: 'O'/'X'}`` of those answered, printing
    feedback with the explanation after each; anything but O/X is asked again, ``q`` or end of input stops."""
    ui = _UI[lang]
    given: dict[str, str] = {}
    stopped = False
    for position, item in enumerate(items, 1):
        print_fn("")
        print_fn(f"[{position}/{len(items)}] {statement_text(item, lang)}")
        while True:
            try:
                raw = input_fn(ui["prompt"])
            except EOFError:
                raw = "q"
            reply = (raw or "").strip().upper()
            if reply in ANSWERS:
                break
            if reply in ("Q", "QUIT", "EXIT"):
                stopped = True
                break
            print_fn(ui["invalid"])
        if stopped:
            print_fn(ui["stopped"])
            break
        given[item["id"]] = reply
        if reply == item["answer"]:
            print_fn(ui["right"])
        else:
            print_fn(f"{ui['wrong']} — {ui['answer_is'].format(answer=item['answer'])}")
        print_fn(f"  {ui['why']}: {item['explanation'][lang]}")
    return given
