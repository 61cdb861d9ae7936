"""Rounding or wrong: the verifier's verdict on models that compute in low precision inside.

A float32 model whose MLP runs its matmuls in bfloat16 (as torchtitan's grouped experts do) differs
from itself sharded by bf16 rounding of each rank's partial sum, ~1e-3: far above the verifier's
1e-5, and a float64 re-run keeps it (the casts still round). The verifier finds the casts and runs
the check again with them made exact; the verdict says which: ``"exact"``, ``"rounding"`` (ok, and
said so) or ``"mismatch"``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autotp import _simulate
from autotp.apply import apply_plan
from autotp.casts import LowPrecisionCasts
from autotp.errors import VerificationError
from autotp.synth import synthesize
from autotp.verifier import low_precision_casts, require_ok, verify

VOCAB, DIM, HIDDEN = 96, 64, 128


class CastLinear(nn.Linear):
    """A Linear whose matmul runs in bfloat16 when ``low`` is set, output back in the input's dtype."""

    low = True

    def forward(self, x):
        if not self.low:
            return super().forward(x)
        return F.linear(x.bfloat16(), self.weight.bfloat16()).type_as(x)


class CastMLP(nn.Module):
    """SwiGLU with bf16 matmuls; ``fused`` keeps gate and up in one projection cut by ``chunk(2)``."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        if fused:
            self.gate_up = CastLinear(DIM, 2 * HIDDEN, bias=False)
        else:
            self.gate, self.up = CastLinear(DIM, HIDDEN, bias=False), CastLinear(DIM, HIDDEN, bias=False)
        self.down = CastLinear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1) if self.fused else (self.gate(x), self.up(x))
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(DIM), CastMLP(fused)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class CastLM(nn.Module):
    """Embedding, two MLP blocks, norm, head: the casts are the MLPs' only departure from float32."""

    def __init__(self, *, low: bool = True, fused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(fused) for _ in range(2))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        for module in self.modules():
            if isinstance(module, CastLinear):
                module.low = low

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0)),)


def mlp_plan(*, fused: bool = False, down=None) -> dict:
    """The MLPs' plan: gate / up (or gate_up) colwise, down rowwise (or ``down``)."""
    plan = {"blocks.*.mlp.gate_up": ColwiseParallel()} if fused else {
        "blocks.*.mlp.gate": ColwiseParallel(), "blocks.*.mlp.up": ColwiseParallel()}
    plan["blocks.*.mlp.down"] = down or RowwiseParallel()
    return plan


def test_bf16_matmuls_with_a_correct_plan_are_rounding():
    """Would catch a correct plan of a model with bf16 matmuls called wrong (the float64 re-run
    keeps the bf16 rounding), the casts not found, or the mode not taking effect on the sharded
    model under the simulator (its difference would stay at bf16 rounding: mismatch)."""
    report = verify(CastLM(), mlp_plan(), tp_size=2, inputs=tokens())
    assert max(report.logits_max_abs_diff) > 1e-4, str(report)  # the bf16 rounding is there
    assert report.verdict == "rounding" and report.ok, str(report)
    # 3 Linears x 2 blocks x (input, weight) in the forward, x (the output gradient) in the backward
    assert report.low_precision_casts == {"bfloat16": 18}
    exact = report.exact_casts
    assert exact.verdict == "exact" and max(exact.logits_max_abs_diff) < 1e-5, str(report)
    assert "OK (low-precision rounding: with its 18 bfloat16 casts made exact it agrees to" in str(report)
    assert require_ok(report, what="CastLM's plan") is report


@pytest.mark.slow
def test_bf16_matmuls_with_a_synthesized_sp_plan_are_rounding():
    """The synthesizer's own plan of the same model under sequence parallel, at tp 4."""
    model = CastLM()
    plan = synthesize(model, example_inputs=tokens(), sequence_parallel=True, tp_size=4)
    report = verify(model, plan, tp_size=4, inputs=tokens())
    assert report.verdict == "rounding", str(report)


@pytest.mark.parametrize("wrong", [
    "contiguous-fused-split", pytest.param("rowwise-without-reduction", marks=pytest.mark.slow)])
def test_a_wrong_plan_is_a_mismatch_with_casts_exact(wrong):
    """Would catch casts made exact passing a wrong plan: a fused gate_up split contiguously (each
    rank's chunk(2) halves the gate alone or the up alone) or a down projection whose partial sums
    are never reduced both still differ when the model runs at float32 throughout."""
    fused = wrong == "contiguous-fused-split"
    down = RowwiseParallel(output_layouts=Partial()) if wrong == "rowwise-without-reduction" else None
    report = verify(CastLM(fused=fused), mlp_plan(fused=fused, down=down), tp_size=2, inputs=tokens())
    assert report.verdict == "mismatch" and not report.ok, str(report)
    assert report.low_precision_casts == {"bfloat16": 18 if not fused else 12}
    assert report.exact_casts is not None and not report.exact_casts.ok
    assert "the plan is wrong" in str(report) and str(report).split()[1] == "MISMATCH"
    with pytest.raises(VerificationError, match="numerically wrong"):
        require_ok(report, what="CastLM's plan")


def test_a_model_without_casts_is_exact():
    """The same model in float32 throughout: exact, no casts looked for, no re-run."""
    report = verify(CastLM(low=False), mlp_plan(), tp_size=2, inputs=tokens())
    assert report.verdict == "exact" and report.ok, str(report)
    assert report.exact_casts is None and report.low_precision_casts == {}
    assert str(report).split()[1] == "OK" and "rounding" not in str(report)
    assert low_precision_casts(CastLM(low=False), tokens()) == {}


def test_the_casts_mode_sees_each_sharded_op_once_under_the_simulator():
    """The mode entered inside the simulator's LocalTensorMode counts the sharded model's casts
    once per op (not once per rank) and makes them exact on every rank."""
    model, sharded, ids = CastLM().eval(), CastLM().eval(), tokens()  # made outside the simulator
    reference = low_precision_casts(model, ids, backward=False)
    with _simulate.simulated_mesh(2) as mesh:
        apply_plan(sharded, mesh, mlp_plan())
        with LowPrecisionCasts(torch.float32) as casts:
            logits = sharded(*ids)
        dtypes = {t.dtype for t in _simulate.per_rank(logits, 2)}
    assert dict(casts.counts) == reference == {"bfloat16": 12}
    assert dtypes == {torch.float32}
    with LowPrecisionCasts(torch.float32):
        expected = model(*ids)
    for value in _simulate.per_rank(logits.detach(), 2):
        assert (value - expected).abs().max() < 1e-5


class NoDoubleMatmul(CastLM):
    """CastLM whose bf16 matmuls have no float64 kernel, as ``torch._grouped_mm``."""

    def forward(self, ids):
        if self.embed.weight.dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        return super().forward(ids)


def test_a_model_that_cannot_run_in_float64_is_decided_in_float32():
    """Would catch verify raising when the float64 re-run's unsharded model cannot run in float64
    (torchtitan's grouped experts): the float32 run with the casts exact decides, and says so."""
    report = verify(NoDoubleMatmul(), mlp_plan(), tp_size=2, inputs=tokens(), tolerance=1e-8)
    assert report.verdict == "mismatch", str(report)  # 1e-8 is below fp32 rounding: no float64 to settle it
    assert report.exact_casts.float64_skipped.startswith("RuntimeError: Expected mat_a"), str(report)
    assert "no float64 re-run of it" in str(report)
