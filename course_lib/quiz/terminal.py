"""The terminal view: ``course-lib quiz --chapter ddp`` and ``course-lib exam``.

Each statement is printed and answered with O or X (anything else is asked again; ``q`` or the end
of input stops early), followed by the verdict and the explanation; then the score, the traps
missed (the exam adds the score per topic and the sections to reread), and the score is recorded.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from .bank import ANSWERS, chapter_title, is_numeric
from .forms import DEFAULT_N, exam_items, quiz_items
from .grading import ExamResult, QuizResult, exam_result, grade_items, normalize_number
from .language import UI, resolve_lang
from .progress import progress_path, record_exam, record_score
from .text import exam_heading, quiz_heading, shown_text

__all__ = ["ask_items", "run_terminal_quiz", "run_terminal_exam"]

_STOP = ("Q", "QUIT", "EXIT")


def _ask(prompt: str, invalid: str, input_fn, print_fn, item: Mapping | None = None) -> str | None:
    """One reply (O/X, or a number for a numeric ``item``), asked again until valid; None to stop."""
    while True:
        try:
            raw = input_fn(prompt)
        except EOFError:
            return None
        reply = (raw or "").strip().upper()
        if reply in _STOP:
            return None
        if item is not None and is_numeric(item):
            try:
                return normalize_number(reply, item["id"])
            except ValueError:
                print_fn(invalid)
                continue
        if reply in ANSWERS:
            return reply
        print_fn(invalid)


def ask_items(
    items: Sequence[Mapping],
    lang: str,
    input_fn: Callable[[str], str] = input,
    print_fn: Callable[..., None] = print,
    feedback: bool = True,
) -> dict[str, str]:
    """Ask ``items`` one by one; return ``{item_id: 'O'/'X'}`` of those answered.

    ``feedback=False`` (an exam) prints no verdict or explanation after an answer."""
    ui = UI[lang]
    given: dict[str, str] = {}
    for position, item in enumerate(items, 1):
        print_fn("")
        print_fn(f"[{position}/{len(items)}] {shown_text(item, lang)}")
        if is_numeric(item):
            reply = _ask(ui["number_prompt"], ui["need_number"], input_fn, print_fn, item)
        else:
            reply = _ask(ui["prompt"], ui["invalid"], input_fn, print_fn)
        if reply is None:
            print_fn(ui["stopped"])
            break
        given[item["id"]] = reply
        if not feedback:
            continue
        graded = grade_items([item], {item["id"]: reply}, lang).items[0]
        if graded.correct:
            print_fn(ui["right"])
        else:
            print_fn(f"{ui['wrong']} — {ui['answer_is'].format(answer=graded.answer_text)}")
        print_fn(f"  {ui['why']}: {item['explanation'][lang]}")
    return given


def _summary(result: QuizResult, print_fn) -> bool:
    """Print the score and the traps missed; False when nothing was answered."""
    ui = UI[result.lang]
    print_fn("")
    if not result.total:
        print_fn(ui["nothing"])
        return False
    print_fn(ui["final"].format(score=result.score, total=result.total))
    print_fn(f"{ui['missed']}: {', '.join(result.missed_traps) or ui['none']}")
    return True


def _save(save: Callable[[], object], lang: str, print_fn) -> None:
    ui = UI[lang]
    try:
        save()
        print_fn(ui["saved"].format(path=progress_path()))
    except OSError as exc:
        print_fn(ui["not_saved"].format(err=exc))


def run_terminal_quiz(
    chapter,
    lang: str | None = None,
    n: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    *,
    input_fn: Callable[[str], str] = input,
    print_fn: Callable[..., None] = print,
    record: bool = True,
    bank_dir=None,
) -> QuizResult:
    """Ask a chapter's quiz on a terminal; return the :class:`QuizResult` of what was answered."""
    lang = resolve_lang(lang)
    topic, items = quiz_items(chapter, n, shuffle, seed, bank_dir=bank_dir)
    title = chapter_title(topic, lang, bank_dir=bank_dir)
    print_fn(quiz_heading(topic, lang, title, items))
    result = grade_items(items, ask_items(items, lang, input_fn, print_fn), lang, topic)
    if _summary(result, print_fn) and record:
        _save(lambda: record_score(topic, result.score, result.total), lang, print_fn)
    return result


def run_terminal_exam(
    lang: str | None = None,
    n: int = DEFAULT_N,
    seed: int = 0,
    *,
    input_fn: Callable[[str], str] = input,
    print_fn: Callable[..., None] = print,
    record: bool = True,
    bank_dir=None,
) -> ExamResult:
    """Ask the exam form ``(n, seed)`` on a terminal; return the :class:`ExamResult`."""
    lang = resolve_lang(lang)
    items = exam_items(n, seed, bank_dir=bank_dir)
    print_fn(exam_heading(lang, items, seed, bank_dir))
    given = ask_items(items, lang, input_fn, print_fn, feedback=False)
    result = exam_result(items, given, lang, seed)
    if not result.total:
        _summary(result, print_fn)
        return result
    print_fn("")  # the verdicts and explanations, only now that every answer is in
    for position, item in enumerate(result.items, 1):
        print_fn("\n".join(result._item_lines(position, item)))
    _summary(result, print_fn)
    print_fn(f"{UI[lang]['by_topic']}:\n{result.topic_table()}")
    if result.reread:
        print_fn(result.reread_text())
    if record:
        _save(lambda: record_exam(result), lang, print_fn)
    return result
