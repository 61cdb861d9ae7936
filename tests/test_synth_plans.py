"""Synthesized plans equal the handwritten ones, module by module, style class and every option."""

import re
import time
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from autotp import styles
from autotp.errors import MeshError, TraceError
from autotp.plan import plan_diff
from autotp.synth import explain, synthesize
from handwritten_plans import plan_for
from autotp.verifier import verify
from synth_models import shardable_model, tiny_model
from synth_toy import NanoGPT, TitanLlama, example_tokens


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_synthesized_plan_equals_handwritten(family, sequence_parallel):
    """Would catch any missing module, wrong style class or layout option against the lead's plans.

    Phi3 included: its ``ShardCounts(names=("num_key_value_heads", "config.num_attention_heads"))``
    is found from the graph and a re-run of the attention, not from the names.
    """
    model = tiny_model(family)
    plan = synthesize(model, sequence_parallel=sequence_parallel, verify=False)
    assert plan_diff(model, plan, plan_for(model, sequence_parallel=sequence_parallel)) == {}


def _layer_keys(diff: dict) -> set[str]:
    return {re.sub(r"\.\d+\.", ".*.", fqn) for fqn in diff}


@pytest.mark.parametrize("name,prefix", [("gemma3", "model"), ("gemma3-vlm", "model.language_model")])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gemma3_differs_from_handwritten_only_where_designed(name, prefix, sequence_parallel):
    """Gemma3 (both classes) differs from the handwritten (NeMo) plan on purpose, nowhere else.

    - Tied embedding and head: NeMo keeps both replicated; synthesis shards both on the vocabulary
      (both users shard the tied weight on dim 0, so the tie holds): 1/tp of the largest matrix.
    The pre-norms agree: both gather once per branch under SP and hand q/k/v and gate/up one
    replicated DTensor. Both plans are verified exact in
    ``test_gemma3_both_plans_exact_and_synthesized_shards_more``.
    """
    model = shardable_model(name)
    plan = synthesize(model, sequence_parallel=sequence_parallel, verify=False)
    diff = plan_diff(model, plan, plan_for(model, sequence_parallel=sequence_parallel))
    assert _layer_keys(diff) == {"lm_head", f"{prefix}.embed_tokens"}


def test_gemma3_both_plans_exact_and_synthesized_shards_more():
    model = shardable_model("gemma3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        synthesized = verify(model, synthesize(model, sequence_parallel=True, verify=False), tp_size=2)
        handwritten = verify(model, plan_for(model, sequence_parallel=True), tp_size=2)
    assert synthesized.ok and handwritten.ok
    # The synthesized plan's vocab-parallel embedding adds one reduce-scatter; gathers are equal.
    assert synthesized.collectives["all_gather_into_tensor"] == handwritten.collectives["all_gather_into_tensor"] == 5
    assert synthesized.param_fraction[0] < handwritten.param_fraction[0]


def test_phi3_fused_projections_are_packed_with_gqa_sizes():
    plan = synthesize(tiny_model("phi3"), verify=False)
    assert plan["model.layers.*.self_attn.qkv_proj"].sizes == (64, 32, 32)
    assert plan["model.layers.*.self_attn"].names == ("num_key_value_heads", "config.num_attention_heads")


def test_gemma3_shards_tied_embedding_and_head_together_and_gathers_prenorms():
    """Tied weights are sharded when both users shard the same weight dim (vocab); post-norms sit
    before the residual add so they stay plain SequenceParallel; pre-norms gather once and hand their
    column projections one DTensor (their input gradients reduce-scattered once)."""
    model = tiny_model("gemma3")
    plan = synthesize(model, sequence_parallel=True, verify=False)
    layer = "model.layers.*"
    expected = {
        "model.embed_tokens": styles.VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=Shard(1),
                                                            use_local_output=False),
        "model.rotary_emb": styles.RotaryEmbedParallel(),
        **{f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        **{f"{layer}.self_attn.{n}": styles.ReplicatedWithGradAllReduce() for n in ("q_norm", "k_norm")},
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        f"{layer}.input_layernorm": styles.Boundary(outputs="gather", local_outputs=False, style=SequenceParallel()),
        f"{layer}.pre_feedforward_layernorm": styles.Boundary(outputs="gather", local_outputs=False,
                                                             style=SequenceParallel()),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        f"{layer}.post_feedforward_layernorm": SequenceParallel(),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    assert plan_diff(model, plan, expected) == {}


def test_olmo2_width_norm_keeps_attention_sharded():
    """q_norm normalises the full projected width: kept exact by WidthShardedNorm, not replicated."""
    plan = synthesize(tiny_model("olmo2"), verify=False)
    assert isinstance(plan["model.layers.*.self_attn.q_norm"], styles.WidthShardedNorm)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_experts_sharded_on_ffn_dim_router_replicated(family):
    model = tiny_model(family)
    plan = synthesize(model, verify=False)
    experts = plan["model.layers.*.mlp.experts"]
    assert (experts.shard_dims, experts.packed) == ({"gate_up_proj": 1, "down_proj": 2}, {"gate_up_proj": 2})
    # kept whole; its backward runs on the experts' partial gradients (one reduction per block)
    assert type(plan["model.layers.*.mlp.gate"]).__name__ == "PartialGradRouter"
    reasons = {r.key: r.reason for r in explain(model)}
    assert "softmax" in reasons["model.layers.*.mlp.gate"]


def test_loss_parallel_off_gathers_the_logits():
    plan = synthesize(tiny_model("llama"), loss_parallel=False, verify=False)
    assert plan["lm_head"].output_layouts == (Replicate(),)
    assert plan["lm_head"].use_local_output


def test_torchtitan_names_get_the_llama_plan():
    plan = synthesize(TitanLlama(), example_inputs=(example_tokens(),), verify=False)
    kinds = {k: type(v).__name__ + (f"({v.outputs})" if isinstance(v, styles.Boundary) else "") for k, v in plan.items()}
    assert kinds == {
        "tok_embeddings": "VocabParallelEmbedding", "output": "ColwiseParallel",
        **{f"layers.*.attention.{w}": "ColwiseParallel" for w in ("wq", "wk", "wv")},
        "layers.*.attention.wo": "RowwiseParallel",
        "layers.*.feed_forward.w1": "ColwiseParallel", "layers.*.feed_forward.w3": "ColwiseParallel",
        "layers.*.feed_forward.w2": "RowwiseParallel",
        # the pre-norms hand each branch's column projections one replicated DTensor
        "layers.*.attention_norm": "Boundary(replicate)", "layers.*.ffn_norm": "Boundary(replicate)",
    }


def test_nanogpt_fused_c_attn_packed_and_tied_head_vocab_sharded():
    plan = synthesize(NanoGPT(), example_inputs=(example_tokens(),), verify=False)
    assert plan["h.*.attn.c_attn"].sizes == (64, 64, 64)
    # n_embd alone also gives per-rank cuts (4 heads of size 8 instead of 2 of 16): the shape
    # check of the re-traced attention rejects it.
    assert plan["h.*.attn"].names == ("n_embd", "n_head")
    assert isinstance(plan["wte"], styles.VocabParallelEmbedding)
    assert plan["lm_head"].output_layouts == (Shard(-1),)
    assert "wpe" not in plan  # looked up by positions computed in the model


class _SoftmaxFeedForward(TitanLlama().layers[0].feed_forward.__class__):
    """A feed-forward whose softmax over the hidden features forbids sharding them."""

    def forward(self, x):
        return self.w2(torch.softmax(self.w1(x), dim=-1) * self.w3(x))


def test_layers_that_differ_get_per_layer_keys():
    """Would catch one layer's plan silently applied to a structurally different layer."""
    model = TitanLlama(layers=3)
    odd = _SoftmaxFeedForward()
    odd.load_state_dict(model.layers[1].feed_forward.state_dict())
    model.layers[1].feed_forward = odd
    plan = synthesize(model, example_inputs=(example_tokens(),), verify=False)
    assert "layers.*.attention.wq" in plan
    assert {"layers.0.feed_forward.w1", "layers.2.feed_forward.w1"} <= set(plan)
    assert not any(key.startswith("layers.1.feed_forward") for key in plan)
    assert "layers.*.feed_forward.w1" not in plan


def test_explain_gives_graph_evidence_from_producer_to_consumer():
    records = {r.key: r for r in explain(tiny_model("llama"))}
    k = records["model.layers.*.self_attn.k_proj"]
    assert k.role == "column"
    assert k.evidence[0].endswith("k_proj") and k.evidence[-1].endswith("o_proj")
    assert "scaled_dot_product_attention" in k.evidence
    assert "k_proj" in str(k)


def test_indivisible_heads_raise_mesh_error_naming_module():
    with pytest.raises(MeshError, match=r"self_attn\.q_proj: .*size 4.*tp=8 does not divide; use tp in \(1, 2, 4\)"):
        synthesize(tiny_model("llama", num_key_value_heads=4, num_attention_heads=4), tp_size=8, verify=False)


def test_model_without_config_or_inputs_raises_trace_error():
    with pytest.raises(TraceError, match="example_inputs"):
        synthesize(TitanLlama(), verify=False)


def test_real_size_configs_synthesize_on_meta_flat_in_depth():
    """70B-shaped Llama on meta: 80 layers cost about what 2 do (one block per layer type is
    traced). Would catch synthesis tracing every layer. CPU time of this process, so that other
    work on the machine does not count; the absolute speed is `benchmarks/bench_synthesis.py`'s."""
    shape = dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
                 vocab_size=128256)
    synthesize(tiny_model("llama", **shape), verify=False)  # warm-up: the first export pays one-off costs
    times = {}
    for layers in (2, 80):
        model = tiny_model("llama", num_hidden_layers=layers, **shape)
        start = time.process_time()
        plan = synthesize(model, tp_size=8, verify=False)
        times[layers] = time.process_time() - start
        assert len(plan) == 11  # 7 Linears, embedding, head, 2 pre-norms
    assert times[80] < 2 * times[2] + 0.5, times
