"""Plan export (autotp.emit, ``autotp plan --emit``): Python modules that rebuild the plan, and
transformers' style strings."""

import inspect
import json

import pytest
import torch.distributed.tensor.parallel as torch_styles
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from autotp import emit, styles
from autotp.cli import main
from autotp.hf_plans import raw_hf_plan
from autotp.models import build_model
from autotp.plan import describe_style

# Values for required options (and for optional ones, to move them off their defaults), by name.
# A new style whose options are not here fails test_every_style_round_trips: add its samples.
_REQUIRED = {
    "sizes": (6, 2), "kv_heads": 2, "head_dim": 4, "heads": 8, "width": 4, "names": ("num_heads",),
    "wrapped": ColwiseParallel(output_layouts=Replicate()), "output_layouts": Shard(1),
    "desired_output_layouts": Replicate(), "shard_dims": {"w1": 0}, "columns": ("w1",),
    "base": ColwiseParallel(), "inputs": ((1, 0), ("bias", 1)), "readers": ("c_attn",), "style": ColwiseParallel(),
    "params": {"wq.weight": 0, "wo.weight": 1},
}
_OPTIONAL = {
    "input_layouts": Shard(1), "output_layouts": Partial(), "desired_input_layouts": Replicate(),
    "input_kwarg_layouts": {"hidden": Shard(1)}, "desired_input_kwarg_layouts": {"hidden": Replicate()},
    "sequence_dim": 0, "shard_dim": 1, "shard_dims": {"w1": 0}, "packed": {"w1": 3}, "attribute": "groups",
    "sizes": (3, 3, 2), "stream": "hidden_states",
    "reduce": ("lam",), "counts": ("n_heads",), "columns": ("w1",), "rows": ("w2",),
    "reduce_grad_features": ((4, 8),), "once": ("b2",), "style": ColwiseParallel(),
    "query_heads": 8, "ratio": "n_rep", "kv_names": ("n_kv_heads",), "head_names": ("n_heads",), "replicated_outputs": True,
    "partial_outputs": True,
}
# Where one option name means another thing in another style: its sample there.
_PER_CLASS = {"HeadParams": {"packed": {"w1": (3, 3)}},
              # A gathered block sliced back; the gradient options keep their defaults there (each
              # is tied to another side: test_fronts and test_partial_inputs build those).
              "Boundary": {"inputs": "gather", "outputs": "shard", "input_grad": "whole", "output_grad": "whole",
                           "stream": None, "columns": ()},  # (both are of inputs="replicate": _FOLDED)
              "ShardCounts": {"base": styles.Boundary(inputs="gather", outputs="shard"), "names": ("n_heads",),
                              "literals": (("view", 3, 2, 16, 2, 4, (2, 5, 4, 4)), ("slice", 3, 2, 48, 16, 32, ()))},
              "GroupCopies": {"rows": {"weight": (0, 10, ((8, 10, 1),))}, "values": {"n_groups": 2}},
              # scale_rows counts whole terms once in place of ``once``: the two do not go together; a
              # module of one side (``side``) takes neither with partial-gradient inputs (test_split_experts
              # round-trips those; partial_grad_plain, a module of columns only, test_partial_inputs).
              **{name: {"scale_rows": ("w1",), "once": (), "side": "both", "partial_grad_plain": False}
                 for name in ("ExpertsParallel",)}}


def _style_classes() -> list[type]:
    """Every ParallelStyle class torch and autotp.styles export by name."""
    found = {}
    for module in (torch_styles, styles):
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, ParallelStyle) and value is not ParallelStyle
                    and not name.startswith("_")):
                found[value.__name__] = value
    return [found[n] for n in sorted(found)]


def _instances(cls: type) -> list[ParallelStyle]:
    """``cls`` with its required options only, and with every optional one moved off its default."""
    params = emit._parameters(cls)
    required = {p.name: _REQUIRED[p.name] for p in params if p.default is p.empty}
    own = _PER_CLASS.get(cls.__name__, {})
    samples = {**_OPTIONAL, **own}
    optional = {p.name: (not p.default) if isinstance(p.default, bool) and p.name not in own else samples[p.name]
                for p in params if p.default is not p.empty}
    return [cls(**required), cls(**required, **optional)]


def _rebuild(style: ParallelStyle) -> ParallelStyle:
    names: set[str] = set()
    source = emit.render(style, names)
    namespace: dict = {}
    exec("\n".join(emit._imports(names, uses_parts=False)), namespace)
    return eval(source, namespace)


@pytest.mark.parametrize("cls", _style_classes(), ids=lambda c: c.__name__)
def test_every_style_round_trips(cls):
    """Would catch an option the export drops or writes in a form the constructor reads differently
    (torch keeps ``sequence_dim`` as ``sequence_sharding``, layouts as 1-tuples)."""
    for style in _instances(cls):
        rebuilt = _rebuild(style)
        assert type(rebuilt) is cls
        assert describe_style(rebuilt) == describe_style(style)
        assert repr(rebuilt) == repr(style)


# The spellings of the styles folded into options in issue 40's second step, each round-tripped too.
_FOLDED = [
    styles.Boundary(inputs="replicate", outputs="local", stream=0),
    styles.Boundary(inputs="replicate", columns=("q", "k"), input_grad="partial", style=ColwiseParallel()),
    styles.Boundary(outputs="gather", local_outputs=False, style=SequenceParallel()),
    styles.Boundary(outputs="gather", output_grad="partial", style=SequenceParallel(sequence_dim=0)),
    styles.Boundary(outputs="slice", output_grad="partial", sequence_dim=0, style=styles.ReplicatedWithGradAllReduce()),
    styles.Boundary(inputs="reduce_grad", style=styles.ReplicatedWithGradAllReduce()),
    styles.ReplicatedWithGradAllReduce(dtensor=True),
    styles.ShardCounts(query_heads=8, kv_names=("n_kv",), base=styles.HeadParams(shard_dims={"t": 0})),
    styles.HeadParams(shard_dims={"wq": 0, "wo": 1}, columns=("wq",), rows=("wo",), seq_output=True),
]


@pytest.mark.parametrize("style", _FOLDED, ids=repr)
def test_folded_spellings_round_trip(style):
    rebuilt = _rebuild(style)
    assert type(rebuilt) is type(style) and repr(rebuilt) == repr(style)
    assert describe_style(rebuilt) == describe_style(style)


def test_style_classes_cover_both_modules():
    names = {c.__name__ for c in _style_classes()}
    assert {"ColwiseParallel", "PrepareModuleInputOutput", "Colwise", "Boundary"} <= names


def test_emitted_sizes_are_expressions_of_the_model():
    """Phi3's fused q/k/v and gate/up parts are cut from the module's width, not hard-coded."""
    import handwritten_plans

    model = build_model("phi3")
    text = emit.emit_python(model, handwritten_plans.plan_for(model), name="phi3_plan")
    assert "_parts(model, 'model.layers.*.self_attn.qkv_proj', (1, 1, 1), dim=0)" in text
    assert "3072" not in text and "8192" not in text


def test_fixed_sizes_of_a_model_without_a_config_are_commented_after_their_comma():
    """A plain-PyTorch model has no config to write sizes from: each fixed size is written as a
    number with a comment, which must follow the argument's comma (a comma after the comment was
    commented out, and the emitted text did not parse when a fixed size was not the last option:
    ``ReplicatedKVColwise(kv_heads=..., head_dim=...)``)."""
    from torch import nn

    from autotp.styles import ReplicatedKVColwise

    model = nn.Sequential(nn.Linear(16, 8))
    plan = {"0": ReplicatedKVColwise(kv_heads=2, head_dim=4)}
    text = emit.emit_python(model, plan)  # raises unless the text rebuilds the plan
    assert "kv_heads=2,  # a fixed size" in text and "head_dim=4,  # a fixed size" in text


def _emit(capsys, tmp_path, *args) -> str:
    assert main(["plan", *args, "--emit", "python"]) == 0
    path = tmp_path / "plans.py"
    path.write_text(capsys.readouterr().out)
    return str(path)


@pytest.mark.parametrize("model, args, function", [
    ("phi3", ["--source", "handwritten"], "phi3_plan"),
    ("qwen3", ["--source", "synth", "--sp", "--tp", "2"], "qwen3_plan"),
])
def test_exported_module_passes_check_and_verify(model, args, function, capsys, tmp_path):
    """The file written for the real model is checked on it, then verified on the tiny model."""
    path = _emit(capsys, tmp_path, model, *args)
    sp = ["--sp"] if "--sp" in args else []
    assert main(["check", model, "--plan", f"{path}:{function}", "--tp", "2", *sp]) == 0
    assert "check: no finding" in capsys.readouterr().out
    assert main(["verify", model, "--plan", f"{path}:{function}", *sp]) == 0
    assert "tp=2  OK" in capsys.readouterr().out


def test_exported_function_refuses_the_other_variant(capsys, tmp_path):
    path = _emit(capsys, tmp_path, "llama", "--source", "handwritten")
    assert main(["verify", "llama", "--plan", f"{path}:llama_plan", "--sp"]) == 2
    assert "export the other with --sp" in capsys.readouterr().err


def test_emit_hf_gives_back_transformers_own_strings(capsys):
    """transformers' plan, translated by autotp and exported again, is the same strings."""
    assert main(["plan", "olmo2", "--source", "hf", "--tp", "2", "--emit", "hf"]) == 0
    exported = json.loads(capsys.readouterr().out)
    raw = raw_hf_plan(build_model("olmo2"))
    # Keys of transformers' default plan that the translation has no key for ("embed_tokens", which
    # transformers adds itself) come back as "replicate", so that from_pretrained loads exactly this plan.
    assert exported and all(raw.get(key, "replicate") == string for key, string in exported.items())


def test_emit_hf_names_styles_without_a_string_in_a_warning(capsys):
    """A partial export is still an export: exit 0, the keys left out named on stderr."""
    assert main(["plan", "llama", "--source", "handwritten", "--sp", "--emit", "hf"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["model.layers.*.self_attn.q_proj"] == "colwise"
    assert captured.err.startswith("autotp: warning: --emit hf left out 8 plan key(s)")
    assert "model.layers.*.input_layernorm (Boundary)" in captured.err
    assert captured.err.count("\n") == 1 and "error" not in captured.err


def test_emit_hf_overrides_the_defaults_transformers_would_add():
    """transformers 5.23 merges a tp_plan into the model's own plan and shards an unnamed
    embed_tokens: a plan that leaves the embedding (or any default key's module) whole must say
    "replicate", else from_pretrained shards it anyway."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from autotp.emit import emit_hf

    model = build_model("llama", tiny=True, tp=2)
    mlp = {"model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
           "model.layers.*.mlp.down_proj": RowwiseParallel()}
    tp_plan, missing = emit_hf(model, mlp)
    assert not missing
    assert tp_plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert tp_plan["model.embed_tokens"] == "replicate" and tp_plan["model.layers.*.self_attn.q_proj"] == "replicate"
    assert set(model.tp_plan) <= set(tp_plan)
