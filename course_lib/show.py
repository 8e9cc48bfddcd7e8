"""Show course code in a notebook: a function's or class's source, highlighted, with where it lives.

The from-scratch algorithms live in ``course_lib``; a notebook shows them next to their result so the
learner reads the algorithm without opening files::

    from course_lib import ddp, show
    show.source(ddp.DDP._launch_bucket)                   # one method
    show.source(zero.ShardedOptimizer.step, lines=(1, 30))  # the first 30 lines of it

In Jupyter the source renders with syntax highlighting (HTML); without a browser (``print``, nbval's text
comparison, a terminal) it is the plain text with a header line ``course_lib/ddp.py, lines 120–151``.
"""

from __future__ import annotations

import html
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Source", "source"]

_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Source:
    """Source text with where it came from; renders highlighted in Jupyter, plain in ``str``."""

    text: str
    where: str  # "course_lib/ddp.py, lines 120–151"

    def __str__(self) -> str:
        return f"# {self.where}\n{self.text}"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython's text form: the same as print()
        p.text(str(self))

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:  # pragma: no cover - pygments ships with IPython
            body = f"<pre>{html.escape(self.text)}</pre>"
        else:
            formatter = HtmlFormatter(noclasses=True, style="default", nowrap=False)
            body = highlight(self.text, PythonLexer(), formatter)
        head = f'<div style="font-size:85%;color:#555"><code>{html.escape(self.where)}</code></div>'
        return head + body


def _where(obj) -> tuple[str, int]:
    path = Path(inspect.getsourcefile(obj) or "?").resolve()
    try:
        shown = path.relative_to(_ROOT).as_posix()
    except ValueError:
        shown = path.name
    return shown, inspect.getsourcelines(obj)[1]


def _drop_docstring(lines: list[str]) -> list[str]:
    """The lines without the body's leading docstring (the signature and code stay)."""
    text = "".join(lines)
    import ast

    tree = ast.parse(textwrap.dedent(text))
    node = tree.body[0] if tree.body else None
    body = getattr(node, "body", None)
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Constant):
        return lines
    if not isinstance(body[0].value.value, str):
        return lines
    first, last = body[0].lineno - 1, body[0].end_lineno  # 0-based start, exclusive end
    return lines[:first] + lines[last:]


def source(obj, lines: tuple[int, int] | None = None, docstring: bool = True) -> Source:
    """The source of ``obj`` (a function, method, class or module) as a :class:`Source`.

    ``lines=(a, b)`` keeps lines a..b of it (1-based, inclusive, counted from the ``def``/``class`` line);
    ``docstring=False`` drops the leading docstring. Raises ``ValueError`` naming the rule when ``lines``
    is out of range, ``TypeError`` when ``obj`` has no Python source (a builtin, a C extension).
    """
    target = inspect.unwrap(getattr(obj, "__func__", obj))
    try:
        src_lines, _ = inspect.getsourcelines(target)
    except (TypeError, OSError) as err:
        raise TypeError(f"{obj!r} has no Python source to show ({err})") from err
    path, start = _where(target)
    first, last = 1, len(src_lines)
    if lines is not None:
        a, b = lines
        if not (1 <= a <= b <= len(src_lines)):
            raise ValueError(
                f"lines={lines} is outside 1..{len(src_lines)}, the length of {getattr(obj, '__qualname__', obj)}"
            )
        first, last = a, b
    kept = src_lines[first - 1 : last]
    if not docstring and lines is None:
        kept = _drop_docstring(kept)
    text = textwrap.dedent("".join(kept)).rstrip("\n")
    where = f"{path}, lines {start + first - 1}–{start + last - 1}"
    return Source(text, where)
