"""The public entry points that combine the layers: :func:`parallelize` (choose a plan, check it if
synthesized, shard) and :func:`synthesize` (write a plan, check it numerically when asked or when
its trace followed value-dependent branches).

They sit above selection, the synthesizer and the verifier so that none of those needs to import
another upward; ``autotp.parallelize`` and ``autotp.synthesize`` (and ``autotp.synth.synthesize``)
are these functions.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp.apply import apply_plan, validate_tp_mesh
from autotp.decision import decide_plan
from autotp.self_check import check_value_branches, self_check_synthesized
from autotp.synth.api import plan_with_analysis


def parallelize(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    tp_shard_plan=None,
    verify_synthesized: bool = True,
    loss_parallel: bool = True,
    example_inputs=None,
    cache: bool = True,
) -> nn.Module:
    """Shard ``model`` over ``tp_mesh`` with the plan :func:`autotp.get_plan` chooses.

    The choice (selection, and the self-check of a synthesized plan) is made once per job: by the
    tp group's first rank under a real process group, and kept in an on-disk cache
    (:mod:`autotp.decision`).

    ``model.generate()`` (KV cache, greedy or sampled) works after either ``loss_parallel``
    setting and gives the unsharded model's tokens; sampling needs the same seed on every rank.

    Args:
        model: the model, on the device the mesh uses (or meta, to be materialised after).
        tp_mesh: a 1-D device mesh (the ``tp`` sub-mesh of a larger one).
        sequence_parallel: use the sequence-parallel variant of the plan.
        tp_shard_plan: a plan dict, a registered plan name, or a dotted import path to one.
        verify_synthesized: when the plan is synthesized, check it numerically first
            (:func:`autotp.self_check.self_check`, on the model or a tiny copy; seconds, once).
        loss_parallel: True (the default, for training): the logits are what the plan makes.
            With autotp's handwritten and synthesized plans that is a ``Shard(-1)`` DTensor, each
            rank holding ``vocab / tp`` columns, which ``labels=`` and
            :func:`autotp.training.next_token_loss` read without gathering (transformers' plans
            gather the head's output, and a plan may leave a tied head replicated). False (serving,
            evaluation): the logits come back whole on every rank as a plain tensor (one
            all-gather per forward; ``[batch, seq, vocab]`` per rank). The model's ``train()`` /
            ``eval()`` mode does not change it; :func:`gathered_logits` switches one block of code
            to whole logits.
        example_inputs: a tuple of positional inputs or a dict of keyword inputs for one forward,
            to trace and self-check a model without a transformers config (a plain-PyTorch model)
            with; made from the config otherwise.
        cache: read and write the on-disk plan cache (``$AUTOTP_CACHE_DIR``, default
            ``~/.cache/autotp``); False decides afresh and stores nothing.

    Returns:
        The same model, sharded in place.

    Raises:
        VerificationError: the synthesized plan failed its self-check and no other source's plan
            passed selection (nothing is sharded).
        NoPlanError: no source gives a plan (for a plain-PyTorch model without ``example_inputs``:
            one line saying to pass them).
    """
    if tp_mesh.ndim != 1:
        validate_tp_mesh(model, tp_mesh)
    choice = decide_plan(model, tp_mesh, sequence_parallel=sequence_parallel, tp_shard_plan=tp_shard_plan,
                         verify_synthesized=verify_synthesized, example_inputs=example_inputs, cache=cache)
    return apply_plan(model, tp_mesh, choice.plan, loss_parallel=loss_parallel)


def synthesize(model: nn.Module, *, example_inputs=None, sequence_parallel: bool = False,
               loss_parallel: bool = True, tp_size: int | None = None,
               verify: bool = True, gather_copies: bool = True) -> dict[str, ParallelStyle]:
    """Write a tensor-parallel plan for ``model`` from its traced graph.

    Keyword Args:
        example_inputs: a tuple of positional inputs, or a dict of keyword inputs; made from the
            config (``input_ids`` of shape (2, 11)) for transformers models when omitted.
        sequence_parallel: keep the residual stream sharded on the sequence between blocks.
        loss_parallel: leave the head's logits vocab-sharded (``Shard(-1)`` DTensor).
        tp_size: if given, check that every sharded extent divides evenly; k/v projections with
            fewer heads than ``tp_size`` (a multiple of them) get one kv head per rank. k/v of one
            head (multi-query) get it without ``tp_size``: that plan is the same at every tp.
        verify: check the plan numerically before returning it (:func:`autotp.self_check.self_check`:
            logits and every gradient at ``tp_size`` (2 if None) on simulated ranks, on the model
            itself or on a tiny copy built from its config), so no plan the verifier rejects is
            handed out. It costs seconds, several times the synthesis (README, "Python API").
            False skips it: for callers that verify the plan themselves. A model that cannot be
            checked (on the meta device with no transformers config) gets a warning.
        gather_copies: parts with fewer groups than ranks (the one kv head of a fused multi-query
            qkv, B and C of a state-space mixer with ``n_groups < tp``) come from a Linear whose
            rows are sharded like its other parts; each forward all-gathers the part and each rank
            cuts its group, and the backward reduce-scatters the part's gradient: the same bytes each
            way. False: every rank holds a whole copy of its group's rows and the copies' weight
            gradients are all-reduced in the backward (no forward communication: the serving choice).

    Returns:
        ``{fnmatch key: ParallelStyle}`` for ``parallelize_module``, keys relative to ``model``.

    Raises:
        VerificationError: (``verify=True``, the default) the plan differs from the unsharded model;
            the message names the first differing parameter and the difference against the tolerance.
        MeshError: an extent ``tp_size`` does not divide; without ``tp_size``, k/v of one head whose
            query heads 2 does not divide (pass ``tp_size``).

    Example::
        >>> plan = synthesize(model)  # doctest: +SKIP
        >>> plan["model.layers.*.self_attn.o_proj"]  # doctest: +SKIP
        RowwiseParallel(...)
    """
    plan, analysis = plan_with_analysis(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                                        loss_parallel=loss_parallel, tp_size=tp_size, gather_copies=gather_copies)
    if verify:
        self_check_synthesized(model, analysis, plan, loss_parallel=loss_parallel)
    else:
        check_value_branches(model, analysis, plan, loss_parallel=loss_parallel)
    return plan
