"""Plots and widgets for the notebooks.

``zero_memory_calculator()`` -- the ZeRO memory calculator (chapter 03): how many bytes of model
states each GPU holds under ZeRO stages 0-3, from the one ZeRO table, ``formulas.zero_model_state_breakdown``
(Rajbhandari et al. 2019, arXiv:1910.02054, Figure 1). ``zero_memory_table()`` is the same
numbers as plain text, printable anywhere (and what the widget shows as its text
representation, so an executed notebook stores a deterministic output).
"""

from __future__ import annotations

import io

from .formulas import zero_model_state_breakdown

__all__ = ["zero_memory_table", "zero_memory_calculator", "ZERO_STAGE_NAMES", "gantt"]

ZERO_STAGE_NAMES = {0: "DDP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
_PRECISION_WORDS = {
    "mixed": "mixed precision: 2-byte params and grads",
    "fp32": "fp32: 4-byte params and grads",
}


def _per_parameter_bytes(precision: str) -> tuple[float, float, float]:
    """(p, g, K): bytes per parameter of params, grads and optimizer state, read off the ZeRO table."""
    one = zero_model_state_breakdown(1, 1, 0, precision)
    return one["params"], one["grads"], one["optimizer"]


def _formula(stage: int) -> str:
    """The stage's per-GPU formula, e.g. ``"pΨ + (g+K)Ψ/N"``: which parts the ZeRO table divides by N."""
    whole, split = zero_model_state_breakdown(1, 1, stage), zero_model_state_breakdown(1, 2, stage)
    parts = [("p", "params"), ("g", "grads"), ("K", "optimizer")]
    terms = []
    for sharded, suffix in ((False, "Ψ"), (True, "Ψ/N")):
        names = [sym for sym, key in parts if (split[key] < whole[key]) == sharded]
        if names:
            terms.append((names[0] if len(names) == 1 else "(" + "+".join(names) + ")") + suffix)
    return " + ".join(terms)


_UNITS = [
    (1e12, "TB", 2**40, "TiB"),
    (1e9, "GB", 2**30, "GiB"),
    (1e6, "MB", 2**20, "MiB"),
    (1e3, "kB", 2**10, "KiB"),
    (1, "B", 1, "B"),
]


def _unit(smallest: float) -> tuple[float, str, float, str]:
    """The largest decimal unit in which ``smallest`` is at least 1 (and its binary sibling)."""
    for unit in _UNITS:
        if smallest >= unit[0]:
            return unit
    return _UNITS[-1]


def _psi_text(psi: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if psi >= scale:
            return f"{psi / scale:g}{suffix}"
    return f"{psi:g}"


def zero_rows(psi: float, n: int, precision: str = "mixed", k: float | None = None) -> list[dict]:
    """Per-GPU bytes for stages 0-3: ``[{"stage", "name", "params", "grads", "optimizer", "total"}, ...]``."""
    return [
        dict(
            stage=s, name=ZERO_STAGE_NAMES[s], **zero_model_state_breakdown(psi, n, s, precision, k)
        )
        for s in range(4)
    ]


def zero_memory_table(
    psi: float, n: int, precision: str = "mixed", k: float | None = None, stage: int | None = None
) -> str:
    """Per-GPU model-state memory under ZeRO stages 0-3 as a fixed-width text table.

    ``psi`` parameters (a count, e.g. ``7.5e9``), ``n`` GPUs, ``precision`` ``"mixed"`` (the
    paper: fp16 params and grads, K = 12) or ``"fp32"`` (K = 8), ``k`` overrides K. Sizes are in
    decimal units (1 GB = 10^9 bytes), one unit for the whole table, with the total also in the
    binary unit (GiB). ``stage`` marks one row. The paper's example (Ψ = 7.5B, N = 64):

    >>> print(zero_memory_table(7.5e9, 64))
    ZeRO model states per GPU: Ψ = 7.5B parameters, N = 64 GPUs, mixed precision: 2-byte params and grads, K = 12
      stage           params      grads  optimizer      total    (GiB)   formula (p=2, g=2)
      0 DDP          15.0 GB    15.0 GB    90.0 GB   120.0 GB    111.8   (p+g+K)Ψ
      1 P_os         15.0 GB    15.0 GB     1.4 GB    31.4 GB     29.2   (p+g)Ψ + KΨ/N
      2 P_os+g       15.0 GB     0.2 GB     1.4 GB    16.6 GB     15.5   pΨ + (g+K)Ψ/N
      3 P_os+g+p      0.2 GB     0.2 GB     1.4 GB     1.9 GB      1.7   (p+g+K)Ψ/N
      model states only (no activations, buffers or fragmentation); Rajbhandari et al. 2019, Fig. 1
    """
    if precision not in _PRECISION_WORDS:
        raise ValueError(f"precision={precision!r} must be 'mixed' or 'fp32'")
    p_bytes, g_bytes, k_default = _per_parameter_bytes(precision)
    words = _PRECISION_WORDS[precision]
    k = k_default if k is None else k
    rows = zero_rows(psi, n, precision, k)
    dec, unit, binary, bunit = _unit(
        min(r["total"] for r in rows)
    )  # one unit; even the smallest total >= 1
    width = max(11, len(f"{rows[0]['total'] / dec:,.1f} {unit}") + 2)

    def cell(value: float) -> str:
        return f"{value / dec:,.1f} {unit}".rjust(width)

    gpus = f"{n} GPU{'s' if n != 1 else ''}"
    lines = [
        f"ZeRO model states per GPU: Ψ = {_psi_text(psi)} parameters, N = {gpus}, {words}, K = {k:g}",
        f"  {'stage':<11}{'params':>{width}}{'grads':>{width}}{'optimizer':>{width}}{'total':>{width}}"
        f"{'(' + bunit + ')':>9}   formula (p={p_bytes:g}, g={g_bytes:g})",
    ]
    for r in rows:
        mark = " <" if stage == r["stage"] else ""
        lines.append(
            f"  {r['stage']} {r['name']:<9}{cell(r['params'])}{cell(r['grads'])}{cell(r['optimizer'])}"
            f"{cell(r['total'])}{r['total'] / binary:>9,.1f}   {_formula(r['stage'])}{mark}"
        )
    lines.append(
        "  model states only (no activations, buffers or fragmentation); Rajbhandari et al. 2019, Fig. 1"
    )
    return "\n".join(lines)


def _bar_chart_png(psi: float, n: int, precision: str, k: float, stage: int) -> bytes:
    """Stacked bars (params / grads / optimizer) per stage, as PNG bytes."""
    from matplotlib.figure import (
        Figure,
    )  # not pyplot: no global figure, no backend switch in the notebook
    from matplotlib.patches import Patch

    rows = zero_rows(psi, n, precision, k)
    dec, unit, _, _ = _unit(min(r["total"] for r in rows))
    fig = Figure(figsize=(6.4, 3.6), dpi=80)
    ax = fig.subplots()
    x = [f"{r['stage']}\n{r['name']}" for r in rows]
    bottom = [0.0] * 4
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
    for part in ("params", "grads", "optimizer"):
        heights = [r[part] / dec for r in rows]
        bars = ax.bar(x, heights, bottom=bottom, label=part, color=colors[part])
        # the chosen stage in full colour, the others faded
        for bar, r in zip(bars, rows, strict=True):
            bar.set_alpha(1.0 if r["stage"] == stage else 0.45)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, total in enumerate(bottom):
        ax.annotate(
            f"{total:,.1f}",
            (i, total),
            ha="center",
            va="bottom",
            fontsize=9,
            fontweight="bold" if i == stage else "normal",
        )
    for label in ax.get_xticklabels():
        label.set_fontweight("bold" if label.get_text().startswith(str(stage)) else "normal")
    ax.set_ylabel(f"{unit} per GPU")
    ax.set_title(f"Ψ = {_psi_text(psi)}, N = {n}, {precision}, K = {k:g}", fontsize=10)
    ax.set_ylim(0, max(bottom) * 1.15 or 1)
    ax.legend(
        handles=[Patch(color=c, label=part) for part, c in colors.items()],
        frameon=False,
        fontsize=9,
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def zero_memory_calculator(
    psi_billions: float = 7.5,
    n: int = 64,
    stage: int = 3,
    precision: str = "mixed",
    k: float | None = None,
):
    """An ipywidgets calculator: Ψ (billions), N GPUs, stage 0-3, precision, K -> bytes per GPU.

    Shows the table of ``zero_memory_table`` (all four stages, the chosen one marked) and a stacked
    bar chart of params / grads / optimizer states per stage; both update as the inputs change.
    The defaults reproduce the ZeRO paper's example (Ψ = 7.5B, N = 64, mixed precision, K = 12):
    120.0 / 31.4 / 16.6 / 1.9 GB. Switching precision resets K to its default (12 mixed, 8 fp32).

    The returned widget's text representation is the table for its current values, so a notebook
    that is executed headless (nbval) stores a deterministic text output.
    """
    import ipywidgets as widgets

    if precision not in _PRECISION_WORDS:
        raise ValueError(f"precision={precision!r} must be 'mixed' or 'fp32'")
    k = _per_parameter_bytes(precision)[2] if k is None else k
    style = {"description_width": "initial"}
    w_psi = widgets.BoundedFloatText(
        value=psi_billions,
        min=0.001,
        max=100000,
        step=0.5,
        description="Ψ (billions of parameters)",
        style=style,
    )
    w_n = widgets.BoundedIntText(value=n, min=1, max=1_000_000, description="N GPUs", style=style)
    w_stage = widgets.ToggleButtons(
        options=[("0 DDP", 0), ("1 P_os", 1), ("2 P_os+g", 2), ("3 P_os+g+p", 3)],
        value=stage,
        description="stage",
        style=style,
    )
    w_prec = widgets.ToggleButtons(
        options=["mixed", "fp32"], value=precision, description="precision", style=style
    )
    w_k = widgets.BoundedFloatText(
        value=k, min=0, max=1000, step=1, description="K (optimizer bytes/param)", style=style
    )
    table = widgets.HTML()
    chart = widgets.Image(format="png")

    class ZeroMemoryCalculator(widgets.VBox):
        """The calculator; ``table()`` is the current text table (also its text/plain repr)."""

        def table(self) -> str:
            return zero_memory_table(
                w_psi.value * 1e9, w_n.value, w_prec.value, w_k.value, stage=w_stage.value
            )

        def __repr__(self) -> str:
            return self.table()

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            data["text/plain"] = self.table()
            return bundle

    calc = ZeroMemoryCalculator()

    def update(*_):
        import html

        table.value = f"<pre style='font-size: 12px'>{html.escape(calc.table())}</pre>"
        chart.value = _bar_chart_png(
            w_psi.value * 1e9, w_n.value, w_prec.value, w_k.value, w_stage.value
        )

    def on_precision(change):
        w_k.value = _per_parameter_bytes(change["new"])[2]  # triggers update through w_k

    w_prec.observe(on_precision, names="value")
    for w in (w_psi, w_n, w_stage, w_k):
        w.observe(update, names="value")
    calc.children = [widgets.HBox([w_psi, w_n]), w_stage, widgets.HBox([w_prec, w_k]), table, chart]
    update()
    return calc


# --------------------------------------------------------------------------- timelines (chapter 05 on)

_GANTT_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#55a868", "W": "#8172b3", "wait": "#d0d0d0"}


def gantt(
    timelines,
    ax=None,
    title: str | None = None,
    unit: str = "ms",
    label_microbatches: bool = True,
    row_names=None,
):
    """Draw per-rank timelines as a Gantt chart: one row per rank, time to the right.

    ``timelines[r]`` is rank r's list of events ``(kind, microbatch, chunk, start, end)`` (seconds,
    or abstract slots with ``unit=""``); kinds "F" (forward, blue), "B" (backward, green), "I" / "W"
    (zero-bubble input / weight gradient) and "wait" (grey). A later chunk (interleaving) is drawn
    lighter; each bar is labelled with its micro-batch. Returns the axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.45 * len(timelines) + 1.2))
    scale = {"ms": 1e3, "s": 1.0, "": 1.0}[unit]
    kinds = set()
    for r, events in enumerate(timelines):
        for kind, mb, chunk, start, end in events:
            kinds.add(kind)
            alpha = 1.0 if chunk <= 0 else max(0.35, 1.0 - 0.3 * chunk)
            ax.barh(
                r,
                (end - start) * scale,
                left=start * scale,
                height=0.8,
                color=_GANTT_COLORS.get(kind, "k"),
                alpha=alpha,
                edgecolor="white",
                linewidth=0.5,
            )
            if label_microbatches and kind != "wait" and (end - start) * scale > 0:
                ax.text(
                    (start + end) / 2 * scale,
                    r,
                    str(mb),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    ax.set_yticks(range(len(timelines)), row_names or [f"rank {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})" if unit else "time (slots)")
    names = {
        "F": "forward",
        "B": "backward",
        "I": "input grad",
        "W": "weight grad",
        "wait": "waiting (recv)",
    }
    ax.legend(
        handles=[Patch(color=_GANTT_COLORS[k], label=names[k]) for k in names if k in kinds],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if unit else -0.3),
        ncol=5,
        frameon=False,
        fontsize=8,
    )
    if title:
        ax.set_title(title, fontsize=10)
    return ax


# --------------------------------------------------------------------------- FSDP (chapter 04)

_GANTT_COLORS.setdefault("AG", "#dd8452")  # all-gather issued
_GANTT_COLORS.setdefault("RS", "#c44e52")  # reduce-scatter issued


def memory_over_step(traces: dict, ax=None, title: str | None = None, gathered: bool = True):
    """Bytes held over one training step, one line per run: ``traces[label] = [(phase, total, gathered)]``.

    One sample per operator (``fsdp_features.reshard_memory_and_traffic`` records them with
    ``FSDPMemTracker``); x is the operator's index within its run, y the total bytes tracked (solid)
    and, with ``gathered``, the unsharded-parameter bytes among them (dashed). The forward / backward /
    step boundaries of each run are marked in its colour. Returns the axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    for i, (label, trace) in enumerate(traces.items()):
        color = f"C{i}"
        ax.plot(
            [t / 1e6 for _, t, _ in trace],
            color=color,
            label=f"{label}: total (peak {max(t for _, t, _ in trace) / 1e6:.2f} MB)",
        )
        if gathered:
            ax.plot(
                [u / 1e6 for _, _, u in trace],
                color=color,
                linestyle="--",
                linewidth=1,
                label=f"{label}: gathered parameters",
            )
    top = max((t for trace in traces.values() for _, t, _ in trace), default=0) / 1e6
    for i, trace in enumerate(traces.values()):  # phase boundaries of each run, in its colour
        for k in range(1, len(trace)):
            if trace[k][0] != trace[k - 1][0]:
                ax.axvline(k, color=f"C{i}", linewidth=0.7, linestyle=":")
                ax.text(k, top * (1.04 - 0.07 * i), f" {trace[k][0]}", fontsize=7, color=f"C{i}")
    ax.set_xlabel("operator (in order of execution)")
    ax.set_ylabel("MB")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def fsdp_timeline(events: dict, ax=None, title: str | None = None, unit: str = "ms"):
    """FSDP compute vs communication, two rows per run, drawn with :func:`gantt`.

    ``events[label] = [(kind, block, start_s, end_s)]`` as ``fsdp_features.prefetch_timeline``
    returns them: "F" / "B" a block's forward / backward compute, "AG" / "RS" the span in which an
    all-gather / reduce-scatter was issued (a call into ``torch.distributed``, not its transfer).
    """
    from matplotlib.patches import Patch

    rows, names = [], []
    for label, evs in events.items():
        rows.append([(k, b, 0, s, e) for k, b, s, e in evs if k in ("F", "B")])
        rows.append([(k, "", 0, s, e) for k, b, s, e in evs if k in ("AG", "RS")])
        names += [f"{label}: compute", f"{label}: comm"]
    ax = gantt(rows, ax=ax, title=title, unit=unit, row_names=names)
    legend = {
        "F": "forward (block)",
        "B": "backward (block)",
        "AG": "all-gather issued",
        "RS": "reduce-scatter issued",
    }
    ax.legend(
        handles=[Patch(color=_GANTT_COLORS[k], label=v) for k, v in legend.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.3),
        ncol=4,
        frameon=False,
        fontsize=8,
    )
    return ax


__all__ += ["memory_over_step", "fsdp_timeline"]


# --------------------------------------------------------------------------- shared bars, curves, cost model


def stacked_bars(
    bars: dict,
    ax=None,
    title: str | None = None,
    unit: str = "MB",
    horizontal: bool = False,
    scale: float | None = None,
    errors: dict | None = None,
):
    """Stacked bars: ``bars[label] = {part: value}`` (bytes with ``unit`` "MB"/"KB", or ms/s values).

    One bar per label, its parts stacked in the order of the first bar's keys, one legend entry per
    part; the value axis starts at 0. ``errors[label]`` (optional) draws a (lo, hi) whisker on the
    bar's total, in the same units as the values. The memory bars of chapters 01 and 03 and the
    compute / communication bars of chapter 00 are drawn with it. Returns the axes.
    """
    import matplotlib.pyplot as plt

    div = (
        scale
        if scale is not None
        else {"MB": 1e6, "KB": 1e3, "B": 1.0, "ms": 1.0, "s": 1.0}.get(unit, 1.0)
    )
    labels = list(bars)
    parts = list(dict.fromkeys(p for b in bars.values() for p in b))
    if ax is None:
        _, ax = plt.subplots(
            figsize=(7, 0.5 * len(labels) + 1.6) if horizontal else (1.2 * len(labels) + 3, 3.4)
        )
    base = [0.0] * len(labels)
    for part in parts:
        vals = [bars[lb].get(part, 0) / div for lb in labels]
        (
            ax.barh(labels, vals, left=base, label=part)
            if horizontal
            else ax.bar(labels, vals, bottom=base, label=part)
        )
        base = [b + v for b, v in zip(base, vals, strict=True)]
    if errors:
        for i, lb in enumerate(labels):
            if lb in errors:
                lo, hi = errors[lb]
                kw = dict(fmt="none", ecolor="k", capsize=3, linewidth=1)
                if horizontal:
                    ax.errorbar(base[i], i, xerr=[[base[i] - lo / div], [hi / div - base[i]]], **kw)
                else:
                    ax.errorbar(i, base[i], yerr=[[base[i] - lo / div], [hi / div - base[i]]], **kw)
    (ax.set_xlabel if horizontal else ax.set_ylabel)(unit)
    (ax.set_xlim if horizontal else ax.set_ylim)(0, max(base + [0]) * 1.15 or 1)
    if horizontal:
        ax.invert_yaxis()
    if horizontal:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    else:
        ax.legend(
            fontsize=8,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.18),
            ncol=min(4, len(parts)),
            frameon=False,
        )
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def scaling_curves(
    x,
    series: dict,
    ax=None,
    title: str | None = None,
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    from_zero: bool = True,
):
    """Lines with error bars: ``series[name] = (ys, lo, hi)`` or ``ys``, all against ``x``.

    ``lo`` / ``hi`` are the spread (e.g. min / max of the repeats whose median is ``ys``); the
    y-axis starts at 0 unless ``from_zero=False`` (log axes). Returns the axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.4))
    for name, s in series.items():
        ys, lo, hi = s if isinstance(s, tuple) else (s, None, None)
        if lo is not None:
            ax.errorbar(
                x,
                ys,
                yerr=[
                    [y - a for y, a in zip(ys, lo, strict=True)],
                    [b - y for y, b in zip(ys, hi, strict=True)],
                ],
                marker="o",
                capsize=3,
                label=name,
            )
        else:
            ax.plot(x, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if from_zero:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def alpha_beta_plot(rows: list[dict], fit, ax=None, title: str | None = None):
    """Measured time per call (median, min–max whiskers) vs the α–β fit, one colour per op, log–log.

    ``rows`` as ``collectives.bandwidth_benchmark`` returns them, ``fit`` an ``AlphaBeta``;
    the fit's β was fitted on sizes ≥ ``fit.min_bytes`` (shaded). Returns the axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for i, op in enumerate(dict.fromkeys(r["op"] for r in rows)):
        mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes"])
        xs = [r["bytes"] for r in mine]
        med = [r["time_s"] * 1e6 for r in mine]
        lo = [r.get("time_lo_s", r["time_s"]) * 1e6 for r in mine]
        hi = [r.get("time_hi_s", r["time_s"]) * 1e6 for r in mine]
        ax.errorbar(
            xs,
            med,
            yerr=[
                [m - a for m, a in zip(med, lo, strict=True)],
                [b - m for m, b in zip(med, hi, strict=True)],
            ],
            fmt="o",
            color=f"C{i}",
            capsize=3,
            label=f"{op}: measured (median, min–max)",
        )
        grid = [xs[0] * (xs[-1] / xs[0]) ** (k / 40) for k in range(41)]
        ax.plot(
            grid,
            [fit.predict(op, b) * 1e6 for b in grid],
            color=f"C{i}",
            linewidth=1,
            label=f"{op}: α={fit.alpha_s[op] * 1e6:.0f} µs, β={fit.beta_bytes_per_s[op] / 1e9:.2f} GB/s",
        )
    ax.axvspan(fit.min_bytes, max(r["bytes"] for r in rows) * 1.5, color="0.92", zorder=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes); shaded: bandwidth regime, where β is fitted")
    ax.set_ylabel("time per call (µs)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


__all__ += ["stacked_bars", "scaling_curves", "alpha_beta_plot"]


# --------------------------------------------------------------------------- DDP (chapter 02)

_GANTT_COLORS.setdefault("AR", "#dd8452")  # all-reduce in flight


def ddp_timeline(timelines: dict, ax=None, title: str | None = None, unit: str = "ms"):
    """DDP compute vs all-reduces, two rows per variant, drawn with :func:`gantt`.

    ``timelines[label] = [(kind, name, start_s, end_s)]`` as ``ddp.ddp_timelines`` returns
    them: kind "compute" (name "forward" / "backward"), "comm" (one all-reduce, launch → done),
    "wait" (the training thread blocked). Forward and backward get their own colours, so the
    forward/backward boundary is where blue turns green.
    """
    from matplotlib.patches import Patch

    rows, names = [], []
    for label, evs in timelines.items():
        rows.append(
            [("F" if n == "forward" else "B", "", 0, a, b) for k, n, a, b in evs if k == "compute"]
        )
        rows.append(
            [("AR" if k == "comm" else "wait", "", 0, a, b) for k, n, a, b in evs if k != "compute"]
        )
        names += [f"{label}: compute", f"{label}: comm"]
    ax = gantt(rows, ax=ax, title=title, unit=unit, row_names=names, label_microbatches=False)
    legend = {
        "F": "forward",
        "B": "backward",
        "AR": "all-reduce (launch → done)",
        "wait": "wait (training thread blocked)",
    }
    ax.legend(
        handles=[Patch(color=_GANTT_COLORS[k], label=v) for k, v in legend.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=4,
        frameon=False,
        fontsize=8,
    )
    return ax


__all__ += ["ddp_timeline"]


# --------------------------------------------------------------------------- the planner widget


def planner_widget(
    params_billions: float = 7.0,
    layers: int = 32,
    hidden: int = 4096,
    heads: int = 32,
    seq_len: int = 2048,
    gpu_memory_gb: float = 80.0,
    gpus_per_node: int = 8,
    nodes: int = 1,
    micro_batch: int = 1,
):
    """An ipywidgets form over ``plan.recommend``: model and cluster in, the plan (or the error) out.

    The form shows the whole plan for its current values; its text representation (what a
    notebook read without a kernel shows, and nbval compares) is one deterministic line naming the
    layout chosen, since the notebook prints the same plan in full beside it.
    """
    import html

    import ipywidgets as widgets

    from .plan import Cluster, Model, PlanError, recommend

    style = {"description_width": "initial"}
    boxes = {
        "params_billions": widgets.BoundedFloatText(
            value=params_billions,
            min=1e-6,
            max=1e5,
            step=0.5,
            description="Ψ (billions)",
            style=style,
        ),
        "layers": widgets.BoundedIntText(
            value=layers, min=1, max=10**4, description="layers", style=style
        ),
        "hidden": widgets.BoundedIntText(
            value=hidden, min=1, max=10**6, description="hidden", style=style
        ),
        "heads": widgets.BoundedIntText(
            value=heads, min=1, max=10**4, description="heads", style=style
        ),
        "seq_len": widgets.BoundedIntText(
            value=seq_len, min=1, max=10**7, description="seq", style=style
        ),
        "micro_batch": widgets.BoundedIntText(
            value=micro_batch, min=1, max=10**4, description="micro-batch", style=style
        ),
        "gpu_memory_gb": widgets.BoundedFloatText(
            value=gpu_memory_gb, min=0.1, max=10**4, step=8, description="GB per GPU", style=style
        ),
        "gpus_per_node": widgets.BoundedIntText(
            value=gpus_per_node, min=1, max=1024, description="GPUs/node", style=style
        ),
        "nodes": widgets.BoundedIntText(
            value=nodes, min=1, max=10**5, description="nodes", style=style
        ),
    }
    out = widgets.HTML()

    def plan():
        v = {k: w.value for k, w in boxes.items()}
        model = Model(
            v["params_billions"] * 1e9, v["layers"], v["hidden"], v["heads"], v["seq_len"]
        )
        cluster = Cluster(v["gpu_memory_gb"], v["gpus_per_node"], v["nodes"])
        return recommend(model, cluster, micro_batch=v["micro_batch"])

    def text() -> str:
        try:
            return str(plan())
        except PlanError as err:
            return f"PlanError: {err}"

    def summary() -> str:
        """Outside a kernel, one line: the form's plan is the one the notebook prints in full."""
        head = "planner form (change the values in JupyterLab)"
        try:
            chosen = plan()
        except PlanError as err:
            return f"{head} · PlanError: {err}"
        line = f"{head} · → {chosen.layout.name()}: {chosen.memory['total'] / 1e9:.1f} GB per GPU"
        fastest = chosen.fastest
        return line + (f"; fastest predicted: {fastest.name()}" if fastest is not None else "")

    class PlannerWidget(widgets.VBox):
        def __repr__(self) -> str:
            return summary()

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            data = bundle[0] if isinstance(bundle, tuple) else bundle
            data["text/plain"] = summary()
            return bundle

    def update(*_):
        out.value = f"<pre style='font-size: 12px'>{html.escape(text())}</pre>"

    for w in boxes.values():
        w.observe(update, names="value")
    names = list(boxes)
    form = PlannerWidget(
        [
            widgets.HBox([boxes[k] for k in names[:3]]),
            widgets.HBox([boxes[k] for k in names[3:6]]),
            widgets.HBox([boxes[k] for k in names[6:]]),
            out,
        ]
    )
    update()
    return form


__all__ += ["planner_widget"]
