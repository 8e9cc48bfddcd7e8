"""Where training memory goes: measured from real tensors, and predicted by formula.

Memory during training has two parts (Rajbhandari et al. 2019, "ZeRO",
arXiv:1910.02054, section 3):

* **model states** -- parameters, gradients, optimizer state. Their size depends
  on the parameter count Psi, not on the batch. ``model_state_bytes`` measures
  them on one rank; ``zero_model_state_bytes`` gives the ZeRO paper's formulas.
* **residual states**, mostly *activations*: tensors the forward pass keeps so
  the backward pass can use them. They grow with batch and sequence length.
  ``SavedTensorMeter`` measures them; ``activation_bytes_estimate`` derives them
  op by op for the course GPT; ``korthikanti_activation_bytes`` is the published
  formula for 16-bit GPU training (Korthikanti et al. 2022, arXiv:2205.05198).

Counting rule used everywhere here: bytes are counted per **unique storage**
(``t.untyped_storage()``, keyed by device and data pointer, size
``untyped_storage().nbytes()``). Two views of one buffer are one buffer; a tied
weight is counted once; a parameter that is a view into a flat buffer counts
the buffer. A DTensor counts only its local shard (``to_local()``), which is
what this rank actually holds. Meta tensors hold no memory and count 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

__all__ = [
    "model_state_bytes",
    "SavedTensorMeter",
    "saved_activation_bytes",
    "saved_tensors_table",
    "activation_bytes_estimate",
    "korthikanti_activation_bytes",
    "zero_model_state_breakdown",
    "zero_model_state_bytes",
    "format_bytes",
]


# --------------------------------------------------------------------------- storages


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this process actually holds: a DTensor's local shard, else ``t``."""
    local = getattr(t, "_local_tensor", None)  # DTensor; the attribute avoids an autograd op
    return local if isinstance(local, torch.Tensor) else t


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[tuple, int] | None:
    """``((device, data_ptr), nbytes)`` of the storage behind ``t``; None if it holds no memory."""
    t = _local(t)
    if t.is_meta:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. sparse tensors: fall back to the tensor itself
        return ("tensor", id(t)), t.numel() * t.element_size()
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage.data_ptr()), storage.nbytes()


def _tensors_in(obj) -> Iterable[torch.Tensor]:
    """Every tensor inside nested dicts / lists / tuples (optimizer state is such a nest)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


# --------------------------------------------------------------------------- model states


def model_state_bytes(model_or_params, optimizer=None, extra=()) -> dict[str, int]:
    """Bytes of model states this process holds, from the tensors themselves.

    Returns ``{"params", "grads", "optimizer", "extra", "total"}``:

    * params    -- ``model.parameters()`` (or the given tensors);
    * grads     -- their ``.grad``;
    * optimizer -- every tensor in ``optimizer.state`` (Adam: ``exp_avg``,
      ``exp_avg_sq`` and the 0-d ``step`` tensor, per parameter);
    * extra     -- any other tensors you want charged (flat buffers, fp32 master
      copies, communication buckets ...).

    Each unique storage is counted once, in the first category it appears in
    (in the order above): gradients that are views into one flat bucket are one
    bucket, and a buffer passed as ``extra`` that already holds the parameters is
    not charged twice.
    """
    if optimizer is not None and not hasattr(optimizer, "state"):
        raise TypeError(f"optimizer must have a .state mapping (torch.optim.Optimizer), got {type(optimizer).__name__}")
    if isinstance(model_or_params, nn.Module):
        params = list(model_or_params.parameters())
    elif isinstance(model_or_params, torch.Tensor):
        params = [model_or_params]
    else:
        params = list(model_or_params)
    groups = {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer": list(_tensors_in(optimizer.state)) if optimizer is not None else [],
        "extra": list(_tensors_in(extra if isinstance(extra, torch.Tensor) else list(extra))),
    }
    out = unique_storage_bytes(groups)
    out["total"] = sum(out.values())
    return out


def unique_storage_bytes(groups: dict, seen: set | None = None) -> dict[str, int]:
    """``{group: bytes}`` over storages not seen before, in the groups' order.

    A storage reachable from two groups is charged to the first; ``seen`` (updated in
    place) carries the storages already charged across calls.
    """
    seen = set() if seen is None else seen
    out = {}
    for name, tensors in groups.items():
        total = 0
        for t in tensors:
            kb = _storage_key_and_bytes(t)
            if kb is not None and kb[0] not in seen:
                seen.add(kb[0])
                total += kb[1]
        out[name] = total
    return out


# --------------------------------------------------------------------------- activations, measured


def _exclusion_keys(exclude) -> set:
    if isinstance(exclude, nn.Module):
        exclude = list(exclude.parameters()) + list(exclude.buffers())
    elif isinstance(exclude, torch.Tensor):
        exclude = [exclude]
    keys = set()
    for t in exclude:
        kb = _storage_key_and_bytes(t)
        if kb is not None:
            keys.add(kb[0])
    return keys


class SavedTensorMeter:
    """Count the bytes autograd saves for backward while the context is active.

    Built on ``torch.autograd.graph.saved_tensors_hooks``: every tensor an op
    saves for its backward passes through ``pack``; we record its storage and
    hand the tensor back unchanged (training is not affected).

    Choices, so the number means "activation memory":

    * unique storages: ``q``, ``k`` and ``v`` that are views of one ``c_attn``
      output count once, and a tensor saved by two ops (softmax's output, reused
      by the next matmul) counts once;
    * parameter storages are excluded (pass the model or its parameters as
      ``exclude``): a Linear saves its weight for backward, but that memory is a
      model state, already counted by ``model_state_bytes``;
    * everything else counts, including the small things: LayerNorm's per-row
      mean and 1/std, SDPA's log-sum-exp, integer token ids saved by the
      embeddings and the loss, and 0-d tensors. (A Python number an op keeps,
      such as ``att * scale``'s scale, is not a tensor and never reaches the hook.)

    While active, the meter keeps a reference to each counted storage so that a
    freed-and-reused address cannot be mistaken for a repeat; it lets go on exit.

    >>> with SavedTensorMeter(exclude=model) as meter:
    ...     logits, loss = model(x, y)
    >>> meter.bytes
    """

    def __init__(self, exclude=()):
        self._excluded = _exclusion_keys(exclude)
        self._held: dict = {}
        self.bytes = 0  # unique, non-excluded storage bytes saved for backward
        self.count = 0  # number of such storages
        self.records: list[tuple[tuple, torch.dtype, int]] = []  # (shape, dtype, storage bytes) per new storage
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        kb = _storage_key_and_bytes(t)
        if kb is not None and kb[0] in self._held and not self._same_storage(self._held[kb[0]], t):
            # the held storage was freed (``resize_(0)``, as ZeRO-3 does with gathered weights) and
            # the allocator handed its address to this new one: retire the old entry, count the new
            self._held[("retired", len(self.records))] = self._held.pop(kb[0])
        if kb is not None and kb[0] not in self._excluded and kb[0] not in self._held:
            key, nbytes = kb
            self._held[key] = _local(t).untyped_storage() if key[0] != "tensor" else t
            self.bytes += nbytes
            self.count += 1
            self.records.append((tuple(t.shape), t.dtype, nbytes))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def _same_storage(held, t: torch.Tensor) -> bool:
        if isinstance(held, torch.Tensor):
            return held is t
        return held._cdata == _local(t).untyped_storage()._cdata

    def live_bytes(self) -> int:
        """Bytes the counted storages hold *now* (call inside the context, e.g. after forward).

        Differs from ``.bytes`` when a saved storage was freed after it was saved: ZeRO-3
        saves the gathered full weight for the matmul's backward, then frees it with
        ``resize_(0)`` and re-gathers it before backward — it is not held as an activation.
        """
        return sum(h.untyped_storage().nbytes() if isinstance(h, torch.Tensor) else h.nbytes()
                   for h in self._held.values())

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._held.clear()


def saved_activation_bytes(fn, *args, exclude=(), **kwargs) -> int:
    """Bytes saved for backward while running ``fn(*args, **kwargs)`` (see ``SavedTensorMeter``).

    The result of ``fn`` is kept alive until counting is done, then dropped.
    """
    with SavedTensorMeter(exclude=exclude) as meter:
        result = fn(*args, **kwargs)
    del result
    return meter.bytes


def saved_tensors_table(output: torch.Tensor, exclude=()) -> list[dict]:
    """Which op saved what: walk the autograd graph behind ``output`` (before backward).

    One row per saved tensor: ``op`` (the backward node, e.g. ``GeluBackward0``),
    ``name`` (``self``, ``mat1``, ``result`` ...), ``shape``, ``dtype``,
    ``bytes`` (its storage) and ``new`` (False when the storage was already
    listed, is excluded -- a parameter --, or is a Python number such as the
    attention scale, which autograd keeps outside the saved-tensor hooks). ``sum(r["bytes"] for r in rows if
    r["new"])`` equals ``SavedTensorMeter.bytes`` for the same forward. Rows come
    in graph order from the output backwards. Reads autograd's ``_saved_*``
    attributes, which exist until backward frees them.
    """
    excluded = _exclusion_keys(exclude)
    seen_storages, seen_nodes, rows = set(), set(), []
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for attr in sorted(a for a in dir(node) if a.startswith("_saved_")):
            try:
                value = getattr(node, attr)
            except RuntimeError:  # already freed by a backward pass
                continue
            for t in _tensors_in(value):
                kb = _storage_key_and_bytes(t)
                if kb is None:
                    continue
                # A Python float saved by an op (e.g. ``att * scale``) is kept as a number
                # outside the saved-tensor hooks; autograd shows it as a 0-d float64.
                python_number = t.dim() == 0 and t.dtype in (torch.float64, torch.complex128)
                new = kb[0] not in seen_storages and kb[0] not in excluded and not python_number
                seen_storages.add(kb[0])
                rows.append(dict(op=node.name(), name=attr[len("_saved_"):], shape=tuple(t.shape),
                                 dtype=t.dtype, bytes=kb[1], new=new))
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return rows


# --------------------------------------------------------------------------- activations, derived


def activation_bytes_estimate(config, batch_size: int, seq_len: int | None = None, *,
                              with_loss: bool = True) -> dict[str, int]:
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
        raise ValueError(f"activation_bytes_estimate assumes dropout=0.0, got dropout={config.dropout}")
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
    return dict(per_layer=per_layer, layers=layers, embedding=embedding, head=head,
                total=layers + embedding + head)


def korthikanti_activation_bytes(seq_len: int, batch_size: int, hidden: int, n_heads: int, n_layers: int = 1,
                                 *, tensor_parallel: int = 1, sequence_parallel: bool = False,
                                 recompute: str = "none") -> float:
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


def zero_model_state_breakdown(psi: float, world_size: int, stage: int, precision: str = "mixed",
                               k: float | None = None) -> dict[str, float]:
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


def zero_model_state_bytes(psi: float, world_size: int, stage: int, precision: str = "mixed",
                           k: float | None = None) -> float:
    """Total per-rank model-state bytes under ZeRO; see ``zero_model_state_breakdown``.

    >>> round(zero_model_state_bytes(7.5e9, 64, stage=1) / 1e9, 1)   # GB
    31.4
    """
    return zero_model_state_breakdown(psi, world_size, stage, precision, k)["total"]


# --------------------------------------------------------------------------- printing


def format_bytes(n: float, binary: bool = False, digits: int = 1) -> str:
    """``format_bytes(1.2e11) -> '120.0 GB'``; ``binary=True`` uses KiB/MiB/GiB (powers of 1024)."""
    base, units = (1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else \
        (1000, ["B", "kB", "MB", "GB", "TB", "PB"])
    if n < 0:
        return "-" + format_bytes(-n, binary, digits)
    if n < base:
        return f"{int(n)} B" if float(n).is_integer() else f"{n:.{digits}f} B"
    exp, value = 0, float(n)
    while value >= base and exp < len(units) - 1:
        exp, value = exp + 1, value / base
    if round(value, digits) >= base and exp < len(units) - 1:  # 999.96 kB prints as 1.0 MB
        exp, value = exp + 1, value / base
    return f"{value:.{digits}f} {units[exp]}"
