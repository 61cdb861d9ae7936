"""Every bad input ends in an AutoTPError subclass with a message that names the fix (the table in docs/bad-input.md)."""

import pytest
import torch
from torch import nn

import handwritten_plans
from autotp import get_plan, synthesize, verify
from autotp._simulate import simulated_mesh
from autotp.apply import apply_plan, validate_tp_mesh
from autotp.errors import AutoTPError, MeshError, PlanError, TraceError, VerificationError
from autotp.models import build_model
from torch.distributed.device_mesh import init_device_mesh


class DataDependent(nn.Module):
    """A decoder whose block branches on a tensor value: torch.export on fake tensors cannot trace it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([Branchy(), Branchy()])
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, h):
        if h.sum() > 0:
            return h + self.fc(h)
        return h


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Conv2d(3, 3, 3, padding=1) for _ in range(2)])
        self.fc = nn.Linear(3, 10)

    def forward(self, x):
        for conv in self.layers:
            x = torch.relu(conv(x))
        return self.fc(x.mean((2, 3)))


IDS = torch.randint(0, 64, (2, 8))


def test_untraceable_model_names_module_and_ways_out():
    """On meta a branch on a value cannot be decided (a materialised model is traced with real values)."""
    with pytest.raises(TraceError) as info:
        synthesize(DataDependent().to("meta"), example_inputs=(IDS.to("meta"),), verify=False)
    message = str(info.value)
    assert "layers.0" in message and "example_inputs" in message and "replicate" in message


def test_non_language_model():
    with pytest.raises(TraceError, match="not a language model"):
        synthesize(ConvNet(), example_inputs=(torch.randn(2, 3, 8, 8),), verify=False)


def test_mesh_of_wrong_dimension():
    model = build_model("llama", tiny=True, tp=2, device="cpu")
    with simulated_mesh(4):
        with pytest.raises(MeshError, match="1-D"):
            validate_tp_mesh(model, init_device_mesh("cpu", (2, 2)))


def test_sizes_tp_does_not_divide():
    model = build_model("llama", tiny=True, tp=2, device="cpu")
    with simulated_mesh(3) as mesh:
        with pytest.raises(MeshError, match="tp=3"):
            apply_plan(model, mesh, handwritten_plans.plan_for(model))


def test_meta_model_passed_to_verify():
    model = build_model("llama")
    with pytest.raises(VerificationError, match="meta device"):
        verify(model, handwritten_plans.plan_for(model))


def test_tp_shard_plan_import_path_that_does_not_exist():
    model = build_model("llama")
    with pytest.raises(PlanError, match="cannot import module"):
        get_plan(model, tp_shard_plan="my_project.plans.LLAMA_PLAN")


def test_all_errors_share_one_root():
    for cls in (MeshError, PlanError, TraceError, VerificationError):
        assert issubclass(cls, AutoTPError)


def test_meta_model_whose_rotary_branches_on_values_asks_for_a_materialised_model():
    """On meta there are no values to decide the dynamic-NTK branch: say so, and what to do."""
    from autotp.models import load_config

    config = load_config("llama-1b")
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(TraceError, match=r"inside model\.rotary_emb: .*materialised model"):
        synthesize(build_model(config), verify=False)


def test_plan_key_matching_no_module_is_refused_with_close_names():
    """parallelize_module only warns on such a key, leaving the module silently replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = build_model("llama", tiny=True, tp=2, device="cpu")
    with simulated_mesh(2) as mesh:
        with pytest.raises(PlanError, match=r"'model\.layers\.\*\.mlp\.gate_up_proj' .*matches no module.*"
                                            r"model\.layers\.0\.mlp\.up_proj"):
            apply_plan(model, mesh, {"model.layers.*.mlp.gate_up_proj": ColwiseParallel()})


def test_every_source_rejected_is_one_error_listing_each_reason():
    """Qwen2.5-7B has 28 heads: no source can shard it at tp=8, and the error says why for each."""
    from autotp.errors import NoPlanError

    with pytest.raises(NoPlanError, match=r"no plan source .* at tp=8: handwritten: .*num_attention_heads=28") as info:
        get_plan(build_model("qwen2"), tp_size=8)
    assert [name for name, _ in info.value.skipped] == ["handwritten", "hf", "synthesized"]
    assert issubclass(NoPlanError, PlanError)


def test_plan_function_that_fails_on_the_model_names_the_function(tmp_path):
    from autotp.selection import load_plan_file

    path = tmp_path / "plans.py"
    path.write_text("def fixed(model, sequence_parallel=False):\n    return {'x': [0][1536]}\n")
    with pytest.raises(PlanError, match=r"fixed\(LlamaForCausalLM, .*IndexError.*compute sizes from the model"):
        load_plan_file(f"{path}:fixed", build_model("llama"))


def test_model_that_cannot_be_copied_names_the_way_out():
    """Legacy ``torch.nn.utils.weight_norm`` keeps a non-leaf weight as module state, which
    ``copy.deepcopy`` refuses: the verifier says so instead of raising torch's RuntimeError."""
    import warnings

    model = build_model("llama", tiny=True, tp=2, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm is deprecated
        torch.nn.utils.weight_norm(model.model.layers[0].mlp.down_proj)
    with pytest.raises(VerificationError, match="cannot be copied for verification.*parametrizations.weight_norm"):
        verify(model, {}, tp_size=2)
