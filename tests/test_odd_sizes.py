"""A vocabulary tp does not divide (GPT-2's 50257 at any even tp) keeps the output head (and the
embedding tied to it) whole, with a warning naming the module and the size, instead of the whole
model being refused; the rest of the model is sharded as usual, and the plan verifies."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import autotp
from autotp import _simulate
from autotp.cli import main
from autotp.models import build_model, load_config, shrink_config
from autotp.plan import resolve

ODD_VOCAB = 257  # prime: no tp above 1 divides it


@pytest.fixture(scope="module")
def odd_gpt2():
    """A 2-layer GPT-2 (tied embedding and head) whose vocabulary no tp divides."""
    config = shrink_config(load_config("gpt2"), tp=2)
    config.vocab_size = ODD_VOCAB
    return build_model(config, device="cpu")


@pytest.fixture(scope="module")
def odd_choice(odd_gpt2):
    """get_plan at tp 2, and the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = autotp.get_plan(odd_gpt2, tp_size=2)
    return choice, [str(w.message) for w in caught]


def test_odd_vocabulary_keeps_the_head_whole_and_verifies(odd_gpt2, odd_choice):
    """get_plan at tp 2: a synthesized plan with lm_head and the tied wte whole, a warning that
    names lm_head and 257, and logits and every gradient equal to the unsharded model's."""
    choice, said = odd_choice
    assert ("autotp: lm_head kept whole on every rank: its 257 output features (the vocabulary) do not split "
            "over tp=2 (no tp above 1 divides it)") in said, said
    assert choice.source == "synthesized"
    touched = resolve(odd_gpt2, choice.plan)
    assert "lm_head" not in touched and "transformer.wte" not in touched
    assert "transformer.h.0.mlp.c_fc" in touched  # the rest is sharded
    report = autotp.verify(odd_gpt2, choice.plan, tp_size=2)
    assert report.ok and len(report.grad_max_abs_diff) == len(list(odd_gpt2.parameters())), str(report)


def test_parallelize_shards_an_odd_vocabulary_model(odd_gpt2, odd_choice):
    """The main entry with that plan, on simulated ranks: the unsharded logits on every rank."""
    ids = torch.randint(0, ODD_VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wanted = odd_gpt2(ids).logits
    plan = odd_choice[0].plan  # chosen outside: torch.export does not run under simulated ranks
    with _simulate.simulated_mesh(2) as mesh:
        model = autotp.parallelize(copy.deepcopy(odd_gpt2), mesh, tp_shard_plan=plan)
        with torch.no_grad():
            logits = model(ids).logits
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        for rank, value in enumerate(_simulate.per_rank(logits, 2)):
            assert torch.allclose(value, wanted, atol=1e-5), f"rank {rank}"


def test_cli_plans_gpt2_at_tp_4_with_a_warning(capsys):
    """`autotp plan gpt2 --tp 4` printed "no plan source passes the checker"; now a plan, exit 0."""
    assert main(["plan", "gpt2", "--tp", "4"]) == 0
    captured = capsys.readouterr()
    assert "plan source: synthesized, tp=4" in captured.out
    assert "transformer.h.*.mlp.c_fc" in captured.out and "lm_head " not in captured.out
    assert "lm_head kept whole on every rank: its 50257 output features" in captured.err
    assert "Traceback" not in captured.err
