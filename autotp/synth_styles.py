"""ParallelStyles that only synthesized plans use (kept apart from :mod:`autotp.styles`).

- :class:`PartialExpertsParallel`: :class:`~autotp.styles.ExpertsParallel` that leaves its output a
  per-rank partial sum, for the MoE block around it to reduce-scatter under sequence parallel.
- :class:`GatherSequenceInput`: all-gather a module's sequence-sharded inputs once at its entry,
  for column Linears that read the residual stream with no norm before them.
- :class:`SequenceParallelMoEBlock`: a MoE block under sequence parallel: whole tokens in (its
  dispatch indexes them with plain ids), its experts' partial sums reduce-scattered out.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp.styles import ExpertsParallel

__all__ = ["GatherSequenceInput", "PartialExpertsParallel", "SequenceParallelMoEBlock"]


class PartialExpertsParallel(ExpertsParallel):
    """Experts sharded on their FFN dim whose output stays a per-rank partial sum (no all-reduce).

    Under sequence parallel the MoE block's output goes back to the ``Shard(1)`` residual stream.
    :class:`~autotp.styles.ExpertsParallel` would all-reduce the partial sum and the block would
    then drop all but its own sequence slice: a reduce-scatter does the same with half the traffic.
    So the reduction is left to the block: ``PrepareModuleOutput(output_layouts=Partial(),
    desired_output_layouts=Shard(1))``. The inputs' gradients are still all-reduced (each rank's
    slice of every expert contributes to them), as in the parent style.

    Keyword Args:
        shard_dims, packed: as for :class:`~autotp.styles.ExpertsParallel`.

    Example::
        >>> from torch.distributed.tensor import Partial, Shard
        >>> from torch.distributed.tensor.parallel import PrepareModuleOutput
        >>> plan = {"model.layers.*.mlp.experts": PartialExpertsParallel(),
        ...         "model.layers.*.mlp": PrepareModuleOutput(output_layouts=Partial(),
        ...                                                   desired_output_layouts=Shard(1))}
    """

    def _prepare_output(self, output, device_mesh):
        return output


class GatherSequenceInput(ParallelStyle):
    """All-gather a module's sequence-sharded inputs once, for the column Linears inside it.

    Without a norm before them (OLMo2 normalises after attention and MLP), q, k and v read the
    ``Shard(1)`` residual stream directly, and ``ColwiseParallel(input_layouts=Shard(1))`` on each
    would all-gather the same tensor three times. Here every DTensor argument sharded on the
    sequence is redistributed to ``Replicate()`` once, at the module's entry, and passed on as a
    plain tensor; positional or keyword, whatever the caller used.

    Keyword Args:
        sequence_dim (int): the sequence dimension of the sharded inputs. Default: 1.
        reshard_output (bool): the module's (first) output is the residual stream itself (a whole
            decoder block kept replicated): return it as a ``Shard(sequence_dim)`` DTensor, this
            rank's slice of the whole-sequence result. Default: False.
        use_local_output (bool): pass the gathered inputs on as plain tensors; ``False`` keeps
            them ``Replicate()`` DTensors (only where every reader is a column Linear). Default: True.

    Example::
        >>> plan = {"model.layers.*.self_attn": GatherSequenceInput()}
    """

    def __init__(self, *, sequence_dim: int = 1, reshard_output: bool = False, use_local_output: bool = True):
        super().__init__()
        self.sequence_dim = sequence_dim
        self.reshard_output = reshard_output
        self.use_local_output = use_local_output

    @staticmethod
    def _gather(sequence_dim, use_local_output, value):
        if isinstance(value, DTensor) and value.placements == (Shard(sequence_dim),):
            value = value.redistribute(placements=[Replicate()])
            # Kept a DTensor, the column Linears' Partial() input gradients are summed and the
            # all-gather's backward reduce-scatters them once.
            return value.to_local() if use_local_output else value
        return value

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        gather = partial(self._gather, self.sequence_dim, self.use_local_output)

        def pre_hook(mod, args, kwargs):
            return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        if self.reshard_output:
            def slice_back(value):
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    whole = DTensor.from_local(value, device_mesh, [Replicate()], run_check=False)
                    return whole.redistribute(placements=[Shard(self.sequence_dim)])
                return value

            def hook(mod, args, out):
                if type(out) in (tuple, list) and out:  # (hidden, attentions...), as a tuple or a list
                    return type(out)([slice_back(out[0]), *out[1:]])
                return slice_back(out)

            module.register_forward_hook(hook)
        return module

    def __repr__(self) -> str:
        extra = ", reshard_output=True" if self.reshard_output else ""
        extra += "" if self.use_local_output else ", use_local_output=False"
        return f"{self.__class__.__name__}(sequence_dim={self.sequence_dim}{extra})"


class SequenceParallelMoEBlock(GatherSequenceInput):
    """A MoE block (router, experts, the combine) on the sequence-sharded residual stream.

    The block's dispatch indexes tokens with plain ids (``y[token_idx]``, a scatter of routed
    rows), which a ``Shard(1)`` DTensor cannot take: any input still sharded on the sequence is
    all-gathered once at the block's entry (a norm before it usually did that already, and then
    nothing happens here), so router and experts see every token as plain ``(tokens, C)`` rows.
    The experts (:class:`PartialExpertsParallel`) leave per-rank partial sums, so the block's output
    is a ``Partial()`` DTensor reduce-scattered to ``Shard(1)``: one collective out, as a row
    Linear's under sequence parallel.

    Keyword Args:
        sequence_dim (int): the sequence dimension of the stream. Default: 1.

    Example::
        >>> plan = {"model.layers.*.mlp": SequenceParallelMoEBlock(),
        ...         "model.layers.*.mlp.experts": PartialExpertsParallel()}
    """

    def __init__(self, *, sequence_dim: int = 1):
        super().__init__(sequence_dim=sequence_dim)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        sequence_dim = self.sequence_dim

        def reduce_scatter(value):
            # The experts' output on each rank is its shard's share of every token: a partial sum.
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                partial_sum = DTensor.from_local(value, device_mesh, [Partial()], run_check=False)
                return partial_sum.redistribute(placements=[Shard(sequence_dim)])
            return value

        def hook(mod, args, out):
            if type(out) in (tuple, list) and out:  # (hidden, router logits...): the first is the stream
                return type(out)([reduce_scatter(out[0]), *out[1:]])
            return reduce_scatter(out)

        module.register_forward_hook(hook)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(sequence_dim={self.sequence_dim})"
