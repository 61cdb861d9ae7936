"""The vocab-parallel embedding: a table sharded over its rows, looked up on the local shard."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel

from autotp._simulate import mesh_coordinate

from autotp.errors import PlanError


class VocabParallelEmbedding(RowwiseParallel):
    """Shard an embedding table over the vocabulary; each rank looks up only the rows it holds.

    ``weight`` is ``Shard(0)``: rank r holds rows ``[r * c, r * c + local)`` with ``c = ceil(V / tp)``
    (torch's ``Shard(0)`` split). During the module's forward the weight is swapped for its local
    shard (``to_local(grad_placements=(Shard(0),))``) and the module's own lookup (its
    ``F.embedding`` / ``torch.embedding`` call on that weight) runs on the shard: ids shifted by the
    rank's offset, ids the rank does not own looked up as row 0 and their output rows zeroed. Each
    rank's output is then a partial sum of the full lookup, reduced on the spot: all-reduce to
    ``Replicate()``, or reduce-scatter to ``Shard(1)`` when ``output_layouts`` says so (sequence
    parallel). Because the lookup's backward only ever sees the local table, the weight's gradient
    is ``Shard(0)`` with the local size on every rank: no full-size gradient is materialised (torch's
    DTensor embedding backward, and stock ``RowwiseParallel``, return a ``Replicate()`` full table).

    What the module does after the lookup (a scale, a norm) runs on the reduced rows: plain tensors
    when replicated, a ``Shard(1)`` DTensor under sequence parallel. Where the module has parameters
    besides ``weight`` (its own or its children's), the rows are all-reduced first and only cut to
    ``output_layouts`` on the way out, so those parameters see whole rows on every rank. A module that unwraps a DTensor weight
    itself (torchtitan's ``Embedding``: ``weight.to_local() if isinstance(weight, DTensor)``) sees a
    plain weight and takes its plain path, whose lookup is the one run on the shard. ``padding_idx``
    is honoured (no gradient to that row); ``scale_grad_by_freq`` and ``sparse`` are not supported.

    Keyword Args:
        input_layouts, output_layouts, use_local_output: as for :class:`RowwiseParallel`.

    Raises:
        PlanError: the module is not an ``nn.Embedding``, its forward never looked up its weight
            with ``F.embedding``, or it asks for ``scale_grad_by_freq`` / ``sparse`` gradients.

    Example::
        >>> plan = {"model.embed_tokens": VocabParallelEmbedding(input_layouts=Replicate())}
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)  # raises: RowwiseParallel's own message
        _require_plain_lookup(module)
        for name, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if name == "weight" else Replicate()
            dist = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        lookup = _ShardLookup(module, device_mesh, input_layout=self.input_layouts[0],
                              output_layouts=tuple(self.output_layouts), use_local_output=self.use_local_output)
        module.register_forward_pre_hook(lookup.enter, with_kwargs=True)
        module.register_forward_hook(lookup.leave, always_call=True)
        return module


def _require_plain_lookup(module: nn.Embedding) -> None:
    """Raise if ``module`` asks for a lookup gradient the shard cannot give."""
    if getattr(module, "scale_grad_by_freq", False) or getattr(module, "sparse", False):
        raise PlanError(
            f"{type(module).__name__}: VocabParallelEmbedding found scale_grad_by_freq="
            f"{module.scale_grad_by_freq}, sparse={module.sparse}; a vocab-sharded lookup needs both False "
            "(frequencies and sparse rows span ranks). Leave this embedding replicated (no plan key)."
        )


def _shard_offset(weight: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
    """First vocabulary row this rank holds: ``rank * ceil(V / tp)``, torch's ``Shard(0)`` split."""
    rows, ranks = weight.shape[0], device_mesh.size()
    return -(-rows // ranks) * mesh_coordinate(device_mesh)


class _ShardLookup(torch.overrides.TorchFunctionMode):
    """The forward hooks of :class:`VocabParallelEmbedding` on one module, and the torch-function
    mode, active only during that module's forward, that runs its embedding lookup on the shard."""

    def __init__(self, module: nn.Module, device_mesh: DeviceMesh, *, input_layout, output_layouts,
                 use_local_output: bool):
        super().__init__()
        self.mesh = device_mesh
        self.input_layout, self.output_layouts, self.use_local_output = input_layout, output_layouts, use_local_output
        # Parameters besides the table, or children with parameters: they must see whole rows.
        others = [n for n, _ in module.named_parameters() if n != "weight"]
        self.reduce_to = (Replicate(),) if others else output_layouts
        self.saved: dict[str, nn.Parameter] = {}
        self.local_weight = None
        self.reduced: DTensor | None = None

    def enter(self, mod, args, kwargs):
        """Pre-hook: plain replicated ids, local parameters, lookups redirected to the shard."""
        for name, param in list(mod._parameters.items()):
            if isinstance(param, DTensor):
                self.saved[name] = param
                grad = (Shard(0),) if name == "weight" else (Replicate(),)
                mod._parameters[name] = param.to_local(grad_placements=grad)
        self.local_weight, self.reduced = mod._parameters["weight"], None
        self.__enter__()
        return tuple(self._ids(a) for a in args), {k: self._ids(v) for k, v in kwargs.items()}

    def _ids(self, x):
        # Every integer tensor becomes the whole ids as a plain tensor: the module may compute
        # its ids from a mask, or take them by keyword.
        if not isinstance(x, torch.Tensor) or x.is_floating_point():
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, (self.input_layout,), run_check=False)
        return x.redistribute(placements=(Replicate(),)).to_local()

    def leave(self, mod, args, output):
        """Post-hook: parameters restored; the output cut to ``output_layouts``, a DTensor unless
        ``use_local_output``."""
        self.__exit__(None, None, None)
        mod._parameters.update(self.saved)
        self.saved.clear()
        looked_up, self.reduced, self.local_weight = self.reduced is not None, None, None
        if output is None:  # the forward raised (an always-call hook): its error is the one to see
            return output
        if not looked_up:
            raise PlanError(
                f"{type(mod).__name__}: VocabParallelEmbedding found a forward that never looks up its "
                "weight with F.embedding (it indexes or transforms the table itself), so the vocab-sharded "
                "lookup cannot run. Leave this embedding replicated (no plan key for it)."
            )
        if isinstance(output, DTensor):
            if tuple(output.placements) != self.output_layouts:
                output = output.redistribute(placements=self.output_layouts)
            return output.to_local() if self.use_local_output else output
        if not isinstance(output, torch.Tensor):
            return output
        return self._laid_out(output)

    def _laid_out(self, output: torch.Tensor):
        """``output``, computed from rows all-reduced to ``Replicate()`` (a module with other
        parameters), cut to ``output_layouts``: a local chunk, no communication forward."""
        out = DTensor.from_local(output, self.mesh, (Replicate(),), run_check=False)
        if tuple(out.placements) != self.output_layouts:
            out = out.redistribute(placements=self.output_layouts)
        return out.to_local() if self.use_local_output else out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.embedding:
            bound = inspect.signature(torch.nn.functional.embedding).bind(*args, **kwargs)
        elif func is torch.embedding:
            bound = inspect.signature(_aten_embedding).bind(*args, **kwargs)
            if bound.arguments.get("padding_idx", -1) == -1:
                bound.arguments["padding_idx"] = None
        else:
            return func(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["weight"] is not self.local_weight:
            return func(*args, **kwargs)
        return self._lookup(**bound.arguments)

    def _lookup(self, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, **_):
        """The shard's part of ``F.embedding(input, full_weight)``, reduced to ``self.reduce_to``."""
        table = self.saved["weight"]
        offset = _shard_offset(table, self.mesh).to(input.device)
        # Rows [offset, offset + local) live here: other ids read row 0, and their rows are zeroed below.
        foreign = (input < offset) | (input >= offset + weight.shape[0])
        local_ids = (input - offset).masked_fill(foreign, 0)
        rows = torch.nn.functional.embedding(local_ids, weight, None, max_norm, norm_type)
        rows = rows.masked_fill(foreign.unsqueeze(-1), 0)
        if padding_idx is not None:  # F.embedding sends no gradient to the padding row
            pad = (input == padding_idx % table.shape[0]).unsqueeze(-1)
            rows = torch.where(pad, rows.detach(), rows)
        partial_sum = DTensor.from_local(rows, self.mesh, (Partial(),), run_check=False)
        self.reduced = partial_sum.redistribute(placements=self.reduce_to)
        if any(isinstance(p, Shard) for p in self.reduce_to):
            # Sequence-sharded rows stay a DTensor for the rest of the module (a scale is fine on
            # it): a plain local shard of an uneven sequence could not be wrapped back exactly.
            return self.reduced
        return self.reduced.to_local()


def _aten_embedding(weight, input, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Signature of ``torch.embedding`` (``aten.embedding``), whose -1 means no padding row."""
