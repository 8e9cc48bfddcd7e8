"""The final O/X exam over the whole course, and a learner's progress (chapter quizzes, exercises, exam).

The API that notebook 09, ``course-lib exam`` / ``course-lib progress`` and the tests use::

    from course_lib.exam import final_exam, grade_exam, exam_items

    final_exam(n=40, seed=0)          # a cell's result: the exam widget in JupyterLab, a text listing elsewhere
    grade_exam(answers, n=40, seed=0, record=False)   # the programmatic path (nbval): answers in, ExamResult out

* :func:`exam_items` ``(n=40, seed=0)`` -- one exam form: **all 14 seed statements** (``seed: true`` in the
  bank) plus items drawn evenly over chapters 00-09 (the chapter with the fewest items on the form draws
  next, chapters and items in a ``random.Random(seed)`` order), **never two items of one** ``group``;
  listed in bank order (chapter by chapter). The same ``(n, seed)`` gives the same form everywhere.
* :func:`final_exam` ``(lang=None, n=40, seed=0, *, mode="auto", record=True)`` -- in a Jupyter kernel an
  :class:`ExamWidget` (the chapter quiz's O/X buttons, feedback with the explanation, running score, then the
  score per topic, the traps missed and the notebook sections to reread); elsewhere an :class:`ExamText`.
  Both show the same deterministic ``text/plain`` listing except its last line, which nbval compares.
* :func:`grade_exam` ``(answers, n=40, seed=0, lang=None, *, record=True)`` -- ``answers`` is
  ``{item_id: "O"/"X"}`` (any subset of the form) or a list of O/X for the whole form in its order. Returns an
  :class:`ExamResult`: ``score``, ``total``, ``by_topic()`` -> ``{topic: (score, total)}``, ``missed_traps``,
  ``reread`` (``(trap, "NN#anchor")`` of each missed item) and ``repr()`` = the full deterministic report.
  Notebooks pass ``record=False`` (a demo answer sheet is not the learner's score).
* :func:`run_terminal_exam` -- the same exam on a terminal (``course-lib exam [--lang ko] [-n 40] [--seed 0]``).
* :func:`record_exercise` / :func:`course_progress` / :func:`progress_report` -- ``course-lib progress``: the
  best score of each chapter quiz, each exercise of :data:`course_lib.check.EXERCISES` that has passed
  ``check()``, and the best exam score. Exercises are **recorded when** ``check(name)`` **passes** on the
  learner's ``exercises/`` file (``package="solutions"`` records nothing); nothing is re-run on demand.

Everything is stored in the quiz's progress file (``$COURSE_LIB_HOME/progress.json``, default
``~/.cache/course_lib``), in its own sections: ``quiz`` (chapter quizzes), ``exam`` and ``exercises``.
"""

from __future__ import annotations

import html
import random
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .quiz import (_UI, LANGS, WIDGET_HINT, QuizResult, QuizWidget, _better, _in_kernel, _normalize_answer,
                   _resolve_lang, _result, _widgets_available, ask_items, chapter_title, chapters, load_bank,
                   progress, progress_path, statement_text, write_progress)

__all__ = ["CourseProgress", "ExamResult", "ExamText", "ExamWidget", "course_progress", "exam_items",
           "exercise_chapters", "final_exam", "grade_exam", "progress_report", "record_exam", "record_exercise",
           "run_terminal_exam", "DEFAULT_N"]

DEFAULT_N = 40
TEXT_HINT = "(answer with grade_exam({{item_id: 'O' or 'X'}}, n={n}, seed={seed}) or: course-lib exam -n {n} " \
            "--seed {seed})"

_EXAM_UI = {
    "ko": {
        "title": "최종 O/X 시험 — 00–{last:02d}장 전체 ({n}문항, 시험지 {seed})",
        "reread": "다시 읽을 곳",
        "by_topic": "주제별 점수",
        "progress": "학습 진행 상황 ({path})",
        "quizzes": "장별 퀴즈 (최고 점수)",
        "exercises": "연습 문제 (check() 통과)",
        "exam": "최종 시험",
        "passed": "통과",
        "not_yet": "아직",
        "attempts": "{n}회 응시",
        "done": "완료: 퀴즈 {q}/{qt}, 연습 문제 {e}/{et}, 최종 시험 {x}",
        "yes": "응시함",
        "no": "응시 전",
    },
    "en": {
        "title": "Final O/X exam — chapters 00–{last:02d} ({n} statements, form {seed})",
        "reread": "Reread",
        "by_topic": "Score by topic",
        "progress": "Course progress ({path})",
        "quizzes": "Chapter quizzes (best score)",
        "exercises": "Exercises (passed check())",
        "exam": "Final exam",
        "passed": "passed",
        "not_yet": "not yet",
        "attempts": "{n} attempt(s)",
        "done": "Done: quizzes {q}/{qt}, exercises {e}/{et}, final exam {x}",
        "yes": "taken",
        "no": "not taken",
    },
}


# --------------------------------------------------------------------------------------------------
# The form
# --------------------------------------------------------------------------------------------------


def exam_items(n: int = DEFAULT_N, seed: int = 0, *, bank_dir=None) -> list[dict]:
    """The exam form: every seed item plus items drawn evenly over the chapters, never two of one group.

    Raises ``ValueError`` for an ``n`` below the number of seed items or above what the group rule allows.
    """
    bank = load_bank(bank_dir=bank_dir)
    order = {item["id"]: index for index, item in enumerate(bank)}
    seeds = [item for item in bank if item.get("seed")]
    rng = random.Random(seed)
    pools = {c: [i for i in bank if i["chapter"] == c and not i.get("seed")] for c in chapters(bank_dir=bank_dir)}
    for pool in pools.values():
        rng.shuffle(pool)
    turn = list(pools)
    rng.shuffle(turn)  # tie-break between chapters with equally many items on the form
    count = {c: sum(i["chapter"] == c for i in seeds) for c in pools}
    taken = {i["group"] for i in seeds if i.get("group")}
    drawn: list[dict] = []
    while True:
        for pool in pools.values():  # drop what the group rule now forbids
            pool[:] = [i for i in pool if i.get("group") not in taken]
        open_chapters = [c for c in turn if pools[c]]
        if not open_chapters:
            break
        chapter = min(open_chapters, key=lambda c: (count[c], turn.index(c)))
        item = pools[chapter].pop(0)
        if item.get("group"):
            taken.add(item["group"])
        drawn.append(item)
        count[chapter] += 1
    low, high = len(seeds), len(seeds) + len(drawn)
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
        raise ValueError(f"n must be an integer between {low} (the seed statements) and {high} (every item the "
                         f"one-per-group rule allows), got {n!r}")
    return sorted(seeds + drawn[: n - len(seeds)], key=lambda item: order[item["id"]])


def _heading(lang: str, n: int, seed: int, bank_dir=None) -> str:
    return _EXAM_UI[lang]["title"].format(last=max(chapters(bank_dir=bank_dir)), n=n, seed=seed)


def _listing(items: Sequence[dict], lang: str, seed: int, hint: str, bank_dir=None) -> str:
    lines = [_heading(lang, len(items), seed, bank_dir)]
    for number, item in enumerate(items, 1):
        lines.append(f"{number:2d}. [{item['chapter']:02d}] " + statement_text(item, lang).replace("\n", "\n    "))
    lines.append(hint)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExamResult(QuizResult):
    """A graded exam: :class:`course_lib.quiz.QuizResult` (score, per item, ``by_topic()``, ``missed_traps``)
    plus ``reread``: ``(trap, "NN#anchor")`` for each missed statement, the notebook section that teaches it."""

    reread: tuple[tuple[str, str], ...] = ()
    seed: int = 0

    def topic_table(self) -> str:
        """One line per topic: ``topic  score/total  pct``, weakest first (ties in order of appearance)."""
        rows = sorted(self.by_topic().items(), key=lambda kv: kv[1][0] / kv[1][1])
        width = max((len(t) for t, _ in rows), default=0)
        return "\n".join(f"  {t:<{width}}  {s:>2}/{n:<2} {round(100 * s / n):>3}%" for t, (s, n) in rows)

    def report(self) -> str:
        ext = _EXAM_UI[self.lang]
        base = super().report().rsplit("\n", 1)[0]  # its last line, topics in one line, becomes the table
        lines = [base, f"{ext['by_topic']}:", self.topic_table()]
        if self.reread:
            lines.append(f"{ext['reread']}: " + ", ".join(f"{where} ({trap})" for trap, where in self.reread))
        return "\n".join(lines)

    __str__ = report

    def __repr__(self) -> str:
        return self.report()


def _exam_result(items: Sequence[dict], lang: str, given: Mapping[str, str], seed: int) -> ExamResult:
    base = _result(None, lang, items, given)
    teaches = {item["id"]: item["teaches"] for item in items}
    reread = tuple(dict.fromkeys((i.trap, teaches[i.id]) for i in base.items if not i.correct))
    return ExamResult(chapter=None, lang=lang, items=base.items, reread=reread, seed=seed)


def record_exam(result: ExamResult) -> dict:
    """Store the exam's score as last (and best, if better) in the progress file's ``exam`` section."""
    data = progress()
    old = data.get("exam") if isinstance(data.get("exam"), dict) else {}
    last = {"score": result.score, "total": result.total, "seed": result.seed}
    entry = {"last": last, "best": last if _better(last, old.get("best")) else old["best"],
             "attempts": int(old.get("attempts", 0)) + 1}
    data["exam"] = entry
    write_progress(data)
    return entry


def grade_exam(answers, n: int = DEFAULT_N, seed: int = 0, lang: str | None = None, *, record: bool = True,
               bank_dir=None) -> ExamResult:
    """Grade ``answers`` for the form ``exam_items(n, seed)``: a dict ``{item_id: 'O'/'X'}`` (any subset,
    case-insensitive) or a list of answers for the whole form in its order. Unknown ids, a list of the wrong
    length or a value other than O/X raise ``ValueError``. Records the score unless ``record=False``."""
    lang = _resolve_lang(lang)
    items = exam_items(n, seed, bank_dir=bank_dir)
    ids = [item["id"] for item in items]
    if isinstance(answers, Mapping):
        unknown = [key for key in answers if key not in ids]
        if unknown:
            raise ValueError(f"unknown item id {unknown[0]!r} for the exam form n={n}, seed={seed}; "
                             f"its ids are: {', '.join(ids)}")
        given = {key: _normalize_answer(value, key) for key, value in answers.items()}
    elif isinstance(answers, Sequence) and not isinstance(answers, (str, bytes)):
        if len(answers) != len(ids):
            raise ValueError(f"the exam form has {len(ids)} statements but {len(answers)} answers were given; "
                             "pass a dict {item_id: 'O'/'X'} to answer a subset")
        given = {item_id: _normalize_answer(value, item_id) for item_id, value in zip(ids, answers)}
    else:
        raise ValueError("answers must be a dict {item_id: 'O'/'X'} or a list of 'O'/'X' in form order")
    if not given:
        raise ValueError("no answers given")
    result = _exam_result(items, lang, given, seed)
    if record:
        record_exam(result)
    return result


# --------------------------------------------------------------------------------------------------
# Displays
# --------------------------------------------------------------------------------------------------


class ExamText:
    """Plain-text exam: the numbered statements (with their chapter) and how to answer them."""

    def __init__(self, items: Sequence[dict], lang: str, seed: int, bank_dir=None):
        self.items, self.lang, self.seed, self._bank_dir = list(items), lang, seed, bank_dir

    def text(self) -> str:
        hint = TEXT_HINT.format(n=len(self.items), seed=self.seed)
        return _listing(self.items, self.lang, self.seed, hint, self._bank_dir)

    def __repr__(self) -> str:
        return self.text()

    __str__ = __repr__

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.text())


class ExamWidget(QuizWidget):
    """The chapter quiz's widget over an exam form: O/X buttons, feedback, running score, ko/en toggle; once
    every statement is answered, the score per topic, the traps missed and the sections to reread, and the
    score is recorded in the progress file's ``exam`` section. ``answer(i, "O")`` drives it from code."""

    def __init__(self, items: Sequence[dict], lang: str, seed: int = 0, *, record: bool = True, bank_dir=None):
        self.seed, self._bank_dir = seed, bank_dir
        super().__init__(None, items, lang, record=record, bank_dir=bank_dir)

    def _load_titles(self, bank_dir) -> dict[str, str]:
        return {code: _heading(code, len(self.items), self.seed, bank_dir) for code in LANGS}

    def _heading(self) -> str:
        return self.title

    def _save(self, result) -> dict:
        return record_exam(result)

    def result(self) -> ExamResult:
        return _exam_result(self.items, self.lang, self.answers, self.seed)

    def _summarize(self) -> None:
        super()._summarize()
        result, ext = self.result(), _EXAM_UI[self.lang]
        extra = [f"<b>{html.escape(ext['by_topic'])}</b>",
                 "<pre style='margin:0'>" + html.escape(result.topic_table()) + "</pre>"]
        if result.reread:
            extra.append(html.escape(f"{ext['reread']}: " + ", ".join(f"{w} ({t})" for t, w in result.reread)))
        self.summary.value += "<br>" + "<br>".join(extra)

    def text(self) -> str:
        return _listing(self.items, self.lang, self.seed, WIDGET_HINT, self._bank_dir)


def final_exam(lang: str | None = None, n: int = DEFAULT_N, seed: int = 0, *, mode: str = "auto",
               record: bool = True, bank_dir=None):
    """The final exam over all chapters (see :func:`exam_items`) as a cell's result: an :class:`ExamWidget` in
    a Jupyter kernel with ipywidgets, else an :class:`ExamText` (``mode="widget"`` / ``"text"`` forces one).
    ``lang`` defaults to the course-wide :func:`course_lib.quiz.get_language`."""
    lang = _resolve_lang(lang)
    if mode not in ("auto", "widget", "text"):
        raise ValueError(f"mode must be 'auto', 'widget' or 'text', got {mode!r}")
    items = exam_items(n, seed, bank_dir=bank_dir)
    if mode == "widget" or (mode == "auto" and _in_kernel() and _widgets_available()):
        return ExamWidget(items, lang, seed, record=record, bank_dir=bank_dir)
    return ExamText(items, lang, seed, bank_dir)


def run_terminal_exam(lang: str | None = None, n: int = DEFAULT_N, seed: int = 0, *,
                      input_fn: Callable[[str], str] = input, print_fn: Callable[..., None] = print,
                      record: bool = True, bank_dir=None) -> ExamResult:
    """Ask the exam on a terminal (O/X, ``q`` or end of input stops), then print the report of the answered
    statements (score per topic, traps missed, sections to reread) and record the score."""
    lang = _resolve_lang(lang)
    items = exam_items(n, seed, bank_dir=bank_dir)
    ui = _UI[lang]
    print_fn(_heading(lang, len(items), seed, bank_dir))
    given = ask_items(items, lang, input_fn, print_fn)
    result = _exam_result(items, lang, given, seed)
    print_fn("")
    if not result.total:
        print_fn(ui["nothing"])
        return result
    print_fn(ui["final"].format(score=result.score, total=result.total))
    print_fn(f"{ui['missed']}: {', '.join(result.missed_traps) or ui['none']}")
    print_fn(f"{_EXAM_UI[lang]['by_topic']}:\n{result.topic_table()}")
    if result.reread:
        print_fn(f"{_EXAM_UI[lang]['reread']}: " + ", ".join(f"{w} ({t})" for t, w in result.reread))
    if record:
        try:
            record_exam(result)
            print_fn(ui["saved"].format(path=progress_path()))
        except OSError as exc:
            print_fn(ui["not_saved"].format(err=exc))
    return result


# --------------------------------------------------------------------------------------------------
# Progress across the course
# --------------------------------------------------------------------------------------------------


def record_exercise(name: str) -> dict:
    """Mark exercise ``name`` as passed in the progress file's ``exercises`` section (called by
    :func:`course_lib.check.check` when the learner's own ``exercises/`` code passes); return its entry."""
    data = progress()
    section = data.get("exercises") if isinstance(data.get("exercises"), dict) else {}
    old = section.get(name) if isinstance(section.get(name), dict) else {}
    section[name] = {"passed": True, "passes": int(old.get("passes", 0)) + 1}
    data["exercises"] = section
    write_progress(data)
    return section[name]


@dataclass(frozen=True)
class CourseProgress:
    """What a learner has done: ``quizzes`` ``{chapter: (best score, total, attempts) or None}``,
    ``exercises`` ``{name: (chapter, passed)}`` (every exercise of ``check.EXERCISES``), ``exam``
    ``(best score, total, attempts)`` or None."""

    quizzes: dict
    exercises: dict
    exam: tuple | None

    def report(self, lang: str | None = None) -> str:
        return progress_report(self, lang)

    def __repr__(self) -> str:
        return self.report()


def exercise_chapters() -> dict[str, int]:
    """``{exercise name: chapter}`` in :data:`course_lib.check.EXERCISES` order, read from ``check.py``'s source
    (importing it imports every checker: torch, Ray, ~20 s on 2 busy cores); imported only if it is not a literal."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).with_name("check.py")).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "EXERCISES" and \
                isinstance(node.value, ast.Dict):
            try:
                return {ast.literal_eval(k): int(ast.literal_eval(v.args[0])[2:4])
                        for k, v in zip(node.value.keys, node.value.values)}
            except (ValueError, AttributeError, IndexError, TypeError):
                break
    from .check import EXERCISES

    return {name: int(ex.module[2:4]) for name, ex in EXERCISES.items()}


def course_progress(*, bank_dir=None) -> CourseProgress:
    """Read the progress file: each chapter quiz's best score, which exercises passed, the best exam score."""
    data = progress()
    quizzes = {}
    for chapter in chapters(bank_dir=bank_dir):
        entry = data["quiz"].get(f"ch{chapter:02d}")
        best = entry.get("best") if isinstance(entry, dict) else None
        quizzes[chapter] = (best["score"], best["total"], int(entry.get("attempts", 0))) if best else None
    passed = data.get("exercises") if isinstance(data.get("exercises"), dict) else {}
    exercises = {name: (chapter, bool((passed.get(name) or {}).get("passed")))
                 for name, chapter in exercise_chapters().items()}
    exam = data.get("exam") if isinstance(data.get("exam"), dict) else None
    best = exam.get("best") if exam else None
    return CourseProgress(quizzes, exercises,
                          (best["score"], best["total"], int(exam.get("attempts", 0))) if best else None)


def _pct(score: int, total: int) -> str:
    return f"{score}/{total} ({round(100 * score / total)}%)"


def progress_report(state: CourseProgress | None = None, lang: str | None = None, *, bank_dir=None) -> str:
    """``course-lib progress``: a table of chapter quizzes (best score), exercises (passed or not) and the exam."""
    lang = _resolve_lang(lang)
    state = course_progress(bank_dir=bank_dir) if state is None else state
    ext = _EXAM_UI[lang]
    lines = [ext["progress"].format(path=progress_path()), f"{ext['quizzes']}:"]
    titles = {chapter: chapter_title(chapter, lang, bank_dir=bank_dir) for chapter in state.quizzes}
    width = max((len(t) for t in titles.values()), default=0)
    for chapter, best in state.quizzes.items():
        shown = f"{_pct(best[0], best[1])}, {ext['attempts'].format(n=best[2])}" if best else ext["not_yet"]
        lines.append(f"  {chapter:02d} {titles[chapter]:<{width}}  {shown}")
    lines.append(f"{ext['exercises']}:")
    width = max((len(name) for name in state.exercises), default=0)
    for name, (chapter, ok) in state.exercises.items():
        lines.append(f"  {chapter:02d} {name:<{width}}  {ext['passed'] if ok else ext['not_yet']}")
    exam = state.exam
    lines.append(f"{ext['exam']}: " + (f"{_pct(exam[0], exam[1])}, {ext['attempts'].format(n=exam[2])}" if exam
                                        else ext["not_yet"]))
    lines.append(ext["done"].format(q=sum(b is not None for b in state.quizzes.values()), qt=len(state.quizzes),
                                    e=sum(ok for _, ok in state.exercises.values()), et=len(state.exercises),
                                    x=ext["yes"] if exam else ext["no"]))
    return "\n".join(lines)
