"""Backward communication at the forward's count: one reduction per shared input, one per parallel block.

Each test counts the collectives of one forward and of its backward (``VerifyReport.collectives`` /
``collectives_backward``) on 2 simulated ranks and checks the numerics against the unsharded model
(logits and every gradient, 1e-5). Would catch a plan whose column projections reduce their input
gradients one by one (q, k, v, gate, up: 5 all-reduces per layer where 2 suffice), or a parallel
block that reduces each branch separately.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import handwritten_plans
from autotp.models import build_model
from autotp.synth import synthesize
from autotp.verifier import verify

LAYERS = 2


def _report(model, plan, tp_size=2, inputs=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, inputs=inputs)
    assert report.ok, str(report)
    return report


def _mirrored(forward: dict[str, int]) -> dict[str, int]:
    """The backward a forward's collectives imply at the limit: an all-reduce's backward is an
    all-reduce, a reduce-scatter's an all-gather and the other way round."""
    swap = {"reduce_scatter_tensor": "all_gather_into_tensor", "all_gather_into_tensor": "reduce_scatter_tensor"}
    return {swap.get(op, op): n for op, n in forward.items() if op != "allreduce"}


@pytest.fixture(scope="module")
def models():
    return {name: build_model(name, tiny=True, tp=2, device="cpu") for name in ("llama", "qwen3", "phi3", "phi")}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("source", ["handwritten", "synthesized"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3"])
def test_branch_inputs_reduced_once(models, name, source, sequence_parallel):
    """Llama-shaped (separate q/k/v, gate/up) and fused (Phi3's qkv_proj, gate_up_proj): 2 per layer
    + 1 at the vocabulary boundary, in each direction."""
    model = models[name]
    plan = (handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel) if source == "handwritten"
            else synthesize(model, sequence_parallel=sequence_parallel, tp_size=2))
    report = _report(model, plan)
    per_direction = 2 * LAYERS + 1
    if sequence_parallel:
        assert report.collectives == {"all_gather_into_tensor": per_direction, "reduce_scatter_tensor": per_direction}
    else:
        assert report.collectives == {"all_reduce": per_direction}
    assert report.collectives_backward == _mirrored(report.collectives)


@pytest.mark.parametrize("source", ["handwritten", "synthesized"])
def test_parallel_block_reduces_once_per_layer(models, source):
    """Phi: attention and MLP read one norm and their partial outputs are summed before one
    all-reduce per layer, forward and backward (+ 1 at the embedding / head)."""
    model = models["phi"]
    plan = handwritten_plans.plan_for(model) if source == "handwritten" else synthesize(model, tp_size=2)
    report = _report(model, plan)
    assert report.collectives == {"all_reduce": LAYERS + 1}
    assert report.collectives_backward == {"all_reduce": LAYERS + 1}


def test_parallel_block_under_sp_reduce_scatters_once_per_layer(models):
    """SP: one all-gather (the shared norm) and one reduce-scatter (the summed branches) per layer.
    In backward the reduce-scatter's gradient comes back sequence-sharded and each branch gathers
    it once (2 all-gathers per layer): the one place above the mirrored forward."""
    model = models["phi"]
    for plan in (handwritten_plans.plan_for(model, sequence_parallel=True),
                 synthesize(model, sequence_parallel=True, tp_size=2)):
        report = _report(model, plan)
        assert report.collectives == {"all_gather_into_tensor": LAYERS + 1, "reduce_scatter_tensor": LAYERS + 1}
        assert report.collectives_backward == {"all_gather_into_tensor": 2 * LAYERS + 1,
                                               "reduce_scatter_tensor": LAYERS + 1}


class _Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class _SideBySide(nn.Module):
    """A block whose two branches read one norm and are summed before the residual."""

    def __init__(self, dim, heads):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        h = self.norm(x)
        return self.attn(h) + self.down(F.gelu(self.up(h))) + x


class _Decoder(nn.Module):
    def __init__(self, vocab=128, dim=64, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_SideBySide(dim, heads) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def test_plain_pytorch_parallel_block_found_from_the_graph():
    """A parallel block written in plain PyTorch, named after nothing: the synthesizer finds the two
    rows whose outputs are added and reduces them once per layer in each direction."""
    torch.manual_seed(0)
    model = _Decoder()
    ids = torch.randint(0, 128, (2, 8))
    plan = synthesize(model, example_inputs=(ids,), tp_size=2)
    assert type(plan["blocks.*.down"]).__name__ == "PartialRowwiseParallel"
    assert type(plan["blocks.*"]).__name__ == "ReplicatedStream"
    report = _report(model, plan, inputs=(ids,))
    assert report.collectives == {"all_reduce": LAYERS + 1}
    assert report.collectives_backward == {"all_reduce": LAYERS + 1}  # + the head's input gradient
