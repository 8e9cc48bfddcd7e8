"""The α–β cost model: the fit recovers a known model, refuses bad input, and fits a real sweep."""

import pytest

from course_lib.comm import ring_factor
from course_lib.experiments import collectives as ch00
from course_lib.results import REORDERED

SIZES = (2**10, 2**12, 2**16, 2**20, 2**22, 2**24)


def _rows(alpha, beta, n=2, ops=("all_reduce", "send_recv")):
    return [
        {
            "op": op,
            "bytes": b,
            "world_size": n,
            "time_s": alpha + (1.0 if op == "send_recv" else ring_factor(op, n)) * b / beta,
        }
        for op in ops
        for b in SIZES
    ]


def test_fit_recovers_a_known_model():
    fit = ch00.fit_alpha_beta(_rows(1e-4, 2e9))
    for op in ("all_reduce", "send_recv"):
        # α is the fastest latency-regime row (≤ 4 KiB): the 1 KiB one, α plus its b/β (≤ 1 µs)
        factor = 1.0 if op == "send_recv" else ring_factor(op, 2)
        REORDERED.assert_close(fit.alpha_s[op], 1e-4 + factor * 2**10 / 2e9)
        # β: that 1 KiB bias shifts the fitted slope by ~0.1 %; 3 % is the model's bound, not rounding
        assert fit.beta_bytes_per_s[op] == pytest.approx(2e9, rel=0.03)
        assert fit.points[op] == 3
    assert fit.predict("all_reduce", 2**24) == pytest.approx(1e-4 + 2**24 / 2e9, rel=0.03)
    # the ring factor carries the model to other world sizes: 2(N−1)/N = 1.5 at N=4
    REORDERED.assert_close(
        fit.predict("all_reduce", 2**24, 4),
        fit.alpha_s["all_reduce"] + 1.5 * 2**24 / fit.beta_bytes_per_s["all_reduce"],
    )
    assert fit.predict("all_reduce", 2**24, 1) == 0.0
    assert "β (GB/s)" in fit.table()


def test_a_slow_latency_row_cannot_make_beta_infinite():
    # the 1 KiB call woke up late (5 ms): taken as α it would exceed every 1-16 MiB call, leaving
    # nothing for β (the fit gave β ≈ 3e18 B/s once); α is capped by the quickest call of any size
    rows = _rows(1e-4, 2e9, ops=("all_reduce",))
    rows[0]["time_s"] = 5e-3
    fit = ch00.fit_alpha_beta(rows)
    quickest = min(r["time_s"] for r in rows)
    REORDERED.assert_close(fit.alpha_s["all_reduce"], quickest)
    assert 1e8 < fit.beta_bytes_per_s["all_reduce"] < 1e11  # finite, within 50x of the true 2 GB/s


def test_fit_refuses_bad_input():
    with pytest.raises(ValueError, match="no rows"):
        ch00.fit_alpha_beta([])
    with pytest.raises(ValueError, match="several world sizes"):
        ch00.fit_alpha_beta(_rows(1e-4, 2e9, n=2) + _rows(1e-4, 2e9, n=4))
    with pytest.raises(ValueError, match="no row with bytes ≥ min_bytes"):
        ch00.fit_alpha_beta([r for r in _rows(1e-4, 2e9) if r["bytes"] < 2**20])
    fit = ch00.fit_alpha_beta(_rows(1e-4, 2e9))
    with pytest.raises(ValueError, match="no fit for op 'broadcast'"):
        fit.predict("broadcast", 1024)


def test_measured_sweep_fits():
    """A real sweep on 2 ranks: median of 5 repeats with spread; the fit gives positive α and β."""
    fit, rows = ch00.measure_alpha_beta(2, sizes_bytes=(2**10, 2**20, 2**22), repeats=5)
    assert {r["op"] for r in rows} == set(ch00.OPS)
    for r in rows:
        assert len(r["times_s"]) == 5
        assert r["time_lo_s"] <= r["time_s"] <= r["time_hi_s"]
    for op in ch00.OPS:
        assert fit.alpha_s[op] > 0 and fit.beta_bytes_per_s[op] > 0
        assert fit.predict(op, 2**22) > fit.predict(op, 2**10)
