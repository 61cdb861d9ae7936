"""Checkpoints (DCP) and full safetensors export of TP (+ FSDP2) models, against unsharded models.

The fused-projection model is tiny Phi-3: its ``qkv_proj`` / ``gate_up_proj`` are stored with
rows permuted (``Colwise``), so a checkpoint or export that skipped the inverse map
would hold the wrong rows. The gloo tests spawn two processes once (a module fixture) and do every
round trip in them; each test then checks the figures it is about.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import autotp
from autotp._simulate import per_rank, simulated_mesh
from autotp.apply import apply_plan
from autotp.checkpoint import (
    CheckpointError,
    _checkpoint_state,
    _per_param_states,
    export_safetensors,
    full_state_dict,
    layout_transforms,
    load_checkpoint,
    save_checkpoint,
)
from autotp.kv import replicate_kv_heads
from autotp.models import build_model
from gloo_launch import run_on_ranks

TOLERANCE = 1e-5
FUSED = "phi3"  # fused qkv_proj and gate_up_proj: Colwise in its plan
ADAMW = dict(lr=1e-2, eps=1e-3, weight_decay=0.1)  # eps as in test_training: a smooth first step


def _two_linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


# ---- full state dict on simulated ranks -------------------------------------------------------


def _rank_values(tensors: dict, tp: int) -> list[dict]:
    return [{k: per_rank(v, tp)[r] for k, v in tensors.items()} for r in range(tp)]


def test_full_state_dict_undoes_the_packed_row_order():
    """Catches an export that writes a fused weight in the permuted order a packed style stores."""
    model = build_model(FUSED, tiny=True, tp=2, device="cpu")
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    plan = autotp.get_plan(model, tp_size=2).plan  # outside the simulated ranks: it may trace
    with simulated_mesh(2) as mesh:
        apply_plan(model, mesh, plan)
        stored = model.get_parameter("model.layers.0.self_attn.qkv_proj.weight").full_tensor()
        full = full_state_dict(model)
    assert not torch.equal(per_rank(stored, 2)[0], expected["model.layers.0.self_attn.qkv_proj.weight"])
    assert any(name.endswith("qkv_proj.weight") for name in layout_transforms(model))
    for rank_values in _rank_values(full, 2):
        assert rank_values.keys() == expected.keys()
        for name, value in rank_values.items():
            assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("gather", [False, True], ids=["copies", "gathered"])
def test_full_state_dict_keeps_one_copy_of_replicated_kv_heads_and_both_tied_names(gather):
    """Catches an export of the tp-expanded k/v rows (copies) or of one rank's shard (gathered), and
    one that drops or shares a tied weight."""
    model = build_model("llama-1b", tiny=True, tp=1, device="cpu")  # one kv head, tied head
    plan = autotp.get_plan(build_model("llama-1b", tiny=True, tp=2), tp_size=2).plan
    plan = replicate_kv_heads(model, plan, 2, gather=gather)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_mesh(2) as mesh:
        apply_plan(model, mesh, plan)
        full = full_state_dict(model)
    assert ("model.layers.0.self_attn.k_proj.weight" in layout_transforms(model)) != gather
    rank0 = _rank_values(full, 2)[0]
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= rank0.keys()
    for name, value in rank0.items():
        assert value.shape == expected[name].shape and torch.equal(value, expected[name]), name
    plain = build_model("llama-1b", tiny=True, tp=1, device="cpu", seed=1)
    plain.load_state_dict(rank0, strict=True)


@pytest.mark.parametrize("gather", [False, True], ids=["copies", "gathered"])
def test_full_state_dict_of_one_state_group_mixer_is_the_unsharded_model(gather):
    """A Mamba2-style mixer with one B / C group at tp 2: its in_proj rows and depthwise conv
    channels are copies per rank (``gather_copies=False``) or sharded packed and gathered each
    forward. Catches an export of the copies' expanded rows or of the packed shard order."""
    from synth_toy import example_tokens
    from test_grouped_parts import GroupedScanMixer, _model

    model = _model(lambda: GroupedScanMixer(groups=1, norm_group=64))
    plan = autotp.synthesize(model, example_inputs=(example_tokens(),), tp_size=2, gather_copies=gather, verify=False)
    assert plan["layers.*.mixer"].gather == gather
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with simulated_mesh(2) as mesh:
        apply_plan(model, mesh, plan)
        full = full_state_dict(model)
    for rank_values in _rank_values(full, 2):
        assert rank_values.keys() == expected.keys()
        for name, value in rank_values.items():
            assert value.shape == expected[name].shape and torch.equal(value, expected[name]), name


# ---- one process, no process group ------------------------------------------------------------


def test_unsharded_model_and_optimizer_round_trip(tmp_path):
    model = _two_linears()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, model=model, optimizer=optimizer, extra={"step": 7})

    fresh = _two_linears()
    with torch.no_grad():
        fresh[0].weight.zero_()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), **ADAMW)
    assert load_checkpoint(tmp_path, model=fresh, optimizer=fresh_optimizer) == {"step": 7}
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], fresh_optimizer.state[q][key]), (name, key)


def test_load_from_a_missing_directory_names_it(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", model=_two_linears())
    with pytest.raises(CheckpointError, match="no DCP .metadata"):
        load_checkpoint(tmp_path, model=_two_linears())


def test_load_into_a_model_with_other_names_lists_them(tmp_path):
    save_checkpoint(tmp_path, model=_two_linears())
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))  # second Linear is "1", not "2"
    expected = r"2 parameter\(s\) of the model are not in it \(first: \['1.bias', '1.weight'\]\), 2 in it"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(tmp_path, model=other)


def test_load_into_a_model_with_other_shapes_names_the_parameter(tmp_path):
    save_checkpoint(tmp_path, model=_two_linears())
    wider = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(CheckpointError, match=r"0.weight: the checkpoint holds shape \(8, 4\), the model \(6, 4\)"):
        load_checkpoint(tmp_path, model=wider)


def test_load_with_optimizer_from_a_weights_only_checkpoint_is_refused(tmp_path):
    save_checkpoint(tmp_path, model=_two_linears())
    model = _two_linears()
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(tmp_path, model=model, optimizer=torch.optim.AdamW(model.parameters()))


def test_a_row_map_without_a_known_inverse_is_refused():
    model = _two_linears()
    model[0].weight._autotp_to_layout = partial(torch.flip, dims=[0])
    with pytest.raises(CheckpointError, match="0.weight: stored in a layout made by .*flip"):
        layout_transforms(model)


def test_optimizer_state_not_shaped_like_a_reordered_parameter_is_refused():
    """A factored moment (one value per row) cannot follow the parameter's row permutation."""
    states = {"state": {"w": {"row_moment": torch.zeros(4), "step": torch.tensor(1.0)}}}
    with pytest.raises(CheckpointError, match=r"w: optimizer state \{'row_moment': \(4,\)\}"):
        _per_param_states(states, "w", torch.zeros(4, 2))


def test_extra_that_is_not_json_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="extra"):
        save_checkpoint(tmp_path, model=_two_linears(), extra={"when": object()})


# ---- gloo processes: save, reload at other layouts, export --------------------------------------


def _build(dp: int, tp: int):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard_cp", "tp"))
    model = build_model(FUSED, tiny=True, tp=2, device="cpu").train()
    autotp.fsdp2_strategy_parallelize(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW), mesh


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(seed))


def _step(model, optimizer, mesh, ids) -> None:
    """One AdamW step on ``ids``, split over the data-parallel ranks (FSDP2 averages gradients)."""
    dp = mesh["dp_shard_cp"]
    ids = ids.chunk(dp.size())[dp.get_local_rank()]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def _optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every optimizer tensor, whole and in the model's own row order, by ``name/state``."""
    state, _ = _checkpoint_state(model, optimizer, layout_transforms(model), empty=False)
    # Cloned: a replicated DTensor's full_tensor() (and a plain ``step``) is the live tensor.
    return {f"{name}/{key}": (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for name, states in state["optim"]["state"].items() for key, v in states.items()}


def _diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest difference between two dicts of tensors with the same keys, and where."""
    assert a.keys() == b.keys()
    return max(((a[k].float() - b[k].float()).abs().max().item(), k) for k in a)


def _round_trips(root: str) -> dict:
    """Save at (dp 1, tp 2), reload at (1, 2) and (2, 1), save at (2, 1) and reload at (1, 2), export."""
    ids, next_ids = _batch(0), _batch(1)
    model, optimizer, mesh = _build(1, 2)
    _step(model, optimizer, mesh, ids)
    saved = dict(logits=_logits(model, ids), optim=_optimizer_state(model, optimizer))
    save_checkpoint(f"{root}/tp2", model=model, optimizer=optimizer, extra={"step": 1})
    export_safetensors(model, f"{root}/hf")
    _step(model, optimizer, mesh, next_ids)
    after_next_step = full_state_dict(model)
    if dist.get_rank() == 0:  # tensors do not survive a queue once their process has exited
        torch.save(saved["logits"], f"{root}/hf/logits.pt")
    out = {}
    for dp, tp in ((1, 2), (2, 1)):
        loaded, loaded_optimizer, loaded_mesh = _build(dp, tp)
        extra = load_checkpoint(f"{root}/tp2", model=loaded, optimizer=loaded_optimizer)
        figures = dict(extra=extra, logits=(_logits(loaded, ids) - saved["logits"]).abs().max().item(),
                       optim=_diff(_optimizer_state(loaded, loaded_optimizer), saved["optim"]))
        _step(loaded, loaded_optimizer, loaded_mesh, next_ids)
        figures["next_step"] = _diff(full_state_dict(loaded), after_next_step)
        out[f"dp{dp}_tp{tp}"] = figures
    # ``loaded`` is now the (2, 1) model after the next step: save it and resume at tp 2.
    reference_logits = _logits(loaded, ids)
    save_checkpoint(f"{root}/dp2", model=loaded, optimizer=loaded_optimizer)
    back, back_optimizer, _ = _build(1, 2)
    load_checkpoint(f"{root}/dp2", model=back, optimizer=back_optimizer)
    out["dp2_to_tp2"] = dict(logits=(_logits(back, ids) - reference_logits).abs().max().item(),
                             optim=_diff(_optimizer_state(back, back_optimizer),
                                         _optimizer_state(loaded, loaded_optimizer)))
    return out


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return root, run_on_ranks(_round_trips, 2, str(root), timeout=240.0, what="checkpoint workers")[0]


@pytest.mark.multiprocess
def test_reload_at_the_same_layout_gives_equal_logits_optimizer_and_next_step(round_trips):
    figures = round_trips[1]["dp1_tp2"]
    assert figures["extra"] == {"step": 1}
    assert figures["logits"] <= TOLERANCE and figures["optim"][0] <= TOLERANCE, figures
    assert figures["next_step"][0] <= TOLERANCE, figures


@pytest.mark.multiprocess
def test_tp2_checkpoint_reloads_at_dp2_tp1_with_equal_logits_optimizer_and_next_step(round_trips):
    """Catches a checkpoint stored in the tp-dependent packed order: tp=1 reads the rows plainly."""
    figures = round_trips[1]["dp2_tp1"]
    assert figures["logits"] <= TOLERANCE and figures["optim"][0] <= TOLERANCE, figures
    assert figures["next_step"][0] <= TOLERANCE, figures


@pytest.mark.multiprocess
def test_dp2_tp1_checkpoint_reloads_at_tp2(round_trips):
    figures = round_trips[1]["dp2_to_tp2"]
    assert figures["logits"] <= TOLERANCE and figures["optim"][0] <= TOLERANCE, figures


@pytest.mark.multiprocess
def test_exported_safetensors_load_into_a_plain_model_with_equal_logits(round_trips):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root = round_trips[0]
    ids, sharded_logits = _batch(0), torch.load(root / "hf" / "logits.pt")
    plain = build_model(FUSED, tiny=True, tp=2, device="cpu", seed=1).eval()
    plain.load_state_dict(load_file(str(root / "hf" / "model.safetensors")), strict=True)
    assert (_logits(plain, ids) - sharded_logits).abs().max().item() <= TOLERANCE
    pretrained = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    assert (_logits(pretrained, ids) - sharded_logits).abs().max().item() <= TOLERANCE
