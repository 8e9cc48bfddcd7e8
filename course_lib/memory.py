"""Where training memory goes: measured from real tensors, and predicted by formula.

Memory during training has two parts (Rajbhandari et al. 2019, "ZeRO",
arXiv:1910.02054, section 3):

* **model states** -- parameters, gradients, optimizer state. Their size depends
  on the parameter count Psi, not on the batch. ``model_state_bytes`` measures
  them on one rank; ``formulas.zero_model_state_bytes`` gives the ZeRO paper's formulas.
* **residual states**, mostly *activations*: tensors the forward pass keeps so
  the backward pass can use them. They grow with batch and sequence length.
  ``SavedTensorMeter`` measures them; ``formulas.activation_bytes_estimate`` derives
  them op by op for the course GPT; ``formulas.korthikanti_activation_bytes`` is the
  published formula for 16-bit GPU training (Korthikanti et al. 2022, arXiv:2205.05198).

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
    "unique_storage_bytes",
    "storage_bytes",
    "tensors_in",
    "SavedTensorMeter",
    "saved_activation_bytes",
    "saved_tensors_table",
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
    except (
        RuntimeError,
        NotImplementedError,
    ):  # e.g. sparse tensors: fall back to the tensor itself
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


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor inside nested dicts / lists / tuples, as a list (an optimizer's ``state`` is such a nest)."""
    return list(_tensors_in(obj))


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
        raise TypeError(
            f"optimizer must have a .state mapping (torch.optim.Optimizer), got {type(optimizer).__name__}"
        )
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


def storage_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the unique storages behind ``tensors`` (not in ``seen``; see :func:`unique_storage_bytes`)."""
    return unique_storage_bytes({"tensors": tensors}, seen)["tensors"]


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
        self.records: list[
            tuple[tuple, torch.dtype, int]
        ] = []  # (shape, dtype, storage bytes) per new storage
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
        return sum(
            h.untyped_storage().nbytes() if isinstance(h, torch.Tensor) else h.nbytes()
            for h in self._held.values()
        )

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
                rows.append(
                    dict(
                        op=node.name(),
                        name=attr[len("_saved_") :],
                        shape=tuple(t.shape),
                        dtype=t.dtype,
                        bytes=kb[1],
                        new=new,
                    )
                )
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return rows


# --------------------------------------------------------------------------- printing


def format_bytes(n: float, binary: bool = False, digits: int = 1) -> str:
    """``format_bytes(1.2e11) -> '120.0 GB'``; ``binary=True`` uses KiB/MiB/GiB (powers of 1024)."""
    base, units = (
        (1024, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"])
        if binary
        else (1000, ["B", "kB", "MB", "GB", "TB", "PB"])
    )
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
