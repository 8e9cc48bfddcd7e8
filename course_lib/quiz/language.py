"""The course-wide quiz language and every learner-facing string, in Korean and English.

English by default, like the prose. ``COURSE_LANG=ko`` in the environment or ``set_language("ko")``
switches every quiz, exam and progress report to Korean; ``lang=`` on a call overrides it for that
call.
"""

from __future__ import annotations

import os
import warnings

__all__ = [
    "LANGS",
    "DEFAULT_LANG",
    "UI",
    "get_language",
    "set_language",
    "resolve_lang",
    "check_lang",
]

LANGS = ("ko", "en")
DEFAULT_LANG = "en"

_language: str | None = None  # set_language(); None: $COURSE_LANG, else DEFAULT_LANG

UI = {
    "ko": {
        # chapter quiz
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
        "answered": "답한 문항 {answered} · 남은 문항 {left}",
        "key": "정답과 해설 (답을 모두 정한 뒤에 읽으세요)",
        "need_number": "숫자를 입력하세요 (예: 0.25)",
        "number_prompt": "숫자> ",
        "compute": "(계산해서 숫자로 답하세요)",
        "recorded": "내 답 {given} — 채점과 해설은 시험이 끝난 뒤에",
        "final": "최종 점수 {score}/{total}",
        "saved": "진행 상황을 저장했습니다: {path}",
        "not_saved": "진행 상황을 저장하지 못했습니다: {err}",
        "prompt": "O/X (q: 그만) > ",
        "invalid": "O 또는 X로 답하세요 (q: 그만).",
        "stopped": "중단했습니다. 답한 문항만 채점합니다.",
        "nothing": "답한 문항이 없어 기록하지 않습니다.",
        # final exam
        "exam_title": "최종 O/X 시험 — 00–{last:02d}장 전체 ({n}문항, 시험지 {seed})",
        "exam_computations": " + 계산 문제 {k}개",
        "reread": "다시 읽을 곳",
        "by_topic": "주제별 점수",
        # progress
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
        # chapter quiz
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
        "answered": "{answered} answered · {left} left",
        "key": "Answers and explanations (read them after answering every statement)",
        "need_number": "enter a number (e.g. 0.25)",
        "number_prompt": "number> ",
        "compute": "(compute it: answer with a number)",
        "recorded": "you said {given} — graded, with the explanation, when the exam ends",
        "final": "Final score {score}/{total}",
        "saved": "Progress saved: {path}",
        "not_saved": "Could not save progress: {err}",
        "prompt": "O/X (q: quit) > ",
        "invalid": "Please answer O or X (q: quit).",
        "stopped": "Stopped. Only the answered statements are graded.",
        "nothing": "Nothing answered; nothing recorded.",
        # final exam
        "exam_title": "Final O/X exam — chapters 00–{last:02d} ({n} statements, form {seed})",
        "exam_computations": " + {k} computations",
        "reread": "Reread",
        "by_topic": "Score by topic",
        # progress
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


def check_lang(lang: str) -> None:
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}; choose one of: {', '.join(LANGS)}")


def get_language() -> str:
    """:func:`set_language`'s choice, else ``$COURSE_LANG``, else English.

    An unknown ``$COURSE_LANG`` (e.g. ``fr``) warns and falls back to English.
    """
    if _language is not None:
        return _language
    env = os.environ.get("COURSE_LANG", "").strip().lower()
    if not env:
        return DEFAULT_LANG
    if env not in LANGS:
        warnings.warn(
            f"ignoring COURSE_LANG={env!r}; choose one of: {', '.join(LANGS)}", stacklevel=3
        )
        return DEFAULT_LANG
    return env


def set_language(lang: str | None) -> str:
    """Set the language of every later quiz in this process (``"ko"`` or ``"en"``).

    ``None`` goes back to ``$COURSE_LANG`` / English. Returns the language now in effect.
    """
    global _language
    if lang is not None:
        check_lang(lang)
    _language = lang
    return get_language()


def resolve_lang(lang: str | None) -> str:
    """``lang`` checked, or the course-wide language when it is None."""
    if lang is None:
        return get_language()
    check_lang(lang)
    return lang
