"""The O/X quiz: the bank's schema and coverage, the seed statements, grading, progress, the terminal
quiz, the widget, and the deterministic text/plain output that nbval compares."""

from __future__ import annotations

import collections
import importlib
import inspect
import json
import re
from pathlib import Path

import pytest
import yaml

q = importlib.import_module("course_lib.quiz")  # the module, even if course_lib re-exports quiz()

CHAPTERS = list(range(10))
SEED_DIR = Path(__file__).resolve().parents[2] / "shared" / "seeds"
BANK_FILES = sorted(q.BANK_DIR.glob("ch*.yaml"))


@pytest.fixture(autouse=True)
def course_home(tmp_path, monkeypatch):
    """Every test writes progress into its own temporary COURSE_LIB_HOME, never into ~/.cache."""
    home = tmp_path / "course_home"
    monkeypatch.setenv("COURSE_LIB_HOME", str(home))
    return home


def correct_answers(chapter):
    return {item["id"]: item["answer"] for item in q.load_bank(chapter)}


def flipped(answer):
    return "X" if answer == "O" else "O"


# -- the bank ---------------------------------------------------------------------------------------


def test_bank_has_one_file_per_chapter_00_to_09():
    assert [p.name for p in BANK_FILES] == [f"ch{c:02d}.yaml" for c in CHAPTERS]
    assert q.chapters() == CHAPTERS


@pytest.mark.parametrize("path", BANK_FILES, ids=lambda p: p.name)
def test_bank_file_schema(path):
    """Raw YAML, checked independently of the engine's validator."""
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    chapter = int(path.stem[2:])
    assert data["chapter"] == chapter
    assert data["title"]["ko"].strip() and data["title"]["en"].strip()
    for item in data["items"]:
        assert set(item) <= {"id", "chapter", "statement", "answer", "explanation", "trap", "source", "seed"}
        assert re.fullmatch(rf"ch{chapter:02d}-[a-z0-9-]+", item["id"]), item["id"]
        assert item["chapter"] == chapter, item["id"]
        assert item["answer"] in ("O", "X"), item["id"]
        for name in ("statement", "explanation"):
            for lang in ("ko", "en"):
                assert isinstance(item[name][lang], str) and item[name][lang].strip(), (item["id"], name, lang)
        assert isinstance(item["trap"], str) and item["trap"].strip(), item["id"]
        assert isinstance(item["source"], str) and item["source"].strip(), item["id"]
        assert item.get("seed", False) in (True, False), item["id"]
    q.validate_bank(data["items"], source=str(path), chapter=chapter)


def test_bank_ids_unique_across_all_chapters():
    ids = [item["id"] for item in q.load_bank()]
    duplicates = [i for i, count in collections.Counter(ids).items() if count > 1]
    assert not duplicates


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_chapter_has_at_least_12_items_besides_the_seeds(chapter):
    items = q.load_bank(chapter)
    assert len(items) >= 10
    assert sum(not item.get("seed") for item in items) >= 12


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_each_chapter_mixes_true_and_false_statements(chapter):
    answers = collections.Counter(item["answer"] for item in q.load_bank(chapter))
    total = sum(answers.values())
    assert min(answers["O"], answers["X"]) >= total / 3, answers


def test_explanations_say_more_than_the_statement():
    for item in q.load_bank():
        for lang in ("ko", "en"):
            assert len(item["explanation"][lang]) > 40, (item["id"], lang)
            assert item["explanation"][lang].strip() != item["statement"][lang].strip(), item["id"]


# -- the seed statements ----------------------------------------------------------------------------


def seed_statements():
    files = sorted(SEED_DIR.glob("003_*.txt"))
    if not files:
        pytest.skip(f"seed file 003_*.txt not found under {SEED_DIR}")
    pairs = []
    for line in files[0].read_text(encoding="utf-8").splitlines():
        match = re.match(r"^(O|X): (.+)$", line.strip())
        if match:
            pairs.append((match.group(2).strip(), match.group(1)))
    return pairs


def test_seed_file_has_fourteen_statements_seven_o_seven_x():
    pairs = seed_statements()
    assert len(pairs) == 14
    assert collections.Counter(answer for _, answer in pairs) == {"O": 7, "X": 7}


def test_all_seed_statements_are_in_the_bank_verbatim_with_the_seed_answer():
    bank = {item["statement"]["ko"]: item for item in q.load_bank()}
    for statement, answer in seed_statements():
        assert statement in bank, f"seed statement missing from the bank: {statement}"
        item = bank[statement]
        assert item["answer"] == answer, item["id"]
        assert item.get("seed") is True, item["id"]


def test_only_seed_statements_are_marked_seed():
    seeds = {statement for statement, _ in seed_statements()}
    marked = {item["statement"]["ko"] for item in q.load_bank() if item.get("seed")}
    assert marked == seeds


@pytest.mark.parametrize(
    "fragment, chapters",
    [
        ("분산 학습은", {0}),
        ("Data Parallel은", {2}),
        ("Model Parallel은", {5, 6}),
        ("파이프라인 병렬은", {5}),
        ("텐서 병렬은", {6}),
        ("Horovod는", {2, 9}),
        ("DeepSpeed는", {3}),
    ],
)
def test_seed_statements_sit_in_their_topic_chapter(fragment, chapters):
    placed = {
        item["chapter"]
        for item in q.load_bank()
        if item.get("seed") and item["statement"]["ko"].startswith(fragment)
    }
    assert placed and placed <= chapters


# -- validation errors ------------------------------------------------------------------------------


def good_item(chapter=0, name="sample"):
    return {
        "id": f"ch{chapter:02d}-{name}",
        "chapter": chapter,
        "statement": {"ko": "문장", "en": "statement"},
        "answer": "O",
        "explanation": {"ko": "해설", "en": "explanation"},
        "trap": "a trap",
        "source": "a source",
    }


def write_bank(root: Path, chapter: int, items, *, title=True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    data = {"chapter": chapter, "items": items}
    if title:
        data["title"] = {"ko": "제목", "en": "title"}
    path = root / f"ch{chapter:02d}.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    return path


def test_malformed_yaml_names_the_file(tmp_path):
    bank = tmp_path / "bank"
    bank.mkdir()
    (bank / "ch00.yaml").write_text("chapter: 0\nitems: [unclosed\n", encoding="utf-8")
    with pytest.raises(q.QuizBankError, match=r"ch00\.yaml.*malformed YAML"):
        q.load_bank(bank_dir=bank)


def test_a_valid_tmp_bank_loads(tmp_path):
    write_bank(tmp_path / "bank", 0, [good_item(0, "a"), good_item(0, "b")])
    assert [i["id"] for i in q.load_bank(0, bank_dir=tmp_path / "bank")] == ["ch00-a", "ch00-b"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda it: it.pop("trap"), r"missing field 'trap'"),
        (lambda it: it.pop("explanation"), r"missing field 'explanation'"),
        (lambda it: it.update(answer="True"), r"answer must be 'O' or 'X'"),
        (lambda it: it.update(answer="o"), r"answer must be 'O' or 'X'"),
        (lambda it: it["statement"].pop("en"), r"statement is missing its 'en' text"),
        (lambda it: it["explanation"].update(ko="  "), r"explanation is missing its 'ko' text"),
        (lambda it: it.update(chapter=3), r"chapter 3 does not match the file's chapter 0"),
        (lambda it: it.update(seed="yes"), r"seed must be true or false"),
        (lambda it: it.update(explaination={}), r"unknown field"),
    ],
    ids=["missing-trap", "missing-explanation", "answer-true", "answer-lowercase", "missing-en",
         "blank-ko", "chapter-mismatch", "seed-not-bool", "typo-field"],
)
def test_invalid_items_are_reported_with_file_and_id(tmp_path, mutate, message):
    item = good_item(0, "broken")
    mutate(item)
    path = write_bank(tmp_path / "bank", 0, [good_item(0, "fine"), item])
    with pytest.raises(q.QuizBankError, match=message) as info:
        q.load_bank(bank_dir=tmp_path / "bank")
    assert str(path) in str(info.value)
    assert "ch00-broken" in str(info.value)


def test_duplicate_id_in_a_file_is_reported(tmp_path):
    path = write_bank(tmp_path / "bank", 0, [good_item(0, "same"), good_item(0, "other"), good_item(0, "same")])
    with pytest.raises(q.QuizBankError, match=r"item 'ch00-same': duplicate id") as info:
        q.load_bank(bank_dir=tmp_path / "bank")
    assert str(path) in str(info.value)


def test_id_prefix_must_match_the_chapter(tmp_path):
    write_bank(tmp_path / "bank", 0, [good_item(0, "a")])
    other = good_item(1, "b")
    other["id"] = "ch00-b"
    write_bank(tmp_path / "bank", 1, [other])
    with pytest.raises(q.QuizBankError, match=r"ch01\.yaml, item 'ch00-b': id must start with 'ch01-'"):
        q.load_bank(bank_dir=tmp_path / "bank")


def test_duplicate_id_within_a_list():
    with pytest.raises(q.QuizBankError, match=r"<items>, item 'ch00-sample': duplicate id"):
        q.validate_bank([good_item(), good_item()])


def test_file_without_items_list_is_rejected(tmp_path):
    bank = tmp_path / "bank"
    bank.mkdir()
    (bank / "ch00.yaml").write_text("- just a list\n", encoding="utf-8")
    with pytest.raises(q.QuizBankError, match=r"ch00\.yaml.*'items' list"):
        q.load_bank(bank_dir=bank)


def test_unknown_chapter_lists_the_available_ones():
    expected = "available chapters: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9"
    for call in (lambda: q.load_bank(42), lambda: q.quiz(42), lambda: q.grade(42, {}), lambda: q.load_bank("x")):
        with pytest.raises(ValueError, match=expected):
            call()


def test_chapter_may_be_given_as_a_string():
    assert q.load_bank("02") == q.load_bank(2)


def test_loaded_items_are_copies():
    items = q.load_bank(0)
    items[0]["answer"] = "changed"
    assert q.load_bank(0)[0]["answer"] in ("O", "X")


# -- grading ----------------------------------------------------------------------------------------


def test_grade_all_correct(course_home):
    answers = correct_answers(2)
    result = q.grade(2, answers)
    assert (result.score, result.total) == (len(answers), len(answers))
    assert all(result.correct.values())
    assert result.missed_traps == [] and result.missed == []
    assert set(result.explanations) == set(answers)


def test_grade_counts_wrong_answers_and_collects_their_traps():
    items = q.load_bank(3)
    answers = {item["id"]: item["answer"] for item in items}
    wrong = [items[0], items[3], items[5]]
    for item in wrong:
        answers[item["id"]] = flipped(item["answer"])
    result = q.grade(3, answers, lang="en")
    assert result.score == len(items) - 3
    assert [i for i, ok in result.correct.items() if not ok] == [item["id"] for item in wrong]
    assert result.missed_traps == list(dict.fromkeys(item["trap"] for item in wrong))
    assert result.explanations[items[0]["id"]] == items[0]["explanation"]["en"]


def test_grade_accepts_lower_case_and_a_list_in_bank_order():
    items = q.load_bank(1)
    as_list = [item["answer"].lower() for item in items]
    result = q.grade(1, as_list, record=False)
    assert result.score == result.total == len(items)


def test_grade_a_subset():
    item = q.load_bank(4)[2]
    result = q.grade(4, {item["id"]: flipped(item["answer"])}, record=False)
    assert (result.score, result.total) == (0, 1)
    assert result.missed_traps == [item["trap"]]


@pytest.mark.parametrize("bad", ["Y", "", "true", None, True, 1, "OX"])
def test_grade_rejects_invalid_answers_naming_item_and_allowed_values(bad):
    item_id = q.load_bank(0)[1]["id"]
    with pytest.raises(ValueError, match=rf"item '{item_id}'.*allowed values are 'O' or 'X'"):
        q.grade(0, {item_id: bad})


def test_grade_rejects_unknown_ids_and_wrong_list_length():
    with pytest.raises(ValueError, match=r"unknown item id 'ch00-nope'"):
        q.grade(0, {"ch00-nope": "O"})
    with pytest.raises(ValueError, match=r"statements but 2 answers"):
        q.grade(0, ["O", "X"])
    with pytest.raises(ValueError, match=r"no answers"):
        q.grade(0, {})
    with pytest.raises(ValueError, match=r"unknown language"):
        q.grade(0, correct_answers(0), lang="fr")


def test_result_report_is_deterministic_and_readable():
    items = q.load_bank(5)
    answers = {item["id"]: item["answer"] for item in items}
    answers[items[1]["id"]] = flipped(items[1]["answer"])
    first = repr(q.grade(5, answers, record=False))
    second = repr(q.grade(5, dict(answers), record=False))
    assert first == second
    lines = first.splitlines()
    score, total = len(items) - 1, len(items)
    assert lines[0] == f"05장 O/X 결과: {score}/{total} 정답 ({round(100 * score / total)}%)"
    assert lines[-1] == f"놓친 함정: {items[1]['trap']}"
    assert "✘" in first and "✔" in first
    assert items[1]["explanation"]["ko"] in first
    english = repr(q.grade(5, answers, lang="en", record=False))
    assert english.splitlines()[0].startswith("Chapter 05 O/X result:")
    assert english.splitlines()[-1] == f"Missed traps: {items[1]['trap']}"


# -- progress ---------------------------------------------------------------------------------------


def test_grade_records_last_and_best_score(course_home):
    answers = correct_answers(2)
    ids = list(answers)
    q.grade(2, answers)
    half = {i: (answers[i] if n % 2 else flipped(answers[i])) for n, i in enumerate(ids)}
    q.grade(2, half)
    path = course_home / "progress.json"
    assert path.is_file() and q.progress_path() == path
    stored = json.loads(path.read_text(encoding="utf-8"))
    entry = stored["quiz"]["ch02"]
    assert entry["best"] == {"score": len(ids), "total": len(ids)}
    assert entry["last"] == {"score": len(ids) // 2, "total": len(ids)}
    assert entry["attempts"] == 2
    assert q.progress() == stored


def test_record_false_writes_nothing(course_home):
    q.grade(0, correct_answers(0), record=False)
    assert not (course_home / "progress.json").exists()
    assert q.progress() == {"quiz": {}}


def test_corrupt_progress_file_is_replaced_with_a_warning(course_home):
    course_home.mkdir(parents=True)
    (course_home / "progress.json").write_text("{not json", encoding="utf-8")
    with pytest.warns(UserWarning, match="unreadable progress file"):
        assert q.progress() == {"quiz": {}}
    with pytest.warns(UserWarning):
        q.grade(1, correct_answers(1))
    assert q.progress()["quiz"]["ch01"]["attempts"] == 1


# -- terminal quiz ----------------------------------------------------------------------------------


def test_terminal_quiz_with_scripted_input(course_home):
    items = q.load_bank(6)[:3]
    replies = iter([
        items[0]["answer"].lower(),          # right, lower case accepted
        "maybe", "", flipped(items[1]["answer"]),  # two invalid replies re-asked, then wrong
        items[2]["answer"],                  # right
    ])
    prompts, printed = [], []

    def fake_input(prompt):
        prompts.append(prompt)
        return next(replies)

    result = q.run_terminal_quiz(6, lang="en", n=3, input_fn=fake_input,
                                 print_fn=lambda *a: printed.append(" ".join(map(str, a))))
    out = "\n".join(printed)
    assert len(prompts) == 5
    assert out.count("Please answer O or X") == 2
    assert (result.score, result.total) == (2, 3)
    assert result.missed == [items[1]["id"]]
    for item in items:
        assert item["statement"]["en"] in out and item["explanation"]["en"] in out
    assert "Final score 2/3" in out
    assert f"Missed traps: {items[1]['trap']}" in out
    assert q.progress()["quiz"]["ch06"]["last"] == {"score": 2, "total": 3}


def test_terminal_quiz_stops_on_q_and_end_of_input(course_home):
    items = q.load_bank(7)
    replies = iter([items[0]["answer"], "q"])
    result = q.run_terminal_quiz(7, input_fn=lambda _: next(replies), print_fn=lambda *a: None)
    assert (result.score, result.total) == (1, 1)

    def eof(_):
        raise EOFError

    printed = []
    result = q.run_terminal_quiz(7, input_fn=eof, print_fn=lambda *a: printed.append(" ".join(map(str, a))))
    assert result.total == 0
    assert q.progress()["quiz"]["ch07"]["attempts"] == 1  # the empty run recorded nothing


def test_terminal_quiz_shuffle_is_deterministic():
    def asked(seed):
        seen = []
        q.run_terminal_quiz(8, lang="en", n=5, shuffle=True, seed=seed, record=False,
                            input_fn=lambda _: "O", print_fn=lambda *a: seen.append(" ".join(map(str, a))))
        return [line for line in seen if line.startswith("[")]

    assert asked(1) == asked(1)
    assert asked(1) != asked(2)


# -- widget and text displays -----------------------------------------------------------------------


def test_widget_builds_and_buttons_give_feedback_score_and_summary(course_home):
    widget = q.quiz(0, mode="widget")
    assert isinstance(widget, q.QuizWidget)
    items = widget.items
    assert len(widget.buttons) == len(items)

    first_o, first_x = widget.buttons[0]
    (first_o if items[0]["answer"] == "O" else first_x).click()
    assert first_o.disabled and first_x.disabled
    assert "✔" in widget.feedback[0].value
    assert "1/1" in widget.score_label.value

    second_o, second_x = widget.buttons[1]
    (second_x if items[1]["answer"] == "O" else second_o).click()  # the wrong one
    assert "✘" in widget.feedback[1].value
    assert "1/2" in widget.score_label.value
    first_o.click()  # a second click on an answered statement changes nothing
    assert len(widget.answers) == 2

    assert not widget.finished and widget.summary.value == ""
    for index, item in enumerate(items[2:], start=2):
        widget.answer(index, item["answer"])
    assert widget.finished
    assert f"{len(items) - 1}/{len(items)}" in widget.summary.value
    assert items[1]["trap"] in widget.summary.value
    assert q.progress()["quiz"]["ch00"]["last"] == {"score": len(items) - 1, "total": len(items)}


def test_widget_answer_by_id_and_invalid_value():
    widget = q.quiz(9, lang="en", n=2, mode="widget", record=False)
    with pytest.raises(ValueError, match="allowed values"):
        widget.answer(0, "maybe")
    widget.answer(widget.items[1]["id"], "x")
    assert widget.answers == {widget.items[1]["id"]: "X"}
    with pytest.raises(ValueError, match="unknown item id"):
        widget.answer("ch09-nope", "O")


def test_widget_text_plain_is_deterministic_and_lists_the_statements():
    first, second = q.quiz(2, mode="widget"), q.quiz(2, mode="widget")
    bundle_1, bundle_2 = first._repr_mimebundle_(), second._repr_mimebundle_()
    assert bundle_1["text/plain"] == bundle_2["text/plain"]
    view = "application/vnd.jupyter.widget-view+json"
    assert bundle_1[view]["model_id"] != bundle_2[view]["model_id"]  # why nbval must skip this one
    text = bundle_1["text/plain"].splitlines()
    items = q.load_bank(2)
    assert text[0] == f"02장 O/X 퀴즈 — {q.chapter_title(2)} ({len(items)}문항)"
    assert text[1:-1] == [f"{n:2d}. {item['statement']['ko']}" for n, item in enumerate(items, 1)]
    assert text[-1] == "(interactive quiz: click O or X)"


def test_displayed_widget_carries_the_deterministic_text():
    """What IPython would send to the frontend (and what nbval compares) for a quiz cell."""
    formatters = pytest.importorskip("IPython.core.formatters")
    formatter = formatters.DisplayFormatter()
    data_1, _ = formatter.format(q.quiz(0, mode="widget"))
    data_2, _ = formatter.format(q.quiz(0, mode="widget"))
    compared = lambda data: {k: v for k, v in data.items() if k != "application/vnd.jupyter.widget-view+json"}
    assert compared(data_1) == compared(data_2) == {"text/plain": q.quiz(0, mode="widget").text()}


def test_nbval_skips_the_widget_view_mimetype():
    plugin = pytest.importorskip("nbval.plugin")
    assert "application/vnd.jupyter.widget-view+json" in inspect.getsource(plugin.IPyNbFile.__init__)


def test_text_fallback_outside_a_kernel():
    shown = q.quiz(4, lang="en", n=3)  # pytest is not a Jupyter kernel
    assert isinstance(shown, q.QuizText)
    lines = repr(shown).splitlines()
    assert lines[0].startswith("Chapter 04 O/X quiz") and lines[0].endswith("(3 statements)")
    assert lines[1:4] == [f"{n:2d}. {item['statement']['en']}" for n, item in enumerate(q.load_bank(4)[:3], 1)]
    assert "course-lib quiz --chapter 4" in lines[-1]
    assert repr(q.quiz(4, lang="en", n=3)) == repr(shown)


def test_quiz_shuffle_and_n():
    plain = [i["id"] for i in q.quiz(5, mode="text").items]
    shuffled = [i["id"] for i in q.quiz(5, mode="text", shuffle=True, seed=3).items]
    assert sorted(plain) == sorted(shuffled) and plain != shuffled
    assert [i["id"] for i in q.quiz(5, mode="text", shuffle=True, seed=3, n=4).items] == shuffled[:4]
    with pytest.raises(ValueError, match="n must be an integer"):
        q.quiz(5, n=0)
    with pytest.raises(ValueError, match="mode must be"):
        q.quiz(5, mode="gui")
