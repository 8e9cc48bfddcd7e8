"""Context parallelism: split the *sequence* over c ranks, and make attention work across the cut.

Everything in a transformer except attention is per token: with the sequence cut into c chunks, the
embeddings, LayerNorms, MLPs and the loss run on this rank's S/c tokens with replicated weights,
exactly like data parallelism over tokens (their gradients are summed over the CP group). Attention
is the one op that mixes tokens: every query needs every (earlier) key and value. Three ways to give
it them, read top to bottom:

1. **Layouts.** :func:`shard_sequence` / :func:`unshard_sequence` cut a sequence and put it back;
   :func:`positions` gives the *global* position ids of a rank's tokens (the position embedding and
   the causal mask must use them, never ``arange(S/c)``).

   * ``"contiguous"``: rank i holds chunk i of c.
   * ``"zigzag"``: the sequence is cut into 2c chunks and rank i holds chunks i and 2c−1−i.

   Causal attention makes contiguous chunks unequal: the last rank's queries see every key, the
   first rank's only its own. Zig-zag pairs an early chunk with a late one, so every rank does the
   same work (:func:`attention_work` counts it).

2. **Ring attention** (Liu et al. 2023; the blockwise form of FlashAttention):
   :func:`ring_attention`. Each rank keeps its queries and passes its K/V block to the next rank
   (``isend`` to r+1, ``irecv`` from r−1) while it attends to the block it already holds, so the
   transfer hides under compute. After c steps every query has seen every block. The partial
   results of two blocks combine with the online-softmax rule, :func:`merge`::

       lse = log(e^lse_a + e^lse_b)          # log Σ exp of the scores of both blocks
       out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b

   where ``out_x`` is softmax attention over block x alone and ``lse_x`` the log-sum-exp of its
   scores (:func:`block_attention` returns both). The merge is exact, associative and commutative.

   *Causal mask.* Masking compares **global** positions (so zig-zag works). A block that is
   entirely in the future of a query chunk is **skipped**; a block entirely in its past is computed
   without a mask; a diagonal block is **computed in full and masked** (its masked half is not
   skipped). So with contiguous chunks rank r computes r + 1 blocks: the last rank does c× the first
   rank's work (it would be (2c−1)× if the masked half of the diagonal were skipped too). Zig-zag:
   (2c+1) half-chunk blocks on every rank.

   *Backward* (an ``autograd.Function``). Only this rank's q, k, v, out and the log-sum-exp
   ``lse`` are saved, all of size ∝ S/c (:func:`ring_attention_saved_bytes`); the other ranks' K/V
   are **not** kept. Backward sends K/V round the ring a second time, and recomputes each block's
   probabilities from ``lse``: ``P = exp(QKᵀ·scale − lse)``, ``dV += Pᵀ dO``,
   ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``, ``dQ += dS K·scale``, ``dK += dSᵀ Q·scale``. dQ stays
   here; the partial dK/dV of a block travel round the ring behind the block: the rank after the
   owner starts the accumulator, each following rank adds its part and passes it on, and the last
   hop returns it to the owner, who adds its own part.

   *Traffic per rank per layer* (:func:`ring_attention_traffic`): forward c−1 sends of a K/V block
   = (c−1)/c of the full K and V; backward c−1 sends of a K/V block plus c−1 sends of a dK/dV
   block — (c−1)/c of K and V again, and the same again as dK/dV.

3. **All-gather CP** (Llama 3's choice): :func:`allgather_attention` all-gathers K and V once per
   layer, then attends locally with the global causal mask. Its backward reduce-scatters dK/dV.
   Same bytes as the ring (:func:`allgather_attention_traffic`), but in one blocking collective,
   and it holds the full K and V (∝ S) during attention.

4. **Ulysses** (DeepSpeed-Ulysses, Jacobs et al. 2023): :func:`ulysses_attention`. An all-to-all
   turns q, k, v from sequence-sharded ``[B, H, S/c, D]`` into head-sharded ``[B, H/c, S, D]``;
   every rank runs ordinary full-sequence attention on its H/c heads; an all-to-all turns the output
   back. Four all-to-alls forward (q, k, v, out), four backward, each sending (c−1)/c of a tensor of
   B·H·(S/c)·D (:func:`ulysses_attention_traffic`): per-rank bytes *fall* with c, while the ring's
   stay ≈ constant. Needs H divisible by c; contiguous layout only (the gathered sequence is in rank
   order). ``comm`` has no all-to-all wrapper, so the all-to-alls call
   ``dist.all_to_all_single`` directly and :class:`~course_lib.comm.CommLog` does not see them.

5. **The tiny GPT**: :func:`context_parallel_gpt` swaps every block's attention for one of the three
   (:class:`ContextParallelAttention`), embeds this rank's tokens at their global positions, and
   averages the loss over all B·S tokens of the CP group; :func:`allreduce_cp_grads` sums the
   replicated weights' gradients over the group.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import comm

__all__ = [
    "LAYOUTS",
    "ATTENTIONS",
    "shard_sequence",
    "unshard_sequence",
    "positions",
    "attention_work",
    "block_attention",
    "merge",
    "ring_attention",
    "allgather_attention",
    "ulysses_attention",
    "ring_attention_traffic",
    "allgather_attention_traffic",
    "ulysses_attention_traffic",
    "ring_attention_saved_bytes",
    "ContextParallelAttention",
    "ContextParallelGPT",
    "context_parallel_gpt",
    "allreduce_cp_grads",
]

LAYOUTS = ("contiguous", "zigzag")


def _size_rank(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _peer(group, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (what ``isend`` / ``irecv`` address)."""
    return rank if group is None else dist.get_global_rank(group, rank)


# =========================================================================== 1. layouts


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")


def _check_cp_size(cp_size: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size={cp_size!r} must be an int >= 1")


def _check_seq_len(seq_len: int, cp_size: int, layout: str) -> None:
    _check_layout(layout)
    _check_cp_size(cp_size)
    if layout == "contiguous" and seq_len % cp_size:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by cp_size={cp_size}: the contiguous layout "
            f"gives each rank one of cp_size equal chunks"
        )
    if layout == "zigzag" and seq_len % (2 * cp_size):
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2·cp_size={2 * cp_size}: the zigzag layout "
            f"cuts the sequence into 2·cp_size equal chunks and gives rank i chunks i and "
            f"2·cp_size−1−i"
        )


def _chunks(rank: int, cp_size: int, layout: str) -> list[int]:
    """Which chunks rank holds, in its local order: [i] of c, or [i, 2c−1−i] of 2c."""
    return [rank] if layout == "contiguous" else [rank, 2 * cp_size - 1 - rank]


class Piece(NamedTuple):
    """A run of consecutive global positions on a rank: local rows [start, start+length)."""

    start: int  # first local row
    length: int
    pos: int  # global position of the first row


def _pieces(rank: int, cp_size: int, seq_len: int, layout: str) -> list[Piece]:
    _check_seq_len(seq_len, cp_size, layout)
    ids = _chunks(rank, cp_size, layout)
    m = seq_len // (cp_size * len(ids))  # chunk length
    return [Piece(j * m, m, i * m) for j, i in enumerate(ids)]


def shard_sequence(
    x: torch.Tensor, rank: int, cp_size: int, layout: str = "contiguous", dim: int = 2
) -> torch.Tensor:
    """Rank ``rank``'s tokens of the full sequence ``x`` (sequence along ``dim``; a copy)."""
    _check_seq_len(x.shape[dim], cp_size, layout)
    ids = _chunks(rank, cp_size, layout)
    parts = x.chunk(cp_size * len(ids), dim=dim)
    return torch.cat([parts[i] for i in ids], dim=dim)


def unshard_sequence(
    chunks, cp_size: int, layout: str = "contiguous", dim: int = 2
) -> torch.Tensor:
    """The full sequence from every rank's tokens (``chunks[i]`` = rank i's): the inverse of shard."""
    _check_layout(layout)
    _check_cp_size(cp_size)
    if len(chunks) != cp_size:
        raise ValueError(f"got {len(chunks)} chunks, expected one per rank (cp_size={cp_size})")
    if layout == "contiguous":
        return torch.cat(list(chunks), dim=dim)
    full = [None] * (2 * cp_size)
    for i, x in enumerate(chunks):
        if x.shape[dim] % 2:
            raise ValueError(
                f"rank {i}'s chunk has {x.shape[dim]} tokens along dim {dim}: a zigzag rank holds "
                f"two equal chunks, so an even number"
            )
        full[i], full[2 * cp_size - 1 - i] = x.chunk(2, dim=dim)
    return torch.cat(full, dim=dim)


def positions(
    rank: int, cp_size: int, seq_len: int, layout: str = "contiguous", device=None
) -> torch.Tensor:
    """Global position ids of rank ``rank``'s tokens, in its local order (int64, length S/c)."""
    return torch.cat(
        [
            torch.arange(p.pos, p.pos + p.length, device=device)
            for p in _pieces(rank, cp_size, seq_len, layout)
        ]
    )


def _pairs(q_pieces, k_pieces, causal: bool):
    """``(q piece, k piece, masked)`` for every pair that must be computed.

    Causal: k entirely after q is skipped; k entirely at or before q's first position is computed
    without a mask; anything else (the diagonal) is computed in full with the mask.
    """
    for qp in q_pieces:
        for kp in k_pieces:
            if not causal or kp.pos + kp.length - 1 <= qp.pos:
                yield qp, kp, False
            elif kp.pos <= qp.pos + qp.length - 1:
                yield qp, kp, True


def attention_work(
    rank: int, cp_size: int, seq_len: int, layout: str = "contiguous", causal: bool = True
) -> int:
    """Query-key scores rank ``rank`` computes in :func:`ring_attention`, over all c steps.

    Contiguous, causal: (rank+1)·(S/c)² (the diagonal block is computed in full, the future
    skipped), so the last rank does c× the first's. Zig-zag: (2c+1)·(S/2c)² on every rank.
    """
    mine = _pieces(rank, cp_size, seq_len, layout)
    return sum(
        qp.length * kp.length
        for src in range(cp_size)
        for qp, kp, _ in _pairs(mine, _pieces(src, cp_size, seq_len, layout), causal)
    )


# =========================================================================== 2. ring attention


def block_attention(q, k, v, allowed=None, scale=None):
    """Softmax attention of q over one block of keys: ``(out, lse)``.

    ``allowed``: a bool ``[Sq, Sk]`` mask (True = may attend) or None. ``lse`` is the log-sum-exp of
    each query's scores (``[..., Sq]``), what :func:`merge` needs to combine blocks.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over blocks a ∪ b from attention over a and over b alone: the online-softmax rule.

    softmax over a ∪ b weighs block a's softmax by Σ_a e^s / Σ_{a∪b} e^s = e^(lse_a − lse).
    """
    lse = torch.logaddexp(lse_a, lse_b)  # log(e^lse_a + e^lse_b), without overflow
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)  # block a's share of the softmax mass
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


def _rows(t, piece: Piece):
    return t.narrow(-2, piece.start, piece.length)


def _allowed(qp: Piece, kp: Piece, device):
    """Causal mask of a piece pair from global positions: key position ≤ query position."""
    pq = torch.arange(qp.pos, qp.pos + qp.length, device=device)
    pk = torch.arange(kp.pos, kp.pos + kp.length, device=device)
    return pk.unsqueeze(0) <= pq.unsqueeze(1)


def _exchange(send, recv, group, tag):
    """Send ``send`` to the next rank and receive the previous rank's into ``recv`` (both start now)."""
    c, r = _size_rank(group)
    return [
        comm.isend(send, _peer(group, (r + 1) % c), group=group, tag=tag),
        comm.irecv(recv, _peer(group, (r - 1) % c), group=group, tag=tag),
    ]


def _wait(works) -> None:
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, scale):
        c, r = _size_rank(group)
        seq_len = q.shape[-2] * c
        mine = _pieces(r, c, seq_len, layout)
        acc = {}  # per query piece: (out, lse) merged so far
        kv = torch.stack([k, v])  # this rank's K/V block, the one that travels
        for step in range(c):
            src = (r - step) % c  # whose block we hold at this step
            if step < c - 1:  # start passing it on before attending to it
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, group, "cp_kv")
            for qp, kp, masked in _pairs(mine, _pieces(src, c, seq_len, layout), causal):
                allowed = _allowed(qp, kp, q.device) if masked else None
                o, lse = block_attention(
                    _rows(q, qp), _rows(kv[0], kp), _rows(kv[1], kp), allowed, scale
                )
                acc[qp] = (o, lse) if qp not in acc else merge(*acc[qp], o, lse)
            if step < c - 1:
                _wait(works)
                kv = incoming
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
        for qp, (o, block_lse) in acc.items():
            _rows(out, qp).copy_(o)
            lse.narrow(-1, qp.start, qp.length).copy_(block_lse)
        ctx.save_for_backward(q, k, v, out, lse)  # all ∝ S/c: no other rank's K/V
        ctx.group, ctx.causal, ctx.layout, ctx.scale = group, causal, layout, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout, scale = ctx.group, ctx.causal, ctx.layout, ctx.scale
        c, r = _size_rank(group)
        seq_len = q.shape[-2] * c
        mine = _pieces(r, c, seq_len, layout)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)  # rowsum(dO ∘ O)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        own = torch.zeros_like(kv)  # my part of my own block's dK/dV (kept until the end)
        pending = None  # (works, received accumulator) of the dK/dV arriving from r−1
        for step in range(c):
            src = (r - step) % c
            if step < c - 1:
                incoming = torch.empty_like(kv)
                works = _exchange(kv, incoming, group, "cp_kv")
            part = own if step == 0 else torch.zeros_like(kv)
            for qp, kp, masked in _pairs(mine, _pieces(src, c, seq_len, layout), causal):
                qr, kr, vr = _rows(q, qp), _rows(kv[0], kp), _rows(kv[1], kp)
                scores = (qr @ kr.transpose(-2, -1)) * scale
                p = torch.exp(scores - lse.narrow(-1, qp.start, qp.length).unsqueeze(-1))
                if masked:
                    p = p.masked_fill(~_allowed(qp, kp, q.device), 0.0)
                do = _rows(dout, qp)
                ds = p * (
                    do @ vr.transpose(-2, -1) - delta.narrow(-1, qp.start, qp.length)[..., None]
                )
                _rows(dq, qp).add_(ds @ kr * scale)
                _rows(part[0], kp).add_(ds.transpose(-2, -1) @ qr * scale)
                _rows(part[1], kp).add_(p.transpose(-2, -1) @ do)
            if step > 0:  # add what the ranks before me accumulated for block src, pass it on
                if pending is not None:
                    _wait(pending[0])
                    part += pending[1]
                received = torch.empty_like(kv)
                pending = (_exchange(part, received, group, "cp_dkv"), received, part)
            if step < c - 1:
                _wait(works)
                kv = incoming
        if pending is not None:  # the accumulator of my own block, back from its last hop
            _wait(pending[0])
            own += pending[1]
        return dq, own[0], own[1], None, None, None, None


def _check_qkv(q, k, v) -> None:
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(
            f"q, k, v must be [batch, heads, seq/c, head_dim], got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def ring_attention(q, k, v, group=None, causal=True, layout="contiguous", scale=None):
    """Attention of this rank's queries over the whole sequence, K/V passed round a ring.

    q, k, v: this rank's tokens ``[B, H, S/c, D]`` in ``layout`` (:func:`shard_sequence`); returns
    this rank's output rows, equal to ``F.scaled_dot_product_attention`` on the full sequence
    (``is_causal=causal``), sharded the same way. ``scale`` defaults to 1/√D.
    """
    _check_qkv(q, k, v)
    c, _ = _size_rank(group)
    _check_seq_len(q.shape[-2] * c, c, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, causal, layout, scale)


# =========================================================================== 3. all-gather CP


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim −2) in rank order; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group, tag):
        c, _ = _size_rank(group)
        ctx.group, ctx.tag = group, tag
        xs = x.movedim(-2, 0).contiguous()
        full = xs.new_empty((c * xs.shape[0],) + xs.shape[1:])
        comm.all_gather(full, xs, group=group, tag=tag)
        return full.movedim(0, -2)

    @staticmethod
    def backward(ctx, grad):
        c, _ = _size_rank(ctx.group)
        gs = grad.movedim(-2, 0).contiguous()
        mine = gs.new_empty((gs.shape[0] // c,) + gs.shape[1:])
        comm.reduce_scatter(mine, gs, group=ctx.group, tag=ctx.tag)
        return mine.movedim(0, -2), None, None


def allgather_attention(q, k, v, group=None, causal=True, layout="contiguous", scale=None):
    """Attention with K and V all-gathered once (one collective for both), masked by global positions."""
    _check_qkv(q, k, v)
    c, r = _size_rank(group)
    seq_len = q.shape[-2] * c
    _check_seq_len(seq_len, c, layout)
    full = _GatherSequence.apply(torch.stack([k, v]), group, "cp_kv")
    mask = None
    if causal:  # gathered keys are in rank order: rank j's tokens at positions(j)
        pos_k = torch.cat([positions(j, c, seq_len, layout, q.device) for j in range(c)])
        mask = pos_k.unsqueeze(0) <= positions(r, c, seq_len, layout, q.device).unsqueeze(1)
    return F.scaled_dot_product_attention(q, full[0], full[1], attn_mask=mask, scale=scale)


# =========================================================================== 4. Ulysses


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block j of ``x`` (dim 0) goes to rank j; block j of the result came from rank j.

    Calls ``dist.all_to_all_single`` directly: :mod:`course_lib.comm` has no all-to-all wrapper.
    """
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x, group):
    """``[B, H, S/c, D]`` (my tokens, all heads) → ``[B, H/c, S, D]`` (all tokens, my heads)."""
    c, _ = _size_rank(group)
    b, h, n, d = x.shape
    send = x.reshape(b, c, h // c, n, d).movedim(1, 0)  # block j: head group j, for rank j
    recv = _all_to_all(send, group)  # block j: my head group, rank j's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * n, d)


def _heads_to_seq(y, group):
    """``[B, H/c, S, D]`` → ``[B, H, S/c, D]``: the inverse of :func:`_seq_to_heads`."""
    c, _ = _size_rank(group)
    b, hc, s, d = y.shape
    send = y.reshape(b, hc, c, s // c, d).permute(2, 0, 1, 3, 4)  # block j: rank j's tokens
    recv = _all_to_all(send, group)  # block j: head group j, my tokens
    return recv.movedim(0, 1).reshape(b, c * hc, s // c, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inverse):
        ctx.group, ctx.inverse = group, inverse
        return (_heads_to_seq if inverse else _seq_to_heads)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_seq_to_heads if ctx.inverse else _heads_to_seq)(grad, ctx.group), None, None


def ulysses_attention(q, k, v, group=None, causal=True, scale=None):
    """All-to-all to head-sharded, full-sequence attention on H/c heads, all-to-all back.

    q, k, v: this rank's contiguous chunk ``[B, H, S/c, D]``; H must be divisible by c.
    """
    _check_qkv(q, k, v)
    c, _ = _size_rank(group)
    heads = q.shape[1]
    if heads % c:
        raise ValueError(
            f"num_heads={heads} is not divisible by cp_size={c}: Ulysses gives each rank "
            f"num_heads/cp_size whole heads of the full sequence"
        )
    qh, kh, vh = (_SeqToHeads.apply(t, group, False) for t in (q, k, v))
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return _SeqToHeads.apply(y, group, True)


ATTENTIONS = {
    "ring": ring_attention,
    "allgather": allgather_attention,
    "ulysses": ulysses_attention,
}


# =========================================================================== traffic and memory


def _check_shape(batch, num_heads, seq_len, head_dim, cp_size, element_size):
    for name, value in (
        ("batch", batch),
        ("num_heads", num_heads),
        ("seq_len", seq_len),
        ("head_dim", head_dim),
        ("element_size", element_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    _check_seq_len(seq_len, cp_size, "contiguous")


def ring_attention_traffic(batch, num_heads, seq_len, head_dim, cp_size, element_size=4) -> dict:
    """Bytes one rank sends per layer in :func:`ring_attention`: ``{"forward", "backward"}``.

    A K/V block is 2·B·H·(S/c)·D elements. Forward: c−1 sends of it ((c−1)/c of the full K and V).
    Backward: c−1 sends of a K/V block again, and c−1 of a dK/dV accumulator of the same size.
    """
    _check_shape(batch, num_heads, seq_len, head_dim, cp_size, element_size)
    block = 2 * batch * num_heads * (seq_len // cp_size) * head_dim * element_size
    kv = (cp_size - 1) * block
    return {"forward": kv, "backward": kv + kv}


def allgather_attention_traffic(
    batch, num_heads, seq_len, head_dim, cp_size, element_size=4
) -> dict:
    """Per rank per layer, ring model: all-gather of K and V forward, reduce-scatter of dK/dV backward.

    Each moves (c−1)/c of the full K and V: the same bytes as the ring, in one collective.
    """
    gathered = ring_attention_traffic(batch, num_heads, seq_len, head_dim, cp_size, element_size)
    return {"forward": gathered["forward"], "backward": gathered["forward"]}


def ulysses_attention_traffic(batch, num_heads, seq_len, head_dim, cp_size, element_size=4) -> dict:
    """Per rank per layer: four all-to-alls each way, each sending (c−1)/c of B·H·(S/c)·D elements.

    Forward: q, k, v to head-sharded and the output back; backward: dO to head-sharded and dq, dk,
    dv back. (c−1) blocks of B·(H/c)·(S/c)·D leave the rank per all-to-all.
    """
    _check_shape(batch, num_heads, seq_len, head_dim, cp_size, element_size)
    if num_heads % cp_size:
        raise ValueError(f"num_heads={num_heads} is not divisible by cp_size={cp_size}")
    one = (
        (cp_size - 1)
        * batch
        * (num_heads // cp_size)
        * (seq_len // cp_size)
        * head_dim
        * element_size
    )
    return {"forward": 4 * one, "backward": 4 * one}


def ring_attention_saved_bytes(batch, num_heads, seq_len, head_dim, cp_size, element_size=4) -> int:
    """Bytes :func:`ring_attention` saves for backward on one rank: q, k, v, out and lse, ∝ S/c.

    4·B·H·(S/c)·D for q, k, v, out (when they are four separate storages) + B·H·(S/c) for lse.
    """
    _check_shape(batch, num_heads, seq_len, head_dim, cp_size, element_size)
    rows = batch * num_heads * (seq_len // cp_size)
    return rows * (4 * head_dim + 1) * element_size


# =========================================================================== 5. the tiny GPT


class ContextParallelAttention(nn.Module):
    """The GPT's ``CausalSelfAttention`` (its ``c_attn`` and ``c_proj``) on this rank's tokens.

    The projections are per token; only the attention itself is ``attention_fn`` (one of
    :data:`ATTENTIONS`, bound to its group and layout).
    """

    def __init__(self, attn: nn.Module, attention_fn):
        super().__init__()
        self.head_dim, self.c_attn, self.c_proj = attn.head_dim, attn.c_attn, attn.c_proj
        self.attention_fn = attention_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        hd = self.head_dim
        qkv = self.c_attn(x)  # laid out head by head, as in models.CausalSelfAttention
        heads = qkv.size(-1) // (3 * hd)
        q, k, v = qkv.view(b, n, heads, 3, hd).unbind(dim=3)
        y = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.c_proj(y.transpose(1, 2).reshape(b, n, heads * hd))


class _SumOverGroup(torch.autograd.Function):
    """Σ over the CP group forward, identity backward: every rank's loss is the global one."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        comm.all_reduce(x, group=group, tag="cp_loss")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ContextParallelGPT(nn.Module):
    """The tiny GPT on this rank's S/c tokens; parameter names are the GPT's (replicated weights).

    ``forward(idx, targets)``: this rank's tokens ``[B, S/c]`` (:func:`shard_sequence` with
    ``dim=1``); returns ``(logits of my tokens, loss)``, where the loss is the mean over all B·S
    tokens of the group, the same value on every rank. Backward gives each replicated weight its
    *partial* gradient: sum them with :func:`allreduce_cp_grads`.
    """

    def __init__(
        self, gpt: nn.Module, process_group=None, attention: str = "ring", layout="contiguous"
    ):
        super().__init__()
        cfg = gpt.config
        if cfg.dropout > 0:
            raise ValueError(
                f"ContextParallelGPT: dropout={cfg.dropout} > 0 is refused — the attention "
                "variants here have no attention dropout; use dropout=0"
            )
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r} must be one of {sorted(ATTENTIONS)}")
        _check_layout(layout)
        c, _ = _size_rank(process_group)
        if attention == "ulysses":
            if layout != "contiguous":
                raise ValueError("ulysses_attention supports the contiguous layout only")
            if cfg.n_head % c:
                raise ValueError(f"num_heads={cfg.n_head} is not divisible by cp_size={c}")
            fn = functools.partial(ulysses_attention, group=process_group)
        else:
            fn = functools.partial(ATTENTIONS[attention], group=process_group, layout=layout)
        self.config, self.process_group, self.layout, self.cp_size = cfg, process_group, layout, c
        self.wte, self.wpe, self.blocks, self.ln_f = gpt.wte, gpt.wpe, gpt.blocks, gpt.ln_f
        self.lm_head = gpt.lm_head
        for block in self.blocks:
            block.attn = ContextParallelAttention(block.attn, fn)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, n = idx.shape
        seq_len = n * self.cp_size
        if seq_len > self.config.block_size:
            raise ValueError(
                f"sequence length {seq_len} (= {n} tokens × cp_size={self.cp_size}) exceeds "
                f"block_size={self.config.block_size}"
            )
        _, r = _size_rank(self.process_group)
        pos = positions(r, self.cp_size, seq_len, self.layout, idx.device)  # global ids
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            mine = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
            )
            loss = _SumOverGroup.apply(mine, self.process_group) / (b * seq_len)
        return logits, loss


def context_parallel_gpt(
    gpt: nn.Module, process_group=None, attention: str = "ring", layout: str = "contiguous"
) -> ContextParallelGPT:
    """The CP form of ``gpt`` (its modules are reused: ``gpt`` is consumed)."""
    return ContextParallelGPT(gpt, process_group, attention, layout)


def allreduce_cp_grads(model: nn.Module, process_group=None) -> int:
    """Σ over the CP group of every parameter's gradient (one flat all-reduce); returns how many."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=process_group, tag="cp_grad")
        for g, v in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(v.view_as(g))
    return len(grads)
