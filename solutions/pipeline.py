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
    p, m = num_stages, num_microbatches
    warmup = min(p - 1 - stage, m)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        actions.append(Action("F", warmup + i))  # the next forward …
        actions.append(Action("B", i))  # … then the oldest backward still owed
    actions += [Action("B", i) for i in range(m - warmup, m)]
    return actions
