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
