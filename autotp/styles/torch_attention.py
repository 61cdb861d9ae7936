"""torch's own ``nn.MultiheadAttention`` sharded by heads, as Megatron shards attention.

``F.multi_head_attention_forward`` computes the head size from its input's width (``embed_dim //
num_heads``) and reads ``in_proj_weight`` as one raw parameter: no count divided per rank and no
stand-in makes it run on a shard. :class:`MultiheadAttentionParallel` shards the parameters (the
packed q/k/v input projection by heads, each part apart; ``out_proj`` by its input features) and
gives the module a per-rank forward with the same semantics, run on the heads this rank holds.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp.errors import MeshError, PlanError, working_tp_sizes
from autotp.styles.base import all_reduce_backward, all_reduce_forward, packed_row_order, permute_rows


class MultiheadAttentionParallel(ParallelStyle):
    """Shard an ``nn.MultiheadAttention`` by heads: each rank holds ``num_heads / tp`` heads.

    The packed ``in_proj_weight`` ``(3E, E)`` (and ``in_proj_bias``) is column-parallel part by
    part: its rows are permuted by :func:`~autotp.styles.packed_row_order` so that the contiguous
    ``Shard(0)`` of rank r is its slice of q, of k and of v (separate ``q/k/v_proj_weight``, when
    kdim or vdim differ from ``embed_dim``, are each ``Shard(0)``); ``bias_k`` / ``bias_v`` are
    sharded with the heads (``Shard(2)``). ``out_proj.weight`` is row-parallel (``Shard(1)``, as
    Linear is ``x @ W^T``): the rank's partial sum is reduced, then the replicated ``out_proj.bias``
    added once. The module's forward is replaced by a per-rank one (its class becomes
    :class:`LocalMultiheadAttention`) with the semantics of ``F.multi_head_attention_forward``: bool
    or float ``attn_mask`` (a per-head 3-D one sliced to the rank's heads), ``key_padding_mask``,
    ``is_causal``, ``batch_first``, unbatched inputs, ``add_zero_attn``, dropout. With
    ``need_weights`` the head-averaged weights are the sum of the rank's heads, all-reduced, over
    ``num_heads``; per-head weights are all-gathered.

    Inputs are taken whole: a plain tensor (its gradient all-reduced), or a DTensor of any layout
    (gathered, its gradient reduced back to that layout: a ``Replicate()`` one from a norm before it
    is reduced once there).

    Keyword Args:
        sequence_parallel (bool): the output returns to a sequence-sharded stream: the partial sum
            is reduce-scattered to the query's own ``Shard`` layout (``Shard(1)``, the stream's, when
            the query arrives whole) and returned as a DTensor, instead of all-reduced to a plain
            tensor. Default: False.

    Example::
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> plan = {"layers.*.self_attn": MultiheadAttentionParallel(),
        ...         "layers.*.linear1": ColwiseParallel(), "layers.*.linear2": RowwiseParallel()}
    """

    def __init__(self, *, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.MultiheadAttention:
            raise PlanError(module=type(module).__name__, found="MultiheadAttentionParallel applied to it",
                            required="an nn.MultiheadAttention (its forward is replaced by a per-rank one)",
                            fix="use it on nn.MultiheadAttention modules only")
        tp = device_mesh.size()
        if module.num_heads % tp:
            raise MeshError(module="nn.MultiheadAttention", found=f"{module.num_heads} heads",
                            required=f"tp={tp} divides them", fix=f"use tp in {working_tp_sizes([module.num_heads])}",
                            tp_sizes=working_tp_sizes([module.num_heads]))
        width = module.embed_dim
        order = packed_row_order((width,) * 3, tp)
        for name, dim, packed in (("in_proj_weight", 0, True), ("in_proj_bias", 0, True), ("q_proj_weight", 0, False),
                                  ("k_proj_weight", 0, False), ("v_proj_weight", 0, False), ("bias_k", 2, False),
                                  ("bias_v", 2, False)):
            _shard(module, name, device_mesh, dim, order if packed else None)
        _shard(module.out_proj, "weight", device_mesh, 1)
        if module.out_proj.bias is not None:
            bias = module.out_proj.bias
            module.out_proj.register_parameter("bias", nn.Parameter(
                distribute_tensor(bias.detach(), device_mesh, [Replicate()]), requires_grad=bias.requires_grad))
        module.__class__ = LocalMultiheadAttention
        module._autotp_mesh, module._autotp_sequence_parallel = device_mesh, self.sequence_parallel
        return module

    def __repr__(self) -> str:
        extra = "sequence_parallel=True" if self.sequence_parallel else ""
        return f"{self.__class__.__name__}({extra})"


def _shard(module: nn.Module, name: str, mesh: DeviceMesh, dim: int, order: torch.Tensor | None = None) -> None:
    """``module.name`` as a ``Shard(dim)`` DTensor parameter; with ``order``, its rows permuted first
    (the parameter keeps that order; ``_autotp_to_layout`` maps an unsharded tensor to it)."""
    param = getattr(module, name)
    if param is None:
        return
    value = param.detach()
    if order is not None:
        value = permute_rows(value, dim=dim, order=order.to(value.device))
    new = nn.Parameter(distribute_tensor(value, mesh, [Shard(dim)]), requires_grad=param.requires_grad)
    if order is not None:
        new._autotp_to_layout = partial(permute_rows, dim=dim, order=order)
    module.register_parameter(name, new)


def _local(value: torch.Tensor | None) -> torch.Tensor | None:
    return value.to_local() if isinstance(value, DTensor) else value


def _whole_inputs(values: tuple, mesh: DeviceMesh) -> list:
    """The inputs as plain whole tensors whose gradient is summed over ranks (each rank's covers
    only its heads); one conversion per distinct tensor, so ``query is key is value`` still holds."""
    done: dict[int, torch.Tensor] = {}
    for value in values:
        if id(value) in done:
            continue
        if isinstance(value, DTensor):
            whole = value.redistribute(placements=[Replicate()] * mesh.ndim)
            done[id(value)] = whole.to_local(grad_placements=[Partial()] * mesh.ndim)
        else:
            done[id(value)] = all_reduce_backward(value, mesh)
    return [done[id(v)] for v in values]


class LocalMultiheadAttention(nn.MultiheadAttention):
    """An ``nn.MultiheadAttention`` after :class:`MultiheadAttentionParallel`: its forward runs this
    rank's heads (never instantiated directly)."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        mesh = self._autotp_mesh
        F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, self.num_heads)
        # Under SP the output takes the query's sequence sharding back (a sequence-first query
        # transposed from the (b, t, d) stream arrives Shard(0)).
        layout = query.placements[0] if isinstance(query, DTensor) and query.placements[0].is_shard() else Shard(1)
        query, key, value = _whole_inputs((query, key, value), mesh)
        batched = query.dim() == 3
        if self.batch_first and batched:  # the "is" relations kept: they pick the fused projection
            swapped = {id(v): v.transpose(1, 0) for v in (query, key, value)}
            query, key, value = (swapped[id(v)] for v in (query, key, value))
        out, weights = self._heads_forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                           average_attn_weights, is_causal, batched)
        if self.batch_first and batched:
            out = out.transpose(1, 0)
        return self._reduce(out, layout if self._autotp_sequence_parallel else Replicate()), weights

    def _reduce(self, partial_sum: torch.Tensor, layout):
        """The rank's partial output summed over ranks into ``layout`` (reduce-scattered on the
        sequence under SP), then ``out_proj.bias`` added once."""
        mesh, bias = self._autotp_mesh, self.out_proj.bias
        out = DTensor.from_local(partial_sum, mesh, [Partial()], run_check=False).redistribute(placements=[layout])
        if bias is not None:
            out = out + bias
        return out if self._autotp_sequence_parallel else out.to_local()

    def _project(self, query, key, value):
        """q, k, v of this rank's heads (each ``(len, batch, heads / tp * head_dim)``)."""
        bias = _local(self.in_proj_bias)
        biases = bias.chunk(3) if bias is not None else (None,) * 3
        if not self._qkv_same_embed_dim:
            weights = (_local(self.q_proj_weight), _local(self.k_proj_weight), _local(self.v_proj_weight))
            return tuple(F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
        weight = _local(self.in_proj_weight)  # rows [q_r | k_r | v_r]
        if query is key and key is value:
            return F.linear(query, weight, bias).chunk(3, dim=-1)
        w_q, w_k, w_v = weight.chunk(3)
        q = F.linear(query, w_q, biases[0])
        if key is value:
            k, v = F.linear(key, torch.cat([w_k, w_v]), None if bias is None else torch.cat(biases[1:])).chunk(2, -1)
            return q, k, v
        return q, F.linear(key, w_k, biases[1]), F.linear(value, w_v, biases[2])

    def _local_mask(self, attn_mask, bsz, tgt_len, src_len):
        """A per-head 3-D mask ``(bsz * num_heads, L, S)`` cut to this rank's heads (no communication)."""
        if attn_mask is None:
            return None
        if attn_mask.dim() == 2:  # one (L, S) mask for every head
            return attn_mask.unsqueeze(0)
        per_head = attn_mask.view(bsz, self.num_heads, tgt_len, src_len)
        mine = DTensor.from_local(per_head, self._autotp_mesh, [Replicate()], run_check=False)
        mine = mine.redistribute(placements=[Shard(1)]).to_local()
        return mine.reshape(-1, tgt_len, src_len)

    def _heads_forward(self, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                       is_causal, batched):
        """``F.multi_head_attention_forward`` after its input projection, on this rank's heads: the
        partial output (before ``out_proj``'s bias) and the weights over all heads."""
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
        tgt_len, bsz, _ = query.shape
        heads, head_dim = self.num_heads // self._autotp_mesh.size(), self.head_dim
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # sdpa's own causal mask, as torch does
        else:
            attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                          target_type=query.dtype, check_other=False)
            is_causal = is_causal and key_padding_mask is None
        q, k, v = self._project(query, key, value)
        attn_mask = self._local_mask(attn_mask, bsz, tgt_len, key.shape[0])
        if self.bias_k is not None:
            k = torch.cat([k, _local(self.bias_k).repeat(1, bsz, 1)])
            v = torch.cat([v, _local(self.bias_v).repeat(1, bsz, 1)])
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
        q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = k.new_zeros(bsz * heads, 1, head_dim)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            key_padding_mask = F.pad(key_padding_mask, (0, 1)) if key_padding_mask is not None else None
        src_len = k.shape[1]
        if key_padding_mask is not None:
            padding = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, heads, -1, -1).reshape(-1, 1, src_len)
            attn_mask = padding if attn_mask is None else attn_mask + padding
        dropout_p = self.dropout if self.training else 0.0
        out_weight = _local(self.out_proj.weight)
        if need_weights:
            scores = q * math.sqrt(1.0 / head_dim)
            scores = torch.baddbmm(attn_mask, scores, k.transpose(-2, -1)) if attn_mask is not None else torch.bmm(
                scores, k.transpose(-2, -1))
            weights = F.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len, bsz, heads * head_dim)
            weights = self._all_heads(weights.view(bsz, heads, tgt_len, src_len), average_attn_weights)
            out = F.linear(out, out_weight)
            return (out, weights) if batched else (out.squeeze(1), weights.squeeze(0))
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0) if attn_mask.shape[0] == 1 else attn_mask.view(bsz, heads, -1, src_len)
        out = F.scaled_dot_product_attention(q.view(bsz, heads, tgt_len, head_dim), k.view(bsz, heads, src_len, head_dim),
                                             v.view(bsz, heads, src_len, head_dim), attn_mask, dropout_p, is_causal)
        out = F.linear(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, heads * head_dim), out_weight)
        return (out, None) if batched else (out.squeeze(1), None)

    def _all_heads(self, weights: torch.Tensor, average: bool) -> torch.Tensor:
        """Attention weights over every head from this rank's: the mean (local sum all-reduced over
        ``num_heads``) or all heads gathered on dim 1."""
        mesh = self._autotp_mesh
        if average:
            return all_reduce_forward(weights.sum(dim=1) / self.num_heads, mesh)
        return DTensor.from_local(weights, mesh, [Shard(1)], run_check=False).full_tensor()
