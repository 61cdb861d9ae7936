"""The synthesizer on olmo-core's own ``Transformer`` (``ai2-olmo-core``), as shipped: its blocks in
an ``nn.ModuleDict``, a rotary module that caches its sin/cos tables in a dict on first call, norms
that cast their weight with ``type_as``, OLMo2's reordered norms with QK-norm over the full width,
Qwen3's per-head QK-norm and tied embeddings. Tiny configs (two layers), random weights.

Each model is verified against its unsharded self (logits and every gradient) at tp 2 and 4, plain
and sequence parallel, and the synthesized sequence-parallel plan is compared with olmo-core's own
``Transformer.apply_tp`` (always sequence parallel), parameter by parameter.

Skipped when olmo-core is not installed (``pip install -e .[peers]``).
"""

import copy
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

pytest.importorskip("olmo_core", reason="olmo-core is an optional test dependency (extra 'peers')")

from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.layer_norm import LayerNormType
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.nn.transformer.config import TransformerBlockType

from autotp import _simulate
from autotp.apply import apply_plan
from autotp.synth import synthesize
from autotp.verifier import verify

VOCAB = 256
COMMON = dict(d_model=64, vocab_size=VOCAB, n_layers=2)


def build(name: str):
    """A two-layer olmo-core model of ``name``'s family, built on cpu with olmo-core's init."""
    configs = {
        "llama": lambda: TransformerConfig.llama_like(**COMMON, n_heads=4),
        "qwen3": lambda: TransformerConfig.llama_like(
            **COMMON, n_heads=8, n_kv_heads=4, head_dim=8, layer_norm_name=LayerNormType.qwen_rms, qk_norm=True,
            use_head_qk_norm=True, tie_word_embeddings=True, feed_forward=FeedForwardConfig(hidden_size=128, bias=False)),
        "olmo2": lambda: TransformerConfig.llama_like(
            **COMMON, n_heads=4, block_name=TransformerBlockType.reordered_norm, qk_norm=True,
            hidden_size_multiplier=1.0, layer_norm_eps=1e-6),
    }
    torch.manual_seed(0)
    return configs[name]().build(init_device="cpu")


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def layout(model) -> dict[str, tuple]:
    out = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        out[name] = (tuple(getattr(param, "placements", (Replicate(),))), tuple(local.shape))
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", ["llama", "qwen3", "olmo2"])
def test_olmo_core_model_is_synthesized_and_verified(name, tp_size, sequence_parallel):
    """Would catch the rotary cache's fake tables from one trace breaking the next (export, or the
    shape proof's module copies), or OLMo2's full-width QK-norm sharded without its statistic reduced."""
    model = build(name)
    plan = synthesize(model, example_inputs=(tokens(),), sequence_parallel=sequence_parallel, tp_size=tp_size,
                      verify=False)
    assert any(key.startswith("blocks.") for key in plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens(),))
    assert report.ok, str(report)
    assert all(abs(f - 1 / tp_size) < 0.01 for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", ["llama", "qwen3", "olmo2"])
def test_synthesized_plan_matches_olmo_cores_apply_tp(name, tp_size):
    """Every parameter's placement and local shape after the synthesized SP plan equals olmo-core's
    own ``apply_tp``, except OLMo2's full-width QK-norm weights: olmo-core keeps them whole
    (it gathers q and k before the norm), autotp shards them with the width and all-reduces the
    norm's statistic (less memory, the same numerics: verified above)."""
    model = build(name)
    plan = synthesize(model, example_inputs=(tokens(),), sequence_parallel=True, tp_size=tp_size, verify=False)
    with _simulate.simulated_mesh(tp_size) as mesh:
        ours = copy.deepcopy(model)
        apply_plan(ours, mesh, plan)
        theirs = copy.deepcopy(model)
        theirs.apply_tp(mesh)
        ours_layout, theirs_layout = layout(ours), layout(theirs)
    differ = {n: (ours_layout[n], theirs_layout[n]) for n in ours_layout if ours_layout[n] != theirs_layout[n]}
    if name == "olmo2":
        norms = {n for n in differ if n.endswith(("q_norm.weight", "k_norm.weight"))}
        assert norms == set(differ) and len(norms) == 4
        assert all(differ[n] == (((Shard(0),), (64 // tp_size,)), ((Replicate(),), (64,))) for n in norms)
    else:
        assert differ == {}
