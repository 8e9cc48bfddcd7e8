"""The O/X bank gives no answer away by its wording: surface cues predict the key no better than chance.

Each test is a classifier's accuracy against the key, not a count of words. A learner who marks
every long statement O, every hedged one O or every "only" claim X must not pass:
- over the bank's non-seed items, the best length threshold (either direction, ko and en) and the
  hedge / "only" / absolute-word rules score at most :data:`BANK_MAX` (60 %);
- per chapter, the fixed rule "the longer half is O" scores at most :data:`CHAPTER_MAX` (70 %)
  (a rule fitted per chapter would be noisy at ~17 items: a cue-free chapter beats 60 % by chance).
The seed statements are verbatim exam sentences and stay out of the bank-wide rules.
"""

from __future__ import annotations

import re

import pytest

from course_lib import quiz as q

BANK_MAX = 0.60
CHAPTER_MAX = 0.70

NON_SEED = [item for item in q.load_bank() if not item.get("seed")]

# A rule predicts one answer for the statements it matches; its accuracy is over those statements
# and counts only where it matches at least MIN_MATCHES of them (a rule that fires twice says nothing).
MIN_MATCHES = 8
RULES = {
    "hedge → O (en)": (
        "en",
        r"\b(usually|can|may|might|often|typically|generally|tends? to)\b",
        "O",
    ),
    "hedge → O (ko)": ("ko", r"보통|수 있|대개|일반적으로|흔히|경향", "O"),
    "only → X (en)": ("en", r"\bonly\b", "X"),
    "only → X (ko)": ("ko", r"만\s|전용|뿐", "X"),
    "absolute → X (en)": ("en", r"\b(always|never|every|all|any|none)\b", "X"),
    "absolute → X (ko)": ("ko", r"항상|절대|반드시|모든|결코|전혀", "X"),
}


def length_accuracy(items, lang: str) -> float:
    """The best accuracy of any rule "length ≥ t → O" or "length ≥ t → X" over ``items``."""
    pairs = [(len(item["statement"][lang]), item["answer"]) for item in items]
    best = 0.0
    for t in sorted({n for n, _ in pairs}):
        long_o = sum(("O" if n >= t else "X") == a for n, a in pairs) / len(pairs)
        best = max(best, long_o, 1 - long_o)
    return best


@pytest.mark.parametrize("lang", ["ko", "en"])
def test_no_length_threshold_predicts_the_answer(lang):
    acc = length_accuracy(NON_SEED, lang)
    assert acc <= BANK_MAX, (
        f"a statement-length threshold ({lang}) predicts {acc:.0%} of the non-seed answers "
        f"(> {BANK_MAX:.0%}): false statements must be as long and as qualified as true ones"
    )


@pytest.mark.parametrize("name", list(RULES))
def test_no_word_cue_predicts_the_answer(name):
    lang, pattern, predicted = RULES[name]
    hits = [item for item in NON_SEED if re.search(pattern, item["statement"][lang], re.I)]
    if len(hits) < MIN_MATCHES:
        return  # too rare to be a cue
    acc = sum(item["answer"] == predicted for item in hits) / len(hits)
    assert acc <= BANK_MAX, (
        f"'{name}' is right on {acc:.0%} of the {len(hits)} statements it matches (> {BANK_MAX:.0%}): "
        + ", ".join(item["id"] for item in hits if item["answer"] == predicted)[:600]
    )


@pytest.mark.parametrize("chapter", q.chapters())
@pytest.mark.parametrize("lang", ["ko", "en"])
def test_the_longer_half_of_a_chapter_is_not_the_true_half(chapter, lang):
    items = sorted(q.load_bank(chapter), key=lambda item: len(item["statement"][lang]))
    half = len(items) // 2
    right = sum(i["answer"] == "X" for i in items[:half]) + sum(
        i["answer"] == "O" for i in items[half:]
    )
    acc = right / len(items)
    assert acc <= CHAPTER_MAX, (
        f"chapter {chapter} ({lang}): marking the longer half O scores {acc:.0%} (> {CHAPTER_MAX:.0%})"
    )


def test_the_classifiers_can_fail():
    """The controls: a bank whose true statements are the long ones is caught."""
    fake = [
        {
            "statement": {"en": "x" * (10 + 50 * (k % 2)), "ko": "가"},
            "answer": "O" if k % 2 else "X",
        }
        for k in range(20)
    ]
    assert length_accuracy(fake, "en") == 1.0


# -- explanations -----------------------------------------------------------------------------------
# A chapter quiz shows each explanation right after its answer, so an explanation must not state the
# fact another item of the chapter hinges on. The facts a checker can find without a reader are the
# formulas and computed values (2(N−1)/N, 4Ψ + 12Ψ/N, (p−1)/(m+p−1), 3/7 (about 43%)): a token
# with a digit or Ψ and an operator, at least 4 characters unless all digits (3/7, 43%), names such as
# ZeRO-1/2 or FSDP2 and a bare 1/N excluded. Items of one group
# already give each other away and are kept apart on an exam form, so only other pairs count.
FORMULA = re.compile(r"[\w()\-−/·.+×=%]*[\dΨ][\w()\-−/·.+×=%]*(?:\s*[+×=]\s*[\w()\-−/·.%]+)*")
NAME = re.compile(r"^[A-Za-z]+-?\d")


def formulas(text: str) -> set[str]:
    """The formula-like tokens of ``text``: a digit or Ψ and an operator; a Korean particle after
    one (…이다, …로) is dropped."""
    found = set()
    for match in FORMULA.finditer(text):
        token = re.sub(r"[가-힣]+$", "", match.group(0)).strip(".,;: +×=")
        while token.endswith(")") and token.count(")") > token.count("("):
            token = token[
                :-1
            ]  # "(about 43%)": the parenthesis closes the sentence's, not the token's
        while token.startswith("(") and token.count("(") > token.count(")"):
            token = token[1:]
        long_enough = len(token) >= 4 or re.fullmatch(r"[\d/.%]{3,}", token)
        if long_enough and re.search(r"[/+×=%]", token) and not NAME.match(token):
            found.add(token)
    return found


def explanation_leaks(items, lang: str) -> list[str]:
    """``"A -> B: formula"`` for each explanation of A that states a formula of B's statement
    (not in A's own statement), A and B not of one group."""
    leaks = []
    for b in items:
        for a in items:
            if a is b or (a.get("group") and a.get("group") == b.get("group")):
                continue
            for formula in formulas(b["statement"][lang]):
                if formula in a["explanation"][lang] and formula not in a["statement"][lang]:
                    leaks.append(f"{a['id']} -> {b['id']}: {formula}")
    return leaks


@pytest.mark.parametrize("chapter", q.chapters())
@pytest.mark.parametrize("lang", ["ko", "en"])
def test_no_explanation_states_the_formula_of_another_item_of_its_chapter(chapter, lang):
    leaks = explanation_leaks(q.load_bank(chapter), lang)
    assert not leaks, f"explanations answer other items of chapter {chapter} ({lang}): {leaks}"


def test_the_explanation_check_can_fail():
    """The control: ZeRO-1's explanation giving the formula a ZeRO-3 item misattributes is caught,
    and the same pair in one group is not."""
    item = {"statement": {"en": "ZeRO-1 shards the optimizer states."}, "group": None}
    zero1 = dict(item, id="a", explanation={"en": "ZeRO-1 needs 4Ψ + 12Ψ/N per rank."})
    zero3 = {
        "id": "b",
        "statement": {"en": "ZeRO-3 needs 4Ψ + 12Ψ/N bytes."},
        "explanation": {"en": "ZeRO-3 needs 16Ψ/N."},
        "group": None,
    }
    assert formulas("sends 2(N−1)/N times, 3/7 (about 43%); ZeRO-1/2, FSDP2, 1/N") == {
        "2(N−1)/N",
        "3/7",
        "43%",
    }
    assert formulas("버블 비율은 (p−1)/(m+p−1)이다") == {"(p−1)/(m+p−1)"}
    assert explanation_leaks([zero1, zero3], "en") == ["a -> b: 4Ψ + 12Ψ/N"]
    assert explanation_leaks([dict(zero1, group="g"), dict(zero3, group="g")], "en") == []
