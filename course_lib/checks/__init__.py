"""Rank-side checkers of the exercises, one module per chapter (mirrors ``exercises/``); the engine is ``check.py``."""


def layered_hint(hints: dict, name: str, level: int = 1) -> str:
    """Hint ``level`` of exercise ``name`` from a chapter's ``hints`` (``{name: (idea, API)}``).

    Hints come in layers: 1 is the idea, 2 the API; there is no level with the code.
    """
    if name not in hints:
        raise ValueError(f"no hints for {name!r}; exercises with hints: {sorted(hints)}")
    if level not in (1, 2):
        raise ValueError(
            f"level={level!r}: 1 is the idea, 2 the API (there is no level with the code)"
        )
    return hints[name][level - 1]
