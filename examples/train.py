"""Train a small language model with FSDP2 + tensor parallelism chosen by autotp.

Run with torchrun; on CPU it uses gloo, on GPUs nccl::

    torchrun --nproc_per_node 4 examples/train.py --model llama-1b --tp 2 --steps 30
    torchrun --nproc_per_node 2 examples/train.py --model qwen3 --tp 2 --sequence-parallel

The model is a built-in config shrunk to a tiny size (``autotp.models.build_model(..., tiny=True)``)
with random weights; the data is a synthetic, learnable token stream (each sequence counts up
from a random start, modulo the vocabulary), so the loss visibly falls within a few dozen steps.
The world size must be ``dp_replicate * dp_shard * tp``; dp_shard is inferred.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

from autotp.dtensor_utils import clip_grad_by_total_norm_, get_grad_norm
from autotp.models import build_model, builtin_names
from autotp.training import fsdp2_strategy_parallelize, next_token_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b", choices=builtin_names())
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (1: plain FSDP)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--plan", default=None, help="explicit plan: registered name or import path")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch size, split over dp")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    return parser.parse_args()


def counting_batch(step: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Sequences ``s, s+1, s+2, ...`` (mod vocab) from random starts: next tokens are predictable."""
    starts = torch.randint(0, vocab, (batch, 1), generator=torch.Generator().manual_seed(step))
    return (starts + torch.arange(seq)) % vocab


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = "cuda" if use_cuda else "cpu"
    if world % (args.tp * args.dp_replicate):
        raise SystemExit(f"world size {world} is not a multiple of tp ({args.tp}) x dp_replicate ({args.dp_replicate})")
    dp_shard = world // (args.tp * args.dp_replicate)
    mesh = init_device_mesh(
        device, (args.dp_replicate, dp_shard, args.tp), mesh_dim_names=("dp_replicate", "dp_shard_cp", "tp")
    )

    model = build_model(args.model, tiny=True, tp=args.tp, device=device).train()
    fsdp2_strategy_parallelize(
        model,
        mesh,
        sequence_parallel=args.sequence_parallel,
        activation_checkpointing=args.activation_checkpointing,
        tp_shard_plan=args.plan,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # Ranks in one tp group see the same rows; the dp replicas split the global batch.
    dp_size = args.dp_replicate * dp_shard
    dp_rank = mesh["dp_replicate"].get_local_rank() * dp_shard + mesh["dp_shard_cp"].get_local_rank()
    if args.batch % dp_size:
        raise SystemExit(f"--batch {args.batch} must be divisible by the data-parallel size {dp_size}")
    dp_group, tp_group = mesh["dp_shard_cp"].get_group(), mesh["tp"].get_group()
    vocab = model.config.get_text_config().vocab_size

    progress = tqdm(range(args.steps), disable=rank != 0, desc=f"{args.model} dp={dp_size} tp={args.tp}")
    for step in progress:
        ids = counting_batch(step, args.batch, args.seq, vocab).chunk(dp_size)[dp_rank].to(device)
        loss = next_token_loss(model(input_ids=ids).logits, ids)
        loss.backward()
        grad_norm = get_grad_norm(list(model.parameters()), dp_group, tp_group)
        clip_grad_by_total_norm_(list(model.parameters()), args.max_grad_norm, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world  # each replica's loss, counted once per tp rank
        progress.set_postfix(loss=f"{mean_loss:.4f}", grad_norm=f"{grad_norm:.3f}")
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            tqdm.write(f"step {step:4d}  loss {mean_loss:.4f}  grad norm {grad_norm:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
