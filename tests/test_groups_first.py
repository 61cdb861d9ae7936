"""A fused q / k / v viewed groups first, with fewer kv groups than ranks: each rank a share of one group.

One Linear makes ``G`` groups side by side, each ``[its q_per_kv query heads | k | v]``, viewed as
``(b, t, G, q_per_kv + 2, hd)``, permuted and cut by ``split((q_per_kv, 1, 1))``; k and v are
expanded to the query heads. With ``tp`` a multiple of ``G`` rank r holds group ``r * G // tp``'s k
and v whole (a copy shared by ``tp / G`` ranks) and its share of that group's query heads
(:mod:`autotp.synth.groups_first`); the copies' gradients are summed. ``G = 1`` is multi-query
attention. Checked against the unsharded model on the logits and every gradient, at tp 2 and 4,
plain and sequence parallel, with about 1/tp of the parameters per rank.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.styles import GroupCopies
from autotp.synth import explain, synthesize
from autotp.styles.group_copies import copy_index
from autotp.verifier import verify
from synth_toy import DIM, example_tokens
from test_ssm_mixer import SSMStack

HEADS, HEAD_DIM = 8, 8


class GroupsFirstAttention(nn.Module):
    """``qkv`` viewed ``(b, t, groups, q_per_kv + 2, hd)`` -> q, k, v per group -> k, v expanded
    to the query heads -> attention -> ``proj``."""

    def __init__(self, groups: int):
        super().__init__()
        self.n_head, self.n_query_groups = HEADS, groups
        self.qkv = nn.Linear(DIM, (HEADS + 2 * groups) * HEAD_DIM)
        self.proj = nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q_per_kv = self.n_head // self.n_query_groups
        qkv = self.qkv(x).view(b, t, self.n_query_groups, q_per_kv + 2, HEAD_DIM).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)
        k = k.expand(b, self.n_query_groups, q_per_kv, t, HEAD_DIM)
        v = v.expand(b, self.n_query_groups, q_per_kv, t, HEAD_DIM)
        q, k, v = (z.reshape(b, -1, t, HEAD_DIM) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class KeysMixedAcrossGroups(GroupsFirstAttention):
    """Also adds each position's mean over every group's k: a rank holding one group's k could
    not compute it, so the projection must stay whole (and the plan exact)."""

    def forward(self, x):
        b, t, _ = x.shape
        q_per_kv = self.n_head // self.n_query_groups
        groups = self.qkv(x).view(b, t, self.n_query_groups, q_per_kv + 2, HEAD_DIM)
        k = groups.permute(0, 2, 3, 1, 4).split((q_per_kv, 1, 1), dim=2)[1]
        return super().forward(x) + k.mean(dim=(1, 2, 4)).unsqueeze(-1)


def _model(groups: int, mixer=GroupsFirstAttention):
    torch.manual_seed(0)
    return SSMStack(mixer=lambda: mixer(groups))


def _bound(model, tp: int) -> float:
    """The Megatron-style fraction: every Linear weight and the token table sharded, the rest whole."""
    sharded = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    total = sum(p.numel() for p in model.parameters())
    return (sharded / tp + total - sharded) / total


def _verified(model, tp, sequence_parallel):
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-4 and report.worst_grad[1] <= 1e-4, str(report)
    return plan, report


MODES = [pytest.param(False, id="plain"), pytest.param(True, id="sp")]


@pytest.mark.parametrize("sequence_parallel", MODES)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("groups", [1, 2])
def test_groups_first_fused_qkv_shards_each_group(groups, tp, sequence_parallel):
    """Would catch: the projection kept whole (0.68 of the parameters per rank at tp 2, 0.52 at
    tp 4, over the bound + 0.1), each group read as a kv head (was a wrong plan at G=2, tp=4: the
    group's query heads held by two ranks), a k / v head cut over ranks, the copies' weight or bias
    gradients left as per-rank shares, or the group and head counts left global. With as many
    groups as ranks (G = tp = 2) each rank holds one group whole, no copies."""
    model = _model(groups)
    plan, report = _verified(model, tp, sequence_parallel)
    assert isinstance(plan["layers.*.mixer.qkv"], GroupCopies) == (groups < tp), plan
    assert max(report.param_fraction) <= _bound(model, tp) + 0.1, (report.param_fraction, _bound(model, tp))


def test_copy_index_gives_each_rank_a_share_of_its_group():
    """Two groups ``[q0 q1 | k | v]`` of one row each over four ranks: rank r holds query row r % 2
    of group r // 2, then that group's k and v."""
    pieces = ((2, 1), (1, 0), (1, 0))
    assert copy_index(8, ((0, 8, 2, pieces),), 4).tolist() == [0, 2, 3, 1, 2, 3, 4, 6, 7, 5, 6, 7]


@pytest.mark.parametrize("groups", [1, 2])
def test_keys_read_across_groups_keep_the_projection_whole(groups):
    """Default-deny: a mean over every group's k cannot be made local to one group's ranks; the
    projection stays whole and the plan exact. Would catch a copy per rank read as if it were all
    the groups."""
    model = _model(groups, KeysMixedAcrossGroups)
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=4)}
    assert records["layers.*.mixer.qkv"].style == "replicated", records["layers.*.mixer.qkv"]
    _verified(model, 4, False)
