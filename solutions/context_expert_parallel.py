"""Chapter 07 exercises (solution): the online-softmax merge (CP) and the MoE dispatch splits (EP).

Check: ``course-lib check merge`` and ``course-lib check dispatch_splits``
(or ``check("merge")``, ``check("dispatch_splits")`` in a notebook).
"""

import torch


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over key blocks a and b from each one's ``(out, lse)``: ``(out, lse)`` over a ∪ b.

    ``out_x`` (…, Sq, D) is softmax attention over block x alone, ``lse_x`` (…, Sq) the log-sum-exp
    of its scores. Block a holds ``e^(lse_a − lse)`` of the merged softmax mass.
    """
    lse = torch.logaddexp(lse_a, lse_b)  # log(e^lse_a + e^lse_b), without overflow
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


def dispatch_splits(experts: torch.Tensor, num_experts: int, ep_size: int) -> list[int]:
    """Rows this rank's dispatch ``all_to_all_single`` sends to each of the ``ep_size`` ranks.

    ``experts`` (N, k): each of this rank's tokens' chosen experts (``route``'s top-k). One row
    goes per chosen expert; rank q holds experts ``[q·E/e, (q+1)·E/e)``.
    """
    if num_experts % ep_size:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by ep_size={ep_size}: expert "
            "parallelism gives every rank E/e whole experts"
        )
    counts = torch.bincount(experts.flatten(), minlength=num_experts)  # rows per expert
    return counts.view(ep_size, -1).sum(dim=1).tolist()  # per rank: its E/e experts, in a row
