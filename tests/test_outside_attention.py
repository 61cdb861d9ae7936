"""Attention idioms of plain-PyTorch model libraries are sharded by heads at the bound (issue 42,
item 3), or kept whole with a warning naming the module and the reason.

The models are in ``outside_attention_models.py``: each a two-layer decoder whose attention uses
one idiom (``F.scaled_dot_product_attention``, grouped-query attention, a per-head output scale,
learned memory keys / values, a relative position bias table shared by every layer, scores carried
from layer to layer, talking heads, a value residual). Each synthesized plan must verify against
the unsharded model (logits and every gradient) and hold, per rank, the parameter fraction of a
plan at the bound: every parameter cut ``1/tp`` but the norms' weights (computed from the model's
parameters, :func:`outside_attention_models.bound_fraction`). A plan that computes something else
fails the first check; one that silently leaves the attention whole (0.46-0.53 of the parameters per
rank at tp 4 before) fails the second.
"""

from __future__ import annotations

import warnings

import pytest
from torch.distributed.tensor import Replicate, Shard
from outside_attention_models import IDIOMS, bound_fraction, tokens

import autotp
from autotp.errors import WholeAttentionWarning
from autotp.synth.trace import trace


def _sharded_at_the_bound(idiom: str, tp: int, sequence_parallel: bool, whole: tuple[str, ...] = ()):
    model = IDIOMS[idiom]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autotp.synthesize(model, example_inputs=(tokens(),), tp_size=tp, sequence_parallel=sequence_parallel)
        report = autotp.verify(model, plan, tp_size=tp, inputs=(tokens(),))
    assert report.ok, str(report)
    assert not [w for w in caught if issubclass(w.category, WholeAttentionWarning)], [str(w.message) for w in caught]
    bound = bound_fraction(model, tp, whole)
    assert max(report.param_fraction) <= bound + 1e-3, (report.param_fraction, bound, plan)
    return model, plan, report


MODES = dict(argnames=("tp", "sequence_parallel"), argvalues=[(2, True), (2, False), (4, True), (4, False)],
             ids=["tp2-sp", "tp2", "tp4-sp", "tp4"])


# Idioms the per-rank analysis already followed before issue 42 (heads split by view / transpose):
# one test over them, its base case (sdpa, tp 2, SP) in the default tier.
@pytest.mark.parametrize(**MODES)
@pytest.mark.parametrize("idiom", ["sdpa", "gqa", "gqa_expand", "head_scale", "memory_kv"])
def test_per_head_idioms_are_sharded_at_the_bound(idiom, tp, sequence_parallel):
    """Would catch sdpa, grouped-query kv (``repeat_interleave`` / ``expand``), a per-head scale
    ``(1, heads, 1, 1)`` or memory keys / values ``(heads, m, d)`` keeping the attention whole."""
    _, plan, _ = _sharded_at_the_bound(idiom, tp, sequence_parallel)
    assert "layers.*.attn.to_q" in plan, plan


@pytest.mark.parametrize(**MODES)
def test_scores_carried_to_the_next_layer_stay_head_sharded(tp, sequence_parallel):
    """Residual attention: layer 1 adds layer 0's pre-softmax scores ``(b, h, n, n)``. Both layers
    are traced (they are called differently), the scores handed on are each rank's heads, and the
    shape proof runs layer 1 with its share of them; before, the attention was kept whole."""
    _, plan, _ = _sharded_at_the_bound("residual_attn", tp, sequence_parallel)
    assert "layers.*.attn.to_q" in plan or "layers.1.attn.to_q" in plan, plan


@pytest.mark.parametrize(**MODES)
def test_first_layers_values_mixed_into_later_layers_stay_head_sharded(tp, sequence_parallel):
    """Value residual: the later layer's per-head mix ``Linear(dim, heads)`` is a column whose
    features are the heads, and the first layer's values it mixes in are each rank's heads. Before,
    the later layer's code was never traced and its plan crashed ("got mixed torch.Tensor and
    DTensor")."""
    _, plan, _ = _sharded_at_the_bound("value_residual", tp, sequence_parallel)
    assert "layers.1.attn.to_value_residual_mix" in plan, plan


@pytest.mark.parametrize(**MODES)
def test_memory_tokens_prepended_to_the_sequence_keep_sequence_parallel(tp, sequence_parallel):
    """Learned memory tokens ``(m, dim)`` prepended before the first block and cut off before the
    head: the blocks see ``n + m`` positions. Under SP the stream is still sliced on the sequence
    where it enters the blocks (after the prepend), the rows reduce-scatter onto it and the head
    reads it sequence-sharded; the tokens themselves (``m x dim``) stay whole. Would catch an SP
    request that silently gives a plain plan (issue 42: three such cases before)."""
    _, plan, _ = _sharded_at_the_bound("memory_tokens", tp, sequence_parallel, whole=("memory_tokens",))
    row = plan["layers.*.attn.to_out"]
    assert row.output_layouts == ((Shard(1),) if sequence_parallel else (Replicate(),)), row
    assert ("layers.*" in plan) == sequence_parallel, plan  # the stream sliced where it enters the blocks


def test_layers_called_with_different_arguments_are_traced_apart():
    """Layers of one structure, the first called with ``prev_attn=None`` and the second with
    scores: each runs code the other does not, so both are traced."""
    _, groups = trace(IDIOMS["residual_attn"](), (tokens(),))
    assert groups.groups["layers"] == [[0], [1]], groups
    _, groups = trace(IDIOMS["sdpa"](), (tokens(),))
    assert groups.groups["layers"] == [[0, 1]], groups


@pytest.mark.parametrize(**MODES)
@pytest.mark.parametrize("idiom", ["called_rel_bias", "shared_rel_bias", "sdpa_rel_bias"])
def test_relative_bias_table_shared_by_every_layer_is_cut_by_heads(idiom, tp, sequence_parallel):
    """T5's bucketed bias, ``Embedding(buckets, heads)`` held once by the model and its ``(heads,
    i, j)`` output handed to every layer: the table is cut on its columns (the heads), each rank
    looks up its own heads' biases and adds them to its own heads' scores, and its rows' gradients
    are each rank's own. Before, a value with a gradient entering the layers kept them whole.
    ``called_rel_bias``: the module itself is handed to every attention, which calls it (the shape
    proof calls a per-rank copy of it); before, that plan crashed when run. ``sdpa_rel_bias``: the
    bias masked and handed to sdpa as its float mask; before, the attention was kept whole."""
    _, plan, _ = _sharded_at_the_bound(idiom, tp, sequence_parallel)
    style = plan["rel_pos.relative_attention_bias"]
    assert type(style).__name__ == "HeadParams" and style.shard_dims == {"weight": 1}, style


@pytest.mark.parametrize(**MODES)
def test_talking_heads_are_gathered_once_around_each_mixer(tp, sequence_parallel):
    """Talking heads: ``Conv2d(heads, heads, 1)`` before and after the softmax. Each mixer's input
    is all-gathered on the heads, it runs whole and each rank keeps its heads of its output; the
    q / k / v / out projections stay sharded by heads. The bound keeps the two small mixers whole."""
    model, plan, _ = _sharded_at_the_bound("talking_heads", tp, sequence_parallel, whole=("talking_heads.weight",))
    for mixer in ("pre_softmax_talking_heads", "post_softmax_talking_heads"):
        style = plan[f"layers.*.attn.{mixer}"]
        assert type(style).__name__ == "PrepareModuleInputOutput", style
    if tp == 4 and not sequence_parallel:  # explain says how (one more synthesis: slow tier only)
        records = {r.key: r for r in autotp.explain(model, example_inputs=(tokens(),), tp_size=tp)}
        assert "all-gathered on the heads" in records["layers.*.attn.pre_softmax_talking_heads"].reason


def test_tiled_kv_heads_keep_the_attention_whole_with_a_warning():
    """kv heads tiled by ``repeat`` (query head h reads kv head h % kv): a rank's block of query
    heads reads kv heads every rank holds a share of. The attention stays whole (default-deny; its exactness:
    test_plain_idioms), and the plan says so with a warning naming the module and the reason
    (before: silently)."""
    model = IDIOMS["gqa_tile"]()
    with pytest.warns(WholeAttentionWarning, match=r"layers\.\*\.attn: attention kept whole") as caught:
        plan = autotp.synthesize(model, example_inputs=(tokens(),), tp_size=2)
    assert "layers.*.attn.to_q" not in plan, plan
    messages = [str(w.message) for w in caught if issubclass(w.category, WholeAttentionWarning)]
    assert len(messages) == 1 and "matmul" in messages[0], messages  # the op where the tiled heads broke
