"""Chapter 05 exercise: the 1F1B schedule of one pipeline stage.

``one_f_one_b_schedule(num_stages, num_microbatches, stage)`` returns the ordered list of
``Action(op, microbatch)`` that stage ``stage`` runs in one training step under 1F1B
(PipeDream-Flush, Narayanan et al. 2021):

1. **warm-up**: ``min(p − 1 − stage, m)`` forwards, so that the later stages have work;
2. **steady state**: alternately one forward (the next micro-batch) and one backward (the oldest
   micro-batch whose backward has not run);
3. **cool-down**: the remaining backwards.

Stage ``stage`` then never holds more than ``p − stage`` micro-batches' activations (GPipe holds m).

Check: ``course-lib check one_f_one_b_schedule`` (or ``check("one_f_one_b_schedule")`` in a notebook):
your order is compared with the reference for many (p, m, stage) and then *run* on real ranks — a
pipeline driven by your schedule must give one device's gradients.
"""

from course_lib.pipeline import Action


def one_f_one_b_schedule(num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """Stage ``stage``'s 1F1B actions: ``[Action("F", 0), ..., Action("B", m − 1)]``."""
    p, m = num_stages, num_microbatches  # noqa: F841
    # TODO: warm-up forwards (how many does stage `stage` need before its first backward?),
    # then alternate Action("F", next micro-batch) and Action("B", oldest micro-batch),
    # then the remaining backwards.
    raise NotImplementedError(
        "one_f_one_b_schedule: implement it (the hint: a stage runs forwards until it holds as many "
        "micro-batches as the stages after it can still take, then alternates one backward with one "
        "forward; notebook 05's exercise section states what the checker compares)"
    )
