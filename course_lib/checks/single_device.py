"""Chapter 01 checker: ``count_model_state_bytes`` == ``memory.model_state_bytes`` (unique storages)."""

from __future__ import annotations

import torch

from ..configs import make_optimizer
from ..launch import device
from ..memory import model_state_bytes
from ..models import GPT, tiny_config
from ..train import train_step

__all__ = ["check_count_model_state_bytes"]


def check_count_model_state_bytes(fn) -> list[str]:
    """Tied and untied one-layer GPTs after one AdamW step: params, grads and optimizer bytes."""
    dev = device()
    problems = []
    for tie in (True, False):
        model = GPT(tiny_config(tie_weights=tie, n_layer=1)).to(dev)
        opt = make_optimizer("adamw", model.parameters())  # the course's AdamW: 2 states per param
        tokens = torch.zeros(2, 8, dtype=torch.long, device=dev)
        train_step(model, opt, tokens, tokens)
        want = model_state_bytes(model, opt)
        got = fn(model, opt)
        for key in ("params", "grads", "optimizer"):
            if got.get(key) != want[key]:
                problems.append(
                    f"tie_weights={tie}: {key} = {got.get(key)} bytes, expected {want[key]}"
                )
    return problems
