"""The NeMo-RL DTensor helpers against the unsharded computation, on simulated ranks."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autotp._simulate import per_rank, simulated_mesh
from autotp.dtensor_utils import (
    clip_grad_by_total_norm_,
    get_grad_norm,
    get_logprobs_from_vocab_parallel_logits,
    to_local_if_dtensor,
)
from autotp.errors import AutoTPError


def _reference_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log_softmax + gather on the whole vocabulary, logits[:, t] scoring ids[:, t + 1]."""
    return torch.gather(F.log_softmax(logits[:, :-1].float(), dim=-1), -1, ids[:, 1:, None]).squeeze(-1)


def _logits_and_ids(vocab: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(3, 7, vocab, generator=generator)
    ids = torch.randint(0, vocab, (3, 7), generator=generator)
    return logits, ids


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_logprobs_and_their_gradient_match_log_softmax(tp):
    """A wrong all-reduce (sum for max), a wrong vocab offset, or a missing softmax term in the
    backward would each change values or gradients; shift is logits[t] -> ids[t + 1]."""
    logits, ids = _logits_and_ids(vocab=16)
    weights = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    reference = logits.clone().requires_grad_()
    expected = _reference_logprobs(reference, ids)
    (expected * weights).sum().backward()

    with simulated_mesh(tp) as mesh:
        sharded = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        out = get_logprobs_from_vocab_parallel_logits(sharded, ids)
        (out * weights).sum().backward()
        grad = sharded.grad.full_tensor()
        assert out.shape == (3, 6)
        for value in per_rank(out, tp):
            torch.testing.assert_close(value, expected.detach(), atol=1e-5, rtol=0)
        for value in per_rank(grad, tp):
            torch.testing.assert_close(value, reference.grad, atol=1e-5, rtol=0)


def test_vocab_parallel_logprobs_with_uneven_vocab_shards():
    """10 ids over 4 ranks split 3/3/3/1 (torch.chunk): the offset must follow the chunk size."""
    logits, ids = _logits_and_ids(vocab=10)
    with simulated_mesh(4) as mesh:
        out = get_logprobs_from_vocab_parallel_logits(distribute_tensor(logits, mesh, [Shard(-1)]), ids)
        for value in per_rank(out, 4):
            torch.testing.assert_close(value, _reference_logprobs(logits, ids), atol=1e-5, rtol=0)


def test_plain_logits_are_taken_as_the_whole_vocabulary():
    logits, ids = _logits_and_ids(vocab=12)
    torch.testing.assert_close(get_logprobs_from_vocab_parallel_logits(logits, ids), _reference_logprobs(logits, ids))


def test_logits_not_sharded_on_the_vocabulary_are_refused():
    logits, ids = _logits_and_ids(vocab=8)
    with simulated_mesh(2) as mesh:
        with pytest.raises(AutoTPError, match="expected Shard\\(-1\\)"):
            get_logprobs_from_vocab_parallel_logits(distribute_tensor(logits, mesh, [Shard(1)]), ids)


def _param(full_value: torch.Tensor, full_grad: torch.Tensor, mesh, placements) -> torch.Tensor:
    if mesh is None:
        param = torch.nn.Parameter(full_value.clone())
        param.grad = full_grad.clone()
        return param
    # distribute_tensor may keep the very tensor it was given as a Replicate shard: copy first.
    param = torch.nn.Parameter(distribute_tensor(full_value.clone(), mesh, placements, src_data_rank=None))
    param.grad = distribute_tensor(full_grad.clone(), mesh, placements, src_data_rank=None)
    return param


# (shape, placements on a (dp, tp) mesh): FSDP x colwise, FSDP x rowwise, a TP-replicated norm
# weight under FSDP, a parameter no one sharded, and (placements of length 1) a parameter FSDP
# sharded on the dp sub-mesh alone, as FSDP2 does with what TP left alone.
_LAYOUTS = [
    ((8, 4), [Shard(0), Shard(0)]),
    ((4, 8), [Shard(0), Shard(1)]),
    ((8,), [Shard(0), Replicate()]),
    ((3,), None),
    ((6,), [Shard(0)]),
]


def _full_tensors(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for shape, _ in _LAYOUTS]


@pytest.mark.parametrize("norm_type", [1, 2, 3, math.inf, 0])
def test_grad_norm_on_dp_x_tp_counts_each_element_once(norm_type):
    """Summing the tp-replicated norm weight, the plain parameter, or the dp-only parameter over
    every rank would count it 2 or 4 times; a missed Shard dim would count half a weight."""
    tensors = _full_tensors(seed=0)
    all_grads = torch.cat([grad.flatten() for _, grad in tensors])
    if norm_type == 0:
        all_grads[::5] = 0.0
        offset = 0
        for _, grad in tensors:
            grad.view(-1).copy_(all_grads[offset : offset + grad.numel()])
            offset += grad.numel()
    expected = torch.linalg.vector_norm(all_grads, norm_type).item()
    with simulated_mesh(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        meshes = {None: None, 1: mesh["dp"], 2: mesh}
        params = [_param(v, g, meshes[p and len(p)], p) for (v, g), (_, p) in zip(tensors, _LAYOUTS)]
        norm = get_grad_norm(params, mesh["dp"].get_group(), mesh["tp"].get_group(), norm_type=norm_type)
    assert norm == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_grad_norm_on_a_tp_mesh(tp):
    tensors = _full_tensors(seed=1)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for _, g in tensors])).item()
    with simulated_mesh(tp) as mesh:
        params = [_param(v, g, mesh if p else None, p[-1:] if p else None) for (v, g), (_, p) in zip(tensors, _LAYOUTS)]
        norm = get_grad_norm(params, None, mesh.get_group())
    assert norm == pytest.approx(expected, rel=1e-5)


def test_grad_norm_on_hsdp_with_only_the_shard_group_passed():
    """The replicate dim is not summed over, so its copies must not be divided out either."""
    value, grad = _full_tensors(seed=2)[0]
    with simulated_mesh(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard_cp"))
        param = _param(value, grad, mesh, [Replicate(), Shard(0)])
        norm = get_grad_norm([param], mesh["dp_shard_cp"].get_group(), None)
    assert norm == pytest.approx(grad.norm().item(), rel=1e-5)


def test_grad_norm_refuses_a_shard_dim_no_group_covers():
    value, grad = _full_tensors(seed=3)[0]
    with simulated_mesh(2) as mesh:
        param = _param(value, grad, mesh, [Shard(0)])
        with pytest.raises(AutoTPError, match="neither dp_cp_group nor tp_group covers it"):
            get_grad_norm([param], None, None)


def test_clip_scales_every_shard_by_the_global_factor():
    tensors = _full_tensors(seed=4)
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for _, g in tensors])).item()
    with simulated_mesh(2) as mesh:
        params = [_param(v, g, mesh if p else None, p[-1:] if p else None) for (v, g), (_, p) in zip(tensors, _LAYOUTS)]
        clip_grad_by_total_norm_(params, max_grad_norm=1.0, total_norm=total)
        clipped = get_grad_norm(params, None, mesh.get_group())
        full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
        for value, (_, grad) in zip(full, tensors):
            for local in per_rank(value, 2):
                torch.testing.assert_close(local, grad / (total + 1e-6))
    assert clipped == pytest.approx(1.0, rel=1e-5)


def test_clip_leaves_gradients_below_the_limit_alone():
    param = _param(torch.zeros(3), torch.tensor([0.1, 0.2, 0.2]), None, None)
    clip_grad_by_total_norm_([param], max_grad_norm=1.0, total_norm=0.3)
    torch.testing.assert_close(param.grad, torch.tensor([0.1, 0.2, 0.2]))


def test_to_local_if_dtensor_returns_the_shard():
    with simulated_mesh(2) as mesh:
        local = to_local_if_dtensor(distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]))
        assert [t.tolist() for t in per_rank(local, 2)] == [[0.0, 1.0], [2.0, 3.0]]
    plain = torch.ones(2)
    assert to_local_if_dtensor(plain) is plain
