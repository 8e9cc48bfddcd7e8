"""The paper formulas the course predicts with, in one place: measured numbers are compared against these.

* Activations: :func:`activation_bytes_estimate` (derived op by op for the course GPT, fp32 on CPU)
  and :func:`korthikanti_activation_bytes` (Korthikanti et al. 2022, 16-bit on GPUs).
* Model states under ZeRO: :func:`zero_model_state_breakdown` / :func:`zero_model_state_bytes`
  (Rajbhandari et al. 2019) — the one ZeRO table every chapter, plot and calculator uses.

Chapters 05–09 add theirs here (pipeline bubble, tensor-parallel communication, the planner).
"""

from __future__ import annotations

__all__ = [
    "activation_bytes_estimate",
    "korthikanti_activation_bytes",
    "zero_model_state_breakdown",
    "zero_model_state_bytes",
    "pipeline_bubble",
    "pipeline_bubble_megatron",
    "pipeline_p2p_bytes",
]


# --------------------------------------------------------------------------- activations, derived


def activation_bytes_estimate(
    config, batch_size: int, seq_len: int | None = None, *, with_loss: bool = True
) -> dict[str, int]:
    """Bytes autograd saves for one forward of ``models.GPT`` in fp32 on the CPU, no dropout.

    Derived by listing what every op saves (``saved_tensors_table`` shows the
    same list, measured). Notation: b batch, s sequence, h d_model, a heads,
    r mlp_ratio, V vocab; every float is 4 bytes. Per transformer block:

    ================================  ===================================  ==================
    op                                saves (for backward)                 floats
    ================================  ===================================  ==================
    ln_1 (LayerNorm)                  input x; mean and 1/std per row      sbh + 2sb
    c_attn (Linear)                   its input (ln_1's output)            sbh
    SDPA, CPU flash kernel            q, k, v (views of one c_attn         3sbh + sbh + asb
                                      output), its output, log-sum-exp
    head concat + c_proj              input = SDPA output (same storage,   0
                                      ``.contiguous()`` is a no-op)
    residual adds, dropout(p=0)       nothing                              0
    ln_2                              input; mean and 1/std                sbh + 2sb
    mlp.c_fc                          its input                            sbh
    GELU                              its input                            r*sbh
    mlp.c_proj                        its input (GELU's output)            r*sbh
    ================================  ===================================  ==================

    per layer (sdpa) = 4*(8 + 2r)*sbh + 4*(4 + a)*sb bytes
                     = s*b*h*(64 + (16 + 4a)/h)  for r = 4       (~ 64*s*b*h)

    With ``attn="math"`` (explicit softmax) attention instead saves copies of
    q, k^T and v (``matmul`` reshapes the strided head views into contiguous
    batches, 3sbh), the softmax output (a*s*s*b floats, reused by ``att @ v``),
    and the causal mask (s*s bools); the 1/sqrt(h/a) scale is kept as a Python
    number, not a tensor:

    per layer (math) = 4*(8 + 2r)*sbh + 16*sb + 4*a*s*s*b + s*s bytes
                     ~ s*b*h*(64 + 4*a*s/h)                        for r = 4

    Outside the blocks: the embeddings save the token ids (b*s int64) and the
    positions (s int64); ln_f saves its input and mean/1-std, ``lm_head`` its input
    (its weight is a parameter); the loss saves log-softmax's output (b*s*V
    floats), the targets (b*s int64) and a 0-d float total weight.

    Compare Korthikanti et al. (``korthikanti_activation_bytes``), 16-bit on GPU:
    s*b*h*(34 + 5as/h). Their 34 = our 16 floats per s*b*h (r = 4) at 2 bytes plus
    two 1-byte dropout masks (after attention, after the MLP); their 5as/h =
    softmax output (2) + its dropout mask (1) + the dropped-out probabilities (2).
    In fp32 without dropout every float costs 4 bytes: 64 and 4as/h. SDPA's CPU
    kernel saves only the log-sum-exp and recomputes the probabilities in
    backward (the FlashAttention trick), so its s*s term vanishes. The int64
    ids are counted by storage: pass ``idx``/``targets`` as their own tensors.

    ``seq_len`` defaults to ``config.block_size``; ``with_loss=False`` for a
    forward without targets. Returns ``{"per_layer", "layers", "embedding",
    "head", "total"}`` in bytes.
    """
    if config.dropout != 0.0:
        raise ValueError(
            f"activation_bytes_estimate assumes dropout=0.0, got dropout={config.dropout}"
        )
    s = config.block_size if seq_len is None else seq_len
    if s > config.block_size:
        raise ValueError(f"sequence length {s} exceeds block_size={config.block_size}")
    b, h, a, r, V = batch_size, config.d_model, config.n_head, config.mlp_ratio, config.vocab_size
    f = 4  # fp32
    sbh, sb = s * b * h, s * b
    shared = f * ((8 + 2 * r) * sbh + 4 * sb)  # everything but the attention core's extras
    if config.attn == "sdpa":
        per_layer = shared + f * a * sb  # + log-sum-exp (q, k, v, out are inside the 8 + 2r)
    else:
        per_layer = shared + f * a * s * s * b + s * s  # + softmax probabilities, causal mask
    embedding = 8 * (b * s + s)  # int64 token ids and positions
    head = f * (2 * sbh + 2 * sb)
    if with_loss:
        head += f * b * s * V + 8 * b * s + 4  # log-probs, int64 targets, 0-d total weight
    layers = config.n_layer * per_layer
    return dict(
        per_layer=per_layer,
        layers=layers,
        embedding=embedding,
        head=head,
        total=layers + embedding + head,
    )


def korthikanti_activation_bytes(
    seq_len: int,
    batch_size: int,
    hidden: int,
    n_heads: int,
    n_layers: int = 1,
    *,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Activation bytes per the Megatron analysis (Korthikanti et al. 2022, arXiv:2205.05198, Table 2).

    16-bit activations, 1-byte dropout masks, attention softmax stored; per layer::

        no parallelism                    s*b*h*(34 + 5*a*s/h)
        tensor parallel t                 s*b*h*(10 + 24/t + 5*a*s/(h*t))
        tensor + sequence parallel        s*b*h*(34/t + 5*a*s/(h*t))
        selective recompute (attention)   drop the 5*a*s/h term
        full recompute                    2*s*b*h   (only each layer's input)

    Returned for ``n_layers`` layers (default 1).
    """
    s, b, h, a, t = seq_len, batch_size, hidden, n_heads, tensor_parallel
    if t < 1:
        raise ValueError(f"tensor_parallel={t} must be >= 1")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r} must be 'none', 'selective' or 'full'")
    if recompute == "full":
        per_layer = 2 * s * b * h / (t if sequence_parallel else 1)
    else:
        attn_scores = 0.0 if recompute == "selective" else 5 * a * s / (h * t)
        linear_part = 34 / t if sequence_parallel else 10 + 24 / t
        per_layer = s * b * h * (linear_part + attn_scores)
    return n_layers * per_layer


# --------------------------------------------------------------------------- ZeRO formulas


def zero_model_state_breakdown(
    psi: float, world_size: int, stage: int, precision: str = "mixed", k: float | None = None
) -> dict[str, float]:
    """Per-rank bytes of params / grads / optimizer under ZeRO stage 0-3 (ZeRO paper, Figure 1).

    ``psi`` parameters, ``world_size`` N data-parallel ranks, Adam. Per parameter:

    * ``precision="mixed"`` (the paper): 2-byte fp16 params, 2-byte fp16 grads,
      K = 12 bytes of optimizer state (fp32 master param, momentum, variance)::

          stage 0 (DDP)         (2 + 2 + K) Psi          = 16 Psi
          stage 1 (P_os)        (2 + 2) Psi + K Psi/N    =  4 Psi + 12 Psi/N
          stage 2 (P_os+g)      2 Psi + (2 + K) Psi/N    =  2 Psi + 14 Psi/N
          stage 3 (P_os+g+p)    (2 + 2 + K) Psi/N        = 16 Psi/N

    * ``precision="fp32"`` (what the CPU runs in this course measure): 4-byte
      params and grads, K = 8 (exp_avg, exp_avg_sq; no master copy needed)::

          stage 0 16 Psi;  stage 1 8 Psi + 8 Psi/N;  stage 2 4 Psi + 12 Psi/N;  stage 3 16 Psi/N

    ``k`` overrides K (default 12 for mixed, 8 for fp32). Model states only: no
    activations, buffers or fragmentation; Psi should be the padded count when
    shards are padded to equal size.
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} must be one of 0, 1, 2, 3 (0 = plain data parallel)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if psi < 0:
        raise ValueError(f"psi={psi} (number of parameters) must be >= 0")
    if precision == "mixed":
        p_bytes, g_bytes, k_default = 2, 2, 12
    elif precision == "fp32":
        p_bytes, g_bytes, k_default = 4, 4, 8
    else:
        raise ValueError(f"precision={precision!r} must be 'mixed' or 'fp32'")
    k = k_default if k is None else k
    if k < 0:
        raise ValueError(f"k={k} (optimizer bytes per parameter) must be >= 0")
    n = world_size
    params = p_bytes * psi / (n if stage >= 3 else 1)
    grads = g_bytes * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    return dict(params=params, grads=grads, optimizer=optimizer, total=params + grads + optimizer)


def zero_model_state_bytes(
    psi: float, world_size: int, stage: int, precision: str = "mixed", k: float | None = None
) -> float:
    """Total per-rank model-state bytes under ZeRO; see ``zero_model_state_breakdown``.

    >>> round(zero_model_state_bytes(7.5e9, 64, stage=1) / 1e9, 1)   # GB
    31.4
    """
    return zero_model_state_breakdown(psi, world_size, stage, precision, k)["total"]


# --------------------------------------------------------------------------- pipeline bubble


def pipeline_bubble(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """Bubble fraction of GPipe / 1F1B with equal stages: idle time / whole step = (p−1)/(v·m+p−1).

    p stages, m micro-batches; ``num_chunks`` v > 1 for interleaved 1F1B (each rank runs v chunks of
    1/v the work, so the fill and drain shrink v-fold). Huang et al. 2019 (GPipe, arXiv:1811.06965);
    Narayanan et al. 2021 (arXiv:2104.04473) §2.2 quote the same idle time relative to the *ideal*
    step instead, (p−1)/m (:func:`pipeline_bubble_megatron`).

    >>> pipeline_bubble(4, 4)   # 3/7
    0.42857142857142855
    """
    for name, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_chunks", num_chunks),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    p, m, v = num_stages, num_microbatches, num_chunks
    return (p - 1) / (v * m + p - 1)


def pipeline_bubble_megatron(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """Megatron's convention: bubble time / ideal time = (p−1)/(v·m). Same idle time as :func:`pipeline_bubble`."""
    pipeline_bubble(num_stages, num_microbatches, num_chunks)  # validates
    return (num_stages - 1) / (num_chunks * num_microbatches)


def pipeline_p2p_bytes(
    num_stages: int, num_microbatches: int, activation_bytes: float, stage: int, num_chunks: int = 1
) -> float:
    """Bytes stage ``stage`` sends per step: one activation forward and one gradient backward per micro-batch
    and boundary it owns (the first stage sends no input gradient, the last no activation)."""
    p, v = num_stages, num_chunks
    virtual = [c * p + stage for c in range(v)]
    sends = sum((s < p * v - 1) + (s > 0) for s in virtual)
    return sends * num_microbatches * activation_bytes


# --------------------------------------------------------------------------- activation checkpointing


def checkpointed_block_activation_bytes(
    n_layer: int, batch_size: int, seq_len: int, d_model: int, bytes_per_element: int = 4
) -> int:
    """What a stack of ``n_layer`` blocks keeps for backward when each block is checkpointed: its input.

    A checkpointed block saves only its input x (b·s·h floats) and recomputes everything inside
    during backward; the other block activations (``activation_bytes_estimate``'s per-block rows)
    exist only while that one block is recomputed. L blocks: L·b·s·h·bytes — the residual stream
    between blocks, and the only activation memory of the stack that grows with depth.
    """
    for name, value in (
        ("n_layer", n_layer),
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("d_model", d_model),
        ("bytes_per_element", bytes_per_element),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    return n_layer * batch_size * seq_len * d_model * bytes_per_element


__all__ += ["checkpointed_block_activation_bytes"]


# --------------------------------------------------------------------------- compute


def training_flops_per_token(num_params: float, n_layer: int, seq_len: int, d_model: int) -> float:
    """FLOPs to train on one token: ``6Ψ + 12·L·s·d`` (forward 2, backward 4 per multiply-add).

    ``6Ψ``: every parameter is one multiply-add per token in the forward pass (2 FLOPs) and two
    in the backward pass (input and weight gradient, 4 FLOPs). ``12·L·s·d``: attention's two
    matmuls that involve no parameter, ``q·kᵀ`` and ``softmax·v`` — per token and layer 2·s·d
    multiply-adds forward, so 2·2·s·d FLOPs forward and 3× that for training (PaLM's accounting,
    Chowdhery et al. 2022, appendix B; no causal halving). Negligible when ``s ≪ d``, not when
    ``s ≈ d``.
    """
    if min(num_params, n_layer, seq_len, d_model) <= 0:
        raise ValueError(
            "training_flops_per_token: num_params, n_layer, seq_len and d_model must be > 0"
        )
    return 6 * num_params + 12 * n_layer * seq_len * d_model


__all__ += ["training_flops_per_token"]


# --------------------------------------------------------------------------- tensor parallelism (chapter 06)


def tp_allreduce_bytes_per_layer(
    batch_size: int, seq_len: int, d_model: int, dtype_bytes: int = 4
) -> dict:
    """Megatron TP's all-reduces in one transformer layer and step: 2 forward (g) + 2 backward (f), each of b·s·h.

    Returns ``{"calls": 4, "tensor_bytes": 4·b·s·h·bytes}``; one rank sends ``2(t−1)/t`` of that in a
    ring. With sequence parallelism each becomes a reduce-scatter + an all-gather: same volume.
    """
    if min(batch_size, seq_len, d_model, dtype_bytes) <= 0:
        raise ValueError(
            "tp_allreduce_bytes_per_layer: batch_size, seq_len, d_model and dtype_bytes must be > 0"
        )
    return {"calls": 4, "tensor_bytes": 4 * batch_size * seq_len * d_model * dtype_bytes}


def tp_ring_bytes_per_token(
    n_layer: int, d_model: int, tp_size: int, dtype_bytes: int = 4
) -> float:
    """Bytes one rank sends per token for TP's block all-reduces: ``L · 4 · h · bytes · 2(t−1)/t``.

    It grows with depth and width and does **not** shrink with a bigger batch: every token's
    activations cross the TP group in every layer, forward and backward.
    """
    if min(n_layer, d_model, tp_size) < 1:
        raise ValueError("tp_ring_bytes_per_token: n_layer, d_model and tp_size must be >= 1")
    return n_layer * 4 * d_model * dtype_bytes * 2 * (tp_size - 1) / tp_size


def dp_ring_bytes_per_token(
    num_params: float, world_size: int, tokens_per_rank: int, dtype_bytes: int = 4
) -> float:
    """Bytes one DP rank sends per token it trains on: ``2(N−1)/N · Ψ · bytes / tokens per rank per step``.

    Once per step, whatever the batch: a larger batch makes it cheaper per token (TP's is not).
    """
    if num_params <= 0 or world_size < 1 or tokens_per_rank < 1:
        raise ValueError(
            "dp_ring_bytes_per_token: num_params > 0, world_size >= 1, tokens_per_rank >= 1"
        )
    return 2 * (world_size - 1) / world_size * num_params * dtype_bytes / tokens_per_rank


__all__ += ["tp_allreduce_bytes_per_layer", "tp_ring_bytes_per_token", "dp_ring_bytes_per_token"]
