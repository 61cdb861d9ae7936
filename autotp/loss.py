"""Loss parallelism for transformers' own ``labels=`` loss: cross-entropy on vocabulary-sharded logits.

The plans keep the LM head's logits as a ``Shard(-1)`` DTensor (each rank holds its slice of the
vocabulary) so that no rank ever materialises ``[batch, seq, vocab]`` in full. transformers'
causal-LM loss (``ForCausalLMLoss``) calls ``logits.view(-1, vocab)`` and ``cross_entropy`` with
plain label tensors, which fails on a DTensor (``got mixed torch.Tensor and DTensor``).
:func:`install_vocab_parallel_loss` replaces that loss on the model with
:class:`VocabParallelCausalLMLoss`: the same arithmetic (labels shifted by one, ``ignore_index``
skipped, ``num_items_in_batch`` as the divisor of a summed loss), computed from each rank's
vocabulary slice with :func:`autotp.dtensor_utils.vocab_parallel_token_logprobs`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from autotp.dtensor_utils import to_local_if_dtensor, vocab_parallel_token_logprobs

__all__ = ["VocabParallelCausalLMLoss", "install_vocab_parallel_loss", "vocab_parallel_cross_entropy"]

logger = logging.getLogger(__name__)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``targets`` under ``logits`` (no shift), as ``F.cross_entropy`` computes it.

    Mean over the targets that are not ``ignore_index``, or, with ``num_items_in_batch``, their
    sum divided by it (transformers' convention for gradient accumulation). Logits that are a
    ``Shard(-1)`` DTensor stay sharded: each rank reads its vocabulary slice only.

    Args:
        logits: ``[..., vocab]`` plain tensor or vocabulary-sharded DTensor.
        targets: ``logits.shape[:-1]`` ids; ``ignore_index`` marks positions that do not count.
        ignore_index: the id of positions to skip.
        num_items_in_batch: divisor of the summed loss; ``None`` for the mean.

    Returns:
        A float32 scalar, the same on every rank of the vocabulary group.

    Raises:
        AutoTPError: logits a DTensor not sharded over the vocabulary, or shapes that disagree.
    """
    targets = to_local_if_dtensor(targets).to(to_local_if_dtensor(logits).device)
    keep = targets != ignore_index
    # An ignored target picks nothing (its id is owned by no rank); its weight 0 zeroes its gradient.
    logprobs = vocab_parallel_token_logprobs(logits, targets.masked_fill(~keep, 0))
    total = -(logprobs * keep).sum()
    if num_items_in_batch is None:
        return total / keep.sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class VocabParallelCausalLMLoss:
    """transformers' ``ForCausalLMLoss`` that also accepts vocabulary-sharded DTensor logits.

    Called as the model calls its ``loss_function`` (positionally or by keyword): ``(logits,
    labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw)``.
    Labels are shifted left by one (``logits[:, t]`` scores ``labels[:, t + 1]``) unless
    ``shift_labels`` is given. Logits that are not a DTensor go to the wrapped loss unchanged;
    a replicated DTensor is read locally (each rank already holds every id).

    Keyword Args:
        fallback: the loss to call on plain logits (the model's original ``loss_function``).
    """

    def __init__(self, *, fallback) -> None:
        self.fallback = fallback

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if not isinstance(logits, DTensor):
            return self.fallback(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if all(p.is_replicate() for p in logits.placements):
            logits = logits.to_local()  # every rank holds the whole vocabulary: nothing to reduce
        if shift_labels is None:
            # Pad one ignored id at the end and drop the first: position t is scored on token t + 1.
            shift_labels = F.pad(to_local_if_dtensor(labels), (0, 1), value=ignore_index)[..., 1:]
        return vocab_parallel_cross_entropy(logits, shift_labels, ignore_index=ignore_index,
                                            num_items_in_batch=num_items_in_batch)

    def __repr__(self) -> str:
        return f"VocabParallelCausalLMLoss(fallback={getattr(self.fallback, '__name__', self.fallback)!r})"


def _causal_lm_losses() -> tuple:
    """transformers' causal-LM loss functions (empty when transformers is not installed)."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return ()
    return (ForCausalLMLoss,)


def install_vocab_parallel_loss(model: nn.Module) -> bool:
    """Give ``model`` a ``loss_function`` that computes transformers' causal-LM loss on sharded logits.

    Only a model whose ``loss_function`` is transformers' causal-LM loss is changed (a custom
    loss the user set, or a classification loss, is left alone: its arithmetic is unknown here).
    transformers resolves ``loss_function`` from ``loss_type`` on each access unless one was set;
    setting it stores the wrapper on the instance, so state dicts and module trees are unchanged.
    Installing twice is a no-op.

    Args:
        model: a transformers ``PreTrainedModel`` (anything else is left alone).

    Returns:
        Whether the model now has the vocabulary-parallel loss.
    """
    current = getattr(model, "loss_function", None)
    if isinstance(current, VocabParallelCausalLMLoss):
        return True
    if current is None or current not in _causal_lm_losses():
        return False
    model.loss_function = VocabParallelCausalLMLoss(fallback=current)
    logger.debug("%s: loss_function replaced by the vocabulary-parallel causal-LM loss", type(model).__name__)
    return True
