"""``torch.compile`` of each decoder block of a TP-sharded model, against eager, on 2 gloo processes.

Users who train with TP compile block by block (torchtitan). :func:`autotp.training.compile_blocks`
does it in place; the test shards a model with a handwritten plan (Llama) and a synthesized plan of
another family (Qwen3: per-head q/k norms), plain and sequence parallel, and compares the logits and
every gradient of a ``labels=`` step with the same sharded model run eagerly, and with the unsharded
model. The test backend is ``aot_eager`` (Dynamo capture and AOT autograd, the parts that meet
DTensor and the TP hooks); inductor was measured by hand (see docs/training.md, "torch.compile").
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autotp
import handwritten_plans
from autotp.apply import apply_plan
from autotp.errors import AutoTPError
from autotp.models import build_model
from autotp.training import compile_blocks
from gloo_launch import run_on_ranks

TOLERANCE = 1e-5
BACKEND = "aot_eager"
CASES = [("llama", "handwritten", False), ("llama", "handwritten", True),
         ("qwen3", "synthesized", False), ("qwen3", "synthesized", True)]


def _model(family: str) -> nn.Module:
    return build_model(family, tiny=True, tp=2, device="cpu").train()


def _plans() -> dict:
    plans = {}
    for family, source, sp in CASES:
        model = _model(family)
        if source == "handwritten":
            plans[family, sp] = handwritten_plans.plan_for(model, sequence_parallel=sp)
        else:
            plans[family, sp] = autotp.synthesize(model, sequence_parallel=sp, verify=False)
    return plans


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Full logits and full gradients (by parameter name) of one ``labels=`` step."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return _full(out.logits), {name: _full(p.grad) for name, p in model.named_parameters()}


def _max_diff(a: tuple, b: tuple) -> tuple[float, float]:
    """(logits difference, largest gradient difference) between two ``_step`` results."""
    grads = max((a[1][n] - b[1][n]).abs().max().item() for n in a[1])
    return (a[0] - b[0]).abs().max().item(), grads


def _one_case(family: str, sp: bool, plan: dict) -> dict:
    from torch._dynamo.utils import counters

    mesh = init_device_mesh("cpu", (2,))
    model = _model(family)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = _step(copy.deepcopy(model), ids)
    eager = _step(apply_plan(copy.deepcopy(model), mesh, plan), ids)
    compiled_model = apply_plan(copy.deepcopy(model), mesh, plan)
    blocks = compile_blocks(compiled_model, backend=BACKEND)
    torch._dynamo.reset()
    counters.clear()
    compiled = _step(compiled_model, ids)
    return dict(
        eager_vs_compiled=_max_diff(eager, compiled),
        unsharded_vs_compiled=_max_diff(reference, compiled),
        names_kept=[n for n, _ in compiled_model.named_parameters()] == [n for n, _ in model.named_parameters()],
        blocks=len(blocks),
        frames=counters["stats"]["unique_graphs"],
        graph_breaks=dict(counters["graph_break"]),
    )


def _all_cases(plans):
    return [_one_case(f, sp, plans[f, sp]) for f, _, sp in CASES]


@pytest.mark.multiprocess
def test_compiled_blocks_match_eager_on_2_processes():
    """Per-block compiled TP model (handwritten and synthesized plans, plain and SP): logits and
    every gradient equal the eager sharded model's and the unsharded model's; each block was
    captured as a graph without graph breaks, and parameter names are unchanged. Catches a TP hook
    or DTensor op that compiles to different numerics, or a block that silently falls back to eager."""
    results = run_on_ranks(_all_cases, 2, _plans(), timeout=480.0, what="compile workers")[0]
    for (family, source, sp), result in zip(CASES, results):
        label = f"{family} {source}{' sp' if sp else ''}: {result}"
        assert max(result["eager_vs_compiled"]) <= TOLERANCE, label
        assert max(result["unsharded_vs_compiled"]) <= TOLERANCE, label
        assert result["names_kept"] and result["blocks"] == 2, label
        assert result["frames"] >= 1 and not result["graph_breaks"], label


def test_compile_blocks_without_a_block_list_names_the_fix():
    with pytest.raises(AutoTPError, match="no nn.ModuleList of decoder blocks"):
        compile_blocks(nn.Sequential(nn.Linear(2, 2)))
