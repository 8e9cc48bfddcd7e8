"""Your exercises. Each file mirrors one in ``solutions/``; check with ``course-lib check <name>``."""
