"""Entries of a list that each layer indexes by its own position are planned like the traced one.

Layers of one structure are traced once. A layer that picks one entry of a list by its index
(Zamba2's shared block holds one low-rank adapter per hybrid layer and runs
``adapters[layer_idx]``) runs only its own entry in the trace; the other layers run theirs the
same way. Planned only where traced, those entries stayed whole and added a full-width output to a
column-sharded one: the plan failed on the shapes in every layer but the traced one.

The toy is plain PyTorch, named after nothing. Checks verify the logits and every gradient against
the unsharded model (1e-5).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.synth import synthesize
from synth_toy import verify_toy

VOCAB, DIM, RANK, LAYERS = 64, 32, 8, 3


class AdaptedBlock(nn.Module):
    """An MLP whose up projection gets a low-rank correction of its own per layer."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.norm = nn.RMSNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.adapters = nn.ModuleList(nn.Sequential(nn.Linear(DIM, RANK, bias=False),
                                                    nn.Linear(RANK, 4 * DIM, bias=False)) for _ in range(LAYERS))

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.gelu(self.up(h) + self.adapters[self.index](h)))


class AdaptedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(AdaptedBlock(i) for i in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_layers_own_adapter_is_sharded(tp):
    """Would catch the adapters the trace never ran left whole (the plan fails on the shapes in
    layers 1 and 2), or planned unlike the traced one (a gradient differs)."""
    model, ids = AdaptedModel(), torch.randint(0, VOCAB, (2, 8))
    plan = synthesize(model, example_inputs=(ids,), tp_size=tp, verify=False)
    report = verify_toy(model, plan, tp, inputs=(ids,))
    for entry in range(LAYERS):
        assert isinstance(plan[f"blocks.*.adapters.{entry}.1"], type(plan["blocks.*.up"])), plan
    # every up projection and adapter output sharded: near the bound, not whole
    assert max(report.param_fraction) < 1.2 / tp, report.param_fraction


def test_zamba2_with_two_hybrid_layers_verifies():
    """transformers' Zamba2 with two hybrid layers (the published 2.7B config has nine): the second
    runs adapter 1 of its shared block, which the trace of the first never called. Would catch the
    plan failing on the shapes there."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from coverage import _tiny_model

    model = _tiny_model("zamba2", 2, repeat=2)
    assert model.config.layers_block_type.count("hybrid") == 2
    plan = synthesize(model, tp_size=2, verify=False)
    report = verify_toy(model, plan, 2, inputs={"input_ids": torch.randint(0, model.config.vocab_size, (2, 8))})
    assert max(report.param_fraction) < 0.6, report.param_fraction
