"""Markdown explains mechanisms; outcomes are printed from the notebook's own measurement.

The developers' guide: every sentence that states a timing outcome (faster, hidden, wins,
"takes 12 ms") is printed by a code cell from that notebook's measurement; markdown says *why*
(the mechanism). This file scans the markdown cells of every ``notebooks/src/NN_*.py`` (parsed with
``tools/build_notebooks.parse``, so cell indices are the stored notebook's) and fails, per notebook,
with every offending sentence: ``notebook, cell index, sentence``.

What is scanned: a markdown cell with its quoted material removed first — fenced code, inline
``code``, ``> blockquotes``, ``$math$``, HTML tags, and text in quotation marks ``"…"``, ``“…”``,
``‘…’`` (exam statements are quoted: "분산 학습은 … 빠르다" is a statement to judge, not a claim).
The rest is cut into sentences (paragraphs, list items, table rows, then ``. ! ?``).

What is flagged (a sentence that asserts a timing outcome; see ``RULES``):

* a speed comparison: faster, slower, quicker, speed-up/speedup, "as slow as", "longer than",
  "twice as long", "makes … fast", "waits less", outperforms, beats, wins/loses, pays off — and the
  Korean 빠르/빠른/빨라, 느리/느린/느려, 숨기/숨겨/숨긴 (outside quotes);
* hiding: hide, hides, hid, hidden, hiding (communication "hidden" behind compute is an outcome);
* a cost in time: cost/costs/saves/gains with a time word (time, speed, ms, seconds, idle…);
* a duration: a number with a time unit ("17.8 ms", "≈ 7 s", "2 minutes", "1½ minutes") — unless it
  is an input the notebook sets: preceded by ``=`` or sleep/sleeps/nap ("each stage sleeps 40 ms",
  "t_F = 40 ms"), or the sentence says it is an assumption (assume/assumed/assumption);
* overlap with a time claim: overlap/overlaps/overlapped in a sentence that also has a duration
  or a comparison (less/more/shorter time, saves).

Mechanism words alone are fine: overlap, all-reduce, bucket, bubble, latency, α, wait — "the
all-reduce of bucket k runs while backward computes the layers before it" is not flagged; nor are
names that contain a flagged word ("hidden size", "the α–β cost model") or a link's speed as a
premise ("fast links inside a node"): ``NEUTRAL`` rewrites those before the rules run.

What is allowed although it matches: the opener's ``**Stored build:**`` line (a line of the first
markdown cell that starts with it: ``tools/build_notebooks.py`` writes it from the build's measured
runtime), and a **prediction** — a sentence that says predict/predicts/predicted/prediction, or we
expect/expected — but only when the next code cell prints a verdict: its source uses ``.verdict``,
``compare(``, ``passed``, ``assert_passed`` or a Result's ``.checks(`` / ``.claims(`` /
``.failures(``, or it calls ``print`` with a comparison (``<``, ``>``, ``==``, ``<=``, ``>=``,
``!=``) inside its arguments (f-strings included). Only the source is read: ``print(result)`` of a
``Result`` is not recognised — print ``result.passed`` or a row's verdict. Otherwise the
prediction is flagged like any other claim.

Run ``python tests/test_notebook_prose.py [NN ...]`` to list the offenders without pytest.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))


def _tool(name: str):
    """A module of tools/ (imported from its file: tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_prose_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse(text: str):
    """``tools/build_notebooks.parse``: cells as the stored notebook has them."""
    return _tool("build_notebooks").parse(text)


# The opener's runtime line, which the executor writes from the build's own measurement.
STORED_BUILD = _tool("nb_provenance").MARKER


# --------------------------------------------------------------------------- quoted material


_QUOTED = [
    re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M),  # fenced code
    re.compile(r"^\s*>.*$", re.M),  # blockquote lines
    re.compile(r"`[^`\n]*`"),  # inline code
    re.compile(r"\$\$.*?\$\$", re.S),  # display math
    re.compile(r"\$[^$\n]*\$"),  # inline math
    re.compile(r"<[^>\n]*>"),  # HTML tags (anchors)
    re.compile(r'"[^"]*"'),  # "…"
    re.compile(r"“[^”]*”"),  # “…”
    re.compile(r"‘[^’]*’"),  # ‘…’
]


def strip_quoted(markdown: str) -> str:
    """The markdown with code, math, tags and quotations replaced by a space."""
    for pattern in _QUOTED:
        markdown = pattern.sub(" ", markdown)
    return markdown


_BLOCK = re.compile(r"\n\s*\n|\n(?=\s*(?:[-*+]|\d+\.)\s)|\n(?=\s*\|)|\n(?=#)")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[가-힣])")


def sentences(markdown: str) -> list[str]:
    """Unquoted sentences of a markdown cell: paragraphs, list items, table rows, then . ! ?."""
    out = []
    for block in _BLOCK.split(strip_quoted(markdown)):
        text = " ".join(block.split()).replace("**", "").replace("*", "")
        out += [s for s in _SENTENCE.split(text) if re.search(r"\w", s)]
    return out


# --------------------------------------------------------------------------- the rules


_NUMBER = r"(?:\d+(?:[.,]\d+)?\s*½?|½)(?:\s*[–-]\s*\d+(?:[.,]\d+)?)?"
_UNIT = r"(?:ms|µs|us|ns|s|secs?|seconds?|mins?|minutes?|hours?)"
DURATION = re.compile(rf"(?<![\w.·/^]){_NUMBER}\s*-?\s*{_UNIT}(?![\w/·^])")
_INPUT_BEFORE = re.compile(r"=|\bsleep|\bslept\b|\bnaps?\b", re.I)  # within 30 characters
_INPUT_AFTER = re.compile(r"\s*(?:naps?|sleeps?)\b", re.I)
_ASSUMED = re.compile(r"\bassum(?:e|es|ed|ing|ption|ptions)\b", re.I)
_TIME_WORD = r"\b(?:time|times|timing|speed|ms|milliseconds?|seconds?|minutes?|µs|idle|wall)\b"
_COST_WORD = r"\b(?:costs?|costing|saves?|saved|saving|gains?|gained)\b"
_COMPARE_TIME = r"\b(?:less|more|shorter|longer)\s+(?:time|idle|wait)|\bsaves?\b"
_OVERLAP = r"\boverlap(?:s|ped|ping)?\b"

# Terms with a flagged word that name a thing, not an outcome: rewritten before the rules run.
NEUTRAL = [
    (re.compile(r"\bhidden\s+(?:size|dim\w*|states?|layers?|units?)\b", re.I), "width"),
    (re.compile(r"\bcost\s+models?\b", re.I), "model"),  # the α–β cost model
    # a link's speed is a premise ("fast links inside a node"), not a measured outcome
    (
        re.compile(
            r"\b(?:fast|faster|fastest|slow|slower|slowest)\s+(?=(?:links?|networks?)\b)", re.I
        ),
        "",
    ),
]

RULES: dict[str, re.Pattern] = {
    "speed comparison": re.compile(
        r"\b(?:faster|slower|quicker|fastest|speed-?ups?|outperforms?|beats?|wins?|won|"
        r"loses?|losing|pays?\s+off|paid\s+off)\b|\bas\s+(?:slow|fast|quick|long)\s+as\b|"
        r"\b(?:longer|shorter)\s+than\b|\btwice\s+as\s+long\b|"
        r"\bwait(?:s|ed|ing)?\s+(?:far\s+|much\s+)?(?:less|more|longer)\b|"
        r"\b(?:less|more|longer)\s+(?:wait|waiting|idle)\b|"
        r"\bmakes?\s+(?:\w+\s+){0,2}(?:fast|slow)\b",
        re.I,
    ),
    "Korean speed/hide word": re.compile(r"빠르|빠른|빨라|느리|느린|느려|숨기|숨겨|숨긴"),
    "hiding": re.compile(r"\b(?:hide|hides|hid|hidden|hiding)\b", re.I),
    "cost in time": re.compile(
        rf"{_COST_WORD}(?=.*{_TIME_WORD})|{_TIME_WORD}(?=.*{_COST_WORD})", re.I
    ),
    "overlap with a time claim": re.compile(
        rf"{_OVERLAP}(?=.*(?:{_COMPARE_TIME}))|(?:{_COMPARE_TIME}).*{_OVERLAP}", re.I
    ),
}
PREDICTION = re.compile(r"\bpredict(?:s|ed|ion|ions)?\b|\bwe\s+expect\b|\bexpected\b", re.I)


def durations(sentence: str) -> list[str]:
    """The time quantities of a sentence that are outcomes, not inputs the notebook sets."""
    if _ASSUMED.search(sentence):
        return []
    return [
        m.group(0).strip()
        for m in DURATION.finditer(sentence)
        if not _INPUT_BEFORE.search(sentence[max(0, m.start() - 30) : m.start()])
        and not _INPUT_AFTER.match(sentence, m.end())
    ]


def timing_claims(sentence: str) -> list[str]:
    """The names of the rules a sentence breaks (empty: it states no timing outcome)."""
    for pattern, neutral in NEUTRAL:
        sentence = pattern.sub(neutral, sentence)
    hits = [name for name, rule in RULES.items() if rule.search(sentence)]
    found = durations(sentence)
    if found:
        hits.append(f"duration {', '.join(found)}")
        if re.search(r"\boverlap", sentence, re.I) and "overlap with a time claim" not in hits:
            hits.append("overlap with a time claim")
    return hits


_VERDICT_WORDS = re.compile(
    r"\.verdict\b|\bcompare\(|\bpassed\b|assert_passed|\.(?:checks|claims|failures)\("
)


def prints_a_verdict(code: str) -> bool:
    """True when a code cell prints a comparison or a verdict (see the module docstring)."""
    if _VERDICT_WORDS.search(code):
        return True
    try:
        tree = ast.parse("\n".join(ln for ln in code.splitlines() if not ln.startswith(("%", "!"))))
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            if any(isinstance(n, ast.Compare) for a in node.args for n in ast.walk(a)):
                return True
    return False


# --------------------------------------------------------------------------- one notebook


@dataclass(frozen=True)
class Offence:
    notebook: str
    cell: int
    sentence: str
    rules: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.notebook} cell {self.cell}: [{'; '.join(self.rules)}] {self.sentence}"


def scan_cells(name: str, cells) -> list[Offence]:
    """Offences in ``cells`` (``(cell_type, source)`` pairs, in notebook order)."""
    out = []
    first = next((i for i, (kind, _) in enumerate(cells) if kind == "markdown"), None)
    for i, (kind, source) in enumerate(cells):
        if kind != "markdown":
            continue
        if i == first:  # the executor's measured runtime line is printed output, not prose
            lines = source.split("\n")
            source = "\n".join(ln for ln in lines if not ln.lstrip().startswith(STORED_BUILD))
        following = next((src for k, src in cells[i + 1 :] if k == "code"), "")
        for sentence in sentences(source):
            rules = timing_claims(sentence)
            if rules and PREDICTION.search(sentence) and prints_a_verdict(following):
                continue
            if rules:
                out.append(Offence(name, i, sentence, tuple(rules)))
    return out


def scan_source(path: Path) -> list[Offence]:
    nb = _parse(path.read_text(encoding="utf-8"))
    return scan_cells(path.stem, [(c.cell_type, c.source) for c in nb.cells])


# --------------------------------------------------------------------------- the scanner, tested


@pytest.mark.parametrize(
    "text",
    [
        "DDP is 1.8× faster than the naive loop here.",
        "world 1: 17.8 ms/step (35.1 ms without the all-reduce)",
        "With prefetch the all-gather is hidden behind the compute.",
        "The overlap hides the communication.",
        "ZeRO-3 beats DDP on this machine.",
        "Recompute costs about 7 ms per step.",
        "Streaming finished in 3.2 s, before serial's preprocessing alone.",
        "The fp16 hook wins on a slow link.",
        "The step takes 12 ms.",
        "Expected runtime: about 1½ minutes on an idle laptop.",
        "Overlap saves most of the all-reduce's time here.",
        "adding a rank makes the step slower.",
        "두 개의 랭크가 더 빠르다.",
        "the backward bar can be *longer* than under the blocking ones",
        "Each round trip costs time that the step cannot use.",
        "What makes both fast is the unit.",
        "Workers waited far less per step.",
    ],
)
def test_the_scanner_flags_timing_outcomes(text):
    assert scan_cells("t", [("markdown", text)]), f"not flagged: {text!r}"


@pytest.mark.parametrize(
    "text",
    [
        "The all-reduce of bucket k runs while backward computes the layers before it.",
        "DDP overlaps communication with backward, and packs gradients into buckets.",
        "Many tiny all-reduces each pay a fixed latency α; the bubble is (p−1)/(m+p−1).",
        "Each stage is a layer whose forward sleeps 40 ms and backward t_B = 80 ms.",
        'The exam trap "분산 학습은 항상 단일 GPU 학습보다 빠르다" is **X**.',
        "The fit: `faster_step(ms=3)` prints `17.8 ms`.",
        "> Quoted output: 2 ranks 35.1 ms/step, faster than 1.",
        "```\nstep 17.8 ms, faster\n```\nThe cell above printed it.",
        "The links are assumptions: α = 10 µs per message and 50 GB/s.",
        "The meter counts bytes saved for backward and still held at the end of forward.",
        "Activations grow with the sequence s; s = 32 and d = 64 here.",
        "Notation: h is the hidden size; TP stays on the fast links inside a node.",
        "The α–β cost model predicts the communication time of one call.",
        "Four 1-second naps; each stage sleeps 60 ms forward and 120 ms backward.",
    ],
)
def test_the_scanner_leaves_mechanisms_and_quotes_alone(text):
    assert scan_cells("t", [("markdown", text)]) == [], f"flagged: {text!r}"


def test_a_prediction_passes_only_before_a_cell_that_prints_a_verdict():
    claim = "We expect the bucketed variant to be faster: the cell below measures it."
    verdicts = [
        "r = race()\nprint(r.passed)",
        "print(f'{measured < predicted * 1.2}')",
        "res.assert_passed()",
        "for q, ok in res.claims().items():\n    print(q, ok)",
    ]
    for code in verdicts:
        assert scan_cells("t", [("markdown", claim), ("code", code)]) == [], code
    silent = ["r = race()\nprint(r['own'])", "x = 1"]
    for code in silent:
        assert scan_cells("t", [("markdown", claim), ("code", code)]), code
    # the prediction must be phrased as one: a bare claim before a verdict cell is still flagged
    bare = "The bucketed variant is faster."
    assert scan_cells("t", [("markdown", bare), ("code", "print(r.passed)")])
    # the *next* code cell decides, not a later one
    cells = [("markdown", claim), ("code", "x = 1"), ("code", "print(r.passed)")]
    assert scan_cells("t", cells)


def test_only_the_openers_stored_build_line_is_measured_output():
    line = f"{STORED_BUILD} 83 s on 2 cores, 1-minute load 0.12 at the start."
    opener = ("markdown", f"# 02 · DDP\n\n{line}\n\nText.")
    assert scan_cells("t", [opener, ("code", "x = 1")]) == []
    assert scan_cells("t", [opener, ("code", "x = 1"), ("markdown", line)])  # not the opener's
    assert scan_cells("t", [("markdown", f"# 02\n\nSee: {line}")])  # it must start the line


def test_offences_name_notebook_cell_and_sentence():
    cells = [("markdown", "# Title"), ("code", "x = 1"), ("markdown", "Intro. It is 2× faster.")]
    (offence,) = scan_cells("05_x", cells)
    assert (offence.notebook, offence.cell, offence.sentence) == ("05_x", 2, "It is 2× faster.")
    assert "speed comparison" in str(offence)


# --------------------------------------------------------------------------- the notebooks


@pytest.mark.parametrize("src", SOURCES, ids=lambda p: p.stem)
def test_markdown_states_no_timing_outcome(src):
    offences = scan_source(src)
    if offences:
        pytest.fail(
            f"{len(offences)} markdown sentence(s) of notebooks/src/{src.name} state a timing "
            "outcome; print it from the measurement in a code cell, or explain the mechanism "
            "(tests/test_notebook_prose.py says what is flagged):\n"
            + "\n".join(f"  {o}" for o in offences),
            pytrace=False,
        )


if __name__ == "__main__":
    chosen = [
        p for p in SOURCES if not sys.argv[1:] or any(p.name.startswith(a) for a in sys.argv[1:])
    ]
    total = 0
    for src in chosen:
        found = scan_source(src)
        total += len(found)
        print(f"{src.stem}: {len(found)}")
        for offence in found:
            print(f"  {offence}")
    sys.exit(1 if total else 0)
