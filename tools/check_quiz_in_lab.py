"""Click through the quiz widget in a real JupyterLab, in headless Chromium (manual check, not part of CI).

Needs Debian's chromium (`apt-get install chromium`). Starts JupyterLab on 127.0.0.1 with a throwaway token on a
scratch notebook holding `quiz(0, lang="en", n=3)`, runs it through JupyterLab's own command, clicks O on statements
1 and 2 (right, then wrong) through the Chrome DevTools protocol, prints what the widget shows and saves a
screenshot. Usage: .venv/bin/python tools/check_quiz_in_lab.py [screenshot.png]
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import nbformat
import websocket

PORT, CDP, TOKEN = 8899, 9222, "course-check"


def main(out_png: str = "quiz_in_lab.png") -> None:
    work = tempfile.mkdtemp(prefix="quiz_lab_")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from course_lib.quiz import quiz\nquiz(0, lang='en', n=3)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, os.path.join(work, "quiz.ipynb"))
    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    root = ["--allow-root"] if os.getuid() == 0 else []
    lab = subprocess.Popen([jupyter, "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={PORT}",
                            f"--IdentityProvider.token={TOKEN}", "--LabApp.expose_app_in_browser=True",
                            f"--notebook-dir={work}", *root], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chrome = subprocess.Popen(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                               "--no-first-run", "--disable-background-networking", "--disable-component-update",
                               "--disable-sync", f"--user-data-dir={work}/chrome", "--window-size=1200,1000",
                               f"--remote-debugging-port={CDP}", "about:blank"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(6)
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{CDP}/json"))
        ws = websocket.create_connection(next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page"),
                                         suppress_origin=True)
        ids = iter(range(1, 10**6))

        def call(method, **params):
            i = next(ids)
            ws.send(json.dumps({"id": i, "method": method, "params": params}))
            while True:
                msg = json.loads(ws.recv())
                if msg.get("id") == i:
                    return msg.get("result", msg)

        def js(expr):
            return call("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)["result"].get(
                "value")

        call("Page.navigate", url=f"http://127.0.0.1:{PORT}/lab/tree/quiz.ipynb?token={TOKEN}")
        for _ in range(60):
            time.sleep(1)
            if js("!!(window.jupyterapp && document.querySelector('.jp-Notebook'))"):
                break
        time.sleep(4)
        js("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        buttons = "Array.from(document.querySelectorAll('.jp-OutputArea-output button'))"
        for _ in range(60):
            time.sleep(1)
            if (js(f"{buttons}.length") or 0) >= 6:
                break
        for i in (0, 1):
            js(f"{buttons}.filter(b => b.textContent.trim() === 'O')[{i}].click()")
            time.sleep(2)
        text = js("document.querySelector('.jp-OutputArea').innerText")
        print(text)
        with open(out_png, "wb") as f:
            f.write(base64.b64decode(call("Page.captureScreenshot", format="png")["data"]))
        ok = "✔ correct" in text and "✘ wrong" in text and "Score 1/2" in text
        print("quiz widget works in JupyterLab:", ok, f"(screenshot: {out_png})")
        sys.exit(0 if ok else 1)
    finally:
        chrome.terminate()
        lab.terminate()
        chrome.wait(10)
        lab.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
