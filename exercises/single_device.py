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
    # TODO: walk model.parameters(), their .grad, and optimizer.state; sum untyped_storage().nbytes()
    # over storages you have not seen yet.
    raise NotImplementedError(
        "count_model_state_bytes: sum untyped_storage().nbytes() over unique storages "
        "(hint: a set of data_ptr() values) for params, grads and optimizer.state"
    )
