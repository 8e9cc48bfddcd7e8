"""Which statements a learner is asked: a chapter quiz, or a final-exam form over every chapter."""

from __future__ import annotations

import random

from .bank import chapter_key, chapters, load_bank

__all__ = ["DEFAULT_N", "COMPUTATIONS", "quiz_items", "exam_items"]

DEFAULT_N = 40  # O/X statements on the final exam
COMPUTATIONS = 3  # numeric questions after them, each from another chapter


def quiz_items(chapter, n=None, shuffle=False, seed=0, *, bank_dir=None) -> tuple[str, list[dict]]:
    """``(topic, items)`` of a chapter quiz: the bank's O/X statements, optionally shuffled by
    ``random.Random(seed)``, then the chapter's numeric questions; ``n`` asks only the first
    ``n`` O/X statements (a short quiz, without the computations)."""
    topic = chapter_key(chapter, bank_dir=bank_dir)
    numeric = load_bank(topic, bank_dir=bank_dir, kind="numeric")
    items = load_bank(topic, bank_dir=bank_dir)
    if shuffle:
        random.Random(seed).shuffle(items)
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(items):
            raise ValueError(
                f"n must be an integer between 1 and {len(items)} (chapter {topic}), got {n!r}"
            )
        return topic, items[:n]
    return topic, items + numeric


BALANCE = 3  # a form's O count is within this many of half its statements


def _draw(bank: list[dict], seeds: list[dict], rng: random.Random, chapter_names) -> list[dict]:
    """Every non-seed item the one-per-group rule allows, in draw order.

    The chapter with the fewest *non-seed* items drawn so far draws next (the seeds do not use up a
    chapter's quota: chapter 05's four seeds leave its other items their turn); chapters and items
    in ``rng``'s order; never two items of one ``group`` nor one of a seed's group."""
    pools = {c: [i for i in bank if i["chapter"] == c and not i.get("seed")] for c in chapter_names}
    for pool in pools.values():
        rng.shuffle(pool)
    turn = list(pools)
    rng.shuffle(turn)  # tie-break between chapters with equally many items drawn
    count = dict.fromkeys(pools, 0)
    taken = {i["group"] for i in seeds if i.get("group")}
    drawn: list[dict] = []
    while True:
        for pool in pools.values():  # drop what the group rule now forbids
            pool[:] = [i for i in pool if i.get("group") not in taken]
        open_chapters = [c for c in turn if pools[c]]
        if not open_chapters:
            return drawn
        chapter = min(open_chapters, key=lambda c: (count[c], turn.index(c)))
        item = pools[chapter].pop(0)
        if item.get("group"):
            taken.add(item["group"])
        drawn.append(item)
        count[chapter] += 1


def _balance(form: list[dict], spare: list[dict], fixed_o: int, size: int) -> list[dict]:
    """``form`` with items swapped for ``spare`` ones of the same chapter and the other answer until
    the O count, ``fixed_o`` (the seeds') plus the form's, is within :data:`BALANCE` of ``size / 2``
    (as close as the spares allow).

    Every drawn item is group-free with every other, so a swap never breaks the group rule, and a
    swap within a chapter keeps the per-chapter counts."""
    form, spare = list(form), list(spare)
    while True:
        o_count = fixed_o + sum(i["answer"] == "O" for i in form)
        excess = o_count - size / 2
        if abs(excess) <= BALANCE - 1:  # aim inside the band, not at its edge
            return form
        too_many = "O" if excess > 0 else "X"
        swap = next(
            (
                (a, b)
                for a, item in enumerate(form)
                if item["answer"] == too_many
                for b, other in enumerate(spare)
                if other["answer"] != too_many and other["chapter"] == item["chapter"]
            ),
            None,
        )
        if swap is None:
            return form
        a, b = swap
        form[a], spare[b] = spare[b], form[a]


def _order(seeds: list[dict], others: list[dict], rng: random.Random) -> list[dict]:
    """The form in ``rng``'s order with no two seed statements side by side (a seed pair's O and X
    sentences would give each other away) wherever there are enough other items to separate them."""
    seeds, others = list(seeds), list(others)
    rng.shuffle(seeds)
    rng.shuffle(others)
    if len(seeds) > len(others) + 1:
        out = seeds + others
        rng.shuffle(out)
        return out
    slots = set(rng.sample(range(len(others) + 1), len(seeds)))  # a seed goes before others[slot]
    out, next_seed = [], iter(seeds)
    for position in range(len(others) + 1):
        if position in slots:
            out.append(next(next_seed))
        if position < len(others):
            out.append(others[position])
    return out


def _computations(bank_dir, rng: random.Random, count: int) -> list[dict]:
    """``count`` numeric questions, each from a different chapter (chapters in ``rng``'s order)."""
    by_chapter: dict[str, list[dict]] = {}
    for item in load_bank(bank_dir=bank_dir, kind="numeric"):
        by_chapter.setdefault(item["chapter"], []).append(item)
    names = sorted(by_chapter)
    rng.shuffle(names)
    return [rng.choice(by_chapter[name]) for name in names[:count]]


def exam_items(
    n: int | None = DEFAULT_N, seed: int = 0, *, computations: int = COMPUTATIONS, bank_dir=None
) -> list[dict]:
    """One exam form: every seed item plus items drawn evenly over the chapters, then
    ``computations`` numeric questions (each from another chapter, as many as the bank has).

    Each chapter gets its share of the non-seed statements whatever its seeds (:func:`_draw`), at
    most one item per ``group``; the O/X count is balanced within :data:`BALANCE` of half by swaps
    inside a chapter; the order is shuffled by ``seed`` with no two seed statements adjacent. The
    same ``(n, seed)`` gives the same form anywhere. ``n=None`` takes every item the group rule
    allows. Raises ``ValueError`` for an ``n`` below the seed count or above what the group rule
    allows.
    """
    bank = load_bank(bank_dir=bank_dir)
    seeds = [item for item in bank if item.get("seed")]
    rng = random.Random(seed)
    drawn = _draw(bank, seeds, rng, chapters(bank_dir=bank_dir))
    low, high = len(seeds), len(seeds) + len(drawn)
    n = high if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
        raise ValueError(
            f"n must be an integer between {low} (the seed statements) and {high} "
            f"(every item the one-per-group rule allows), got {n!r}"
        )
    k = n - len(seeds)
    seed_o = sum(i["answer"] == "O" for i in seeds)
    picked = _balance(drawn[:k], drawn[k:], seed_o, n)
    return _order(seeds, picked, rng) + _computations(bank_dir, rng, computations)
