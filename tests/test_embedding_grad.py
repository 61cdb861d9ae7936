"""The vocab-parallel embedding's gradient: ``Shard(0)`` with the local size on every rank, never
a full-size table (issue 13 item 3), and the embedding forms other codebases write (a scaled
subclass, a module that unwraps a DTensor weight itself, a padding row, a norm inside).

Each numerical check compares with the unsharded model (logits and every gradient, 1e-5)."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from synth_toy import DIM, VOCAB, TitanLlama, example_tokens
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import handwritten_plans
from autotp import _simulate
from autotp.apply import apply_plan
from autotp.errors import PlanError
from autotp.models import build_model
from autotp.styles import VocabParallelEmbedding
from autotp.synth import synthesize
from autotp.verifier import verify


class LookupBackwardWatch(TorchDispatchMode):
    """Records the output shape of every embedding backward op run while it is active."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "embedding" in str(func) and "backward" in str(func):
            self.shapes.append(tuple(out.shape))
        return out


def _grad_layout(model, plan, tp_size, inputs, table: str):
    """Placements and per-rank local shapes of ``table``'s gradient after one backward on simulated
    ranks, its full shape, and the shapes the embedding backward ops made."""
    with warnings.catch_warnings(), _simulate.simulated_mesh(tp_size) as mesh:
        warnings.simplefilter("ignore")
        sharded = copy.deepcopy(model)
        apply_plan(sharded, mesh, plan)
        out = sharded(*inputs)
        logits = getattr(out, "logits", out)
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        full = sharded.get_parameter(table).shape
        with LookupBackwardWatch() as watch:
            logits.float().pow(2).mean().backward()
        grad = sharded.get_parameter(table).grad
        shapes = [tuple(g.shape) for g in _simulate.per_rank(grad.to_local(), tp_size)]
        return tuple(grad.placements), shapes, tuple(full), watch.shapes


def _verified(model, plan, tp_size, inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=inputs)
    assert report.ok, str(report)
    return report


@pytest.fixture(scope="module")
def tiny_llama():
    return build_model("llama", tiny=True, tp=2, device="cpu")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_handwritten_embedding_gradient_is_local_shard(tiny_llama, sequence_parallel):
    """Would catch torch's DTensor embedding backward: a ``Replicate()`` full-size gradient on
    every rank (the whole table materialised in backward)."""
    plan = handwritten_plans.plan_for(tiny_llama, sequence_parallel=sequence_parallel)
    ids = torch.randint(0, tiny_llama.config.vocab_size, (2, 16))
    placements, shapes, full, made = _grad_layout(tiny_llama, plan, 2, (ids,), "model.embed_tokens.weight")
    assert placements == (Shard(0),)
    assert shapes == [(full[0] // 2, full[1])] * 2
    assert made == [(full[0] // 2, full[1])], f"the lookup's backward made {made}"
    _verified(tiny_llama, plan, 2, {"input_ids": ids})


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_synthesized_embedding_gradient_is_local_shard(sequence_parallel, tp_size):
    model = TitanLlama()
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=sequence_parallel,
                      tp_size=tp_size, verify=False)
    assert isinstance(plan["tok_embeddings"], VocabParallelEmbedding)
    placements, shapes, _, made = _grad_layout(model, plan, tp_size, (example_tokens(),), "tok_embeddings.weight")
    assert placements == (Shard(0),)
    assert shapes == [(VOCAB // tp_size, DIM)] * tp_size
    assert made == [(VOCAB // tp_size, DIM)]
    _verified(model, plan, tp_size, (example_tokens(),))


class ScaledEmbedding(nn.Embedding):
    """Gemma's form: the looked-up rows times a constant."""

    def forward(self, ids):
        return super().forward(ids) * DIM ** 0.5


class UnwrappingEmbedding(nn.Embedding):
    """torchtitan's form: the module unwraps a DTensor weight itself and calls ``F.embedding``."""

    def forward(self, ids):
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return F.embedding(ids, weight, self.padding_idx)


class NormedEmbedding(nn.Embedding):
    """An embedding with a norm of its own on the looked-up rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, ids):
        return self.norm(super().forward(ids))


def _with_embedding(embedding: nn.Embedding) -> TitanLlama:
    model = TitanLlama()
    with torch.no_grad():
        embedding.weight.copy_(model.tok_embeddings.weight)
    model.tok_embeddings = embedding
    return model


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("embedding", [
    ScaledEmbedding(VOCAB, DIM),
    UnwrappingEmbedding(VOCAB, DIM),
    NormedEmbedding(VOCAB, DIM),
    nn.Embedding(VOCAB, DIM, padding_idx=3),
], ids=["scaled", "unwraps-dtensor", "with-norm", "padding-idx"])
def test_embedding_forms_are_exact_with_local_gradient(embedding, sequence_parallel):
    """Would catch "aten.embedding got mixed torch.Tensor and DTensor" (a module that unwraps the
    weight), a norm run on partial rows, or a gradient sent to the padding row."""
    model = _with_embedding(embedding)
    layout = {"output_layouts": Shard(1), "use_local_output": False} if sequence_parallel else {}
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=sequence_parallel, tp_size=2,
                      verify=False)
    table = plan["tok_embeddings"]  # the synthesizer's own style: the rows reduced at the lookup
    assert isinstance(table, VocabParallelEmbedding) and tuple(table.output_layouts) == (layout.get("output_layouts", Replicate()),)
    ids = example_tokens()
    ids[0, :3] = 3  # the padding row (and ids on both ranks' halves)
    placements, shapes, _, made = _grad_layout(model, plan, 2, (ids,), "tok_embeddings.weight")
    assert (placements, shapes, made) == ((Shard(0),), [(VOCAB // 2, DIM)] * 2, [(VOCAB // 2, DIM)])
    _verified(model, plan, 2, (ids,))


class IndexingEmbedding(nn.Embedding):
    def forward(self, ids):
        return self.weight[ids]


def test_embedding_that_indexes_its_table_is_a_plan_error():
    """The shard lookup only replaces ``F.embedding``; a forward that indexes the table itself
    reads local rows with global ids. Would catch that silently wrong lookup (ids below the shard's
    size index without error; larger ones fail in the module's own indexing)."""
    model = _with_embedding(IndexingEmbedding(VOCAB, DIM))
    with _simulate.simulated_mesh(2) as mesh:
        apply_plan(model, mesh, {"tok_embeddings": VocabParallelEmbedding(input_layouts=Replicate())})
        with pytest.raises(PlanError, match="never looks up its weight with F.embedding"):
            model(example_tokens() % (VOCAB // 2))


def test_verifier_names_a_full_size_embedding_gradient(tiny_llama):
    """torch's stock ``RowwiseParallel`` on the table is numerically right but returns a
    ``Replicate()`` full-size gradient on every rank: the verifier reports it by name, and reports
    nothing for autotp's vocab-parallel embedding."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    ids = torch.randint(0, tiny_llama.config.vocab_size, (2, 16))
    plan = handwritten_plans.plan_for(tiny_llama)
    stock = {**plan, "model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    assert _verified(tiny_llama, stock, 2, {"input_ids": ids}).grads_not_local_size == ["model.embed_tokens.weight"]
    assert _verified(tiny_llama, plan, 2, {"input_ids": ids}).grads_not_local_size == []


class TableMeanEmbedding(nn.Embedding):
    """An embedding that adds its table's mean row to the looked-up rows: a read of the table
    itself, which a vocab-sharded table would answer with this rank's rows only."""

    def forward(self, ids):
        return super().forward(ids) + self.weight.mean(0)


def test_embedding_reading_its_table_outside_the_lookup_stays_whole():
    """Would catch the table sharded there: the mean over this rank's rows, silently wrong."""
    model = _with_embedding(TableMeanEmbedding(VOCAB, DIM))
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert "tok_embeddings" not in plan
    _verified(model, plan, 2, (example_tokens(),))
