"""The public styles after issue 40's fold: fewer names, each old spelling an option of a kept style.

What each folded style shards and communicates is checked where plans use it (the synthesis
matrix, the handwritten plans, test_backward_comm's collective counts); here: the surface itself.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from autotp import styles
from autotp._simulate import simulated_mesh
from autotp.errors import PlanError
from autotp.styles.declared import declaration


def _public_styles() -> list[str]:
    return [n for n in styles.__all__ if inspect.isclass(getattr(styles, n))
            and issubclass(getattr(styles, n), ParallelStyle)]


def test_public_styles_are_20_and_every_one_is_exported():
    names = _public_styles()
    assert len(names) == 20, names
    defined = {n for n, v in vars(styles).items() if inspect.isclass(v) and issubclass(v, ParallelStyle)}
    assert defined == set(names), defined ^ set(names)


@pytest.mark.parametrize("old", sorted(styles.RENAMED))
def test_a_folded_name_says_its_new_spelling(old):
    with pytest.raises(AttributeError, match=r"folded into another style's options: use \w+\("):
        getattr(styles, old)
    new = styles.RENAMED[old].split("(")[0]
    assert new in styles.__all__, new


@pytest.mark.parametrize("case", [
    ({"inputs": "scatter"}, "inputs='scatter'; use one of"),
    ({"inputs": "gather", "input_grad": "partial"}, "only inputs taken as 'replicate'"),
    ({"outputs": "replicate", "output_grad": "partial"}, "drop outputs"),
    ({"outputs": "shard"}, "needs inputs='gather'"),
    ({"stream": 0}, "set inputs='replicate'"),
    ({"inputs": "replicate", "stream": 0, "input_grad": "partial"}, "drop columns and input_grad"),
    ({"outputs": "gather", "style": SequenceParallel(use_local_output=True)}, "must stay a Shard"),
    ({"outputs": "sum", "output_grad": "partial"}, "or use 'gather' / 'slice'"),
])
def test_boundary_refuses_sides_that_do_not_go_together(case):
    options, message = case  # one parameter: every case runs in the default tier (conftest keeps a
    # test with several parameters at its base case there)
    with pytest.raises(PlanError, match=message):
        styles.Boundary(**options)


def test_folded_linear_options_declare_what_the_old_classes_did():
    assert declaration(styles.Colwise(sizes=(4, 2, 2))).sizes == (4, 2, 2)
    assert declaration(styles.Colwise(weight_in_out=True)).weight_in_out
    assert declaration(styles.Rowwise(weight_in_out=True)).weight_in_out
    partial_row = declaration(styles.Rowwise(output_layouts=Partial(), use_local_output=False))
    assert partial_row.linear == "row" and not partial_row.scatters_heads


def test_boundary_sides_on_two_ranks():
    """Each side converts as documented: a partial output summed, a plain one wrapped Replicate(),
    a sequence-sharded input gathered and the whole result sliced back to this rank's positions."""
    with simulated_mesh(2) as mesh:
        summed = styles.Boundary(outputs="sum")._apply(nn.Identity(), mesh)
        out = summed(torch.ones(2, 3))
        assert not isinstance(out, DTensor) and torch.equal(out, torch.full((2, 3), 2.0))

        shared = styles.Boundary(outputs="replicate")._apply(nn.Identity(), mesh)
        out = shared(torch.ones(2, 3))
        assert isinstance(out, DTensor) and out.placements == (Replicate(),)

        seen = []

        class Block(nn.Module):
            def forward(self, x):
                seen.append(x)
                return x * 2

        block = styles.Boundary(inputs="gather", outputs="shard")._apply(Block(), mesh)
        stream = torch.arange(8.0).view(1, 4, 2)
        sharded = DTensor.from_local(stream, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        out = block(sharded)
        assert not isinstance(seen[0], DTensor) and seen[0].shape == (1, 4, 2)  # whole and plain inside
        assert isinstance(out, DTensor) and out.placements == (Shard(1),)
        assert torch.equal(out.full_tensor(), stream * 2)


def test_second_fold_sides_on_two_ranks():
    """The sides the second fold added: a sequence-parallel norm's output gathered once (plain, or
    kept a Replicate() DTensor), a whole output cut to this rank's positions (with a gradient that
    comes back partial and is summed in the parameters), and the stream alone taken as a DTensor."""
    with simulated_mesh(2) as mesh:
        stream = torch.arange(16.0).view(1, 4, 4)
        sharded = DTensor.from_local(stream, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        for local in (True, False):
            norm = styles.Boundary(outputs="gather", local_outputs=local, style=SequenceParallel())._apply(
                nn.LayerNorm(4), mesh)
            out = norm(sharded)
            assert isinstance(out, DTensor) is not local
            assert torch.allclose(out.full_tensor() if not local else out, nn.functional.layer_norm(stream, (4,)))

        table = nn.Linear(4, 4)
        whole = table(stream)
        cut = styles.Boundary(outputs="slice", output_grad="partial", style=styles.ReplicatedWithGradAllReduce())._apply(
            table, mesh)
        out = cut(stream)
        assert isinstance(out, DTensor) and out.placements == (Shard(1),)
        assert torch.allclose(out.full_tensor(), whole)
        out.full_tensor().sum().backward()
        assert torch.allclose(table.weight.grad.full_tensor(), torch.ones(1, 4, 4).mul(stream).sum((0, 1)).expand(4, 4))

        whole_grad = torch.randn(1, 4, 4, requires_grad=True)  # without output_grad: the gradient gathered whole
        cut = styles.Boundary(outputs="slice")._apply(nn.Identity(), mesh)(whole_grad)
        assert isinstance(cut, DTensor) and cut.placements == (Shard(1),) and cut.to_local().shape == (1, 2, 4)
        cut.full_tensor().sum().backward()
        assert torch.equal(whole_grad.grad, torch.ones(1, 4, 4))

        seen = []

        class Block(nn.Module):
            def forward(self, x, scale):
                seen.append((x, scale))
                return x * scale

        block = styles.Boundary(inputs="replicate", outputs="local", stream=0)._apply(Block(), mesh)
        out = block(stream, torch.ones(1))
        assert isinstance(seen[0][0], DTensor) and not isinstance(seen[0][1], DTensor)
        assert not isinstance(out, DTensor) and torch.equal(out, stream)
        with pytest.raises(PlanError, match="found no such input"):
            styles.Boundary(inputs="replicate", outputs="local", stream="hidden")._apply(Block(), mesh)(stream, 1.0)


def test_a_sliced_output_with_partial_gradients_needs_the_parameters_reduced():
    """Every parameter behind a cut whose gradient comes back partial must have that gradient
    summed: a child's parameters, or the module's own without ``ReplicatedWithGradAllReduce``, are refused."""
    with simulated_mesh(2) as mesh:
        with pytest.raises(PlanError, match="belongs to a child"):
            styles.Boundary(outputs="slice", output_grad="partial")._apply(nn.Sequential(nn.Linear(2, 2)), mesh)
        with pytest.raises(PlanError, match="add style=ReplicatedWithGradAllReduce"):
            styles.Boundary(outputs="slice", output_grad="partial")._apply(nn.Linear(2, 2), mesh)


def test_the_plan_table_shows_only_the_options_a_style_sets():
    """A folded style carries many options at their defaults; the CLI table lists the ones set."""
    from autotp.cli_text import plan_rows

    rows = plan_rows({"norm": styles.Boundary(outputs="replicate"),
                      "fused": styles.Colwise(sizes=(8, 4, 4)),
                      "row": styles.Rowwise(output_layouts=Partial(), use_local_output=False),
                      "sp_norm": styles.Boundary(outputs="gather", local_outputs=False, style=SequenceParallel())})
    options = {row[0]: row[5] for row in rows}
    assert options == {"norm": "outputs=replicate", "fused": "sizes=8,4,4", "row": "",
                       "sp_norm": "local_outputs=False, outputs=gather"}, options  # a wrapper's own options too


def test_a_forward_that_raises_leaves_its_mode():
    """``mode_during_forward`` leaves the mode it entered when the forward raises: a mode left on
    the stack pops the wrong mode when an enclosing ``torch.device("meta")`` exits, so every tensor
    made afterwards (a whole model) would land on meta."""
    import torch
    from torch import nn
    from torch.overrides import TorchFunctionMode

    from autotp.styles.base import mode_during_forward

    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("a per-rank run that fails on a shape")

    module = Raises()
    mode_during_forward(module, TorchFunctionMode)
    with torch.device("meta"), pytest.raises(ValueError):
        module(torch.ones(1))
    assert torch.ones(1).device.type == "cpu"
