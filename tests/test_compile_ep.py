"""Expert parallelism under torch.compile: 2 gloo ranks, each compiling its patched model fullgraph.

The EP step (route, all_to_all / all_reduce collectives, experts, combine) runs inside each
block's moeflow op, its host bookkeeping (splits, step protocol) outside the traced graph. Each
rank's compiled logits must match the unsharded eager model's within rtol 1e-5 (atol 1e-5 x
max|logit|; max-abs and RMS error in the failure message) at two prompt lengths, ranks holding
different token counts under all_to_all. gemma4 with EP (its routing passes between two
modules through Python) refuses to compile with CompiledStepError naming the layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ep_spawn import check_case

W = 2


def _quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _compiled_matches_unsharded(rank: int, mode: str) -> None:
    from hf_configs import tiny_model

    import moeflow
    from moeflow.testing import assert_close

    model = tiny_model("qwen3_moe", seed=11)
    prompts = [torch.randint(3, 97, (2, S + (rank if mode == "all_to_all" else 0)),
                             generator=torch.Generator().manual_seed(40 + S)) for S in (6, 9)]
    with torch.no_grad():
        want = [model(ids).logits for ids in prompts]
    moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD, ep_mode=mode,
                        ep_options={"timeout_s": 30.0})
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for ids, w in zip(prompts, want):
            assert_close(compiled(ids).logits, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()),
                         what=f"rank {rank} {mode} compiled logits, S={ids.shape[1]}")
    torch._dynamo.reset()


def _gemma4_refuses(rank: int) -> None:
    from hf_configs import available_families, tiny_model

    import moeflow
    from moeflow.hf.op import CompiledStepError

    if "gemma4" not in available_families():
        return
    model = tiny_model("gemma4", seed=12)
    moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD, ep_mode="all_to_all")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        with torch.no_grad():
            compiled(torch.randint(3, 97, (1, 5)))
    except CompiledStepError as exc:
        assert "gemma4 with expert parallelism" in str(exc) and "(layer 0)" in str(exc), str(exc)
    else:
        raise AssertionError("gemma4 with EP compiled without the named refusal")
    torch._dynamo.reset()


def _case(fn):
    def run(rank: int, W: int) -> None:
        _quiet()
        fn(rank)
    return run


CASES = [
    ("all_to_all", _case(lambda rank: _compiled_matches_unsharded(rank, "all_to_all"))),
    ("all_reduce", _case(lambda rank: _compiled_matches_unsharded(rank, "all_reduce"))),
    ("gemma4_refuses", _case(_gemma4_refuses)),
]


@pytest.mark.parametrize("case", [name for name, _ in CASES])
def test_ep_under_compile(case):
    check_case("test_compile_ep", W, case)
