"""course_lib — the companion library of the Hands-On Distributed Training course.

One module per chapter; see the notebooks in ``notebooks/`` for the story.
"""

__version__ = "0.1.0"
