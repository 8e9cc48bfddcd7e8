"""What an experiment returns: a table of checked quantities, and the tolerances they are checked with.

Every experiment in the course ends in the same table, whether a notebook prints it or a test asserts it:

    quantity | measured | reference | tolerance | verdict

*reference* names what the measurement is compared with — a formula, one device, the library version
(torch DDP, FSDP2, DTensor, …) — and *tolerance* is one of the named tolerances below, never a bare
number chosen to pass on one machine.

Tolerances
----------
Distributed training reorders floating-point sums (a ring all-reduce adds the ranks' gradients in another
order than one device adds a full batch), so "equal" means equal up to what that reordering can do:

* :data:`EXACT` — the same operations in the same order: byte counts, message counts, and results that
  must agree bit for bit (our DDP against torch DDP on the same buckets).
* :data:`REORDERED` — the same computation on the same ranks whose only difference is the order of fp32
  additions (e.g. one program under ``spawn`` and under ``torchrun``): a few ulps (fp32's ulp is 1.2e-7).
* :data:`SGD` — a technique against one device with SGD: the update ``lr·g`` is linear in the gradient, so
  the reordering's ~1e-7 relative noise stays at that level after a few steps; a wrong technique (a missed
  average, a lost shard, one rank's batch) moves weights by ``lr·|g|`` ≈ 1e-3 or more.
* :data:`ADAMW` — a technique against one device with AdamW. Adam divides by ``√v + eps``: a gradient
  that is ~0 by cancellation turns the reordering noise into a visible step of up to ``lr·noise/eps``.
  The course's AdamW uses ``eps = 1e-6`` (see :mod:`course_lib.configs`) and bias-free models, which keeps
  the worst difference measured on these models at 1.15e-5 (ZeRO under an LR scheduler, lr = 1e-2, 4 steps,
  on a machine where a 1e-5 bound failed); the bound leaves about 4× room, while a wrong technique moves
  weights by ≈ ``lr`` per step (≥ 1e-3).
* :data:`FP16` / :data:`BF16` — a run whose gradients or parameters are rounded to 16 bits on purpose
  (compression hooks, mixed precision): fp16 keeps 10 explicit mantissa bits (relative step 2⁻¹¹ ≈ 4.9e-4),
  bf16 keeps 7 (2⁻⁸ ≈ 3.9e-3); a few steps accumulate a few such roundings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Iterable, Mapping

import torch

__all__ = [
    "Tolerance",
    "EXACT",
    "REORDERED",
    "SGD",
    "ADAMW",
    "FP16",
    "BF16",
    "for_optimizer",
    "max_abs_diff",
    "Row",
    "Result",
    "Measured",
    "MappingReader",
    "FieldAccess",
]


@dataclass(frozen=True)
class Tolerance:
    """``|got − want| ≤ atol + rtol·|want|`` element-wise (``torch.allclose``'s rule), with its reason."""

    name: str
    rtol: float
    atol: float
    why: str

    def __str__(self) -> str:
        if self.rtol == 0 and self.atol == 0:
            return f"{self.name} (bitwise)"
        return f"{self.name} (rtol {self.rtol:.0e}, atol {self.atol:.0e})"

    def ok(self, got, want) -> bool:
        """True when every element of ``got`` is within this tolerance of ``want``."""
        return all(_close(g, w, self) for g, w in _pairs(got, want))

    def assert_close(self, got, want, msg: str = "") -> None:
        """Raise ``AssertionError`` naming the worst element (key, |Δ|, bound) when not :meth:`ok`."""
        for key, (g, w) in zip(_keys(want), _pairs(got, want), strict=True):
            if not _close(g, w, self):
                diff = (_tensor(g) - _tensor(w)).abs()
                bound = self.atol + self.rtol * _tensor(w).abs()
                where = f"[{key}]" if key is not None else ""
                raise AssertionError(
                    f"{msg + ': ' if msg else ''}{where} max|Δ| = {diff.max().item():.3e} "
                    f"exceeds {self} (worst bound there {bound.flatten()[diff.argmax()]:.3e})"
                )


EXACT = Tolerance("exact", 0.0, 0.0, "same operations in the same order")
REORDERED = Tolerance(
    "reordered fp32 sums", 1e-6, 1e-7, "same computation, another order of fp32 additions"
)
SGD = Tolerance("SGD", 1e-5, 1e-6, "linear update: reordering noise stays at fp32 rounding")
ADAMW = Tolerance(
    "AdamW", 1e-5, 5e-5, "Adam amplifies noise on ~0 gradients; eps=1e-6 bounds it (1.2e-5 seen)"
)
FP16 = Tolerance(
    "fp16 rounding", 1e-3, 1e-3, "10 explicit mantissa bits: 4.9e-4 relative per rounding"
)
BF16 = Tolerance(
    "bf16 rounding", 2e-2, 1e-2, "7 explicit mantissa bits: 3.9e-3 relative per rounding"
)


def for_optimizer(name: str) -> Tolerance:
    """The equality tolerance for a run with optimizer ``name`` (``"sgd"`` or ``"adamw"``)."""
    table = {"sgd": SGD, "adamw": ADAMW}
    if name not in table:
        raise ValueError(f"optimizer={name!r} has no named tolerance: use one of {sorted(table)}")
    return table[name]


def _tensor(x) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return t.detach().to("cpu", torch.float64)


def _keys(want) -> list:
    if isinstance(want, Mapping):
        return list(want)
    return [None]


def _pairs(got, want) -> Iterable[tuple[Any, Any]]:
    """Matching pieces of two values: dicts by the reference's keys, anything else as one piece."""
    if isinstance(want, Mapping):
        missing = [k for k in want if k not in got]
        if missing:
            raise KeyError(f"{missing[:3]} missing from the measured values")
        return [(got[k], want[k]) for k in want]
    return [(got, want)]


def _close(got, want, tol: Tolerance) -> bool:
    g, w = _tensor(got), _tensor(want)
    if g.shape != w.shape:
        raise ValueError(f"shapes differ: measured {tuple(g.shape)}, reference {tuple(w.shape)}")
    return bool(torch.all((g - w).abs() <= tol.atol + tol.rtol * w.abs()))


def max_abs_diff(got, want) -> float:
    """max |got − want| over every element (dicts compared over the reference's keys)."""
    return max(
        ((_tensor(g) - _tensor(w)).abs().max().item() for g, w in _pairs(got, want)), default=0.0
    )


# --------------------------------------------------------------------------- the result table


@dataclass
class Row:
    quantity: str
    measured: Any
    reference: Any  # the value compared with (None where the check is a condition)
    against: str  # what the reference is: "formula 2Ψ(N−1)/N", "one device", "torch DDP", …
    tolerance: str  # a Tolerance's text, "≥ 10×", "within ±20 %", …
    verdict: bool


def _reference_cell(r) -> str:
    """The reference column: "value (what it is)", the value or the label alone, or "—"."""
    value = _fmt(r.reference) if r.reference is not None else ""
    if value and r.against:
        return f"{value} ({r.against})"
    return value or r.against or "—"


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v == 0 or math.isnan(v) or math.isinf(v):
            return f"{v:g}"
        return f"{v:.3e}" if abs(v) < 1e-3 or abs(v) >= 1e6 else f"{v:.4g}"
    return str(v)


@dataclass
class Result:
    """A titled table of checked quantities; experiments add rows, notebooks print it, tests assert it.

    Rows are added with :meth:`equal`, :meth:`exact`, :meth:`within` and :meth:`condition` (kept in
    ``checked``); subclasses may keep their own fields (the numbers a plot needs) and compute rows in
    :meth:`checks`; :meth:`claims` (``{quantity: verdict}``) is kept for older callers.
    """

    title: str = field(default="", kw_only=True)
    checked: list[Row] = field(default_factory=list, kw_only=True, repr=False)

    # -- adding rows
    def equal(self, quantity: str, got, want, tol: Tolerance, against: str = "one device") -> Row:
        """A row: ``got`` equals ``want`` within ``tol``; measured is max |Δ|."""
        row = Row(quantity, max_abs_diff(got, want), None, against, str(tol), tol.ok(got, want))
        self.checked.append(row)
        return row

    def exact(self, quantity: str, got, want, against: str) -> Row:
        """A row: a count or byte number that must be exactly the reference."""
        row = Row(quantity, got, want, against, "exact", got == want)
        self.checked.append(row)
        return row

    def within(self, quantity: str, got: float, want: float, rel: float, against: str) -> Row:
        """A row: ``|got − want| ≤ rel·|want|`` (a model's prediction, a ratio)."""
        ok = abs(got - want) <= rel * abs(want)
        row = Row(quantity, got, want, against, f"within ±{rel:.0%}", ok)
        self.checked.append(row)
        return row

    def condition(
        self, quantity: str, measured, ok: bool, rule: str, reference=None, against: str = ""
    ) -> Row:
        """A row for a condition that is not a comparison with one value (``rule`` says what must hold)."""
        row = Row(quantity, measured, reference, against, rule, bool(ok))
        self.checked.append(row)
        return row

    # -- reading
    def checks(self) -> list[Row]:
        """Every row: the ones added so far (subclasses append computed rows here)."""
        return list(self.checked)

    @property
    def passed(self) -> bool:
        """Every row passed, and there is at least one: a table with nothing checked passed nothing."""
        rows = self.checks()
        return bool(rows) and all(r.verdict for r in rows)

    def claims(self) -> dict[str, bool]:
        return {r.quantity: r.verdict for r in self.checks()}

    def failures(self) -> list[Row]:
        return [r for r in self.checks() if not r.verdict]

    def table(self) -> str:
        """The rows as an aligned text table (what ``print(result)`` shows)."""
        lines = [self.title] if self.title else []
        rows = self.checks()
        if not rows:
            return "\n".join(lines + ["(no rows)"])
        head = ("quantity", "measured", "reference", "tolerance", "verdict")
        body = [
            (
                r.quantity,
                _fmt(r.measured),
                _reference_cell(r),
                r.tolerance,
                "PASS" if r.verdict else "FAIL",
            )
            for r in rows
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(5)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in body
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, p, cycle) -> None:  # IPython: the table, not the dataclass
        p.text(self.table())

    def assert_passed(self) -> None:
        """Raise ``AssertionError`` listing every failed row, or saying that no rows were checked."""
        if not self.checks():
            raise AssertionError(f"{self.title or type(self).__name__}: no rows were checked")
        bad = self.failures()
        if bad:
            raise AssertionError(
                "failed checks:\n"
                + "\n".join(
                    f"  {r.quantity}: measured {_fmt(r.measured)}, reference {_fmt(r.reference)} {r.against}, "
                    f"{r.tolerance}"
                    for r in bad
                )
            )

    def as_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


# --------------------------------------------------------------------------- results that read like dicts
# Notebooks written before results were tables index what an experiment returned (``r["ratio"]``).
# These two keep that working while the rows carry the checks.


class MappingReader:
    """Mix into a :class:`Result` dataclass whose numbers sit in one field, to read it like that field.

    ``_reads`` names the field (a dict, or a list of rows); ``res[key]``, ``key in res``,
    ``iter(res)``, ``len(res)``, ``keys()``, ``items()`` and ``get()`` read it. A missing key raises
    ``KeyError`` with :meth:`_missing`'s text. :class:`Measured` and
    :class:`~course_lib.timing.Timings` share this one reader.
    """

    _reads: ClassVar[str] = "values"

    def _view(self):
        return getattr(self, self._reads)

    def _missing(self, key) -> object:
        """What a ``KeyError`` for ``key`` says (the key itself, as a dict's would)."""
        return key

    def __getitem__(self, key):
        try:
            return self._view()[key]
        except KeyError:
            raise KeyError(self._missing(key)) from None

    def __contains__(self, key) -> bool:
        return key in self._view()

    def __iter__(self):
        return iter(self._view())

    def __len__(self) -> int:
        return len(self._view())

    def keys(self):
        return self._view().keys()

    def items(self):
        return self._view().items()

    def get(self, key, default=None):
        return self._view().get(key, default)


@dataclass
class Measured(MappingReader, Result):
    """A :class:`Result` that also reads as the numbers it measured: ``res["loss"]``, ``res[0]``, ``len(res)``.

    ``values`` is what a notebook plots and prints (a dict, or a list of rows); the rows are the checks.
    """

    values: dict | list = field(default_factory=dict)


class FieldAccess:
    """Mix into a :class:`Result` dataclass to read its fields by name: ``report["ratio"]``."""

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if f.name not in ("title", "checked")]

    def __getitem__(self, name: str):
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def __contains__(self, name) -> bool:
        return name in self.keys()

    def get(self, name: str, default=None):
        return getattr(self, name) if name in self.keys() else default
