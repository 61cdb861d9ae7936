"""Cases the coverage sweep caught, each on the transformers model that showed it (tiny, random).

Every plan is verified on simulated ranks against the unsharded model (logits and every gradient,
1e-5 relative above 1).
"""

import warnings

import pytest

from autotp.models import build_model, load_config, shrink_config
from autotp.synth import explain, synthesize
from autotp.verifier import verify


def _tiny(name: str, tp: int):
    config = shrink_config(load_config(name), tp=tp)
    config.use_cache = False
    return build_model(config, device="cpu").eval()


@pytest.mark.parametrize("tp", [2, 4])
def test_head_front_after_a_norm_standing_for_every_layer_is_not_taken(tp):
    """ELECTRA's causal LM: the last layer's output norm feeds the head's dense + norm before the
    tied output Linear (a whole front), but that traced layer stands for every layer, whose norms
    feed whole attention. Taking the front gave every layer's norm a partial gradient reduction:
    the token-type table's gradient came out tp times too large (0.30 off at tp 2, silently)."""
    model = _tiny("electra", tp)
    plan = synthesize(model, tp_size=tp, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp)
    assert report.ok, str(report)


def test_table_that_is_not_an_embedding_weight_is_cut_with_the_heads():
    """CPM-Ant's segment-position module looks up its own ``relative_attention_bias`` (no
    ``weight``, one column per head) by ids made from the input: the vocab-parallel style cannot
    take it (it failed to apply when it was given one). Looked up per head, the table is a per-head
    parameter: cut on its columns with the heads (``HeadParams``), and the plan verifies."""
    model = _tiny("cpmant", 2)
    records = {r.key: r for r in explain(model, tp_size=2)}
    assert records["cpmant.position_bias"].role == "head_params"
    assert "relative_attention_bias sharded with the heads" in records["cpmant.position_bias"].reason
    plan = synthesize(model, tp_size=2, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=2)
    assert report.ok, str(report)
