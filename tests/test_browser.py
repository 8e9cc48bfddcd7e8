"""The quiz as a learner sees it: JupyterLab from this venv, in Debian's headless Chromium (raw DevTools, no driver).

One JupyterLab on a free port opens a notebook with the collectives (00) quiz in English and in Korean, runs it, clicks
the right answer to statement 1 and the wrong one to statement 2 with real mouse events, and the verdicts, the
explanation and the running score must appear inside each cell's output area (``.jp-OutputArea``; the cell source
holds none of them); the final exam's widget (third cell) answers a click the same way. A Korean font must be
installed (``fc-match :lang=ko``) and the quiz's Korean statement must render as glyphs: its pixels differ from the
same line drawn as missing-glyph boxes and from other syllables, which a Chromium without CJK fonts (the control,
same check) cannot tell apart. Screenshots go to ``.cache/test-artifacts/browser/`` (gitignored). Skipped, saying
so, only where Chromium is not installed; ``.ci/run`` installs ``chromium`` and ``fonts-noto-cjk``. Leaves no
jupyter, kernel or chromium process behind.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from course_lib.quiz import UI as QUIZ_UI
from course_lib.quiz import exam_items, load_bank
from course_lib.quiz.bank import is_numeric
from course_lib.quiz.grading import format_number

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("COURSE_LIB_CACHE", ROOT / ".cache")) / "test-artifacts" / "browser"


def _driver():
    spec = importlib.util.spec_from_file_location(
        "_check_quiz_in_lab", ROOT / "tools" / "check_quiz_in_lab.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lab_driver = _driver()
pytestmark = [
    pytest.mark.skipif(
        lab_driver.find_chromium() is None,
        reason="Debian's chromium is not installed here (apt-get install chromium fonts-noto-cjk; "
        ".ci/run does it), so the real-browser quiz test cannot run",
    ),
    pytest.mark.timeout(300),
]


def test_a_korean_font_is_installed():
    picked = lab_driver.korean_font()
    assert lab_driver.CJK_FONT.search(picked), (
        f"fc-match :lang=ko picks {picked or 'nothing'!r}, not a CJK font: Chromium would draw the Korean quiz as "
        "empty boxes. Install one: apt-get install fonts-noto-cjk"
    )


def test_quiz_feedback_in_the_output_area_in_english_and_korean(tmp_path):
    started = time.monotonic()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    items = load_bank("collectives")[:3]
    env = dict(
        os.environ, COURSE_LIB_HOME=str(tmp_path / "home")
    )  # the kernel's clicks record nothing real
    exam = exam_items(n=14)
    with lab_driver.Lab(
        {"quiz.ipynb": lab_driver.quiz_notebook(("en", "ko"), exam_n=14, numeric=True)}, env=env
    ) as lab:
        found = lab_driver.check_quiz(lab, "quiz.ipynb", ("en", "ko"), items, ARTIFACTS)
        exam_shown = lab_driver.answer(  # the final exam's widget, cell 3: graded only at the end
            lab.page, 2, 0, exam[0]["answer"], shown=f"1 answered · {len(exam) - 1} left"
        )
        number = load_bank("collectives", kind="numeric")[0]  # cell 4: typed into its box, checked
        number_shown = lab_driver.answer_number(lab.page, 3, 0, format_number(number["answer"]))
        text, font = lab_driver.statement(
            lab.page, 1, 3
        )  # statement 3 of the Korean quiz (not a seed item)
        pixels = lab_driver.korean_renders(lab.page, text, font)
        (ARTIFACTS / "korean_line.png").write_bytes(pixels.pop("png"))
    assert lab.left_alive == [], f"processes left behind: {lab.left_alive}"

    for lang in ("en", "ko"):
        shown, ui = found[lang], lab_driver.UI[lang]
        assert f"{ui['right']} " in shown, shown  # statement 1, answered right
        answer_is = QUIZ_UI[lang]["answer_is"].format(answer=items[1]["answer"])
        assert f"{ui['wrong']} — {answer_is}" in shown, shown  # statement 2, answered wrong
        assert shown.count("✔") == 1 and shown.count("✘") == 1, shown
        assert (
            items[0]["explanation"][lang][:40] in shown
            and items[1]["explanation"][lang][:40] in shown
        )
        assert ui["score"] in shown
        assert items[2]["statement"][lang] in shown  # the cell shows its own language
        assert found["screenshots"][lang].stat().st_size > 10_000
    assert "✔ 정답" not in found["en"] and "✔ correct" not in found["ko"]

    computations = sum(is_numeric(item) for item in exam)
    assert computations == 3 and len(exam) == 14 + computations, [item["id"] for item in exam]
    heading = (
        f"\nFinal O/X exam — chapters 00–10 (14 statements, form 0) + {computations} computations\n"
    )
    assert heading in exam_shown, exam_shown[:200]
    # mid-exam: the answer is taken, with no verdict and no explanation (it could answer a later one)
    assert f"you said {exam[0]['answer']} — graded" in exam_shown
    assert (
        "✔" not in exam_shown.split("Final O/X exam")[1]
        and "✘" not in exam_shown.split("Final O/X exam")[1]
    )
    assert exam[0]["explanation"]["en"][:40] not in exam_shown

    # a numeric question: the typed number reached the kernel, was graded right, and explained
    assert f"{lab_driver.UI['en']['right']} " in number_shown, number_shown
    assert number["explanation"]["en"][:40] in number_shown, number_shown

    assert text == items[2]["statement"]["ko"]
    assert pixels["vs_boxes"] > 0.02 and pixels["vs_other_syllables"] > 0.02, (
        f"the Korean statement looks like missing-glyph boxes: {pixels} (font {font!r})"
    )
    elapsed = time.monotonic() - started
    print(
        f"browser quiz check: {elapsed:.1f} s; Korean line vs boxes {pixels['vs_boxes']:.3f}, "
        f"vs other syllables {pixels['vs_other_syllables']:.3f}; screenshots in {ARTIFACTS}"
    )


def test_the_korean_check_fails_without_cjk_fonts():
    """The control: in a Chromium whose fontconfig sees DejaVu only, the same Korean line is a row of boxes that
    the pixel check cannot tell from boxes or from other syllables -- so the check above can fail."""
    text = load_bank("collectives")[2]["statement"]["ko"]
    pixels = lab_driver.korean_renders_without_cjk_fonts(text)
    assert pixels["vs_boxes"] < 0.005 and pixels["vs_other_syllables"] < 0.005, pixels
