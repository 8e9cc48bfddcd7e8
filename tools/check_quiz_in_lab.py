"""Drive the course in a real JupyterLab in headless Chromium, through the raw Chrome DevTools protocol.

Used by ``tests/test_browser.py`` (CI) and by hand: ``.venv/bin/python tools/check_quiz_in_lab.py [OUT_DIR]``.
Needs Debian's ``chromium`` and a Korean font (``apt-get install chromium fonts-noto-cjk``; ``.ci/run`` does it);
no browser download, no driver package: a websocket to Chromium's DevTools port is all it uses.

* :class:`Lab` starts JupyterLab from this venv on a free port (127.0.0.1, a random token, its own config,
  runtime, settings and workspace directories in a scratch folder) and Chromium with ``--remote-debugging-port=0``
  (the port it picked is read back from ``DevToolsActivePort``), each in its own process group. ``close()``
  ends both groups and every process they started (kernels run in their own sessions: they are found as
  descendants and by the scratch folder in their command line) and returns what was left alive (nothing).
* :func:`check_quiz` opens a scratch notebook with ``quiz('collectives', lang=...)`` cells, runs
  them, clicks the right answer to statement 1 and the wrong one to statement 2 with real mouse
  events, and returns what each cell's output area (``.jp-OutputArea``) shows, with a screenshot
  per language.
* :func:`korean_renders` compares the pixels of a Korean line, drawn in the quiz statement's own font, with
  the same line whose Hangul is replaced by other syllables and by missing-glyph boxes: with no Korean font
  all three are the same row of boxes.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from functools import partial
from pathlib import Path

import nbformat
import websocket

HANGUL = re.compile(r"[\uac00-\ud7a3]")
TOFU = "\ue000"  # a private-use code point: no font has it, so Chromium draws the missing-glyph box
CJK_FONT = re.compile(
    r"CJK|Nanum|Baekmuk|UnDotum|UnBatang|Noto (Sans|Serif) KR|Source Han", re.IGNORECASE
)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
]
SETTINGS = {  # no network from the page, and every cell attached to the DOM (no windowing)
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


class StartError(Exception):
    """JupyterLab or Chromium exited while starting (the message holds its log)."""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    return "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else None


def korean_font() -> str:
    """What fontconfig picks for Korean text (``fc-match :lang=ko``): ``family|file``, or '' without fontconfig."""
    if not shutil.which("fc-match"):
        return ""
    done = subprocess.run(
        ["fc-match", "-f", "%{family}|%{file}", ":lang=ko"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout.strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(what: str, probe, timeout: float, every: float = 0.25):
    """Poll ``probe`` until it returns something true; a page script error (element not there yet, page
    navigating) counts as not yet. Raises ``TimeoutError`` naming ``what`` and the last error."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        try:
            value = probe()
        except (RuntimeError, OSError, ValueError) as exc:
            value, last = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout:.0f} s waiting for {what}"
                + (f" (last: {last})" if last else "")
            )
        time.sleep(every)


class DevTools:
    """A minimal Chrome DevTools protocol client over one page's websocket."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, suppress_origin=True, timeout=60)
        self._next = 0

    def call(self, method: str, **params):
        self._next += 1
        self.ws.send(json.dumps({"id": self._next, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._next:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str):
        out = self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in out:
            raise RuntimeError(
                f"page script failed: {out['exceptionDetails'].get('exception', out)}"
            )
        return out["result"].get("value")

    def screenshot(self, clip: dict | None = None) -> bytes:
        params = {"format": "png"}
        if clip:
            params["clip"] = {**clip, "scale": 1}
        return base64.b64decode(self.call("Page.captureScreenshot", **params)["data"])

    def click(self, selector_js: str) -> None:
        """A real mouse click (press + release) at the centre of the element ``selector_js`` evaluates to."""
        box = self.js(
            f"(async () => {{ const e = {selector_js}; e.scrollIntoView({{block: 'nearest', "
            "behavior: 'instant'}); await new Promise(r => requestAnimationFrame(() => "
            "requestAnimationFrame(r))); const r = e.getBoundingClientRect(); "
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent",
                type=kind,
                x=box[0],
                y=box[1],
                button="left",
                clickCount=1,
            )

    def close(self) -> None:
        self.ws.close()


def _start_chromium(work: Path, env: dict, size: str, procs: list) -> DevTools:
    """Chromium on ``about:blank`` with DevTools on a port it picks itself (appended to ``procs`` at once, so a
    failed start is still cleaned up); returns its page."""
    profile = work / "chrome"
    profile.mkdir()
    proc = subprocess.Popen(
        [
            find_chromium() or "chromium",
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    procs.append(proc)
    active = profile / "DevToolsActivePort"

    def devtools_port():
        if proc.poll() is not None:
            raise StartError(
                f"chromium exited ({proc.returncode}) before opening its DevTools port"
            )
        words = active.read_text().split() if active.is_file() else []
        return words[0] if words else None

    port = _wait("Chromium's DevToolsActivePort", devtools_port, 60)
    pages = _wait(
        "a page target",
        lambda: [
            p
            for p in json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10))
            if p["type"] == "page"
        ],
        30,
    )
    return DevTools(pages[0]["webSocketDebuggerUrl"])


def _end(procs: list[subprocess.Popen], marker: str) -> list[int]:
    """End ``procs``' process groups, their descendants and any process naming ``marker``; return pids still alive."""
    import psutil

    def ours():
        found = set()
        for proc in procs:
            try:
                found |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)} | {
                    proc.pid
                }
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter(["cmdline"]):
            if marker in " ".join(p.info["cmdline"] or []):
                found.add(p.pid)
        return found

    found = ours()
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)  # each was started as its own session: pgid == pid
            except (ProcessLookupError, PermissionError):
                pass
        for pid in found:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        gone, alive = psutil.wait_procs(_processes(found), timeout=grace)
        found = {p.pid for p in alive} | (ours() - {p.pid for p in gone})
        if not found:
            break
    for proc in procs:
        try:
            proc.wait(1)
        except subprocess.TimeoutExpired:
            pass
    return sorted(p.pid for p in _processes(found) if p.status() != psutil.STATUS_ZOMBIE)


def _processes(pids) -> list:
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


class Lab:
    """JupyterLab on a free port + headless Chromium pointed at it; a context manager that cleans up both."""

    def __init__(
        self,
        notebooks: dict[str, nbformat.NotebookNode],
        *,
        env: dict | None = None,
        size: str = "1280,1600",
        timeout: float = 120,
    ):
        self.work = Path(tempfile.mkdtemp(prefix="course_lab_"))
        self.timeout, self.procs, self.left_alive = timeout, [], []
        for name, nb in notebooks.items():
            nbformat.write(nb, self.work / name)
        for rel, value in SETTINGS.items():
            path = self.work / "settings" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        self.token = secrets.token_hex(16)
        self.env = dict(os.environ if env is None else env)
        self.env.update(
            JUPYTER_CONFIG_DIR=str(self.work / "config"),
            JUPYTER_RUNTIME_DIR=str(self.work / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(self.work / "settings"),
            IPYTHONDIR=str(self.work / "ipython"),
            JUPYTERLAB_WORKSPACES_DIR=str(self.work / "workspaces"),
        )
        self.size = size
        self.page: DevTools | None = None
        self._log = None
        self.url = ""

    def __enter__(self) -> "Lab":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        jupyter = Path(sys.executable).parent / "jupyter"
        self._log = open(self.work / "lab.log", "wb")  # noqa: SIM115 - closed in close()
        root = ["--allow-root"] if os.getuid() == 0 else []
        lab = subprocess.Popen(
            [
                str(jupyter),
                "lab",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={free_port()}",
                f"--IdentityProvider.token={self.token}",
                "--LabApp.expose_app_in_browser=True",
                f"--ServerApp.root_dir={self.work}",
                *root,
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env=self.env,
            cwd=self.work,
            start_new_session=True,
        )
        self.procs.append(lab)
        runtime = self.work / "runtime"

        def server_info():
            if lab.poll() is not None:
                raise StartError(
                    f"jupyter lab exited ({lab.returncode}): {(self.work / 'lab.log').read_text()}"
                )
            for f in runtime.glob("jpserver-*.json"):
                info = json.loads(f.read_text() or "{}")
                if info.get("port"):
                    return info
            return None

        info = _wait("JupyterLab's server file", server_info, self.timeout)
        self.url = f"http://127.0.0.1:{info['port']}"
        self.page = _start_chromium(self.work, self.env, self.size, self.procs)

    def open(self, notebook: str) -> DevTools:
        """Open ``notebook``, wait until its kernel is idle and make it the active panel (a headless window has no
        focus, so nothing is current until activated)."""
        self.page.call("Emulation.setFocusEmulationEnabled", enabled=True)
        self.page.call("Page.navigate", url=f"{self.url}/lab/tree/{notebook}?token={self.token}")
        panel = (
            f"Array.from(window.jupyterapp.shell.widgets('main')).find(w => w.context && "
            f"w.context.path === {json.dumps(notebook)})"
        )
        _wait(
            f"JupyterLab to open {notebook} with its kernel idle",
            lambda: self.page.js(
                f"{panel}?.sessionContext?.session?.kernel?.status === 'idle' && "
                "!!document.querySelector('.jp-Notebook .jp-CodeCell')"
            ),
            self.timeout,
            0.5,
        )
        self.page.js(f"(window.jupyterapp.shell.activateById({panel}.id), true)")
        _wait(
            "the notebook to be the current widget",
            lambda: self.page.js(f"window.jupyterapp.shell.currentWidget === {panel}"),
            30,
        )
        return self.page

    def close(self) -> list[int]:
        if self.page is not None:
            try:
                self.page.close()
            except Exception:  # noqa: BLE001 - the browser may already be gone
                pass
        self.left_alive = _end(self.procs, str(self.work))
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self.work, ignore_errors=True)
        return self.left_alive


# --------------------------------------------------------------------------------------------------
# The quiz in the browser
# --------------------------------------------------------------------------------------------------

UI = {
    "en": {"right": "✔ correct", "wrong": "✘ wrong", "score": "Score 1/2 · 1 left"},
    "ko": {"right": "✔ 정답", "wrong": "✘ 오답", "score": "점수 1/2 · 남은 문항 1"},
}


NUMERIC_CELL = """from course_lib.quiz import QuizWidget, load_bank
QuizWidget("collectives", load_bank("collectives", kind="numeric")[:1], "en", record=False)"""


def quiz_notebook(
    langs=("en", "ko"), n: int = 3, exam_n: int | None = None, numeric: bool = False
) -> nbformat.NotebookNode:
    """One ``quiz('collectives', lang=..., n=n)`` cell per language, then (``exam_n``) a
    ``final_exam(n=exam_n)`` cell, then (``numeric``) a quiz of the chapter's first numeric question
    alone (:data:`NUMERIC_CELL`)."""
    cells = [
        nbformat.v4.new_code_cell(
            f"from course_lib.quiz import quiz\nquiz('collectives', lang={lang!r}, n={n})"
        )
        for lang in langs
    ]
    if exam_n is not None:
        cells.append(
            nbformat.v4.new_code_cell(
                f"from course_lib.quiz import final_exam\nfinal_exam(n={exam_n})"
            )
        )
    if numeric:
        cells.append(nbformat.v4.new_code_cell(NUMERIC_CELL))
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    return nb


def _output(cell: int) -> str:
    return f"document.querySelectorAll('.jp-Notebook .jp-CodeCell')[{cell}].querySelector('.jp-OutputArea')"


def _button(cell: int, statement: int, value: str) -> str:
    return (
        f"Array.from({_output(cell)}.querySelectorAll('.widget-button'))"
        f".filter(b => b.textContent.trim() === '{value}')[{statement}]"
    )


def check_quiz(lab: Lab, notebook: str, langs, items, out_dir: Path | None = None) -> dict:
    """Run every cell of ``notebook`` (one ``quiz('collectives', lang=...)`` per language), click
    the right answer to statement 1 and the wrong one to statement 2 in each, and return
    ``{lang: output-area text}`` plus ``"screenshots"``. ``items`` are the quiz's statements (to
    know the right answers)."""
    page = lab.open(notebook)
    try:
        # Start the run without awaiting its promise (it resolves only once the kernel has run every cell).
        page.js("(window.jupyterapp.commands.execute('notebook:run-all-cells'), true)")
        wanted = [items[0]["answer"], "X" if items[1]["answer"] == "O" else "O"]
        found, shots = {}, {}
        for cell, lang in enumerate(langs):
            _wait(
                f"the {lang} quiz widget's buttons in cell {cell}'s output area",
                partial(
                    page.js,
                    f"({_output(cell)} || document.body).querySelectorAll('.widget-button').length >= 6",
                ),
                lab.timeout,
                0.5,
            )
            for statement, value in enumerate(wanted):
                page.click(_button(cell, statement, value))
                _wait(
                    f"feedback {statement + 1} in cell {cell}",
                    partial(
                        page.js,
                        f"({_output(cell)}.innerText.match(/[✔✘]/g) || []).length >= {statement + 1}",
                    ),
                    60,
                )
            score, text = UI[lang]["score"], f"{_output(cell)}.innerText"
            _wait(
                f"the {lang} score line", lambda score=score, text=text: score in page.js(text), 60
            )
            found[lang] = page.js(f"{_output(cell)}.innerText")
            if out_dir is not None:
                page.js(f"{_output(cell)}.scrollIntoView({{block: 'start'}})")
                time.sleep(0.5)
                shots[lang] = out_dir / f"quiz_{lang}.png"
                shots[lang].write_bytes(page.screenshot())
        found["screenshots"] = shots
        return found
    except Exception:
        if out_dir is not None:  # what the page showed when it went wrong
            (out_dir / "failure.png").write_bytes(page.screenshot())
        raise


def answer(
    page: DevTools,
    cell: int,
    statement: int,
    value: str,
    timeout: float = 60,
    shown: str | None = None,
) -> str:
    """Click ``value`` (O/X) for ``statement`` (0-based) of the widget in ``cell``; return its output area's text
    once the verdict is there (or, with ``shown``, once that text is: an exam grades only at its end)."""
    _wait(
        f"the widget's buttons in cell {cell}",
        lambda: page.js(
            f"{_output(cell)}.querySelectorAll('.widget-button').length >= {2 * (statement + 1)}"
        ),
        timeout,
        0.5,
    )
    before = page.js(f"({_output(cell)}.innerText.match(/[✔✘]/g) || []).length")
    page.click(_button(cell, statement, value))
    if shown is not None:
        _wait(
            f"{shown!r} in cell {cell}",
            lambda: shown in page.js(f"{_output(cell)}.innerText"),
            timeout,
        )
        return page.js(f"{_output(cell)}.innerText")
    _wait(
        f"the verdict in cell {cell}",
        lambda: page.js(f"({_output(cell)}.innerText.match(/[✔✘]/g) || []).length > {before}"),
        timeout,
    )
    return page.js(f"{_output(cell)}.innerText")


def answer_number(page: DevTools, cell: int, index: int, value: str, timeout: float = 60) -> str:
    """Type ``value`` into the ``index``-th (0-based) number box of the widget in ``cell`` as a learner does
    (a click, then the keys' text) and press its Check button; return the output area's text once the
    verdict is there."""
    box = f"{_output(cell)}.querySelectorAll('.widget-text input')[{index}]"
    _wait(f"number box {index} in cell {cell}", lambda: page.js(f"!!{box}"), timeout, 0.5)
    before = page.js(f"({_output(cell)}.innerText.match(/[✔✘]/g) || []).length")
    page.click(box)
    page.call("Input.insertText", text=value)
    _wait(  # the box shows the text; ipywidgets sends it to the kernel as it is typed
        f"{value!r} in number box {index}", lambda: page.js(f"{box}.value") == value, timeout
    )
    time.sleep(0.5)  # let the typed value reach the kernel before Check reads it
    page.click(_button(cell, index, "Check"))
    _wait(
        f"the verdict in cell {cell}",
        lambda: page.js(f"({_output(cell)}.innerText.match(/[✔✘]/g) || []).length > {before}"),
        timeout,
    )
    return page.js(f"{_output(cell)}.innerText")


def statement(page: DevTools, cell: int, number: int) -> tuple[str, str]:
    """``(text, CSS font)`` of statement ``number`` (1-based) of the quiz in ``cell``'s output area."""
    return tuple(
        page.js(f"""(() => {{
        const e = Array.from({_output(cell)}.querySelectorAll('.widget-html-content'))
            .find(e => e.innerText.trim().startsWith('{number}.'));
        const s = getComputedStyle(e);
        return [e.innerText.trim().replace(/^{number}\\.\\s*/, ''),
                `${{s.fontStyle}} ${{s.fontWeight}} ${{s.fontSize}} ${{s.fontFamily}}`];
    }})()""")
    )


def _probe_png(
    page: DevTools, font: str, text: str, size: tuple[int, int] | None = None
) -> tuple[bytes, tuple]:
    """Screenshot of ``text`` alone, black on white, in CSS font ``font`` (a fixed box over the page), in a box of
    ``size`` (width, height) or its natural size; returns the PNG and the size."""
    fixed = (
        f"width:{size[0]}px;height:{size[1]}px;box-sizing:border-box;overflow:hidden;"
        if size
        else ""
    )
    rect = page.js(f"""(async () => {{
        let d = document.getElementById('course-probe');
        if (!d) {{ d = document.createElement('div'); d.id = 'course-probe'; document.body.appendChild(d); }}
        d.style.cssText = 'position:fixed;left:0;top:0;z-index:2147483647;background:#fff;color:#000;'
            + 'padding:6px;white-space:pre;line-height:1.4;{fixed}font:' + {json.dumps(font)};
        d.textContent = {json.dumps(text)};
        await document.fonts.ready;
        await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
        const r = d.getBoundingClientRect();
        return {{x: Math.floor(r.x), y: Math.floor(r.y), width: Math.ceil(r.width), height: Math.ceil(r.height)}};
    }})()""")
    return page.screenshot(rect), (rect["width"], rect["height"])


def _differ(a: bytes, b: bytes) -> float:
    """Share of pixels that differ between two PNGs (1.0 when their sizes differ)."""
    from PIL import Image, ImageChops

    one, two = Image.open(io.BytesIO(a)).convert("L"), Image.open(io.BytesIO(b)).convert("L")
    if one.size != two.size:
        return 1.0
    diff = ImageChops.difference(one, two).point(lambda v: 255 if v > 32 else 0)
    return diff.histogram()[255] / (one.size[0] * one.size[1])


def korean_renders(page: DevTools, text: str, font: str) -> dict:
    """Draw ``text`` (Korean), the same with its Hangul replaced by other syllables, and by missing-glyph boxes,
    in CSS ``font``; return the share of differing pixels: ``vs_boxes`` and ``vs_other_syllables`` (both ~0 when
    Chromium has no Korean font: every syllable is the same box)."""
    if not HANGUL.search(text):
        raise ValueError(f"no Hangul in {text!r}")
    other = HANGUL.sub(lambda m: chr(0xAC00 + (ord(m.group()) - 0xAC00 + 5000) % 11172), text)
    boxes = HANGUL.sub(TOFU, text)
    korean, size = _probe_png(page, font, text)
    (shifted, _), (tofu, _) = (
        _probe_png(page, font, t, size) for t in (other, boxes)
    )  # same box: comparable
    page.js("document.getElementById('course-probe')?.remove()")
    return {
        "vs_boxes": _differ(korean, tofu),
        "vs_other_syllables": _differ(korean, shifted),
        "png": korean,
    }


def korean_renders_without_cjk_fonts(text: str, font: str = "16px sans-serif") -> dict:
    """The negative control: :func:`korean_renders` in a Chromium whose fontconfig sees only DejaVu (no CJK)."""
    work = Path(tempfile.mkdtemp(prefix="course_nocjk_"))
    fonts = next(
        (
            d
            for d in ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/dejavu")
            if Path(d).is_dir()
        ),
        None,
    )
    if fonts is None:
        raise FileNotFoundError("no DejaVu font directory for the no-CJK control")
    (work / "fonts.conf").write_text(
        f"<?xml version='1.0'?><!DOCTYPE fontconfig SYSTEM 'fonts.dtd'><fontconfig><dir>{fonts}</dir>"
        f"<cachedir>{work}/fc-cache</cachedir></fontconfig>"
    )
    env = dict(os.environ, FONTCONFIG_FILE=str(work / "fonts.conf"))
    procs: list = []
    try:
        page = _start_chromium(work, env, "800,300", procs)
        page.call("Page.navigate", url="data:text/html;charset=utf-8,<html><body></body></html>")
        _wait("the blank page", lambda: page.js("document.readyState === 'complete'"), 30)
        result = korean_renders(page, text, font)
        page.close()
        return result
    finally:
        _end(procs, str(work))
        shutil.rmtree(work, ignore_errors=True)


def main(out_dir: str = ".cache/test-artifacts/browser") -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from course_lib.quiz import load_bank

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print("Korean font (fc-match :lang=ko):", korean_font() or "none")
    with Lab({"quiz.ipynb": quiz_notebook()}) as lab:
        found = check_quiz(lab, "quiz.ipynb", ("en", "ko"), load_bank("collectives")[:3], out)
        for lang in ("en", "ko"):
            print(f"--- {lang} output area ---\n{found[lang]}")
    print(
        "left alive:",
        lab.left_alive,
        "screenshots:",
        [str(p) for p in found["screenshots"].values()],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
