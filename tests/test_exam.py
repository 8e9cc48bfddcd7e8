"""The final O/X exam and course progress: the form (14 seeds, every chapter, never two of a group), grading with
per-topic scores, missed traps and sections to reread, the widget, the text fallback, the terminal exam and the
``course-lib exam`` / ``course-lib progress`` commands, ``course-lib quiz --chapter`` by topic or number, the exercise
registry (data, checkers resolved when used), and a real ``check()`` pass landing in the progress file."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import chapters as course
from course_lib import quiz as q
from course_lib.quiz.forms import BALANCE

x = q  # the exam's API is the quiz package's

ROOT = Path(__file__).resolve().parents[1]
GROUPED = {item["id"]: item["group"] for item in q.load_bank() if item.get("group")}


@pytest.fixture(autouse=True)
def course_home(tmp_path, monkeypatch):
    """Each test has its own progress file and the course default language (English)."""
    home = tmp_path / "course_home"
    monkeypatch.setenv("COURSE_LIB_HOME", str(home))
    monkeypatch.delenv("COURSE_LANG", raising=False)
    q.set_language(None)
    return home


def flipped(answer):
    return "X" if answer == "O" else "O"


def key(form):
    return {item["id"]: item["answer"] for item in form}


# -- the form ---------------------------------------------------------------------------------------


def ox(form):
    return [item for item in form if item.get("kind") != "numeric"]


@pytest.mark.parametrize("seed", range(6))
def test_a_form_ends_with_three_computations_from_three_chapters(seed):
    form = x.exam_items(seed=seed)
    numeric = form[40:]
    assert len(form) == 43 and ox(form) == form[:40]
    assert all(i["kind"] == "numeric" for i in numeric)
    assert len({i["chapter"] for i in numeric}) == 3
    assert x.exam_items(seed=seed, computations=0) == form[:40]
    item = numeric[0]
    slack = item["tolerance"]
    near, far = item["answer"] + slack / 2, item["answer"] + 10 * slack + 1
    graded = x.grade_exam({item["id"]: str(near)}, seed=seed, record=False)
    assert graded.score == 1 and graded.items[0].answer_text.endswith(")")
    assert x.grade_exam({item["id"]: far}, seed=seed, record=False).score == 0
    with pytest.raises(ValueError, match="a number is expected"):
        x.grade_exam({item["id"]: "O"}, seed=seed, record=False)


@pytest.mark.parametrize("seed", range(12))
def test_form_has_40_items_all_14_seeds_every_chapter_and_one_per_group(seed):
    form = ox(x.exam_items(n=40, seed=seed))
    assert len(form) == 40 and len({i["id"] for i in form}) == 40
    assert sum(bool(i.get("seed")) for i in form) == 14
    assert {i["id"] for i in q.load_bank() if i.get("seed")} <= {i["id"] for i in form}
    groups = collections.Counter(i["group"] for i in form if i.get("group"))
    assert all(count == 1 for count in groups.values()), groups
    per_chapter = collections.Counter(i["chapter"] for i in form if not i.get("seed"))
    assert set(per_chapter) == set(q.chapters())
    # each chapter its share of the non-seed statements, whatever its seeds
    assert max(per_chapter.values()) - min(per_chapter.values()) <= 1, per_chapter
    small = ox(x.exam_items(n=30, seed=seed))
    assert len(small) == 30 and sum(bool(i.get("seed")) for i in small) == 14


@pytest.mark.parametrize("n", [27, 40, 60])  # 27: 13 others can just separate 14 seeds
def test_forms_are_balanced_shuffled_and_keep_seed_statements_apart(n):
    """Over many forms: O within ±3 of half, no two seeds side by side, not in bank order, and every
    chapter's non-seed items reachable (chapter 05's four seeds once filled its whole quota)."""
    order = {item["id"]: k for k, item in enumerate(q.load_bank())}
    reached = collections.Counter()
    for seed in range(150):
        form = ox(x.exam_items(n=n, seed=seed))
        o_count = sum(i["answer"] == "O" for i in form)
        assert abs(o_count - n / 2) <= BALANCE, (seed, o_count)
        seeds = [bool(i.get("seed")) for i in form]
        assert not any(a and b for a, b in zip(seeds, seeds[1:], strict=False)), seed
        ranks = [order[i["id"]] for i in form]
        assert ranks != sorted(ranks)
        reached.update(i["chapter"] for i in form if not i.get("seed"))
    assert set(reached) == set(q.chapters()) and min(reached.values()) >= 150  # ≥ 1 a form


def test_form_is_deterministic_varies_with_the_seed_and_reaches_every_grouped_item():
    assert x.exam_items(seed=5) == x.exam_items(seed=5)
    assert x.exam_items(seed=5) != x.exam_items(seed=6)
    drawn = {i["id"] for seed in range(60) for i in x.exam_items(n=60, seed=seed)}
    bank = q.load_bank(kind=None)  # numeric questions too
    seed_groups = {i["group"] for i in bank if i.get("seed") and i.get("group")}
    # every form has every seed, so an item that would give a seed away never appears
    shadowed = {i["id"] for i in bank if i.get("group") in seed_groups and not i.get("seed")}
    assert not drawn & shadowed
    # a group limits a form, not the bank: every other member gets its turn
    assert set(GROUPED) - shadowed <= drawn
    assert drawn == {i["id"] for i in bank} - shadowed


def test_form_size_bounds():
    seeds_only = x.exam_items(n=14, computations=0)
    assert len(seeds_only) == 14 and all(i.get("seed") for i in seeds_only)
    largest = len(x.exam_items(n=None, computations=0))  # every item the group rule allows
    assert largest > 40
    assert len(x.exam_items(n=largest, computations=0)) == largest
    for bad in (13, largest + 1, 40.0, True, "40"):
        with pytest.raises(ValueError, match=r"between 14 \(the seed statements\) and"):
            x.exam_items(n=bad)


# -- grading ----------------------------------------------------------------------------------------


def test_grade_all_right_then_some_wrong_scores_per_topic_traps_and_reread(course_home):
    form = x.exam_items()
    answers = key(form)
    perfect = x.grade_exam(answers, record=False)
    assert (
        (perfect.score, perfect.total) == (43, 43)
        and perfect.missed_traps == []
        and perfect.reread == ()
    )
    wrong = [form[1], form[17], form[33]]
    for item in wrong:
        answers[item["id"]] = flipped(item["answer"]).lower()
    result = x.grade_exam(answers, record=False)
    assert (result.score, result.total) == (40, 43)
    assert result.missed == [i["id"] for i in wrong]
    assert result.missed_traps == list(dict.fromkeys(i["trap"] for i in wrong))
    assert result.reread == tuple(dict.fromkeys((i["trap"], q.section_of(i)) for i in wrong))
    assert all(where[:2].isdigit() and where[2] == "#" for _, where in result.reread)  # "NN#anchor"
    topics = result.by_topic()
    assert sum(n for _, n in topics.values()) == 43
    expected = collections.Counter(i["topic"] for i in form)
    assert {t: n for t, (_, n) in topics.items()} == dict(expected)
    for topic, (score, total) in topics.items():
        assert score == total - sum(i["topic"] == topic for i in wrong)
    reported = result.reported_topics()  # small topics folded into their chapter
    assert sum(n for _, n in reported.values()) == 43
    for name, (_, total) in reported.items():
        if not name.endswith("(other topics)"):
            assert total >= q.grading.MIN_TOPIC_ITEMS and topics[name][1] == total
    folded = {t for t, (_, n) in topics.items() if n < q.grading.MIN_TOPIC_ITEMS}
    assert folded and not folded & set(reported)
    assert not (course_home / "progress.json").exists()  # record=False


def test_report_is_deterministic_and_names_topics_traps_and_sections(course_home):
    form = x.exam_items(seed=2)
    answers = key(form)
    miss = form[4]
    answers[miss["id"]] = flipped(miss["answer"])
    text = repr(x.grade_exam(answers, seed=2, record=False))
    assert text == repr(x.grade_exam(dict(answers), seed=2, record=False))
    lines = text.splitlines()
    assert lines[0] == "O/X exam result: 42/43 correct (98%)"
    assert f"Missed traps: {miss['trap']}" in lines
    table_start = lines.index("Score by topic:")
    weakest = lines[table_start + 1].split()
    assert weakest[0] == miss["topic"]  # weakest topic first
    topic, anchor = miss["teaches"].split("#")
    assert lines[-1] == f"Reread: {course.number(topic):02d}#{anchor} ({miss['trap']})"
    assert not any(
        line.startswith("By topic:") for line in lines
    )  # the table replaces the one-line summary
    korean = repr(x.grade_exam(answers, seed=2, lang="ko", record=False)).splitlines()
    assert korean[0] == "O/X 시험 결과: 42/43 정답 (98%)" and korean[-1].startswith(
        "다시 읽을 곳: "
    )
    assert "주제별 점수:" in korean


def test_grade_accepts_a_list_in_form_order_and_rejects_bad_input():
    form = x.exam_items(n=20, seed=1)
    result = x.grade_exam([i["answer"] for i in form], n=20, seed=1, record=False)
    assert result.score == result.total == 23  # 20 O/X statements and 3 computations
    with pytest.raises(ValueError, match="23 statements but 2 answers"):
        x.grade_exam(["O", "X"], n=20, seed=1)
    outside = next(i["id"] for i in q.load_bank() if i["id"] not in {f["id"] for f in form})
    with pytest.raises(
        ValueError, match=f"unknown item id '{outside}' for the exam form n=20, seed=1"
    ):
        x.grade_exam({outside: "O"}, n=20, seed=1)
    with pytest.raises(ValueError, match="allowed values are 'O' or 'X'"):
        x.grade_exam({form[0]["id"]: "maybe"}, n=20, seed=1)
    with pytest.raises(ValueError, match="no answers"):
        x.grade_exam({}, n=20, seed=1)
    with pytest.raises(ValueError, match="unknown language"):
        x.grade_exam({form[0]["id"]: "O"}, n=20, seed=1, lang="fr")


def test_grading_records_last_and_best_exam_score_beside_the_quizzes(course_home):
    form = x.exam_items()
    q.grade(3, {i["id"]: i["answer"] for i in q.load_bank(3)})
    x.grade_exam(key(form))
    half = {
        i["id"]: (i["answer"] if n % 2 else flipped(i["answer"])) for n, i in enumerate(ox(form))
    }
    x.grade_exam(half)
    stored = json.loads((course_home / "progress.json").read_text(encoding="utf-8"))
    assert stored["exam"] == {
        "best": {"score": 43, "total": 43, "seed": 0},
        "last": {"score": 20, "total": 40, "seed": 0},  # the computations left unanswered
        "attempts": 2,
    }
    assert stored["quiz"]["zero"]["attempts"] == 1  # the quiz section survives exam writes


# -- displays ---------------------------------------------------------------------------------------


def test_widget_grades_and_explains_only_at_the_end_then_topics_traps_reread_and_record(
    course_home,
):
    widget = x.final_exam(mode="widget")
    assert isinstance(widget, x.ExamWidget) and len(widget.buttons) == 43
    assert (
        "Final O/X exam — chapters 00–10 (40 statements, form 0) + 3 computations"
        in widget.header.value
    )
    items = widget.items
    o_button, x_button = widget.buttons[0]
    (x_button if items[0]["answer"] == "O" else o_button).click()  # wrong on purpose
    # mid-exam: no verdict, no explanation (it could answer a later statement), no running score
    assert "wrong" not in widget.feedback[0].value and "graded" in widget.feedback[0].value
    assert items[0]["explanation"]["en"] not in widget.feedback[0].value
    assert "1 answered · 42 left" in widget.score_label.value
    for index, item in enumerate(items[1:-1], start=1):
        widget.answer(index, item["answer"])
    assert not any("correct" in f.value for f in widget.feedback)
    widget.answer(len(items) - 1, items[-1]["answer"])
    assert widget.finished
    assert "✘ wrong" in widget.feedback[0].value and "✔ correct" in widget.feedback[1].value
    assert "42/43" in widget.score_label.value
    summary = widget.summary.value
    assert "Final score 42/43" in summary and "Score by topic" in summary
    assert f"Reread: {q.section_of(items[0])}" in summary and items[0]["trap"] in summary
    assert q.progress()["exam"]["last"] == {"score": 42, "total": 43, "seed": 0}
    widget.set_lang("ko")
    assert "최종 O/X 시험" in widget.header.value and "주제별 점수" in widget.summary.value


def test_widget_and_text_listings_are_deterministic():
    widget, again = (
        x.final_exam(mode="widget", record=False),
        x.final_exam(mode="widget", record=False),
    )
    bundle = widget._repr_mimebundle_()
    assert bundle["text/plain"] == again._repr_mimebundle_()["text/plain"] == widget.text()
    lines = widget.text().splitlines()
    cut = lines.index("")  # the statements, then the answer key for a reader without a kernel
    lines, answer_key = lines[:cut], lines[cut + 1 :]
    form = x.exam_items()
    assert lines[0] == "Final O/X exam — chapters 00–10 (40 statements, form 0) + 3 computations"
    assert lines[-1] == q.WIDGET_HINT
    assert answer_key[0].startswith("Answers and explanations")
    assert answer_key[1].startswith(f" 1. {form[0]['answer']} — ")
    first_plain = next(n for n, i in enumerate(form) if not i.get("seed"))
    plain = form[first_plain]
    tag = f"{first_plain + 1:2d}. [{course.number(plain['chapter']):02d}] "
    assert lines[lines.index(tag + plain["statement"]["ko"]) + 1] == (
        f"    ({plain['statement']['en']})"
    )
    shown = x.final_exam(seed=3)  # pytest is not a kernel: the text fallback
    assert isinstance(shown, x.ExamText)
    text = repr(shown).splitlines()
    widget_text = x.ExamWidget(x.exam_items(seed=3), "en", 3, record=False).text().splitlines()
    cut = text.index("")
    assert text[cut - 1] == (
        "(answer with grade_exam({item_id: 'O' or 'X'}, n=40, seed=3) or: "
        "course-lib exam -n 40 --seed 3)"
    )
    assert text[cut:] == widget_text[cut:]  # the same answer key
    assert text[1 : cut - 1] == widget_text[1 : cut - 1]
    assert repr(x.final_exam(lang="ko", mode="text")).startswith(
        "최종 O/X 시험 — 00–10장 전체 (40문항, 시험지 0)"
    )
    with pytest.raises(ValueError, match="mode must be"):
        x.final_exam(mode="gui")


@pytest.mark.parametrize("lang", ["ko", "en"])
@pytest.mark.parametrize("seed", [0, 3])
def test_every_exam_item_is_listed_in_both_languages(seed, lang):
    """The exam's text fallback: each statement (tagged with its chapter) and each explanation in
    Korean, then the English in parentheses, numeric questions included, in either language."""
    from test_quiz import assert_bilingual_listing

    shown = x.final_exam(seed=seed, lang=lang, mode="text")
    tags = [f"[{course.number(item['chapter']):02d}] " for item in shown.items]
    assert any(item.get("kind") == "numeric" for item in shown.items)
    assert_bilingual_listing(repr(shown), shown.items, tags)


# -- terminal and command line ----------------------------------------------------------------------


def test_terminal_exam_with_scripted_input(course_home):
    form = x.exam_items(n=14)
    replies = iter(
        [form[0]["answer"].lower(), "maybe", flipped(form[1]["answer"]), form[2]["answer"], "q"]
    )
    printed = []
    result = x.run_terminal_exam(
        n=14,
        input_fn=lambda _: next(replies),
        print_fn=lambda *a: printed.append(" ".join(map(str, a))),
    )
    out = "\n".join(printed)
    assert (result.score, result.total) == (2, 3)
    # the verdicts and explanations come after the last answer, none between the questions
    last_question = max(i for i, line in enumerate(printed) if line.startswith("[3/17]"))
    assert not any("why:" in line or "✔" in line for line in printed[:last_question])
    assert form[0]["explanation"]["en"] in out
    assert "Please answer O or X" in out and "Final score 2/3" in out
    assert f"Missed traps: {form[1]['trap']}" in out and "Score by topic:" in out
    assert f"Reread: {q.section_of(form[1])} ({form[1]['trap']})" in out
    assert q.progress()["exam"]["last"] == {"score": 2, "total": 3, "seed": 0}


def run_cli(args, stdin="", home=None):
    env = dict(os.environ, COURSE_LIB_HOME=str(home), PYTHONIOENCODING="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "course_lib.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_cli_exam_and_progress(course_home):
    form = x.exam_items(n=14, seed=4)  # 14 seed statements, then 3 computations
    statements, numeric = form[:14], form[14:]
    answers = "".join(f"{i['answer']}\n" for i in statements[:-1])
    answers += f"{flipped(statements[-1]['answer'])}\n"
    answers += "not a number\n" + "".join(f"{i['answer']}\n" for i in numeric)
    done = run_cli(["exam", "-n", "14", "--seed", "4", "--lang", "ko"], answers, course_home)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("최종 O/X 시험 — 00–10장 전체 (14문항, 시험지 4) + 계산 문제 3개")
    assert "숫자를 입력하세요" in done.stdout  # a reply that is not a number is asked again
    assert (
        "최종 점수 16/17" in done.stdout
        and f"다시 읽을 곳: {q.section_of(statements[-1])}" in done.stdout
    )
    bad = run_cli(["exam", "-n", "3"], "", course_home)
    assert bad.returncode == 2 and "between 14 (the seed statements)" in bad.stderr
    q.record_score(2, 10, 17)
    shown = run_cli(["progress"], "", course_home)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"Course progress ({course_home / 'progress.json'})"
    assert any(
        line.startswith("  02 ") and line.endswith("10/17 (59%), 1 attempt(s)") for line in lines
    )
    assert any(line.startswith("  05 ") and line.endswith("not yet") for line in lines)
    assert "Final exam: 16/17 (94%), 1 attempt(s)" in lines
    assert lines[-1].startswith(f"Done: quizzes 1/{len(q.chapters())}, exercises 0/")


# -- progress ---------------------------------------------------------------------------------------


def test_course_progress_lists_every_chapter_and_exercise():
    from course_lib.check import EXERCISES

    assert EXERCISES is q.EXERCISES  # one registry, read by the checker and by progress
    assert x.exercise_chapters() == {name: ex.chapter for name, ex in EXERCISES.items()}
    assert x.exercise_chapters()["count_model_state_bytes"] == "single-device"
    state = x.course_progress()
    assert list(state.quizzes) == q.chapters() and all(v is None for v in state.quizzes.values())
    assert list(state.exercises) == list(EXERCISES) and not any(
        ok for _, ok in state.exercises.values()
    )
    assert state.exercises["ring_all_reduce"] == ("collectives", False) and state.exam is None
    q.record_score(0, 3, 4)
    x.record_exercise("ring_all_reduce")
    x.record_exercise("ring_all_reduce")
    state = x.course_progress()
    assert state.quizzes["collectives"] == (3, 4, 1) and state.exercises["ring_all_reduce"] == (
        "collectives",
        True,
    )
    assert q.progress()["exercises"]["ring_all_reduce"] == {"passed": True, "passes": 2}
    korean = x.progress_report(state, "ko").splitlines()
    assert korean[-1].startswith(f"완료: 퀴즈 1/{len(q.chapters())}, 연습 문제 1/")
    assert any(
        line.strip().startswith("00 ring_all_reduce") and line.endswith("통과") for line in korean
    )


def test_a_passing_check_of_the_learners_exercise_is_recorded_and_the_solution_is_not(
    learner_answer,
):
    from course_lib.check import check

    assert check("count_model_state_bytes", package="solutions").passed
    assert "exercises" not in q.progress()  # the reference solution is not the learner's work
    run = learner_answer(
        "single_device", (ROOT / "solutions" / "single_device.py").read_text(encoding="utf-8")
    )
    assert run("count_model_state_bytes").passed
    assert q.progress()["exercises"] == {"count_model_state_bytes": {"passed": True, "passes": 1}}
    assert x.course_progress().exercises["count_model_state_bytes"] == ("single-device", True)


# -- the exercise registry --------------------------------------------------------------------------


def test_the_registry_is_data_and_imports_no_checker_until_one_is_used():
    """Importing the checker (or listing exercises) imports neither torch nor a checks module; a runner
    resolves its "module:function" name to the checker in course_lib/checks/<module>.py."""
    code = (
        "import sys, course_lib.check as c, course_lib.quiz as q\n"
        "print(sorted(m for m in sys.modules if m.startswith('course_lib.checks') or m == 'torch'))\n"
        "ex = c.EXERCISES['allreduce_gradients']\n"
        "print(ex.checker, ex.runner.__module__, ex.runner.__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == "[]"
    assert second == (
        "course_lib.checks.ddp:check_allreduce_gradients course_lib.checks.ddp "
        "check_allreduce_gradients"
    )
    for name, ex in q.EXERCISES.items():
        module, function = ex.checker.split(":")
        assert module == f"course_lib.checks.{ex.module}", name
        assert course.chapter(ex.chapter).topic == ex.chapter, name


def test_cli_quiz_takes_a_topic_or_a_number(course_home):
    items = q.quiz_items("ddp")[1]  # the O/X statements, then 3 computations
    answers = "".join(f"{i['answer']}\n" for i in items)
    by_topic = run_cli(["quiz", "--chapter", "ddp"], answers, course_home)
    assert by_topic.returncode == 0, by_topic.stderr
    assert by_topic.stdout.startswith(
        f"Chapter 02 O/X quiz — {q.chapter_title('ddp')} ({len(items) - 3} statements)"
        " + 3 computations"
    )
    assert f"Final score {len(items)}/{len(items)}" in by_topic.stdout
    by_number = run_cli(["quiz", "--chapter", "2", "-n", "1"], "q\n", course_home)
    assert by_number.returncode == 0 and by_number.stdout.splitlines()[0].startswith(
        "Chapter 02 O/X quiz"
    )
    assert (
        q.progress()["quiz"]["ddp"]["attempts"] == 1
    )  # the run that answered nothing recorded nothing
    bad = run_cli(["quiz", "--chapter", "nope"], "", course_home)
    assert (
        bad.returncode == 2
        and "unknown chapter 'nope'; available chapters: collectives (00)" in bad.stderr
    )
