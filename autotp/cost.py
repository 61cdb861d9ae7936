"""What a plan costs each rank, read off the plan without running it: parameters and collectives.

Selection (:func:`autotp.get_plan`) ranks the plans that pass the checker by these figures:
fewer parameters per rank first, then fewer collective bytes per step.

The collective figure is a static estimate, per token of one training step (forward and
backward), of the bytes the plan's boundaries reduce or gather, counted on the styles whose
boundaries are known (each module a key matches, so every layer counts):

- a row-parallel Linear or a vocabulary-parallel embedding reduces its output in the forward: an
  all-reduce of the output width (2 units per element: reduce-scatter + all-gather), or a
  reduce-scatter under sequence parallelism (1); a :class:`~autotp.styles.Rowwise` with ``output_layouts=Partial()``
  shares its reduction with its sibling (half each); grouped experts (``ExpertsParallel``) reduce
  their output the same way;
- a column-parallel Linear gathers its output when the plan asks for it whole (1 unit), gathers its
  input under sequence parallelism (1 forward, 1 backward), and otherwise all-reduces its input's
  gradient in the backward (2), unless an ancestor holds a module whose output the plan makes a
  ``Replicate()`` DTensor (:class:`~autotp.styles.Boundary` with ``outputs="replicate"`` on the block's norm): then the
  projections reading it reduce their gradients once, counted at that module (2 x its width);
  grouped experts reduce their input's gradient the same way unless the block shares it;
- every other style counts nothing (an estimate, not a measurement: :func:`autotp.verify` counts
  the collectives a plan really runs).

The ring's ``(tp - 1) / tp`` factor is the same for every plan at one tp size and is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autotp.memory import param_bytes_per_rank
from autotp.plan import Plan, base_style, resolve
from autotp.styles import Boundary, ExpertsParallel, Rowwise


@dataclass(frozen=True)
class PlanCost:
    """Parameter bytes per rank (of ``total_bytes``) and the estimated collective bytes per token
    of a step (forward + backward) of one plan at one tp size."""

    per_rank_bytes: int
    total_bytes: int
    collective_bytes: int

    @property
    def fraction(self) -> float:
        """Parameters per rank over the model's (1.0: nothing sharded)."""
        return self.per_rank_bytes / self.total_bytes if self.total_bytes else 1.0


def plan_cost(model: nn.Module, plan: Plan, tp_size: int) -> PlanCost:
    """The :class:`PlanCost` of ``plan`` for ``model`` at ``tp_size`` (shapes only: meta is fine).

    Raises:
        PlanError: a plan key matches no module, or two keys give one module different styles.
    """
    per_rank, total = param_bytes_per_rank(model, plan, tp_size)
    return PlanCost(per_rank, total, collective_bytes_per_token(model, plan))


def collective_bytes_per_token(model: nn.Module, plan: Plan) -> int:
    """The module docstring's estimate of the bytes ``plan``'s collectives move per token of a
    forward and backward.

    >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    >>> mlp = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False))
    >>> collective_bytes_per_token(mlp, {"0": ColwiseParallel(), "1": RowwiseParallel()})  # 2 x 4 fp32, each way
    64
    """
    resolved = {fqn: base_style(style) for fqn, (_, style) in resolve(model, plan).items()}
    modules = dict(model.named_modules())
    shared = {_parent(fqn) for fqn, style in resolved.items() if isinstance(style, Boundary) and style.shares_output}
    hidden = _hidden_size(model)
    units = 0.0  # elements moved, counted as described in the module docstring
    for fqn, style in resolved.items():
        module = modules[fqn]
        width_in, width_out = _widths(module, hidden)
        ancestors_share = any(fqn.startswith(f"{p}.") or not p for p in shared)
        if isinstance(style, RowwiseParallel):
            factor = 0.5 if isinstance(style, Rowwise) and style.partial_output else 1.0
            units += factor * _reduce_units(getattr(style, "output_layouts", None)) * width_out
        elif isinstance(style, ColwiseParallel):
            if _is(getattr(style, "output_layouts", None), Replicate):
                units += width_out
            if _is(getattr(style, "input_layouts", None), Shard):
                units += 2 * width_in
            elif not ancestors_share:
                units += 2 * width_in
        elif isinstance(style, ExpertsParallel):
            units += 2 * hidden + (0 if ancestors_share else 2 * hidden)
        elif isinstance(style, Boundary) and style.shares_output:
            units += 2 * width_out
    return int(units * _element_size(model))



def _reduce_units(layouts) -> int:
    """2 for an all-reduce to ``Replicate()`` (the default), 1 for a reduce-scatter to ``Shard``."""
    return 1 if _is(layouts, Shard) else 2


def _is(layouts, kind) -> bool:
    layouts = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
    return any(isinstance(layout, kind) for layout in layouts)


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _widths(module: nn.Module, hidden: int) -> tuple[int, int]:
    """Input and output feature widths of ``module`` (a Linear's, an Embedding's output, a norm's
    weight), else the model's hidden size."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if isinstance(module, nn.Embedding):
        return 0, module.embedding_dim  # token ids: no gradient to reduce
    weight = getattr(module, "weight", None)
    if isinstance(weight, nn.Parameter) and weight.dim() >= 1:
        return weight.shape[-1], weight.shape[-1]
    return hidden, hidden


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "hidden_size", None)
    return size if isinstance(size, int) else 0


def _element_size(module: nn.Module) -> int:
    for param in module.parameters():
        if param.is_floating_point():
            return param.element_size()
    return 4
