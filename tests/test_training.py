"""FSDP2 + TP training against single-process training.

The multi-process tests spawn gloo processes once per mesh (a module fixture) and run every case
in them; each test then checks the cases it is about. One training step (forward, backward,
gradient norm, AdamW) must give the loss, gradient norm, gradients and updated parameters of the
same step on the unsharded model, within ``TOLERANCE`` (fp32, absolute).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import handwritten_plans
from autotp.dtensor_utils import get_grad_norm, to_local_if_dtensor
from autotp.errors import AutoTPError, MeshError
from autotp.models import build_model
from autotp.training import (
    apply_activation_checkpointing,
    fsdp2_strategy_parallelize,
    get_lm_ac_layers,
    import_class_from_path,
    next_token_loss,
    unshard_fsdp2_model,
)
from gloo_launch import run_on_ranks

TOLERANCE = 1e-5
MODEL = "llama-1b"  # a Llama with tied embedding and head, so the tie is exercised too
# AdamW's first step is about lr * g / (|g| + eps): with eps=1e-8 a gradient of ~1e-8 turns fp32
# round-off into an lr-sized difference. eps=1e-3 keeps the step a smooth function of the
# gradient, so the comparison tests the sharding rather than the sign of noise.
ADAMW = dict(lr=1e-2, eps=1e-3, weight_decay=0.1)
LAYER_WEIGHT = "model.layers.0.mlp.down_proj.weight"


def _tiny_model() -> nn.Module:
    return build_model(MODEL, tiny=True, tp=2, device="cpu").train()


def _layer_weight_shape() -> tuple[int, int]:
    """The unsharded shape of ``LAYER_WEIGHT`` in the tiny model (it follows the shrinker)."""
    return tuple(build_model(MODEL, tiny=True, tp=2).get_parameter(LAYER_WEIGHT).shape)


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def _reference_step() -> dict:
    """The same step, unsharded and in one process, with torch's own loss and norm."""
    model = _tiny_model()
    ids = _batch()
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = torch.nn.utils.get_total_norm(list(grads.values())).item()
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return dict(loss=loss.item(), grad_norm=norm, grads=grads, params=params)


def _dp_slice(mesh, names) -> tuple[int, int]:
    """This rank's index among the data-parallel replicas and their number."""
    index, size = 0, 1
    for dim, name in enumerate(names):
        if name != "tp":
            index = index * mesh.size(dim) + mesh.get_coordinate()[dim]
            size *= mesh.size(dim)
    return index, size


def _one_step(case: dict, plans: dict, reference: dict) -> dict:
    names, shape = zip(*case["mesh"])
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _tiny_model()
    fsdp2_strategy_parallelize(
        model,
        mesh,
        sequence_parallel=case["sp"],
        activation_checkpointing=case["ac"],
        tp_shard_plan=plans.get((case["plan"], case["sp"])),
    )
    dp_index, dp_size = _dp_slice(mesh, names)
    ids = _batch().chunk(dp_size)[dp_index]
    loss = next_token_loss(model(input_ids=ids).logits, ids)
    loss.backward()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)  # every dp replica's loss, tp times each
    dp_group = mesh["dp_shard_cp"].get_group() if "dp_shard_cp" in names else None
    tp_group = mesh["tp"].get_group() if "tp" in names else None
    norm = get_grad_norm(list(model.parameters()), dp_group, tp_group)
    grad_diff = max(_max_diff(p.grad, reference["grads"][n]) for n, p in model.named_parameters())
    with unshard_fsdp2_model(model):
        unsharded_shape = tuple(to_local_if_dtensor(model.get_parameter(LAYER_WEIGHT)).shape)
    sharded_shape = tuple(model.get_parameter(LAYER_WEIGHT).to_local().shape)
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    return dict(
        loss=mean_loss.item() / dist.get_world_size(),
        grad_norm=norm,
        grad_diff=grad_diff,
        param_diff=max(_max_diff(p, reference["params"][n]) for n, p in model.named_parameters()),
        tied=model.lm_head.weight is model.model.embed_tokens.weight,
        shapes=(sharded_shape, unsharded_shape),
    )


def _max_diff(tensor, expected: torch.Tensor) -> float:
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return (full.detach() - expected).abs().max().item()


def _steps(cases, plans, reference):
    return [_one_step(case, plans, reference) for case in cases]


def _launch(world: int, cases: list[dict], plans: dict, reference: dict, timeout: float = 240.0) -> list[dict]:
    """Run ``cases`` on ``world`` spawned gloo processes; rank 0's results (all ranks must agree)."""
    outcomes = run_on_ranks(_steps, world, cases, plans, reference, timeout=timeout, what="training workers")
    for rank in range(1, world):
        for mine, theirs in zip(outcomes[0], outcomes[rank]):
            assert mine["loss"] == theirs["loss"] and mine["grad_norm"] == theirs["grad_norm"], f"rank {rank} disagrees"
    return outcomes[0]


def _plans() -> dict:
    """Plans for the workers by (source, sequence_parallel). A synthesis failure fails the tests."""
    from autotp import synthesize

    model = _tiny_model()
    plans = {("handwritten", sp): handwritten_plans.plan_for(model, sequence_parallel=sp) for sp in (False, True)}
    for sp in (False, True):
        plans[("synthesized", sp)] = synthesize(model, sequence_parallel=sp, verify=False)
    return plans


def _cases(mesh, plans, combos) -> list[dict]:
    return [
        dict(mesh=mesh, plan=plan, sp=sp, ac=ac, label=f"{plan}{' sp' if sp else ''}{' ac' if ac else ''}")
        for plan, sp, ac in combos
        if (plan, sp) in plans
    ]


@pytest.fixture(scope="module")
def reference():
    return _reference_step()


@pytest.fixture(scope="module")
def plans():
    return _plans()


_COMBOS = [
    ("handwritten", False, False),
    ("handwritten", True, True),
    ("synthesized", False, False),
    ("synthesized", True, True),
]


@pytest.fixture(scope="module")
def mesh_2x2(reference, plans):
    """4 processes: (dp_shard_cp=2, tp=2) for every case, then HSDP (dp_replicate=2, dp_shard_cp=2)."""
    cases = _cases((("dp_shard_cp", 2), ("tp", 2)), plans, _COMBOS)
    cases += _cases((("dp_replicate", 2), ("dp_shard_cp", 2)), plans, [("handwritten", False, True)])
    return {(c["mesh"], c["label"]): r for c, r in zip(cases, _launch(4, cases, plans, reference))}


@pytest.fixture(scope="module")
def mesh_1x2(reference, plans):
    """2 processes: (dp_shard_cp=1, tp=2)."""
    combos = [("handwritten", False, False), ("handwritten", True, True), ("synthesized", True, False)]
    cases = _cases((("dp_shard_cp", 1), ("tp", 2)), plans, combos)
    return {c["label"]: r for c, r in zip(cases, _launch(2, cases, plans, reference))}


def _assert_matches(result: dict, reference: dict, label: str) -> None:
    seen = {k: result[k] for k in ("loss", "grad_norm", "grad_diff", "param_diff", "tied")}
    message = f"{label}: {seen}; single process: loss {reference['loss']}, grad norm {reference['grad_norm']}"
    assert result["loss"] == pytest.approx(reference["loss"], abs=TOLERANCE), message
    assert result["grad_diff"] <= TOLERANCE, message
    assert result["grad_norm"] == pytest.approx(reference["grad_norm"], abs=TOLERANCE), message
    assert result["param_diff"] <= TOLERANCE, message
    assert result["tied"], f"{label}: lm_head.weight and embed_tokens.weight are no longer one parameter"


def _check_source(results: dict, reference: dict, source: str) -> None:
    labels = [label for label in results if (label[1] if isinstance(label, tuple) else label).startswith(source)]
    assert labels
    for label in labels:
        _assert_matches(results[label], reference, str(label))


@pytest.mark.multiprocess
def test_dp2_tp2_handwritten_plan_step_matches_single_process(mesh_2x2, reference):
    """Plain TP, and sequence parallel with activation checkpointing, FSDP-sharded over dp=2.
    Catches grads not averaged over dp, a norm counting tp-replicated weights twice, a lost tie."""
    _check_source(mesh_2x2, reference, "handwritten")


@pytest.mark.multiprocess
def test_dp2_tp2_synthesized_plan_step_matches_single_process(mesh_2x2, reference):
    _check_source(mesh_2x2, reference, "synthesized")


@pytest.mark.multiprocess
def test_dp2_tp2_unshard_gathers_dp_but_keeps_tp_shards(mesh_2x2):
    """down_proj (hidden x ffn) is rowwise over tp (hidden x ffn/2 local) and FSDP-halved on dim 0
    (hidden/2 x ffn/2); unsharding gathers the dp halves only."""
    result = mesh_2x2[((("dp_shard_cp", 2), ("tp", 2)), "handwritten")]
    hidden, ffn = _layer_weight_shape()
    assert result["shapes"] == ((hidden // 2, ffn // 2), (hidden, ffn // 2))


@pytest.mark.multiprocess
def test_hsdp_without_tp_step_matches_single_process(mesh_2x2, reference):
    """dp_replicate=2 x dp_shard_cp=2, no tp dim: TP skipped, HSDP grads averaged over all 4."""
    result = mesh_2x2[((("dp_replicate", 2), ("dp_shard_cp", 2)), "handwritten ac")]
    _assert_matches(result, reference, "hsdp")
    hidden, ffn = _layer_weight_shape()
    assert result["shapes"] == ((hidden // 2, ffn), (hidden, ffn))


@pytest.mark.multiprocess
def test_dp1_tp2_step_matches_single_process(mesh_1x2, reference):
    assert {"handwritten", "handwritten sp ac", "synthesized sp"} <= set(mesh_1x2)
    for label, result in mesh_1x2.items():
        _assert_matches(result, reference, label)


# ---------------------------------------------------------------- single-process unit tests


def test_lm_ac_layers_are_the_decoder_blocks_of_any_family():
    """Found by structure: the Gemma3 VLM's text layers outweigh its vision tower's."""
    llama = build_model("llama")
    assert get_lm_ac_layers(llama) == list(llama.model.layers)
    vlm = build_model("gemma3-vlm")
    assert get_lm_ac_layers(vlm) == list(vlm.model.language_model.layers)


def test_lm_ac_layers_of_a_model_without_lists_is_empty():
    assert get_lm_ac_layers(nn.Sequential(nn.Linear(2, 2))) == []


def test_activation_checkpointing_recomputes_and_keeps_gradients():
    """The layer's first projection runs twice (forward + recompute) and no gradient changes; a
    wrapper that silently did not checkpoint would run it once. (Recompute stops early, once the
    last saved tensor is rebuilt, so the layer's final projection is not a reliable witness.)"""
    plain, checkpointed = _tiny_model(), _tiny_model()
    apply_activation_checkpointing(get_lm_ac_layers(checkpointed))
    apply_activation_checkpointing(get_lm_ac_layers(checkpointed))  # idempotent
    calls = []
    checkpointed.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    ids = _batch()
    for model in (plain, checkpointed):
        next_token_loss(model(input_ids=ids).logits, ids).backward()
    assert len(calls) == 2
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=TOLERANCE, rtol=0, msg=name)


def test_next_token_loss_is_shifted_cross_entropy():
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(next_token_loss(logits, ids), expected)


def test_import_class_from_path():
    assert import_class_from_path("torch.nn.Linear") is nn.Linear
    assert import_class_from_path("torch.nn:Linear") is nn.Linear
    with pytest.raises(AutoTPError, match="has no attribute 'Nope'"):
        import_class_from_path("torch.nn.Nope")
    with pytest.raises(AutoTPError, match="not a dotted path"):
        import_class_from_path("Linear")


def test_mesh_with_unknown_dim_names_is_refused_before_sharding():
    from autotp._simulate import simulated_mesh

    model = build_model("llama", tiny=True, tp=2)
    with simulated_mesh(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(MeshError, match=r"\['dp'\] are none of"):
            fsdp2_strategy_parallelize(copy.deepcopy(model), mesh)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
        with pytest.raises(MeshError, match="HSDP needs both"):
            fsdp2_strategy_parallelize(copy.deepcopy(model), mesh)
