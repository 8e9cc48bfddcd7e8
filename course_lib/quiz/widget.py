"""The ipywidgets view: O / X buttons per statement, feedback with the explanation, a running
score, a ko/en toggle, and a summary once every statement is answered (then the score is recorded).

Displaying a widget gives two MIME types: ``application/vnd.jupyter.widget-view+json`` (the live
widget; nbval skips it because its model id is random) and ``text/plain``, the listing of
:mod:`course_lib.quiz.text` ending in :data:`~course_lib.quiz.text.WIDGET_HINT`, which nbval
compares. Tests and scripts drive a widget without a browser: ``answer(i, "O")`` or
``buttons[i][0].click()``.
"""

from __future__ import annotations

import html
from typing import Callable, Sequence

from .bank import chapter_title, is_numeric, statement_text
from .grading import ExamResult, QuizResult, exam_result, grade_items, normalize_for
from .language import LANGS, UI, check_lang
from .progress import progress_path, record_exam, record_score
from .text import WIDGET_HINT, exam_heading, exam_listing, quiz_heading, quiz_listing

__all__ = ["QuizWidget", "ExamWidget", "in_kernel", "widgets_available"]

_GREEN, _RED = "#1a7f37", "#cf222e"


def in_kernel() -> bool:
    """Is this code running in a Jupyter kernel?"""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class QuizWidget:
    """A chapter's quiz as a widget (see the module docstring).

    ``language`` (a ``ToggleButtons``) or ``set_lang("ko")`` re-renders statements, feedback and
    score in the other language; seed items show their Korean text in both.
    """

    feedback_each = True  # the verdict and explanation right after each answer (a chapter quiz)

    def __init__(
        self,
        chapter: str | None,
        items: Sequence[dict],
        lang: str,
        title: str | None = None,
        *,
        record: bool = True,
        bank_dir=None,
    ):
        import ipywidgets as w

        self.chapter, self.items, self.lang, self.record = chapter, list(items), lang, record
        self._titles = self._load_titles(bank_dir)
        if title is not None:
            self._titles[lang] = title
        self.answers: dict[str, str] = {}
        self.saved_entry: dict | None = None
        self._save_error: OSError | None = None
        self.header = w.HTML("")
        self.language = w.ToggleButtons(
            options=[("English", "en"), ("한국어", "ko")],
            value=lang,
            layout=w.Layout(width="auto"),
            style={"button_width": "5.5em"},
        )
        self.language.observe(lambda change: self.set_lang(change["new"]), names="value")
        self.buttons: list[tuple] = []
        self.feedback: list = []
        self.statements: list = []
        rows = [self._row(w, index) for index in range(len(self.items))]
        self.score_label = w.HTML("")
        self.summary = w.HTML("")
        top = w.HBox([self.header, self.language])
        self.box = w.VBox([top, *rows, self.score_label, self.summary])
        self._render()

    def _row(self, w, index: int):
        if is_numeric(self.items[index]):
            return self._numeric_row(w, index)
        statement, feedback = w.HTML(""), w.HTML("")
        o_button = w.Button(description="O", layout=w.Layout(width="3.5em"))
        x_button = w.Button(description="X", layout=w.Layout(width="3.5em"))
        o_button.on_click(self._handler(index, "O"))
        x_button.on_click(self._handler(index, "X"))
        self.statements.append(statement)
        self.buttons.append((o_button, x_button))
        self.feedback.append(feedback)
        return w.VBox([statement, w.HBox([o_button, x_button]), feedback])

    def _numeric_row(self, w, index: int):
        """A numeric question: a text box for the number and a Check button."""
        statement, feedback = w.HTML(""), w.HTML("")
        box = w.Text(placeholder="a number", layout=w.Layout(width="12em"))
        check = w.Button(description="Check", layout=w.Layout(width="6em"))

        def on_check(_button):
            try:
                value = normalize_for(self.items[index], box.value)
            except ValueError:
                feedback.value = html.escape(UI[self.lang]["need_number"])
                return
            self._on_answer(index, value)

        check.on_click(on_check)
        self.statements.append(statement)
        self.buttons.append((box, check))
        self.feedback.append(feedback)
        return w.VBox([statement, w.HBox([box, check]), feedback])

    @property
    def title(self) -> str:
        return self._titles[self.lang]

    # What the exam's widget changes: titles, the heading, the result, where a score goes.

    def _load_titles(self, bank_dir) -> dict[str, str]:
        return {code: chapter_title(self.chapter, code, bank_dir=bank_dir) for code in LANGS}

    def _heading(self) -> str:
        return quiz_heading(self.chapter, self.lang, self.title, self.items)

    def _save(self, result: QuizResult) -> dict:
        return record_score(self.chapter, result.score, result.total)

    def result(self) -> QuizResult:
        """The answered statements so far, graded."""
        return grade_items(self.items, self.answers, self.lang, self.chapter)

    def text(self) -> str:
        return quiz_listing(self.chapter, self.lang, self.title, self.items, WIDGET_HINT)

    # -- language ---------------------------------------------------------------------------------

    def set_lang(self, lang: str) -> None:
        """Show the quiz in ``lang`` (``"ko"`` / ``"en"``): what the toggle does."""
        check_lang(lang)
        self.lang = lang
        if self.language.value != lang:
            self.language.value = lang  # calls set_lang again through the observer; harmless
        self._render()

    def _render(self) -> None:
        self.header.value = f"<b>{html.escape(self._heading())}</b>"
        for number, (item, label) in enumerate(zip(self.items, self.statements, strict=True), 1):
            text = html.escape(statement_text(item, self.lang)).replace("\n", "<br><i>", 1)
            if "<i>" in text:
                text += "</i>"
            label.value = f"<b>{number}.</b> {text}"
        for index, item in enumerate(self.items):
            if item["id"] in self.answers:
                self._show_feedback(index)  # an exam shows the verdicts only once finished
        self.score_label.value = self._score_text()
        if self.finished:
            self._summarize()

    # -- answers ----------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return len(self.answers) == len(self.items)

    def answer(self, index: int | str, value: str) -> None:
        """Answer statement ``index`` (0-based position, or its id) as its button would."""
        if isinstance(index, str):
            ids = [item["id"] for item in self.items]
            if index not in ids:
                raise ValueError(f"unknown item id {index!r}; this quiz has: {', '.join(ids)}")
            index = ids.index(index)
        self._on_answer(index, normalize_for(self.items[index], value))

    def _handler(self, index: int, value: str) -> Callable:
        return lambda _button: self._on_answer(index, value)

    def _on_answer(self, index: int, value: str) -> None:
        item = self.items[index]
        if item["id"] in self.answers:  # one attempt per statement; buttons are disabled anyway
            return
        self.answers[item["id"]] = value
        for button in self.buttons[index]:
            button.disabled = True
        chosen = self._chosen(index)
        if self.feedback_each:
            chosen.button_style = "success" if self._correct(index) else "danger"
        else:
            chosen.button_style = "info"  # answered; the verdict waits for the end
        self._show_feedback(index)
        self.score_label.value = self._score_text()
        if self.finished:
            self._finish()

    def _chosen(self, index: int):
        """The button that took statement ``index``'s answer (O or X; Check for a number)."""
        first, second = self.buttons[index]
        if is_numeric(self.items[index]):
            return second
        return first if self.answers[self.items[index]["id"]] == "O" else second

    def _graded(self, index: int):
        item = self.items[index]
        return grade_items([item], {item["id"]: self.answers[item["id"]]}, self.lang).items[0]

    def _correct(self, index: int) -> bool:
        return self._graded(index).correct

    def _show_feedback(self, index: int) -> None:
        ui, item = UI[self.lang], self.items[index]
        if not (self.feedback_each or self.finished):
            given = self.answers[item["id"]]
            self.feedback[index].value = html.escape(ui["recorded"].format(given=given))
            return
        graded = self._graded(index)
        correct = graded.correct
        verdict = ui["right"]
        if not correct:
            verdict = f"{ui['wrong']} — {ui['answer_is'].format(answer=graded.answer_text)}"
        color = _GREEN if correct else _RED
        self.feedback[index].value = (
            f"<span style='color:{color}'><b>{html.escape(verdict)}</b></span> "
            f"{html.escape(item['explanation'][self.lang])}"
        )

    def _score_text(self) -> str:
        answered = [i for i in self.items if i["id"] in self.answers]
        score = grade_items(answered, self.answers, self.lang).score
        key = "score" if self.feedback_each or self.finished else "answered"
        text = UI[self.lang][key].format(
            score=score, answered=len(answered), left=len(self.items) - len(answered)
        )
        return f"<b>{html.escape(text)}</b>"

    def _finish(self) -> None:
        if not self.feedback_each:  # the exam's verdicts and explanations, all at the end
            for index in range(len(self.items)):
                self._chosen(index).button_style = "success" if self._correct(index) else "danger"
                self._show_feedback(index)
            self.score_label.value = self._score_text()
        self._save_error = None
        if self.record:
            try:
                self.saved_entry = self._save(self.result())
            except OSError as exc:
                self._save_error = exc
        self._summarize()

    def _summarize(self) -> None:
        ui = UI[self.lang]
        result = self.result()
        final = ui["final"].format(score=result.score, total=result.total)
        missed = f"{ui['missed']}: {', '.join(result.missed_traps) or ui['none']}"
        parts = [f"<b>{html.escape(final)}</b>", html.escape(missed)]
        if self.record and self._save_error is not None:
            parts.append(html.escape(ui["not_saved"].format(err=self._save_error)))
        elif self.record and self.saved_entry is not None:
            parts.append(html.escape(ui["saved"].format(path=progress_path())))
        self.summary.value = "<br>".join(parts)

    # -- display ----------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = dict(self.box._repr_mimebundle_())
        data["text/plain"] = self.text()
        return data


class ExamWidget(QuizWidget):
    """The quiz widget over an exam form: no verdict or explanation until every statement is
    answered (an explanation would answer a later statement); then each verdict and explanation,
    the score per topic and the sections to reread, and the score in the progress file."""

    feedback_each = False

    def __init__(
        self, items: Sequence[dict], lang: str, seed: int = 0, *, record: bool = True, bank_dir=None
    ):
        self.seed, self._bank_dir = seed, bank_dir
        super().__init__(None, items, lang, record=record, bank_dir=bank_dir)

    def _load_titles(self, bank_dir) -> dict[str, str]:
        return {code: exam_heading(code, self.items, self.seed, bank_dir) for code in LANGS}

    def _heading(self) -> str:
        return self.title

    def _save(self, result: ExamResult) -> dict:
        return record_exam(result)

    def result(self) -> ExamResult:
        return exam_result(self.items, self.answers, self.lang, self.seed)

    def text(self) -> str:
        return exam_listing(self.items, self.lang, self.seed, WIDGET_HINT, self._bank_dir)

    def _summarize(self) -> None:
        super()._summarize()
        result = self.result()
        table = "<pre style='margin:0'>" + html.escape(result.topic_table()) + "</pre>"
        extra = [f"<b>{html.escape(UI[self.lang]['by_topic'])}</b>", table]
        if result.reread:
            extra.append(html.escape(result.reread_text()))
        self.summary.value += "<br>" + "<br>".join(extra)
