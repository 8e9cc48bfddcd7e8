"""Reference solutions, file for file the same as ``exercises/``."""
