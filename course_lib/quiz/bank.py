"""The quiz bank: one YAML file per chapter, ``quiz_bank/<topic>.yaml``, loaded and checked.

A chapter is named by its topic (``"ddp"``, see :mod:`course_lib.chapters`); anywhere a chapter is
asked for, its notebook number (``2`` or ``"02"``) works too. Each item has a Korean and an English
statement, the answer ``O`` (true) or ``X`` (false), an explanation that says *why*, a short
``trap`` naming the misconception it tests, a ``source``, a ``topic`` (the exam scores per topic),
``teaches`` (``"<chapter>#anchor"``: the notebook section that teaches it, in the item's chapter or
an earlier one) and, for items that give each other away, a ``group`` (an exam form draws at most
one item per group). Items marked ``seed: true`` are the course's 14 exam statements, kept verbatim:
their Korean text is shown in both languages (in English with the translation under it). The
plain-text listing (:mod:`.text`) shows every item that way, Korean first, whatever the language.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Iterable, Mapping

import yaml

from .. import chapters as course
from .language import LANGS, resolve_lang

__all__ = [
    "BANK_DIR",
    "QuizBankError",
    "ANSWERS",
    "REQUIRED_FIELDS",
    "OPTIONAL_FIELDS",
    "chapters",
    "chapter_key",
    "number",
    "load_bank",
    "is_numeric",
    "validate_bank",
    "chapter_title",
    "statement_text",
    "anchor_of",
    "section_of",
]

#: Next to this package, so it works from a source tree and an installed wheel
#: (pyproject's package-data includes ``quiz_bank/*.yaml``).
BANK_DIR = Path(__file__).resolve().parents[1] / "quiz_bank"

ANSWERS = ("O", "X")
REQUIRED_FIELDS = (
    "id",
    "chapter",
    "statement",
    "answer",
    "explanation",
    "trap",
    "source",
    "topic",
    "teaches",
)
OPTIONAL_FIELDS = ("seed", "group", "kind", "tolerance")
#: ``ox``: a statement answered O or X; ``numeric``: a question answered with a number the learner
#: computes from the chapter's formulas (``answer`` the number, ``tolerance`` the absolute slack).
KINDS = ("ox", "numeric")

_SLUG = r"[a-z0-9][a-z0-9-]*"
_SLUG_RE = re.compile(rf"^{_SLUG}$")
_TEACHES_RE = re.compile(rf"^({_SLUG})#([A-Za-z0-9][A-Za-z0-9_-]*)$")
TOPICS = tuple(c.topic for c in course.CHAPTERS)


class QuizBankError(ValueError):
    """The bank (a YAML file or a list of items) is malformed; the message names file and item."""


# ------------------------------------------------------------------------------------- chapters


def number(topic: str) -> int:
    """The notebook number of chapter ``topic``."""
    return course.number(topic)


def _bank_files(bank_dir) -> dict[str, Path]:
    """``{topic: path}`` in course order (by notebook number)."""
    root = BANK_DIR if bank_dir is None else Path(bank_dir)
    if not root.is_dir():
        raise QuizBankError(f"quiz bank directory not found: {root}")
    found = {path.stem: path for path in root.glob("*.yaml")}
    unknown = sorted(set(found) - set(TOPICS))
    if unknown:
        raise QuizBankError(
            f"{found[unknown[0]]}: not a chapter topic; "
            f"bank files are named <topic>.yaml, topics: {', '.join(TOPICS)}"
        )
    return {topic: found[topic] for topic in TOPICS if topic in found}


def chapters(*, bank_dir=None) -> list[str]:
    """The chapters that have a bank file, by topic in course order."""
    return list(_bank_files(bank_dir))


def chapter_key(key, *, bank_dir=None) -> str:
    """The topic of chapter ``key`` (a topic, or a notebook number: ``2`` / ``"02"``).

    Raises ``ValueError`` listing the chapters of the bank.
    """
    available = chapters(bank_dir=bank_dir)
    topic = None
    if isinstance(key, (int, str)) and not isinstance(key, bool):
        try:
            topic = course.chapter(key).topic
        except ValueError:
            pass
    if topic not in available:
        listing = ", ".join(f"{t} ({number(t):02d})" for t in available) or "none"
        raise ValueError(f"unknown chapter {key!r}; available chapters: {listing}")
    return topic


# ------------------------------------------------------------------------------------- schema


def _label(item: Mapping, where: str) -> str:
    item_id = item.get("id")
    if isinstance(item_id, str) and item_id:
        return f"{where}, item {item_id!r}"
    return f"{where}, item without id"


def _check_fields(item: Mapping, label: str) -> None:
    for name in REQUIRED_FIELDS:
        if item.get(name) is None:
            raise QuizBankError(f"{label}: missing field {name!r}")
    unknown = sorted(set(item) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS))
    if unknown:
        raise QuizBankError(
            f"{label}: unknown field(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(REQUIRED_FIELDS + OPTIONAL_FIELDS)}"
        )


def _check_chapter(item: Mapping, label: str, chapter: str | None) -> str:
    topic = item["chapter"]
    if topic not in TOPICS:
        raise QuizBankError(
            f"{label}: chapter must be a chapter topic ({', '.join(TOPICS)}), got {topic!r}"
        )
    if chapter is not None and topic != chapter:
        raise QuizBankError(
            f"{label}: chapter {topic!r} does not match the file's chapter {chapter!r}"
        )
    item_id = item["id"]
    if not isinstance(item_id, str) or not _SLUG_RE.match(item_id):
        raise QuizBankError(
            f"{label}: id must look like 'ddp-short-name' (lower case, digits, dashes)"
        )
    if not item_id.startswith(f"{topic}-") or item_id == f"{topic}-":
        raise QuizBankError(f"{label}: id must start with '{topic}-' (its chapter is {topic!r})")
    return topic


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_answer(item: Mapping, label: str) -> None:
    kind = item.get("kind", "ox")
    if kind not in KINDS:
        raise QuizBankError(f"{label}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "numeric":
        if not _is_number(item["answer"]):
            raise QuizBankError(
                f"{label}: a numeric item's answer must be a number, got {item['answer']!r}"
            )
        tolerance = item.get("tolerance")
        if not _is_number(tolerance) or tolerance < 0:
            raise QuizBankError(
                f"{label}: a numeric item needs tolerance: a number ≥ 0 (the absolute slack), "
                f"got {tolerance!r}"
            )
        if item.get("seed"):
            raise QuizBankError(f"{label}: a seed statement is O/X, not numeric")
        return
    if item["answer"] not in ANSWERS:
        raise QuizBankError(f"{label}: answer must be 'O' or 'X', got {item['answer']!r}")
    if "tolerance" in item:
        raise QuizBankError(f"{label}: tolerance belongs to numeric items (kind: numeric)")


def is_numeric(item: Mapping) -> bool:
    """Is ``item`` a numeric question (answered with a number), not an O/X statement?"""
    return item.get("kind", "ox") == "numeric"


def _check_texts(item: Mapping, label: str) -> None:
    _check_answer(item, label)
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


def _check_tags(item: Mapping, label: str) -> None:
    if "seed" in item and not isinstance(item["seed"], bool):
        raise QuizBankError(f"{label}: seed must be true or false, got {item['seed']!r}")
    for name in ("topic", "group"):
        value = item.get(name)
        if name in item and (not isinstance(value, str) or not _SLUG_RE.match(value)):
            raise QuizBankError(
                f"{label}: {name} must be a short lower-case name "
                f"(letters, digits, dashes), got {value!r}"
            )


def _check_teaches(item: Mapping, label: str, topic: str) -> None:
    teaches = item["teaches"]
    match = _TEACHES_RE.match(teaches) if isinstance(teaches, str) else None
    if not match or match.group(1) not in TOPICS:
        raise QuizBankError(
            f"{label}: teaches must look like 'ddp#anchor' (a chapter topic, '#', "
            f"the notebook anchor), got {teaches!r}"
        )
    if number(match.group(1)) > number(topic):
        raise QuizBankError(
            f"{label}: teaches {teaches!r} points at a later chapter than the "
            f"item's ({topic}); an item must be answerable from its chapter or an "
            "earlier one"
        )


def _check_item(item, where: str, chapter: str | None) -> str:
    """Check one item; return its id. ``where`` names the file (or source) for messages."""
    if not isinstance(item, Mapping):
        raise QuizBankError(f"{where}: expected a mapping (one item), got {type(item).__name__}")
    label = _label(item, where)
    _check_fields(item, label)
    topic = _check_chapter(item, label, chapter)
    _check_texts(item, label)
    _check_tags(item, label)
    _check_teaches(item, label, topic)
    return item["id"]


def _check_items(pairs: Iterable[tuple[str, object]], chapter_of: Mapping[str, str | None]):
    seen: dict[str, str] = {}
    for where, item in pairs:
        item_id = _check_item(item, where, chapter_of.get(where))
        if item_id in seen:
            first = seen[item_id]
            also = f" (first in {first})" if first != where else ""
            raise QuizBankError(f"{where}, item {item_id!r}: duplicate id{also}")
        seen[item_id] = where


def validate_bank(items, *, source: str = "<items>", chapter=None) -> list[dict]:
    """Check a list of items against the schema; return it unchanged.

    Raises :class:`QuizBankError` naming ``source`` and the item id for a missing field, an answer
    other than O/X, a missing ko/en text, a duplicate id, or (when ``chapter`` is given) a chapter
    that does not match.
    """
    if not isinstance(items, list):
        raise QuizBankError(f"{source}: expected a list of items, got {type(items).__name__}")
    topic = None if chapter is None else course.chapter(chapter).topic
    _check_items(((source, item) for item in items), {source: topic})
    return items


# ------------------------------------------------------------------------------------- files


def _read_file(path: Path, topic: str) -> tuple[dict, list]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuizBankError(f"{path}: cannot read quiz bank file: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise QuizBankError(f"{path}: malformed YAML: {exc}") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get("items"), list):
        raise QuizBankError(
            f"{path}: expected a mapping with 'chapter', 'title' and an 'items' list"
        )
    if data.get("chapter") != topic:
        raise QuizBankError(
            f"{path}: top-level chapter {data.get('chapter')!r} does not match the file name"
        )
    title = data.get("title")
    if not isinstance(title, Mapping) or not all(
        isinstance(title.get(k), str) and title[k] for k in LANGS
    ):
        raise QuizBankError(f"{path}: title must be a mapping with 'ko' and 'en' texts")
    return dict(title), data["items"]


_CACHE: dict[tuple, tuple[dict, list]] = {}


def _load_all(bank_dir) -> tuple[dict[str, dict], list[dict]]:
    """Every file of a bank, validated together (ids unique across files). Cached by mtime."""
    files = _bank_files(bank_dir)
    key = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files.values())
    if key not in _CACHE:
        titles, pairs, chapter_of = {}, [], {}
        for topic, path in files.items():
            titles[topic], items = _read_file(path, topic)
            chapter_of[str(path)] = topic
            pairs.extend((str(path), item) for item in items)
        _check_items(pairs, chapter_of)
        _CACHE.clear()
        _CACHE[key] = (titles, [dict(item) for _, item in pairs])
    titles, items = _CACHE[key]
    return copy.deepcopy(titles), copy.deepcopy(items)


def load_bank(chapter=None, *, bank_dir=None, kind: str | None = "ox") -> list[dict]:
    """The checked items of one chapter (in file order), or of all chapters (in course order).

    ``kind`` selects the O/X statements (``"ox"``, the default), the numeric questions
    (``"numeric"``) or both (``None``). ``bank_dir`` points at another directory of
    ``<topic>.yaml`` files (tests use it). Malformed YAML or items raise :class:`QuizBankError`;
    an unknown chapter raises ``ValueError``.
    """
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)} or None, got {kind!r}")
    topic = None if chapter is None else chapter_key(chapter, bank_dir=bank_dir)
    _, items = _load_all(bank_dir)
    return [
        item
        for item in items
        if (topic is None or item["chapter"] == topic)
        and (kind is None or item.get("kind", "ox") == kind)
    ]


def chapter_title(chapter, lang: str | None = None, *, bank_dir=None) -> str:
    """The chapter's title from its bank file, in ``lang`` (default: the course language)."""
    lang = resolve_lang(lang)
    titles, _ = _load_all(bank_dir)
    return titles[chapter_key(chapter, bank_dir=bank_dir)][lang]


# ------------------------------------------------------------------------------------- items


def statement_text(item: Mapping, lang: str) -> str:
    """The statement as shown: a seed item's Korean text verbatim in both languages (in English
    the translation follows on its own line, in parentheses); other items in ``lang``."""
    if item.get("seed") and lang != "ko":
        return f"{item['statement']['ko']}\n({item['statement'][lang]})"
    return item["statement"][lang]


def anchor_of(item: Mapping) -> tuple[str, str]:
    """``(chapter topic, anchor)`` of the notebook section that teaches ``item``."""
    match = _TEACHES_RE.match(item["teaches"])
    return match.group(1), match.group(2)


def section_of(item: Mapping) -> str:
    """Where a learner rereads ``item``: ``"NN#anchor"`` (notebook NN, its anchor)."""
    topic, anchor = anchor_of(item)
    return f"{number(topic):02d}#{anchor}"
