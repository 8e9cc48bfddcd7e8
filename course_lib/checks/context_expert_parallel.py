"""Chapter 07 checkers: the online-softmax ``merge`` (CP) and the MoE ``dispatch_splits`` (EP).

**merge.** ``merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`` combines attention over key block a
and over key block b (each from :func:`~course_lib.context_parallel.block_attention`) into attention
over a ∪ b. On every rank, for several shapes, the keys are cut into uneven blocks (this rank's cut
points differ from the others'), the learner's merge folds the blocks left to right, and the result
is compared with ``F.scaled_dot_product_attention`` over all keys (the output) and with
``torch.logsumexp`` of all scores (the lse), within :data:`~course_lib.results.SGD`. Two more
rules: merge(b, a) must equal merge(a, b), and scores of magnitude ~100 (where ``exp`` overflows
fp32) must still merge to finite, correct values. The messages say what differs, never the formula.

**dispatch_splits.** ``dispatch_splits(experts, num_experts, ep_size) -> list[int]``: how many
rows this rank's dispatch all-to-all sends to each rank, from its tokens' chosen experts (N, k).
On every rank, for several routings (a rank with no tokens, top-1 and top-2, a skewed router),
the result must equal the library's send splits (:func:`~course_lib.expert_parallel.split_sizes`
of the group's all-gathered counts, nothing dropped). Then the splits are used for real: an
``all_to_all_single`` of them gives every rank its receive sizes (they must be the library's), and
a second one dispatches the expert ids themselves, sorted, with those splits: every row arriving on
rank q must be for one of q's experts. Last, ``num_experts`` not divisible by ``ep_size`` must
raise a ``ValueError`` that names both numbers.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..context_parallel import block_attention
from ..expert_parallel import split_sizes
from ..launch import device
from ..results import SGD, max_abs_diff

__all__ = ["check_merge", "check_dispatch_splits"]

MERGE_CASES = [
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
    for shape, keys, size in MERGE_CASES:
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


# --------------------------------------------------------------------------- dispatch_splits

SPLIT_CASES = [
    (0, 1, 1, 0.0),  # rank 0 has no tokens
    (16, 2, 2, 0.0),
    (9, 4, 2, 4.0),  # skewed: each rank's tokens favour the next rank's first expert
]  # (tokens on rank 0, experts per rank, top-k, skew); rank r has 5·r more tokens


def _routed(tokens, num_experts, k, skew, gen) -> torch.Tensor:
    """(tokens, k) distinct expert ids per token, as ``route``'s top-k picks them."""
    rank, per = dist.get_rank(), num_experts // dist.get_world_size()
    scores = torch.randn(tokens, num_experts, generator=gen)
    scores[:, (rank + 1) % dist.get_world_size() * per] += skew
    return scores.topk(k, dim=-1).indices


def _split_list(got, ep_size, where) -> list[str]:
    if isinstance(got, torch.Tensor):
        return [
            f"{where}: dispatch_splits returned a tensor; all_to_all_single takes its split sizes "
            "as a list of ints"
        ]
    if not isinstance(got, list | tuple) or not all(isinstance(n, int) for n in got):
        return [f"{where}: dispatch_splits returned {got!r}, expected a list of {ep_size} ints"]
    if len(got) != ep_size:
        return [
            f"{where}: dispatch_splits returned {len(got)} sizes, expected one per rank ({ep_size})"
        ]
    return []


def _exchange(send, want_recv, experts, per, where) -> list[str]:
    """The splits used for real: all-to-all the counts, then dispatch the sorted expert ids."""
    rank, dev, problems = dist.get_rank(), experts.device, []
    recv = torch.empty(len(send), dtype=torch.long, device=dev)
    dist.all_to_all_single(recv, torch.tensor(send, dtype=torch.long, device=dev))
    recv = recv.tolist()
    mine = f"[{rank * per}, {(rank + 1) * per})"
    if recv != want_recv:
        problems.append(
            f"{where}: all_to_all_single of the splits gives receive sizes {recv}, but the ranks "
            f"chose this rank's experts {mine} {want_recv} times"
        )
    ids = experts.flatten().sort().values  # grouped by expert, so by destination rank
    arrived = ids.new_empty(sum(recv))
    dist.all_to_all_single(arrived, ids, recv, list(send))
    stray = int(((arrived < rank * per) | (arrived >= (rank + 1) * per)).sum())
    if stray:
        problems.append(
            f"{where}: dispatched with these splits, {stray} of the {arrived.numel()} rows "
            f"arriving here are for experts outside this rank's {mine}"
        )
    return problems


def _anywhere(problems) -> bool:
    """Whether any rank found a problem (an all-reduce: every rank must call it)."""
    flag = torch.tensor(1 if problems else 0, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _not_divisible(fn) -> list[str]:
    rank, e = dist.get_rank(), dist.get_world_size()
    E = 2 * e - 1  # not a multiple of e
    experts = torch.arange(E, device=device()).view(-1, 1)
    where = f"rank {rank}, num_experts={E}, ep_size={e}"
    try:
        got = fn(experts, E, e)
    except NotImplementedError:
        raise
    except ValueError as err:
        if {str(E), str(e)} <= set(re.findall(r"\d+", str(err))):
            return []
        return [f"{where}: the ValueError should name both numbers and the rule; it says {err}"]
    except Exception as err:  # noqa: BLE001 - the wrong error is the learner's result
        return [
            f"{where}: raised {type(err).__name__} ({err}), expected a ValueError naming the rule"
        ]
    return [
        f"{where}: returned {got!r}; {E} experts do not split into {e} equal whole shares, so "
        "it must raise ValueError"
    ]


def check_dispatch_splits(fn) -> list[str]:
    rank, e, dev = dist.get_rank(), dist.get_world_size(), device()
    for tokens, per, k, skew in SPLIT_CASES:
        E = per * e
        gen = torch.Generator().manual_seed(1000 * rank + 10 * per + k)
        experts = _routed(tokens + 5 * rank, E, k, skew, gen).to(dev)
        where = f"rank {rank}, {len(experts)} tokens, top-{k} of {E} experts on {e} ranks"
        local = torch.bincount(experts.flatten(), minlength=E)
        counts = local.new_empty(e * E)
        comm.all_gather(counts, local, tag="moe_counts")
        # nothing dropped: the kept matrix is the counts
        want_send, want_recv = split_sizes(counts.view(e, E), rank)
        got = fn(experts.clone(), E, e)
        problems = _split_list(got, e, where)
        if not problems and sum(got) != experts.numel():
            problems.append(
                f"{where}: dispatch_splits sum to {sum(got)}, but the dispatch sends one row per "
                f"chosen expert: {experts.numel()}"
            )
        usable = torch.tensor(0 if problems else 1, device=dev)
        if not problems and list(got) != want_send:
            problems.append(
                f"{where}: dispatch_splits is {list(got)}, expected {want_send} (rank q holds "
                f"experts [q·{per}, (q+1)·{per}))"
            )
        dist.all_reduce(usable, op=dist.ReduceOp.MIN)  # every rank exchanges, or none
        if usable.item():
            problems += _exchange(got, want_recv, experts, per, where)
        if _anywhere(problems):  # stop together: the next case's collectives need every rank
            return problems
    return _not_divisible(fn)
