"""course_lib.experiments.compile_dist: torch.compile on torch DDP and on FSDP2, on 2 real gloo ranks.

One spawn for both rank functions (a spawn costs ~2 s on 2 cores); cheap backends only (a graph
counter, aot_eager): no code generation.
"""

import pytest
import torch

from course_lib.experiments import compile_dist as C
from course_lib.launch import spawn
from course_lib.results import REORDERED, SGD


def _both():
    return C.compiled_ddp_split(4.0, steps=2), C.compiled_fsdp2_vs_eager("aot_eager", steps=2)


@pytest.fixture(scope="module")
def ranks():
    return spawn(_both, 2)


def test_graph_counter_records_each_graph_and_runs_it_unchanged():
    counter = C.GraphCounter()
    f = torch.compile(lambda x: torch.sin(x) + 1, backend=counter)
    x = torch.arange(4.0)
    assert torch.equal(f(x), torch.sin(x) + 1)
    assert len(counter) == 1


def test_compiled_ddp_makes_one_graph_per_bucket_within_one(ranks):
    for ddp, _ in ranks:
        # the DDP optimizer's first bucket is always 1 MiB; DDP's is bucket_cap_mb: ±1
        assert len(ddp["buckets"]) >= 2
        assert abs(ddp["graphs"] - len(ddp["buckets"])) <= 1


def test_compiled_ddp_equals_eager_ddp(ranks):
    for ddp, _ in ranks:
        REORDERED.assert_close(ddp["losses"], ddp["eager_losses"])
        SGD.assert_close(ddp["weights"], ddp["eager_weights"])
    SGD.assert_close(ranks[1][0]["weights"], ranks[0][0]["weights"])


def test_fsdp2_with_compiled_blocks_equals_eager(ranks):
    for _, fsdp in ranks:
        REORDERED.assert_close(fsdp["losses"], fsdp["eager_losses"])
        SGD.assert_close(fsdp["weights"], fsdp["eager_weights"])


def test_bucket_cap_below_one_mib_is_refused():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        C.compiled_ddp_split(0.5)
