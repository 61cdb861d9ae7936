"""``generate()`` with a KV cache on a sharded model gives the unsharded model's tokens.

A case shards a tiny model with :func:`autotp.parallelize` (one plan source, plain or
sequence-parallel, loss-parallel logits or whole ones) and generates greedily and by sampling with
a fixed seed; the tokens must equal the unsharded model's exactly. The simulated tests run in this
process; the gloo tests run all the cases of a fixture inside one pair of processes, to pay their
start (seconds) once.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import autotp
from autotp import _simulate
from autotp.apply import gathered_logits
from autotp.models import build_model
from gloo_launch import run_on_ranks

PROMPT = (2, 5)  # batch, tokens: an odd prompt, so the sequence-parallel prefill splits unevenly
SAMPLING = dict(do_sample=True, top_k=8)
SEED = 7


def _prompt(model) -> dict:
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, min(vocab, 256), PROMPT, generator=torch.Generator().manual_seed(1))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def _generate(model, prompt: dict, *, sample: bool, new_tokens: int) -> torch.Tensor:
    # min_new_tokens: no early stop at a random end-of-sequence token, so every step is compared.
    torch.manual_seed(SEED)  # the same seed on every rank: each samples the same token
    return model.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True,
                          pad_token_id=0, **(SAMPLING if sample else dict(do_sample=False)))


def _sharded(family: str, mesh, *, source: str = "auto", sequence_parallel: bool = False, **options):
    """A tiny ``family`` model sharded by ``autotp.parallelize`` with the plan of ``source``, or
    (``source="fsdp2"``) by ``fsdp2_strategy_parallelize`` on a 1 x 2 (dp_shard_cp, tp) mesh."""
    model = build_model(family, tiny=True, tp=2, device="cpu")
    if source == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard_cp", "tp"))
        return autotp.fsdp2_strategy_parallelize(model, mesh, sequence_parallel=sequence_parallel, **options)
    if source != "auto":
        options["tp_shard_plan"] = autotp.get_plan(model, source=source, sequence_parallel=sequence_parallel,
                                                   tp_size=2).plan
    return autotp.parallelize(model, mesh, sequence_parallel=sequence_parallel, **options)


# ---------------------------------------------------------------------------- simulated ranks

@pytest.fixture(scope="module")
def llama():
    """The unsharded tiny Llama and a prompt for it."""
    model = build_model("llama", tiny=True, tp=2, device="cpu")
    return model, _prompt(model)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_greedy_generate_on_simulated_ranks_gives_unsharded_tokens(llama, sequence_parallel):
    """Would catch the vocab-sharded logits reaching transformers' decoding (``got mixed
    torch.Tensor and DTensor``) and, under SP, a one-token decode step the sequence split breaks."""
    reference, prompt = llama
    wanted = _generate(reference, prompt, sample=False, new_tokens=4)
    with _simulate.simulated_mesh(2) as mesh:
        model = _sharded("llama", mesh, source="handwritten", sequence_parallel=sequence_parallel)
        got = _generate(model, prompt, sample=False, new_tokens=4)
        for rank, tokens in enumerate(_simulate.per_rank(got, 2)):
            assert torch.equal(tokens, wanted), f"rank {rank}: {tokens.tolist()} != {wanted.tolist()}"


def test_sampled_generate_on_simulated_ranks_gives_unsharded_tokens(llama):
    """Would catch ranks sampling from different logits (their own vocabulary slice)."""
    reference, prompt = llama
    wanted = _generate(reference, prompt, sample=True, new_tokens=4)
    with _simulate.simulated_mesh(2) as mesh:
        model = _sharded("llama", mesh, source="handwritten")
        got = _generate(model, prompt, sample=True, new_tokens=4)
        for rank, tokens in enumerate(_simulate.per_rank(got, 2)):
            assert torch.equal(tokens, wanted), f"rank {rank}: {tokens.tolist()} != {wanted.tolist()}"


def test_loss_parallel_false_returns_whole_logits_on_every_rank(llama):
    """Would catch a forward handing serving code a DTensor or one rank's vocabulary slice."""
    reference, prompt = llama
    wanted = reference(**prompt).logits
    with _simulate.simulated_mesh(2) as mesh:
        model = _sharded("llama", mesh, source="handwritten", sequence_parallel=True, loss_parallel=False)
        logits = model(**prompt).logits
        assert not isinstance(logits, DTensor) and logits.shape == wanted.shape
        for rank, value in enumerate(_simulate.per_rank(logits.detach(), 2)):
            assert torch.allclose(value, wanted, atol=1e-5), f"rank {rank}"


def test_loss_parallel_false_logits_train_like_the_unsharded_model(llama):
    """A user's own loss on the whole logits gives the unsharded gradients. Would catch the gather
    cutting the logits off from autograd, or their gradient counted once per rank."""
    reference, prompt = copy.deepcopy(llama[0]), llama[1]
    ids = prompt["input_ids"]
    F.cross_entropy(reference(**prompt).logits.flatten(0, 1), ids.flatten()).backward()
    with _simulate.simulated_mesh(2) as mesh:
        model = _sharded("llama", mesh, source="handwritten", sequence_parallel=True, loss_parallel=False)
        F.cross_entropy(model(**prompt).logits.flatten(0, 1), ids.flatten()).backward()
        for name, param in model.named_parameters():
            wanted = reference.get_parameter(name).grad
            for rank, grad in enumerate(_simulate.per_rank(param.grad.full_tensor(), 2)):
                assert torch.allclose(grad, wanted, atol=1e-5), f"{name}, rank {rank}"


def test_default_keeps_loss_parallel_logits_outside_gathered_logits(llama):
    """Training's default is unchanged: the logits stay a ``Shard(-1)`` DTensor (each rank holds
    half the vocabulary) except inside ``gathered_logits``; would catch the hook leaking out."""
    _, prompt = llama
    with _simulate.simulated_mesh(2) as mesh:
        model = _sharded("llama", mesh, source="handwritten")
        with gathered_logits(model):
            inside = model(**prompt).logits
        after = model(**prompt).logits
    assert not isinstance(inside, DTensor)
    assert isinstance(after, DTensor) and after.placements == (Shard(2),)
    assert after.to_local().shape[-1] * 2 == inside.shape[-1]


# ---------------------------------------------------------------------------- real gloo processes

def _forward_finding(model, prompt: dict, loss_parallel: bool) -> str | None:
    """What is wrong with a training forward's logits (a DTensor where whole ones were asked for,
    or a warning it raised), or None. Loss-parallel logits are what the plan makes: a ``Shard(-1)``
    DTensor, or whole ones from a plan whose head gathers them (transformers') or is replicated."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(**prompt).logits
    if not loss_parallel and isinstance(logits, DTensor):
        return f"loss_parallel=False gave {logits.placements} DTensor logits"
    return f"warned: {caught[0].message}" if caught else None


def generation_cases(cases: list[tuple], new_tokens: int) -> dict:
    """Run on each gloo rank: ``{case: outcome}`` for ``case = (family, source, sp, loss_parallel)``;
    the outcome is ``"equal"`` (greedy and sampled tokens equal, and a forward with gradients gives
    the logits ``loss_parallel`` asks for, without a warning), or what went wrong."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotp.errors import one_line

    mesh = init_device_mesh("cpu", (2,))
    outcomes, references = {}, {}
    for case in cases:
        family, source, sequence_parallel, loss_parallel = case
        if family not in references:
            reference = build_model(family, tiny=True, tp=2, device="cpu")
            prompt = _prompt(reference)
            references[family] = prompt, {s: _generate(reference, prompt, sample=s, new_tokens=new_tokens)
                                          for s in (False, True)}
        prompt, wanted = references[family]
        try:
            model = _sharded(family, mesh, source=source, sequence_parallel=sequence_parallel,
                             loss_parallel=loss_parallel)
            got = {s: _generate(model, prompt, sample=s, new_tokens=new_tokens) for s in (False, True)}
            finding = _forward_finding(model, prompt, loss_parallel)
        except Exception as error:  # one case's failure must not hide the others'
            outcomes[case] = f"error: {one_line(error)}"
            continue
        bad = [(("sampled" if s else "greedy"), got[s].tolist(), wanted[s].tolist())
               for s in got if not torch.equal(got[s], wanted[s])]
        outcomes[case] = f"differs (got, wanted): {bad}" if bad else finding or "equal"
    return outcomes


def _outcomes(cases: list[tuple]) -> dict:
    ranks = run_on_ranks(generation_cases, 2, cases, 8, timeout=1800.0, what="generate workers")
    return {case: {rank: ranks[rank][case] for rank in ranks} for case in cases}


# The public entry points as a user calls them (the plan autotp picks), plain and SP, both logit
# modes; FSDP2 + TP once in each mode.
LLAMA_CASES = [("llama", "auto", sp, lp) for sp in (False, True) for lp in (True, False)] + [
    ("llama", "fsdp2", True, True), ("llama", "fsdp2", False, False)]

# Every source that has a plan for the family; transformers' plans have no SP variant.
# Left out: handwritten mixtral and olmo2 (none written), transformers' gemma3 (get_plan refuses
# it: it shards the head tied to a replicated embedding).
_SOURCES = {"qwen3": ("handwritten", "hf", "synthesized"), "gemma3": ("handwritten", "synthesized"),
            "mixtral": ("hf", "synthesized"), "phi": ("handwritten", "hf", "synthesized"),
            "olmo2": ("hf", "synthesized")}
MATRIX_CASES = [(family, source, sp, True) for family, sources in _SOURCES.items() for source in sources
                for sp in (False, True) if not (source == "hf" and sp)]


@pytest.fixture(scope="module")
def llama_outcomes():
    return _outcomes(LLAMA_CASES)


@pytest.fixture(scope="module")
def matrix_outcomes():
    return _outcomes(MATRIX_CASES)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", LLAMA_CASES, ids=lambda c: f"{c[1]}-{'sp' if c[2] else 'plain'}-lp{int(c[3])}")
def test_generate_after_parallelize_on_two_gloo_processes(llama_outcomes, case):
    """``autotp.parallelize`` (or ``fsdp2_strategy_parallelize``) then ``generate`` (8 tokens, KV
    cache; greedy and seeded sampling) on 2 real processes gives the unsharded tokens on both.
    Would catch what the simulator cannot: ranks drawing different samples, real collectives in
    the one-token decode steps, FSDP2's hooks meeting the gathered logits."""
    assert llama_outcomes[case] == {0: "equal", 1: "equal"}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", MATRIX_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'sp' if c[2] else 'plain'}")
def test_generate_matrix_on_two_gloo_processes(matrix_outcomes, case):
    """Every plan source, dense and MoE, plain and SP: the same tokens as the unsharded model."""
    assert matrix_outcomes[case] == {0: "equal", 1: "equal"}
