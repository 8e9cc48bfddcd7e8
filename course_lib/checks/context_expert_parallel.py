"""Context-parallel checker: the learner's online-softmax ``merge`` of two attention blocks.

``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`` combines attention over key block a and over
key block b (each from :func:`~course_lib.context_parallel.block_attention`) into attention over
a ∪ b. On every rank, for several shapes, the keys are cut into uneven blocks (this rank's cut
points differ from the others'), the learner's merge folds the blocks left to right, and the result
is compared with ``F.scaled_dot_product_attention`` over all keys (the output) and with
``torch.logsumexp`` of all scores (the lse), within :data:`~course_lib.results.SGD`. Two more
rules: merge(b, a) must equal merge(a, b), and scores of magnitude ~100 (where ``exp`` overflows
fp32) must still merge to finite, correct values. The messages say what differs, never the formula.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..context_parallel import block_attention
from ..launch import device
from ..results import SGD, max_abs_diff

__all__ = ["check_merge"]

CASES = [
    ((1, 1, 3, 4), 7, 1.0),
    ((2, 3, 5, 8), 12, 1.0),
    ((2, 2, 4, 4), 9, 60.0),  # scores ~100: exp() of them overflows fp32
]  # (q shape, number of keys, scale of q)


def _close(name, got, want, where) -> list[str]:
    if not isinstance(got, torch.Tensor):
        return [f"{where}: {name} is {type(got).__name__}, expected a tensor"]
    if tuple(got.shape) != tuple(want.shape):
        return [f"{where}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    if not torch.isfinite(got).all():
        return [f"{where}: {name} has inf or nan entries (the scores are large here)"]
    if SGD.ok(got, want):
        return []
    return [
        f"{where}: {name} differs from attention over all keys by {max_abs_diff(got, want):.3g}"
    ]


def _result(value, where) -> tuple | list[str]:
    if not (isinstance(value, tuple | list) and len(value) == 2):
        return [f"{where}: merge returned {type(value).__name__}, expected (out, lse)"]
    return tuple(value)


def check_merge(fn) -> list[str]:
    rank, dev = dist.get_rank(), device()
    problems = []
    for shape, keys, size in CASES:
        gen = torch.Generator().manual_seed(100 * rank + keys)
        q = (torch.randn(shape, generator=gen) * size).to(dev)
        k, v = (torch.randn(shape[:2] + (keys, shape[-1]), generator=gen).to(dev) for _ in range(2))
        cuts = sorted(torch.randperm(keys - 1, generator=gen)[:2].add(1).tolist())
        bounds = [0, *cuts, keys]
        blocks = [
            block_attention(q, k[..., a:b, :], v[..., a:b, :])
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        where = f"rank {rank}, q{shape}, {keys} keys in blocks {bounds}"
        want_out = F.scaled_dot_product_attention(q, k, v)
        want_lse = torch.logsumexp((q @ k.transpose(-2, -1)) / math.sqrt(shape[-1]), dim=-1)
        acc = blocks[0]
        for blk in blocks[1:]:
            acc = _result(fn(*acc, *blk), where)
            if isinstance(acc, list):
                return acc
        problems += _close("out", acc[0], want_out, where)
        problems += _close("lse", acc[1], want_lse, where)
        ab, ba = (
            _result(fn(*blocks[0], *blocks[1]), where),
            _result(fn(*blocks[1], *blocks[0]), where),
        )
        if isinstance(ab, list) or isinstance(ba, list):
            return problems + (ab if isinstance(ab, list) else ba)
        if not problems and not SGD.ok(ab[0], ba[0]):
            problems.append(
                f"{where}: merge(a, b) and merge(b, a) differ by {max_abs_diff(ab[0], ba[0]):.3g}; "
                "the blocks' order must not matter"
            )
        if problems:
            return problems
    return problems
