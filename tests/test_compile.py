"""course_lib.experiments.compile: torch.compile against eager, and a graph break found by explain.

The harness runs with backend="aot_eager" (Dynamo + AOTAutograd, no generated kernels: a cold
inductor compile takes ~25 s on 2 cores); notebook 01 asserts the inductor run's losses.
"""

import torch

from course_lib.experiments import compile as C
from course_lib.models import tiny_config
from course_lib.results import ADAMW


def test_compiled_losses_equal_eager_within_the_named_tolerances():
    eager, twin = C.twins(tiny_config(n_layer=1))
    compiled = torch.compile(twin, backend="aot_eager")
    run = C.compile_vs_eager(
        eager, compiled, batch_size=4, steps=3, rounds=2, steps_per_round=1, backend="aot_eager"
    )
    assert run.passed, run
    assert len(run.losses["compiled"]) == len(run.losses["eager"]) == 3
    assert ADAMW.ok(run.losses["compiled"], run.losses["eager"])
    assert set(run.timings.medians()) == {"eager", "compiled"}
    assert run.compile_s > 0 and "first step" in str(run)


def test_explain_finds_the_item_graph_break():
    got = C.explain_breaks(C.with_item_break, torch.randn(2, 5))
    assert got["graphs"] == 2 and got["breaks"] == 1, got
    assert "item()" in got["reasons"][0], got


def test_a_function_without_a_break_is_one_graph():
    got = C.explain_breaks(lambda t: torch.softmax(t * 2, dim=-1), torch.randn(2, 5))
    assert (got["graphs"], got["breaks"], got["reasons"]) == (1, 0, [])


def test_the_cache_goes_under_the_project_unless_the_environment_names_one(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert C.use_project_cache() == str(C.CACHE_DIR)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    assert C.use_project_cache() == "/elsewhere"
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # inductor's own default
    assert C.use_project_cache() == str(C.CACHE_DIR)
