"""Chapter 01 exercise: count a model's state bytes from the real tensors.

Check: ``course-lib check count_model_state_bytes``.
"""

import torch


def count_model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Return ``{"params": .., "grads": .., "optimizer": ..}`` in bytes.

    Count each *storage* once (``t.untyped_storage()``, keyed by its ``data_ptr()``; bytes from
    ``.nbytes()``): a tied weight appears twice in ``named_parameters(remove_duplicate=False)``
    but lives in memory once. Optimizer state is every tensor in ``optimizer.state``
    (AdamW: exp_avg, exp_avg_sq and a scalar step per parameter).
    """
    seen = set()

    def bytes_of(tensors):
        total = 0
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    params = list(model.parameters())
    return {
        "params": bytes_of(params),
        "grads": bytes_of(p.grad for p in params if p.grad is not None),
        "optimizer": bytes_of(
            v
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
    }
