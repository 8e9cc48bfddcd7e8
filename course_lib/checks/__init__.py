"""Rank-side checkers of the exercises, one module per chapter (mirrors ``exercises/``); the engine is ``check.py``."""
