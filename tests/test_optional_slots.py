"""Module trees with empty slots, non-module heads, reshaping layers and mixed blocks are planned.

Plain-PyTorch decoders written the way outside libraries write them, each varying one thing about
the module tree the tracer meets: a layer held as ``nn.ModuleList([norm or None, attention,
feed-forward, combiner or None])``; a top-level list of optional per-layer norms with ``None``
where a layer has none; a head that is a lambda or a closure stored as a plain attribute, with
heads split by a small reshaping layer module (and by ``einops.layers.torch.Rearrange`` where
einops is installed); a stack alternating attention and MLP-only blocks.

Each is synthesized at tp 2, plain and sequence-parallel. The plan must verify against the
unsharded model (logits and every gradient), and shard the attention and MLP Linears: a test
catches a crash on an empty slot (before: ``'NoneType' object has no attribute
'named_parameters'``), a plan that computes something else, and one that silently leaves the
blocks whole. A forward export cannot trace must be a :class:`~autotp.errors.TraceError` that
names the module.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from synth_toy import verify_toy
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import autotp
from autotp.errors import TraceError
from autotp.plan import resolve
from autotp.synth.trace import block_signature, collapsed, group_entries
from autotp.training import get_lm_ac_layers

VOCAB, DIM, HEADS, FFN, SEQ = 64, 32, 4, 64, 11


class SplitHeads(nn.Module):
    """``(b, t, heads * d) -> (b, heads, t, d)`` with the head count a fixed attribute: the
    reshaping layer modules some libraries build their attention from."""

    def __init__(self, heads: int):
        super().__init__()
        self.heads = heads

    def forward(self, x):
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, -1).permute(0, 2, 1, 3)


class MergeHeads(nn.Module):
    """``(b, heads, t, d) -> (b, t, heads * d)``."""

    def forward(self, x):
        b, _, t, _ = x.shape
        return x.permute(0, 2, 1, 3).reshape(b, t, -1)


class Attention(nn.Module):
    """Causal multi-head attention with q / k / v / o Linears; heads split and merged by the given
    layer modules (default :class:`SplitHeads` / :class:`MergeHeads`)."""

    def __init__(self, split: nn.Module | None = None, merge: nn.Module | None = None):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.split = split if split is not None else SplitHeads(HEADS)
        self.merge = merge if merge is not None else MergeHeads()

    def forward(self, x):
        q, k, v = (self.split(p(x)) for p in (self.q, self.k, self.v))
        return self.o(self.merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class GatedResidual(nn.Module):
    """``x + gate * y`` with a learned per-channel gate: the optional residual combiner."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.full((DIM,), 0.5))

    def forward(self, x, y):
        return x + self.gate * y


class SlotLayers(nn.Module):
    """Each layer an ``nn.ModuleList([norm or None, attention, feed-forward, combiner or None])``;
    the forward skips the empty slots. Layers 1 and 2 are alike (one traced for both)."""

    def __init__(self, norms=(False, True, True), combiners=(True, False, False)):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(DIM) if norm else None, Attention(), FeedForward(),
                           GatedResidual() if combine else None])
            for norm, combine in zip(norms, combiners))
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for norm, attention, feed_forward, combine in self.layers:
            y = attention(x if norm is None else norm(x))
            x = x + y if combine is None else combine(x, y)
            x = x + feed_forward(x)
        return self.out(self.norm(x))


class Block(nn.Module):
    def __init__(self, attention=Attention):
        super().__init__()
        self.attn, self.mlp = attention(), FeedForward()

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class OptionalNorms(nn.Module):
    """A top-level ``nn.ModuleList`` of per-layer input norms, ``None`` where a layer has none, read
    beside the blocks by ``zip``. The blocks are alike and the first norm is off, so the blocks
    collapse to one traced entry while the norms do not."""

    def __init__(self, norms=(False, True, True)):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in norms)
        self.input_norms = nn.ModuleList(nn.LayerNorm(DIM) if on else None for on in norms)
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block, norm in zip(self.blocks, self.input_norms):
            x = block(x if norm is None else norm(x))
        return self.out(self.norm(x))


class ClosureHead(nn.Module):
    """Logits from a plain attribute that is no module: a lambda over the tied embedding (as
    x-transformers writes ``to_logits``), or a closure over a raw output weight. The blocks'
    attention is made by ``attention`` (heads split by :class:`SplitHeads` by default)."""

    def __init__(self, head: str = "lambda", attention=Attention):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(attention) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        if head == "lambda":
            self.to_logits = lambda h: h @ self.embed.weight.t()
        else:
            self.out_weight = nn.Parameter(torch.randn(VOCAB, DIM) / DIM**0.5)
            weight = self.out_weight

            def project(h):
                return F.linear(h, weight)

            self.to_logits = project

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.to_logits(self.norm(x))


class AttentionBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(DIM), Attention()

    def forward(self, x):
        return x + self.attn(self.norm(x))


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(DIM), FeedForward()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class MixedBlocks(nn.Module):
    """A stack alternating attention-only and MLP-only blocks (two block types in one list)."""

    def __init__(self, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(AttentionBlock() if i % 2 == 0 else MLPBlock() for i in range(depth))
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _einops_attention() -> Attention:
    from einops.layers.torch import Rearrange

    return Attention(Rearrange("b t (h d) -> b h t d", h=HEADS), Rearrange("b h t d -> b t (h d)"))


HAVE_EINOPS = importlib.util.find_spec("einops") is not None

MODELS = {
    "slots in each layer's list": SlotLayers,
    "optional norms beside the blocks": OptionalNorms,
    "lambda head, reshaping layer modules": ClosureHead,
    "alternating attention and MLP blocks": MixedBlocks,
}
if HAVE_EINOPS:
    MODELS["closure head, einops layer modules"] = lambda: ClosureHead("closure", attention=_einops_attention)
else:
    MODELS["closure head, reshaping layer modules"] = lambda: ClosureHead("closure")


def _linears(model: nn.Module) -> tuple[list[str], list[str]]:
    """FQNs of the attention and MLP Linears a plan must shard: (column ones, row ones)."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    tail = lambda name: name.rpartition(".")[2]  # noqa: E731
    return ([n for n in names if tail(n) in ("q", "k", "v", "up")],
            [n for n in names if tail(n) in ("o", "down")])


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_module_tree_is_sharded_and_exact(name, sequence_parallel):
    """q / k / v / up column-sharded, o / down row-sharded, the plan exact, the model left untouched.

    Catches: a crash on an empty slot; norms beside the blocks never traced (under SP, a plain norm
    on a sharded stream); an einops head count kept global (attention left whole); a verified copy
    whose closure head read, and wrote gradients into, the original model's weights."""
    torch.manual_seed(0)
    model = MODELS[name]()
    plan = autotp.synthesize(model, example_inputs=(_tokens(),), sequence_parallel=sequence_parallel, tp_size=2,
                             verify=False)
    styles = {fqn: style for fqn, (_, style) in resolve(model, plan).items()}
    columns, rows = _linears(model)
    assert len(columns) >= 4 and len(rows) >= 2
    unsharded = {fqn: styles.get(fqn) for fqn in columns if not isinstance(styles.get(fqn), ColwiseParallel)}
    unsharded.update({fqn: styles.get(fqn) for fqn in rows if not isinstance(styles.get(fqn), RowwiseParallel)})
    assert not unsharded, unsharded
    verify_toy(model, plan, 2, inputs=(_tokens(),))
    # The verifier runs copies: a closure head must read the copy's weights, not write gradients here.
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []


def test_empty_slots_tell_layers_apart():
    """Two layers are interchangeable only with their empty slots at the same places: ``named_modules``
    skips a ``None``, so ``[linear, None]`` and ``[linear]`` looked alike."""
    layers = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), None]), nn.ModuleList([nn.Linear(2, 2)]),
                            nn.ModuleList([nn.Linear(2, 2), None])])
    assert block_signature(layers[0]) != block_signature(layers[1])
    assert group_entries(layers) == [[0, 2], [1]]
    assert group_entries(nn.ModuleList([None, nn.LayerNorm(2), None, nn.LayerNorm(2)])) == [[0, 2], [1, 3]]


def test_stacks_of_one_length_collapse_in_step():
    """Blocks alike and norms ``[None, norm, norm]``: collapsed each alone, the one traced block met
    the empty norm and the norms were never planned (a crash under sequence parallelism)."""
    model = OptionalNorms()
    with collapsed(model) as groups:
        assert len(model.blocks) == len(model.input_norms) == 2
    assert groups.groups == {"blocks": [[0], [1, 2]], "input_norms": [[0], [1, 2]]}
    assert len(model.blocks) == 3


def test_activation_checkpointing_layers_skip_empty_slots():
    stack = nn.ModuleList([nn.Linear(4, 4), None, nn.Linear(4, 4)])
    assert get_lm_ac_layers(nn.Sequential(nn.Embedding(4, 4), stack)) == [stack[0], stack[2]]


class Unchecked(SlotLayers):
    """Calls every slot of its layers, the empty ones included."""

    def forward(self, ids):
        x = self.embed(ids)
        for norm, attention, feed_forward, _ in self.layers:
            x = x + attention(norm(x))
            x = x + feed_forward(x)
        return self.out(self.norm(x))


class NamedActivation(FeedForward):
    """An MLP whose activation is a name (``"gelu"``), where a module or function is called."""

    def __init__(self):
        super().__init__()
        self.act = "gelu"

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class StringActivation(MixedBlocks):
    def __init__(self):
        super().__init__()
        self.layers[1].mlp = NamedActivation()


def test_calling_an_empty_slot_is_a_trace_error_naming_the_slots():
    with pytest.raises(TraceError, match=r"failed inside <root>: TypeError: 'NoneType' object is not callable\. "
                                         r"The model holds empty slots \(None\) at layers\.0\.0, layers\.1\.3, "
                                         r"layers\.2\.3: skip them"):
        autotp.synthesize(Unchecked(), example_inputs=(_tokens(),), tp_size=2, verify=False)


def test_a_non_module_where_a_module_is_called_is_a_trace_error_naming_the_module():
    with pytest.raises(TraceError, match=r"StringActivation: .* inside layers\.1\.mlp: TypeError: 'str' object"):
        autotp.synthesize(StringActivation(), example_inputs=(_tokens(),), tp_size=2, verify=False)
