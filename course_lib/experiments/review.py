"""Chapter 10's runs: DDP, ZeRO-1/2/3, FSDP2, TP and the pipeline bubble once more, side by side, measured at N = 2;
the planner against those measurements.

* :func:`review_suite` — rank function (N = 2): our DDP and ZeRO-1/2/3 (``zero``: bytes held vs the formula,
  bytes sent vs 2Ψ/3Ψ, equality with one device; ``zero_stage_profile``: activations and model states at an equal
  micro-batch), FSDP2 (``fsdp.fsdp2_vs_zero3``), Megatron TP (``tensor_parallel.tp_step``: all-reduces per
  layer, weight bytes per rank) and pipeline bubbles (``pipeline.sleep_bubbles``).
* :func:`comparison_rows` / :func:`comparison_table` — parent side: one row per technique.
* :func:`plan_vs_measured` — ``plan.memory_per_gpu`` (fp32, the course model) against the bytes measured above.
* :data:`FIXED_CASES` / :func:`fixed_cases` — the planner's fixed cases and what each must give.
* :func:`review_result` / :func:`planner_result` — all of the above as a ``results.Result`` table
  (quantity | measured | reference | tolerance | verdict), what the tests assert.
* :func:`deepspeed_mapping` — DeepSpeed's ``zero_optimization`` configs next to the course's own ZeRO.
* :func:`max_delta_named` — a table whose equality rows say that their measured cell is max |Δ|.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from itertools import pairwise

import torch
import torch.distributed as dist

from ..launch import device
from ..memory import SavedTensorMeter
from ..models import GPT, equality_config
from ..plan import Cluster, Layout, Model, PlanError, memory_per_gpu, recommend, zero_paper_table
from ..results import Measured, Row
from .common import Result, parallel_config, step_batch, zero_config

__all__ = [
    "review_suite",
    "ReviewSuite",
    "REVIEW_PARTS",
    "comparison_rows",
    "comparison_table",
    "plan_vs_measured",
    "FIXED_CASES",
    "fixed_cases",
    "review_result",
    "planner_result",
    "deepspeed_mapping",
    "deepspeed_model_config",
    "max_delta_named",
    "MICRO_BATCH",
]

MICRO_BATCH = 2  # sequences per rank in the activation measurement
TP_BATCH = 8  # sequences in the tensor-parallel step (every TP rank runs all of them)


def _plain(obj):
    """Drop tensors (logits, gradients) from a result: only numbers travel back."""
    if isinstance(obj, Measured):
        return replace(obj, values=_plain(obj.values))
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if not isinstance(v, torch.Tensor)}
    if isinstance(obj, list):
        return [_plain(v) for v in obj if not isinstance(v, torch.Tensor)]
    return obj


@dataclass
class ReviewSuite(Measured):
    """:func:`review_suite`'s result: reads as its dict of plain numbers (``suite["zero"]``); its rows
    are :func:`review_result`'s, every check of the review."""

    def checks(self) -> list[Row]:
        return review_result(self).checks() + list(self.checked)


def _one_device_activation_bytes(config, batch_size: int) -> int:
    """Bytes autograd saves for backward in one forward of the whole model on one device."""
    model = GPT(config, seed=0).to(device())
    x, y = step_batch(0, config, batch_size, device())
    with SavedTensorMeter(exclude=model) as meter:
        model(x, y)
    return meter.bytes


def review_suite(
    bubble_ms: tuple[float, float] = (60.0, 120.0), microbatches=(1, 4)
) -> ReviewSuite:
    """Rank function: every technique of chapters 02–06 once, on this rank (run it at N = 2).

    Returns a :class:`ReviewSuite` reading as plain numbers: ``zero`` (``zero_stage_report`` for
    stages 0–3), ``profile`` (``zero_stage_profile`` at micro-batch :data:`MICRO_BATCH`, no timing),
    ``fsdp`` (``fsdp2_vs_zero3``, one timed round), ``tp`` and ``sp`` (``tp_step`` on
    ``parallel_config``, without and with sequence parallelism), ``tp_one_device_activation_bytes``
    (the same forward on one device) and ``bubbles`` (``sleep_bubbles``: each stage sleeps
    ``bubble_ms`` forward / backward; the median of 3 steps per rank, so one stall on a busy
    machine does not move it).
    """
    from .fsdp import fsdp2_vs_zero3
    from .pipeline import sleep_bubbles
    from .tensor_parallel import tp_step
    from .zero import zero_stage_profile, zero_stage_report

    zero = [zero_stage_report(stage) for stage in range(4)]
    profile = zero_stage_profile(micro_batch=MICRO_BATCH, rounds=0)
    fsdp = fsdp2_vs_zero3(steps=1)
    tp = tp_step(batch_size=TP_BATCH)
    sp = tp_step(batch_size=TP_BATCH, sequence_parallel=True)
    t_f, t_b = (v / 1e3 for v in bubble_ms)
    bubbles = sleep_bubbles(("gpipe", "1f1b"), tuple(microbatches), t_f=t_f, t_b=t_b, steps=3)
    bubbles.pop("timelines")
    world = dist.get_world_size()
    values = {
        "world_size": world,
        "zero": zero,
        "profile": profile,
        "fsdp": fsdp,
        "tp": tp,
        "sp": sp,
        "tp_one_device_activation_bytes": _one_device_activation_bytes(parallel_config(), TP_BATCH),
        "bubbles": bubbles,
    }
    return ReviewSuite(
        title=f"chapter 10 review at N = {world}: DDP, ZeRO, FSDP2, TP, PP", values=_plain(values)
    )


# --------------------------------------------------------------------------- parent side


def _tp_expected_block_bytes(t: int) -> int:
    """Bytes of the block Linears of the TP model on one device, divided by t: what a TP rank should hold."""
    model = GPT(parallel_config(), seed=0)
    full = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if n.startswith("blocks.") and ".ln_" not in n
    )
    return full // t


def comparison_rows(res: dict) -> list[dict]:
    """One row per technique from a rank's :func:`review_suite` result: what it splits, memory and traffic
    (formula and measured / formula), and whether it trained exactly like one device."""
    n = res["world_size"]
    rows = []
    splits = ("nothing (replicas)", "optimizer state", "+ gradients", "+ parameters")
    mem = ("16Ψ", "8Ψ + 8Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N")
    for r in res["zero"]:
        s = r["stage"]
        rows.append(
            {
                "technique": "DDP (ours)" if s == 0 else f"ZeRO-{s} (ours)",
                "splits": splits[s],
                "memory": mem[s],
                "memory_ratio": r["ratio"],
                "traffic": "3Ψ" if s == 3 else "2Ψ",
                "traffic_ratio": r["comm_ratio"],
                "equal": "yes: max |Δweight| ≤ 1e-5"
                if r["max_abs_diff"] <= 1e-5
                else "no: max |Δweight| > 1e-5 (FAIL)",
            }
        )
    f = res["fsdp"]["fsdp2"]
    rows.append(
        {
            "technique": "FSDP2 (torch)",
            "splits": "+ parameters",
            "memory": "16Ψ/N",
            "memory_ratio": f["memory_ratio"],
            "traffic": "3Ψ",
            "traffic_ratio": f["comm_ratio"],
            "equal": "checked in chapter 04",
        }
    )
    tp = res["tp"]
    layers = parallel_config().n_layer
    per_layer = (
        tp["forward"].get("all_reduce:tp", 0) / layers,
        tp["backward"].get("all_reduce:tp", 0) / layers,
    )
    rows.append(
        {
            "technique": "TP (Megatron, ours)",
            "splits": "each layer's matrices",
            "memory": "W_blocks/t",
            "memory_ratio": tp["block_linear_bytes"] / _tp_expected_block_bytes(n),
            "traffic": "2+2 all-reduces/layer",
            "traffic_ratio": (per_layer[0] + per_layer[1]) / 4,
            "equal": "checked in chapter 06",
        }
    )
    rows.append(
        {
            "technique": "PP (GPipe, 1F1B)",
            "splits": "layers into stages",
            "memory": "16Ψ/p + acts",
            "memory_ratio": float("nan"),
            "traffic": "boundary activations",
            "traffic_ratio": float("nan"),
            "equal": "its bubble: §2, timed",
        }
    )
    return rows


def comparison_table(rows: list[dict], world_size: int = 2) -> str:
    """The rows of :func:`comparison_rows` as text (ratios are measured / formula at N = ``world_size``)."""
    lines = [
        f"{'technique':<20} {'splits':<22} {'memory/rank':<13} {'measured':>8}  {'traffic/step':<22} "
        f"{'measured':>8}  equals one device?",
        f"{'':<20} {'':<22} {'formula':<13} {'÷ formula':>8}  {'formula':<22} {'÷ formula':>8}",
        "-" * 124,
    ]
    for r in rows:
        mr = "—" if r["memory_ratio"] != r["memory_ratio"] else f"{r['memory_ratio']:.3f}"
        tr = "—" if r["traffic_ratio"] != r["traffic_ratio"] else f"{r['traffic_ratio']:.3f}"
        lines.append(
            f"{r['technique']:<20} {r['splits']:<22} {r['memory']:<13} {mr:>8}  {r['traffic']:<22} "
            f"{tr:>8}  {r['equal']}"
        )
    lines += [
        f"N = {world_size} data-parallel ranks, Ψ parameters, fp32 AdamW; memory: model states per rank after "
        "a step;",
        "traffic: the ring bytes one rank sends per step (CommLog); —: no byte formula checked here.",
        f"TP: W_blocks = the bytes of the blocks' Linear weights, split over t = {world_size} ranks; "
        "2+2 = all-reduces per layer,",
        "    in forward + backward (its measured ÷ formula: all-reduces counted per layer ÷ 4).",
        "PP: 16Ψ/p = model states per stage; acts = activations of m micro-batches (GPipe) or at most p "
        "(1F1B).",
    ]
    return "\n".join(lines)


def plan_vs_measured(res: dict) -> list[dict]:
    """``plan.memory_per_gpu`` (fp32, course model, micro-batch :data:`MICRO_BATCH`) vs the measured bytes.

    Model states: ``zero_stage_profile``'s after-step snapshot (stages 0–3) and FSDP2's accounting;
    activations: the bytes saved for backward at the end of forward (``zero_stage_profile``).
    """
    model = Model.from_config(zero_config())
    n, prof = res["world_size"], res["profile"]
    rows = []
    for s in range(4):
        pred = memory_per_gpu(
            model, Layout(dp=n, zero=s, recompute="none"), micro_batch=MICRO_BATCH, precision="fp32"
        )
        rows.append(
            {
                "layout": "DDP" if s == 0 else f"ZeRO-{s}",
                "predicted_states": pred["model_states"],
                "measured_states": prof["peak"][s]["after step"]["model states"],
                "predicted_activations": pred["activations"],
                "measured_activations": prof["activation_bytes"][s],
            }
        )
    pred = memory_per_gpu(
        model, Layout(dp=n, zero=3, recompute="none"), micro_batch=MICRO_BATCH, precision="fp32"
    )
    rows.append(
        {
            "layout": "FSDP2",
            "predicted_states": pred["model_states"],
            "measured_states": res["fsdp"]["fsdp2"]["memory"]["total"],
            "predicted_activations": pred["activations"],
            "measured_activations": None,
        }
    )
    for r in rows:
        r["states_ratio"] = r["measured_states"] / r["predicted_states"]
        r["activations_ratio"] = (
            r["measured_activations"] / r["predicted_activations"]
            if r["measured_activations"] is not None
            else None
        )
    return rows


# --------------------------------------------------------------------------- the planner's fixed cases


def _is_zero2_or_fsdp(plan) -> bool:
    return plan.layout.tp == plan.layout.pp == 1 and plan.layout.zero in (2, 3)


def _tp_in_node_pp_or_fsdp_across(plan) -> bool:
    lay, c = plan.layout, plan.cluster
    inside = 1 < lay.tp <= c.gpus_per_node and c.gpus_per_node % lay.tp == 0
    across = (lay.pp > 1 or lay.zero >= 2) and lay.dp * lay.pp >= c.nodes
    return inside and across


#: name -> (Model, Cluster, what the recommendation must be, a check of the plan); None check = PlanError expected
FIXED_CASES = {
    "7B on 8×80 GB": (
        Model(7e9, 32, 4096, 32, 2048, 32000, "7B"),
        Cluster(80, 8, 1),
        "ZeRO-2 / FSDP (no model parallelism)",
        _is_zero2_or_fsdp,
    ),
    "70B on 64×80 GB (8 per node)": (
        Model(70e9, 80, 8192, 64, 4096, 32000, "70B"),
        Cluster(80, 8, 8),
        "TP inside the node; across nodes PP, or ZeRO-2/3 / FSDP",
        _tp_in_node_pp_or_fsdp_across,
    ),
    "GPT-2 small (124M) on 8×80 GB": (
        Model(124e6, 12, 768, 12, 1024, 50257, "GPT-2 small"),
        Cluster(80, 8, 1),
        "plain DDP",
        lambda p: p.layout == Layout(dp=8),
    ),
    "1.5B on one 24 GB GPU": (
        Model(1.5e9, 48, 1600, 25, 1024, 50257, "GPT-2 XL"),
        Cluster(24, 1, 1),
        "an error: 16Ψ = 24 GB of model states alone exceed one GPU",
        None,
    ),
    "1T on 16×80 GB": (
        Model(1e12, 128, 25600, 160, 2048, 32000, "1T"),
        Cluster(80, 8, 2),
        "an error saying how many GPUs are missing",
        None,
    ),
}


def fixed_cases() -> list[dict]:
    """Run :func:`plan.recommend` on :data:`FIXED_CASES`: ``{"case", "expected", "plan" or "error", "ok"}``."""
    out = []
    for name, (model, cluster, expected, check) in FIXED_CASES.items():
        try:
            plan = recommend(model, cluster)
        except PlanError as err:
            out.append(
                {
                    "case": name,
                    "expected": expected,
                    "plan": None,
                    "error": str(err),
                    "ok": check is None,
                }
            )
        else:
            out.append(
                {
                    "case": name,
                    "expected": expected,
                    "plan": plan,
                    "error": None,
                    "ok": check is not None and bool(check(plan)),
                }
            )
    return out


# --------------------------------------------------------------------------- the checked table


REVIEW_PARTS = ("bytes", "equality", "bubbles", "planner")
"""The parts of :func:`review_result`: bytes held and sent against the formulas (deterministic),
weights against one device (max|Δ| varies with the machine's rounding), the timed pipeline
bubbles, and the planner against the measured bytes (deterministic)."""


def _is_equality(row: Row) -> bool:
    return row.tolerance.startswith(("AdamW", "SGD")) and row.reference is None


def _max_delta_row(row: Row) -> Row:
    """An equality row (``Result.equal``: measured = max |Δ| over every element) named so, once."""
    equality = row.reference is None and (
        row.tolerance.startswith(("AdamW", "SGD")) or row.tolerance.endswith("(bitwise)")
    )
    said = re.search(r"max ?\|Δ", row.quantity)
    return replace(row, quantity=f"{row.quantity} (max |Δ|)") if equality and not said else row


def max_delta_named(res: Result) -> Result:
    """``res``'s rows as a plain :class:`Result` (same title), every equality row named ``"… (max |Δ|)"``:
    its measured cell is the largest |Δ| over every element, and a bare 0 there says nothing by itself."""
    return Result(title=res.title, checked=[_max_delta_row(row) for row in res.checks()])


def _bytes_rows(out: Result, res) -> None:
    # One row per quantity: measured / formula for every technique (zero_stage_report's own byte rows
    # restate the same model states and traffic in bytes: chapter 03 prints them).
    for r in comparison_rows(res):
        name = r["technique"]
        if r["memory_ratio"] == r["memory_ratio"]:  # not NaN: the pipeline has no byte formula here
            out.within(
                f"{name}: model states per rank / formula",
                r["memory_ratio"],
                1.0,
                0.01,
                f"formula {r['memory']}",
            )
            out.within(
                f"{name}: sent per step / formula",
                r["traffic_ratio"],
                1.0,
                0.01,
                f"formula {r['traffic']}",
            )
    held = [z["measured"]["total"] for z in res["zero"]]
    out.condition(
        "memory per rank: DDP > ZeRO-1 > ZeRO-2 > ZeRO-3",
        held,
        all(a > b for a, b in pairwise(held)),
        "strictly decreasing",
    )
    f, z3 = res["fsdp"]["fsdp2"], res["fsdp"]["zero3"]
    out.within(
        "FSDP2 (torch) vs our ZeRO-3: model-state bytes per rank",
        f["memory"]["total"],
        z3["memory"]["total"],
        0.02,
        "our ZeRO-3",
    )
    acts = res["profile"]["activation_bytes"]
    for s in range(1, 4):
        out.exact(
            f"ZeRO-{s} activation bytes per rank",
            acts[s],
            acts[0],
            "DDP (ZeRO shards no activations)",
        )
    if "sp" in res:
        one, tp, sp = (
            res["tp_one_device_activation_bytes"],
            res["tp"]["activation_bytes"],
            res["sp"]["activation_bytes"],
        )
        t = res["world_size"]
        out.condition(
            f"TP t={t}: activation bytes per rank",
            tp,
            tp < one,
            "fewer than one device",
            one,
            "one device",
        )
        out.condition(
            f"TP + SP t={t}: activation bytes per rank",
            sp,
            sp < tp,
            "fewer than TP alone",
            tp,
            "TP alone",
        )


def _equality_rows(out: Result, res) -> None:
    for z in res["zero"]:  # weights and losses against one device, judged with results.ADAMW
        name = "DDP" if z["stage"] == 0 else f"ZeRO-{z['stage']}"
        out.checked += [
            replace(row, quantity=f"{name} (ours): {_max_delta_row(row).quantity}")
            for row in z.checks()
            if _is_equality(row)
        ]


def _bubble_rows(out: Result, res) -> None:
    p, margin = res["world_size"], res["bubbles"]["margin"]
    for r in res["bubbles"]["rows"]:
        worst = max(r["per_rank"], key=lambda b: abs(b - r["formula"]))
        out.condition(
            f"{r['schedule']} m={r['m']}: bubble of the worst rank",
            worst,
            all(abs(b - r["formula"]) <= margin for b in r["per_rank"]),
            f"within ±{margin}",
            r["formula"],
            "formula (p−1)/(m+p−1)",
        )
        if r["schedule"] == "gpipe":
            out.exact(
                f"gpipe m={r['m']}: peak live micro-batches",
                r["peak_live"],
                r["m"],
                "m (all of them)",
            )
        else:
            out.condition(
                f"1f1b m={r['m']}: peak live micro-batches",
                r["peak_live"],
                r["peak_live"] <= p,
                f"≤ p = {p}",
            )


def _planner_rows(out: Result, res) -> None:
    for r in plan_vs_measured(res):
        out.within(
            f"{r['layout']}: model-state bytes per rank vs the planner",
            r["measured_states"],
            round(r["predicted_states"]),
            0.01,
            "plan.memory_per_gpu (fp32)",
        )
        if r["measured_activations"] is not None:
            out.within(
                f"{r['layout']}: activation bytes per rank vs the planner",
                r["measured_activations"],
                round(r["predicted_activations"]),
                0.01,
                "plan.memory_per_gpu (fp32)",
            )


def review_result(res, part: str | None = None) -> Result:
    """Every check of the review as rows, or those of one ``part`` of :data:`REVIEW_PARTS`.

    ``"bytes"``: :func:`comparison_rows` at their formulas, ``zero_stage_report``'s byte rows,
    FSDP2 = our ZeRO-3, activations equal at every ZeRO stage, and TP's (and TP + SP's) activation
    bytes per rank below one device's (and TP's); ``"equality"``: each ZeRO stage's weights and
    losses against one device (``results.ADAMW``, judged on the ranks, where the tensors are);
    ``"bubbles"``: the bubbles at (p−1)/(m+p−1) and the live micro-batches; ``"planner"``:
    :func:`plan_vs_measured`.
    """
    parts = {
        "bytes": _bytes_rows,
        "equality": _equality_rows,
        "bubbles": _bubble_rows,
        "planner": _planner_rows,
    }
    if part is not None and part not in parts:
        raise ValueError(f"part={part!r} is not one of {REVIEW_PARTS} (or None: all of them)")
    title = f"chapter 10 review at N = {res['world_size']}: DDP, ZeRO, FSDP2, TP, PP"
    out = Result(title=title if part is None else f"{title} — {part}")
    for name, add in parts.items():
        if part in (None, name):
            add(out, res)
    return out


def planner_result() -> Result:
    """The chooser's own checks: the ZeRO paper's table (rounded to 0.1 GB) and every fixed case."""
    out = Result(title="the strategy chooser: the ZeRO paper and the fixed cases")
    paper = zero_paper_table(7.5e9, 64)
    for (name, gb), want in zip(paper.items(), (120.0, 31.4, 16.6, 1.9), strict=True):
        out.exact(
            f"{name}: model states per GPU (GB, 0.1), Ψ = 7.5B, N = 64",
            round(gb, 1),
            want,
            "ZeRO paper, Figure 1",
        )
    for c in fixed_cases():
        if c["plan"] is not None:
            got = c["plan"].layout.name()
        elif m := re.search(
            r"need at least (\d+) GPUs .*?\((\d+) nodes?.*?instead of (\d+)", c["error"]
        ):
            got = f"PlanError: needs ≥ {m[1]} GPUs ({m[2]} nodes), has {m[3]}"
        else:  # another error: its last clause, cut at a word boundary
            tail = c["error"].split(": ")[-1]
            got = "PlanError: …" + (tail if len(tail) <= 60 else tail[:60].rsplit(" ", 1)[0] + " …")
        out.condition(c["case"], got, c["ok"], c["expected"])
    return out


# --------------------------------------------------------------------------- DeepSpeed in context


def deepspeed_model_config():
    """The model DeepSpeed trains in notebook 10 (and ``tests/test_zero_libs.py``): odd sizes, so it pads.

    Not ``zero_config``: with its 512-token vocabulary and 128 tokens per step, many output rows get
    near-zero gradients, which DeepSpeed's AdamW (eps = 1e-8) turns into full-size steps of rounding
    noise — the comparison with one device would then measure Adam, not DeepSpeed (chapter 03).
    """
    return equality_config(vocab_size=32, block_size=16, n_layer=2, n_head=3, d_model=27)


def deepspeed_mapping() -> list[dict]:
    """DeepSpeed ``zero_optimization`` settings next to the course's own code and the planner's layout."""
    return [
        {"deepspeed": {"stage": 0}, "ours": "ddp.DDP", "plan": Layout(dp=2, zero=0).name()},
        {
            "deepspeed": {"stage": 1},
            "ours": "zero.ZeroOptimizer(stage=1)",
            "plan": Layout(dp=2, zero=1).name(),
        },
        {
            "deepspeed": {"stage": 2},
            "ours": "zero.ZeroOptimizer(stage=2)",
            "plan": Layout(dp=2, zero=2).name(),
        },
        {
            "deepspeed": {"stage": 3},
            "ours": "zero3.Zero3 (≈ FSDP2 fully_shard)",
            "plan": Layout(dp=2, zero=3).name(),
        },
        {
            "deepspeed": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "ours": "— (ZeRO-Offload: Adam state and step on the CPU)",
            "plan": "not modelled (the GPU keeps the 16-bit weights, 2Ψ)",
        },
        {
            "deepspeed": {"stage": 3, "offload_param": {"device": "nvme"}},
            "ours": "— (ZeRO-Infinity: parameters on NVMe)",
            "plan": "suggested when nothing fits",
        },
    ]
