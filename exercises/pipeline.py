"""Chapter 05 exercise: the 1F1B schedule of one pipeline stage.

``one_f_one_b_schedule(num_stages, num_microbatches, stage)`` returns the ordered list of
``Action(op, microbatch)`` that stage ``stage`` runs in one training step under 1F1B
(PipeDream-Flush, Narayanan et al. 2021):

a warm-up of forwards, a steady state that alternates forwards and backwards, a cool-down of
backwards — arranged so that stage ``stage`` never holds more than ``p − stage`` micro-batches'
activations (GPipe holds m). How many forwards each phase runs is the exercise: notebook 05
draws the schedule, and ``course_lib.checks.pipeline.hint("one_f_one_b_schedule", 1)`` gives the
idea, level 2 the API.

Check: ``course-lib check one_f_one_b_schedule`` (or ``check("one_f_one_b_schedule")`` in a notebook):
your order is compared with the reference for many (p, m, stage) and then *run* on real ranks — a
pipeline driven by your schedule must give one device's gradients.
"""

from course_lib.pipeline import Action


def one_f_one_b_schedule(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Stage ``stage``'s 1F1B actions: ``[Action("F", 0), ..., Action("B", m − 1)]``."""
    p, m = num_stages, num_microbatches  # noqa: F841
    # TODO: warm-up, steady state, cool-down (notebook 05's schedule figure; hints in layers)
    raise NotImplementedError(
        "one_f_one_b_schedule: implement it (hints: course_lib.checks.pipeline.hint("
        "'one_f_one_b_schedule', 1), then level 2; notebook 05's exercise section states what "
        "the checker compares)"
    )
