"""Chapter 07 exercises: the online-softmax merge (CP) and the MoE dispatch splits (EP).

* **merge** — ring attention attends to one K/V block at a time. Each block gives ``(out, lse)``:
  softmax attention over that block alone and the log-sum-exp of its scores
  (``course_lib.context_parallel.block_attention``). Combine two blocks into attention over both,
  exactly, whatever their order, and without overflow when the scores are large.
* **dispatch_splits** — before the dispatch ``all_to_all_single``, every rank must know how many
  rows it sends to each rank (its ``input_split_sizes``). The experts are sharded contiguously:
  rank q holds experts ``[q·E/e, (q+1)·E/e)``; a token sends one row per chosen expert.

Check: ``course-lib check merge`` and ``course-lib check dispatch_splits``
(or ``check("merge")``, ``check("dispatch_splits")`` in a notebook).
"""

import torch


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over key blocks a and b from each one's ``(out, lse)``: ``(out, lse)`` over a ∪ b.

    ``out_x`` (…, Sq, D) is softmax attention over block x alone, ``lse_x`` (…, Sq) the log-sum-exp
    of its scores.
    """
    # TODO: the merged lse, then each block's output weighted by its share of the softmax mass.
    raise NotImplementedError(
        "merge: chapter 07's section 3 derives the rule; the TODO above says the steps"
    )


def dispatch_splits(experts: torch.Tensor, num_experts: int, ep_size: int) -> list[int]:
    """Rows this rank's dispatch ``all_to_all_single`` sends to each of the ``ep_size`` ranks.

    ``experts`` (N, k): each of this rank's tokens' chosen experts (``route``'s top-k). Return a
    list of ``ep_size`` ints. Raise ``ValueError`` naming both numbers when ``num_experts`` is not
    divisible by ``ep_size``.
    """
    # TODO: rows per expert, then per rank (its E/e experts are next to each other).
    raise NotImplementedError(
        "dispatch_splits: chapter 07's section 11, step 2; the TODO above says the steps"
    )
