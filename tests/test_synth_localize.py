"""The localize pass alone: candidates, per-rank cuts, and the confirmation by re-running a module."""

import types

import torch
import torch.nn.functional as F
from torch import nn

from autotp.synth.localize import candidate_names, find_names, local_ranges
from autotp.synth.roles import Role

PACKED = {"qkv": Role("packed_column", "", sizes=(32, 16, 16)), "out": Role("row", "")}
INPUTS = ((torch.empty(2, 5, 32, device="meta"),), {})


class FusedAttention(nn.Module):
    """q | k | v cut with sizes from ``config.heads`` and ``kv_heads``, as Phi3 does."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(heads=4, hidden=32, layers=2)
        self.kv_heads, self.head_dim, self.unused = 2, 8, 2
        self.qkv, self.out = nn.Linear(32, 64), nn.Linear(32, 32)

    def forward(self, x):
        b, t, _ = x.shape
        q_end = self.config.heads * self.head_dim
        qkv = self.qkv(x)
        q, k, v = qkv[..., :q_end], qkv[..., q_end:q_end + self.kv_heads * self.head_dim], qkv[..., q_end + self.kv_heads * self.head_dim:]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


def test_candidates_are_int_attributes_equal_to_part_numbers_module_first():
    names = candidate_names(FusedAttention(), {32, 16, 4, 2})
    assert names == ["kv_heads", "unused", "config.heads", "config.hidden", "config.layers"]


def test_smallest_confirmed_set_is_found():
    """Would catch a search that stops at a set giving the right cuts for the wrong reason, or
    that divides attributes the slicing does not read."""
    module = FusedAttention()
    candidates = candidate_names(module, {32, 16, 4, 2})
    assert find_names(module, INPUTS, PACKED, {"qkv": (32, 16, 16)}, candidates, 2) == ("kv_heads", "config.heads")


def test_no_candidate_set_gives_none():
    module = FusedAttention()
    assert find_names(module, INPUTS, PACKED, {"qkv": (32, 16, 16)}, ["unused", "config.layers"], 2) is None


def test_local_ranges_tile_the_per_rank_width():
    assert sorted(local_ranges((32, 16, 16), 4)) == [(0, 8), (8, 12), (12, 16)]


class _CountedHeads(nn.Module):
    """``view(b, t, self.n_head, -1)``: per-rank shapes right only with ``n_head`` divided by tp."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.n_head = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _CountedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_CountedHeads() for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def test_shape_proof_keeps_whole_what_a_failed_fake_forward_never_reached(monkeypatch):
    """The per-rank shapes of a module are proven on the inputs one fake forward gives it. Where that
    forward stopped before the module (an op fake tensors reject), nothing is proven: its Linears
    stay whole, with the reason (they were sharded with the global head count, a crash at best)."""
    from autotp.synth import explain, shape_proof, synthesize
    from autotp.synth.local_run import Captured

    ids = torch.randint(0, 64, (2, 8))
    torch.manual_seed(0)
    model = _CountedModel()
    plan = synthesize(model, example_inputs=(ids,), tp_size=2, verify=False)
    assert "layers.*.q" in plan and any("n_head" in repr(s) for s in plan.values()), plan

    def stopped(*args, **kwargs):
        captured = Captured()
        captured.failed = "RuntimeError: no fake kernel"
        return captured

    monkeypatch.setattr(shape_proof, "capture_inputs", stopped)
    plan = synthesize(model, example_inputs=(ids,), tp_size=2, verify=False)
    assert "layers.*.q" not in plan, plan
    reasons = {r.key: r.reason for r in explain(model, example_inputs=(ids,), tp_size=2)}
    assert "stopped before it (RuntimeError: no fake kernel)" in reasons["layers.*.q"], reasons["layers.*.q"]


def test_shared_traces_export_a_module_once_per_roles_and_call():
    """Inside ``shared_traces`` (a selection: synthesis, then the checker over each source) an
    export of a module alone is made once for equal roles (their reasons aside) and an equal call,
    and again for other roles, another tp or other input shapes; outside it, every call exports."""
    from autotp.synth.local_run import shared_traces, trace_local

    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    call = ((torch.empty(2, 3, 8, device="meta"),), {})
    roles = {"0": Role("column", "from the synthesizer"), "2": Role("row", "from the synthesizer")}
    said_otherwise = {name: Role(role.kind, "read from a plan") for name, role in roles.items()}
    with shared_traces():
        first = trace_local(module, call, roles, (), 2)
        assert first is not None and trace_local(module, call, said_otherwise, (), 2) is first
        assert trace_local(module, call, roles, (), 1) is not first
        assert trace_local(module, call, {"0": roles["0"]}, (), 2) is not first
        other = ((torch.empty(2, 5, 8, device="meta"),), {})
        assert tuple(trace_local(module, other, roles, (), 2).nodes["linear"]["shape"]) == (2, 5, 8)
    assert trace_local(module, call, roles, (), 2) is not first
