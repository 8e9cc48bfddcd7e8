"""Which statements a learner is asked: a chapter quiz, or a final-exam form over every chapter."""

from __future__ import annotations

import random

from .bank import chapter_key, chapters, load_bank

__all__ = ["DEFAULT_N", "quiz_items", "exam_items"]

DEFAULT_N = 40  # statements on the final exam


def quiz_items(chapter, n=None, shuffle=False, seed=0, *, bank_dir=None) -> tuple[str, list[dict]]:
    """``(topic, items)`` of a chapter quiz: the bank's items, optionally shuffled by
    ``random.Random(seed)``, then the first ``n``."""
    topic = chapter_key(chapter, bank_dir=bank_dir)
    items = load_bank(topic, bank_dir=bank_dir)
    if shuffle:
        random.Random(seed).shuffle(items)
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(items):
            raise ValueError(
                f"n must be an integer between 1 and {len(items)} (chapter {topic}), got {n!r}"
            )
        items = items[:n]
    return topic, items


def exam_items(n: int | None = DEFAULT_N, seed: int = 0, *, bank_dir=None) -> list[dict]:
    """One exam form: every seed item plus items drawn evenly over the chapters.

    The chapter with the fewest items on the form draws next (chapters and items in a
    ``random.Random(seed)`` order), never two items of one ``group`` nor one of a seed's group.
    Listed in bank order, chapter by chapter; the same ``(n, seed)`` gives the same form anywhere.
    ``n=None`` takes every item the group rule allows. Raises ``ValueError`` for an ``n`` below
    the seed count or above what the group rule allows.
    """
    bank = load_bank(bank_dir=bank_dir)
    order = {item["id"]: index for index, item in enumerate(bank)}
    seeds = [item for item in bank if item.get("seed")]
    rng = random.Random(seed)
    pools = {
        c: [i for i in bank if i["chapter"] == c and not i.get("seed")]
        for c in chapters(bank_dir=bank_dir)
    }
    for pool in pools.values():
        rng.shuffle(pool)
    turn = list(pools)
    rng.shuffle(turn)  # tie-break between chapters with equally many items on the form
    count = {c: sum(i["chapter"] == c for i in seeds) for c in pools}
    taken = {i["group"] for i in seeds if i.get("group")}
    drawn: list[dict] = []
    while True:
        for pool in pools.values():  # drop what the group rule now forbids
            pool[:] = [i for i in pool if i.get("group") not in taken]
        open_chapters = [c for c in turn if pools[c]]
        if not open_chapters:
            break
        chapter = min(open_chapters, key=lambda c: (count[c], turn.index(c)))
        item = pools[chapter].pop(0)
        if item.get("group"):
            taken.add(item["group"])
        drawn.append(item)
        count[chapter] += 1
    low, high = len(seeds), len(seeds) + len(drawn)
    n = high if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not low <= n <= high:
        raise ValueError(
            f"n must be an integer between {low} (the seed statements) and {high} "
            f"(every item the one-per-group rule allows), got {n!r}"
        )
    return sorted(seeds + drawn[: n - len(seeds)], key=lambda item: order[item["id"]])
