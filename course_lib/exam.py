"""An alias: the final exam lives in :mod:`course_lib.quiz` (forms, grading, views, progress).

Kept so that ``from course_lib.exam import final_exam, grade_exam, exam_items`` (notebook 09) keeps
working; new code imports from :mod:`course_lib.quiz`.
"""
from .quiz import (DEFAULT_N, CourseProgress, ExamResult, ExamText, ExamWidget, course_progress,
                   exam_items, exercise_chapters, final_exam, grade_exam, progress_report,
                   record_exam, record_exercise, run_terminal_exam)

__all__ = ["CourseProgress", "ExamResult", "ExamText", "ExamWidget", "course_progress",
           "exam_items", "exercise_chapters", "final_exam", "grade_exam", "progress_report",
           "record_exam", "record_exercise", "run_terminal_exam", "DEFAULT_N"]
