"""Train a small language model with FSDP2 + tensor parallelism chosen by autotp.

Run with torchrun; on CPU it uses gloo, on GPUs nccl::

    torchrun --nproc_per_node 4 examples/train.py --model llama-1b --tp 2 --steps 30
    torchrun --nproc_per_node 2 examples/train.py --model qwen3 --tp 2 --sequence-parallel
    torchrun --nproc_per_node 2 examples/train.py --model phi3 --steps 10 --save runs/ckpt
    torchrun --nproc_per_node 2 examples/train.py --model phi3 --tp 1 --tiny-tp 2 --steps 20 --resume runs/ckpt

The model is a built-in config shrunk to a tiny size (``autotp.models.build_model(..., tiny=True)``)
with random weights; the data is a synthetic, learnable token stream (each sequence counts up
from a random start, modulo the vocabulary), so the loss visibly falls within a few dozen steps.
The loss is transformers' own (``model(input_ids=ids, labels=ids).loss``), computed on the
vocabulary-sharded logits. The world size must be ``dp_replicate * dp_shard * tp``; dp_shard is
inferred.

``--save DIR`` writes a checkpoint (model, AdamW state, step) with :mod:`autotp.checkpoint` after
the last step (and every ``--save-every`` steps); ``--resume DIR`` loads one and continues from
its step, at any (dp, tp) layout: the loss printed for each step continues where it stopped.
``--export DIR`` writes the trained weights as one safetensors file with transformers' names.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autotp.checkpoint import export_safetensors, load_checkpoint, save_checkpoint
from autotp.dtensor_utils import clip_grad_by_total_norm_, get_grad_norm
from autotp.models import build_model, builtin_names
from autotp.training import fsdp2_strategy_parallelize


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b", choices=builtin_names())
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--tiny-tp", type=int, default=None,
                        help="tp the tiny config's head counts are shrunk for (default: --tp); "
                             "keep the saved run's value when resuming at another tp")
    parser.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas (1: plain FSDP)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--plan", default=None, help="explicit plan: registered name or import path")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="global batch size, split over dp")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--save", metavar="DIR", help="checkpoint directory to write after the last step")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    parser.add_argument("--resume", metavar="DIR", help="checkpoint to load and continue from")
    parser.add_argument("--export", metavar="DIR", help="write model.safetensors + config.json here at the end")
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

    model = build_model(args.model, tiny=True, tp=args.tiny_tp or args.tp, device=device).train()
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

    start = 0
    if args.resume:
        start = load_checkpoint(args.resume, model=model, optimizer=optimizer).get("step", 0)
        if rank == 0:
            print(f"resumed from {args.resume} at step {start}", flush=True)
    if rank == 0:
        print(f"{args.model}: dp={dp_size} tp={args.tp}, steps {start}..{args.steps - 1}", flush=True)
    for step in range(start, args.steps):
        ids = counting_batch(step, args.batch, args.seq, vocab).chunk(dp_size)[dp_rank].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grad_norm = get_grad_norm(list(model.parameters()), dp_group, tp_group)
        clip_grad_by_total_norm_(list(model.parameters()), args.max_grad_norm, grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss = mean_loss.item() / world  # each replica's loss, counted once per tp rank
        if rank == 0:
            print(f"step {step:4d}  loss {mean_loss:.4f}  grad norm {grad_norm:.3f}", flush=True)
        done = step + 1
        if args.save and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            save_checkpoint(args.save, model=model, optimizer=optimizer, extra={"step": done})
            if rank == 0:
                print(f"saved {args.save} at step {done}", flush=True)
    if args.export:
        path = export_safetensors(model, args.export)
        if rank == 0:
            print(f"exported {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
