"""Synthesis on model code that writes outputs in place, builds its own lookup ids, normalises
looked-up rows inside the embedding, or cannot be traced with its layers collapsed.

Each plan is verified on simulated ranks against the unsharded model (logits and every gradient,
tolerance 1e-5 scaled by the reference's magnitude above 1).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import explain, styles
from autotp.synth import synthesize
from autotp.verifier import VerifyReport, verify
from synth_toy import DIM, VOCAB, NanoGPT, TitanBlock, TitanLlama, example_tokens, verify_toy


def _verify(model, plan, tp_size=2):
    return verify_toy(model, plan, tp_size)


class InPlaceBlock(TitanBlock):
    """Adds the attention output to the row-parallel FFN output in place (``out.add_``)."""

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        out = self.feed_forward(self.ffn_norm(x))
        out.add_(x)
        return out


class InPlaceLlama(TitanLlama):
    """Scales the looked-up embedding rows in place (``h *= sqrt(dim)``) before the blocks."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(InPlaceBlock() for _ in range(2))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        h *= DIM ** 0.5
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_outputs_written_in_place_are_handed_out_as_copies(sequence_parallel):
    """Without the copy, the in-place write on ``to_local()``'s view raises in the sharded forward."""
    model = InPlaceLlama()
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=sequence_parallel, tp_size=2,
                      verify=False)
    assert getattr(plan["tok_embeddings"], "copy_output", False)
    assert getattr(plan["layers.*.feed_forward.w2"], "copy_output", False)
    assert not getattr(plan["layers.*.attention.wo"], "copy_output", False)  # its output is only read
    _verify(model, plan)


class MaskPositions(nn.Embedding):
    """Positions looked up by ids it computes from its first input, or from a keyword it is given."""

    def forward(self, mask, position_ids=None):
        if position_ids is None:
            position_ids = torch.cumsum(mask, dim=1) - 1
        return super().forward(position_ids)


class NormedEmbedding(nn.Embedding):
    """A token table whose rows are normalised inside the module (a child norm, read twice)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.norm = nn.RMSNorm(self.embedding_dim)

    def forward(self, ids):
        return self.norm(super().forward(ids))


class SelfIndexedLlama(TitanLlama):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = NormedEmbedding(VOCAB, DIM)
        self.positions = MaskPositions(64, DIM)

    def forward(self, tokens):
        mask = torch.ones_like(tokens)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens) + tokens.clamp(max=0)  # from the input
        h = self.tok_embeddings(tokens) + self.positions(mask, position_ids=positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def test_embedding_with_keyword_ids_and_one_normalising_rows_both_shard():
    """The vocab-parallel style turns every integer input into a replicated DTensor (ids by keyword
    work), and reduces the rows at the lookup, so a table whose rows are normalised inside the
    module (a child norm reading them twice) is sharded too and the norm sees whole rows."""
    model = SelfIndexedLlama()
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert records["tok_embeddings"].role == "vocab_embedding"
    assert records["positions"].role == "vocab_embedding"
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert isinstance(plan["tok_embeddings"], styles.VocabParallelEmbedding)
    assert "layers.*.attention.wq" in plan
    _verify(model, plan)


def test_embedding_computing_its_ids_from_a_mask_verifies():
    class MaskLlama(TitanLlama):
        def __init__(self):
            super().__init__()
            self.positions = MaskPositions(64, DIM)

        def forward(self, tokens):
            h = self.tok_embeddings(tokens) + self.positions(torch.ones_like(tokens))
            for layer in self.layers:
                h = layer(h)
            return self.output(self.norm(h))

    model = MaskLlama()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert isinstance(plan["positions"], styles.VocabParallelEmbedding)
    _verify(model, plan)


class CountedNanoGPT(NanoGPT):
    """Checks its depth in forward, so it traces only whole; its attention divides widths by
    attributes, which localization must find by running the same (uncollapsed) layers."""

    def __init__(self):
        super().__init__(layers=3)

    def forward(self, idx):
        if len(self.h) != 3:
            raise ValueError("expected 3 blocks")
        return super().forward(idx)


def test_localization_runs_the_layers_the_trace_saw():
    model = CountedNanoGPT()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert isinstance(plan["h.*.attn.c_attn"], styles.Colwise)
    assert isinstance(plan["h.*.attn"], styles.ShardCounts)
    _verify(model, plan)


def test_tolerance_is_relative_above_magnitude_one():
    """fp32 rounding grows with the values: 5e-5 on a gradient that peaks at 100 is a match, on one
    that peaks at 0.5 it is not; the worst gradient is chosen relative to its own scale."""
    report = VerifyReport(tp_size=2, tolerance=1e-5, logits_max_abs_diff=[0.0, 0.0],
                          grad_max_abs_diff={"big": 5e-5, "small": 2e-6}, grad_scale={"big": 100.0, "small": 0.5})
    assert report.ok and report.worst_grad[0] == "small"
    report.grad_max_abs_diff["small"] = 5e-5
    assert not report.ok and report.worst_grad == ("small", 5e-5)
    report = VerifyReport(tp_size=2, tolerance=1e-5, logits_max_abs_diff=[3e-5, 0.0], logits_scale=2.0)
    assert not report.ok


class ScaledInputBody(nn.Module):
    """Owns an input scale applied to the residual stream, next to the layers it holds."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.input_scale = nn.Parameter(torch.full((DIM,), 1.5))
        self.layers = nn.ModuleList(TitanBlock() for _ in range(2))
        self.norm = nn.RMSNorm(DIM)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens) * self.input_scale
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class ScaledInputLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = ScaledInputBody()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))


def test_parameters_of_a_module_holding_the_layers_meet_the_sequence_sharded_stream():
    """Under SP the body's own scale multiplies the sequence-sharded stream: it becomes a replicated
    DTensor (its gradient reduced over the shards) while the layers keep their styles; making the
    body sequence parallel instead would replicate every child's parameters."""
    model = ScaledInputLM()
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=True, tp_size=2, verify=False)
    assert isinstance(plan["model"], styles.ReplicatedWithGradAllReduce) and plan["model"].dtensor
    assert "model.layers.*.attention_norm" in plan and "model.layers.*.attention.wq" in plan
    _verify(model, plan)


class BufferScaledBlock(TitanBlock):
    """A block with a buffer of its own (a constant output scale) and parameters only below it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x):
        return super().forward(x) * self.layer_scalar


class BufferScaledLlama(TitanLlama):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(BufferScaledBlock() for _ in range(2))


def test_a_block_owning_only_a_buffer_is_not_taken_for_a_rotary_table():
    """Rotary modules are buffers-only subtrees; a decoder block holding a scale buffer (its
    parameters are in its children) must keep the sequence-sharded stream, not be made local."""
    model = BufferScaledLlama()
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=True, tp_size=2, verify=False)
    assert not any(isinstance(s, styles.RotaryEmbedParallel) for s in plan.values())
    _verify(model, plan)


class AddmmLinear(nn.Module):
    """transformers' ``Conv1D``: a weight stored (in, out), applied with ``addmm``."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class AddmmBlock(nn.Module):
    """A pre-norm block whose projections store their weights ``(in, out)``; with ``mixed`` the
    up-projection's features are mixed (a cumulative sum), so nothing in it can be sharded."""

    def __init__(self, mixed: bool = False):
        super().__init__()
        self.mixed = mixed
        self.ln = nn.LayerNorm(DIM)
        self.up, self.down = AddmmLinear(DIM, 4 * DIM), AddmmLinear(4 * DIM, DIM)

    def forward(self, x):
        h = self.up(self.ln(x))
        h = torch.cumsum(h, dim=-1) if self.mixed else h
        return [x + self.down(torch.relu(h))]  # a list, as some HF blocks return


class FusedAddmmAttention(nn.Module):
    """GPT-2's attention: one ``(in, out)`` product for q, k and v, split by an attribute."""

    def __init__(self):
        super().__init__()
        self.split_size, self.heads = DIM, 4
        self.c_attn, self.c_proj = AddmmLinear(DIM, 3 * DIM), AddmmLinear(DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = (z.view(b, t, -1, DIM // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class AddmmAttentionBlock(AddmmBlock):
    def __init__(self):
        super().__init__()
        self.ln_attn, self.attn = nn.LayerNorm(DIM), FusedAddmmAttention()

    def forward(self, x):
        return super().forward(x + self.attn(self.ln_attn(x)))


class AddmmLM(TitanLlama):
    def __init__(self, block=lambda: AddmmBlock(mixed=True)):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(2))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)[0]
        return self.output(self.norm(h))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_weights_stored_in_out_are_sharded_on_their_own_dims(sequence_parallel):
    """transformers' Conv1D layout (``addmm(b, x, W)``, W of shape (in, out)): the column products
    shard W on dim 1 (the fused one part by part, with its split attribute divided), the rows on
    dim 0; two all-reduces per block, as with nn.Linear."""
    model = AddmmLM(block=AddmmAttentionBlock)
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=sequence_parallel, tp_size=2,
                      verify=False)
    assert plan["layers.*.attn.c_attn"].sizes == (DIM, DIM, DIM)
    assert plan["layers.*.attn.c_attn"].weight_in_out
    assert plan["layers.*.up"].weight_in_out and plan["layers.*.up"].sizes is None
    assert isinstance(plan["layers.*.down"], styles.Rowwise) and plan["layers.*.down"].weight_in_out
    assert plan["layers.*.attn"].names == ("split_size",)
    report = _verify(model, plan)
    if not sequence_parallel:
        assert report.collectives == {"all_reduce": 2 * 2 + 1}
    assert report.param_fraction[0] < 0.6


def test_whole_blocks_under_sequence_parallel_gather_once_and_slice_back():
    """Blocks whose matmuls stay whole read the sequence-sharded stream: each gathers its input once
    and slices its output back to the shard; their weight products are never taken for norms."""
    model = AddmmLM()
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=True, tp_size=2, verify=False)
    block = plan["layers.*"]
    assert isinstance(block, styles.Boundary) and block.inputs == "gather" and block.outputs == "shard"
    assert not any(key.startswith("layers.*.") for key in plan)
    _verify(model, plan)


def test_gpt2_conv1d_layers_are_sharded_and_verify():
    """The same on transformers' own GPT-2 (Conv1D everywhere, a fused ``c_attn`` split by
    ``split_size``): every projection sharded, the attention's split attribute divided."""
    from autotp.models import build_model, load_config, shrink_config

    model = build_model(shrink_config(load_config("gpt2"), tp=2), device="cpu")
    plan = synthesize(model, tp_size=2, verify=False)
    assert isinstance(plan["transformer.h.*.attn.c_attn"], styles.Colwise) and plan["transformer.h.*.attn.c_attn"].weight_in_out
    assert len(plan["transformer.h.*.attn.c_attn"].sizes) == 3
    assert isinstance(plan["transformer.h.*.mlp.c_proj"], styles.Rowwise) and plan["transformer.h.*.mlp.c_proj"].weight_in_out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=2)
    assert report.ok, str(report)
    assert report.collectives == {"all_reduce": 2 * model.config.n_layer + 1}


class StatefulBlock(TitanBlock):
    """Saves its output as module state in forward, as recurrent blocks keep their last state."""

    def forward(self, x):
        out = super().forward(x)
        self.last_state = out.detach()
        return out


class StatefulLlama(TitanLlama):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(StatefulBlock() for _ in range(2))


def test_synthesis_leaves_no_fake_tensor_in_module_state():
    """Tracing runs the blocks on fake tensors; state they save must not stay behind in the user's
    model (a fake tensor there corrupted later runs under simulated ranks). Would catch synthesis
    that returns with ``last_state`` holding a FakeTensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    model = StatefulLlama()
    model(example_tokens())  # a real state before synthesis: kept as it was
    real = model.layers[0].last_state
    synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert model.layers[0].last_state is real
    fresh = StatefulLlama()  # no state before synthesis: none after
    synthesize(fresh, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert not any(isinstance(v, FakeTensor) for m in fresh.modules() for v in vars(m).values())
    assert not hasattr(fresh.layers[0], "last_state")
