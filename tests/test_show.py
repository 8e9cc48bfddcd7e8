"""course_lib.show: a notebook shows course code with where it lives."""

import pytest

from course_lib import ddp, show


def test_source_names_file_and_lines_and_renders_html():
    s = show.source(ddp.DDP)
    text = str(s)
    assert text.startswith("# course_lib/ddp.py, lines ")
    assert "class DDP" in text
    html = s._repr_html_()
    assert "course_lib/ddp.py" in html and "<span" in html  # highlighted


def test_lines_and_docstring_options():
    full = show.source(show.source).text.splitlines()
    head = show.source(show.source, lines=(1, 3))
    assert head.text.splitlines() == full[:2]  # line 3 is blank: trailing blank lines are dropped
    assert head.where.endswith(
        f"lines {show.inspect.getsourcelines(show.source)[1]}–{show.inspect.getsourcelines(show.source)[1] + 2}"
    )
    assert '"""' in show.source(show.source).text
    assert '"""' not in show.source(show.source, docstring=False).text
    assert "def source(" in show.source(show.source, docstring=False).text


def test_bad_input_names_the_rule():
    with pytest.raises(ValueError, match="outside 1.."):
        show.source(show.source, lines=(5, 10_000))
    with pytest.raises(TypeError, match="no Python source"):
        show.source(len)
