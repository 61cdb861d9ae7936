"""Measure training throughput (tokens/s, forward + backward) of each plan, side by side in one run.

Run under torchrun; every rank holds one shard of every plan's model, and the plans take turns
step by step (the order rotates each round), so machine noise hits all of them alike::

    torchrun --nproc-per-node 2 benchmarks/bench_runtime.py                  # CPU, gloo (a proxy)
    torchrun --nproc-per-node 8 benchmarks/bench_runtime.py --device cuda    # GPUs, nccl

For each family: the handwritten, synthesized and transformers plan (plain TP), and the handwritten
and synthesized sequence-parallel plans, applied to copies of one randomly initialised model of
the family's architecture with the widths given by ``--hidden`` etc. (small enough for CPU). A step
is zero_grad, forward, the plan's loss (vocab-parallel cross-entropy when the head keeps the
vocabulary sharded), backward; no optimizer. Its time is the slowest rank's. The first step's
losses are compared across plans (same weights, same batch: they must agree).

Writes medians and ratios to ``benchmarks/results/runtime.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import RowwiseParallel
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).parent))
from _plans_common import NoPlan, plan_from, plan_loss  # noqa: E402

from autotp import styles  # noqa: E402
from autotp.apply import apply_plan  # noqa: E402
from autotp.errors import one_line  # noqa: E402
from autotp.models import build_model, load_config  # noqa: E402
from autotp.plan import plan_diff  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "runtime.json"
VARIANTS = [("handwritten", False), ("synthesized", False), ("hf", False), ("handwritten", True), ("synthesized", True)]
# --previous: the handwritten plans against their layout before issue 13 (``previous_layout``).
PREVIOUS_VARIANTS = [("handwritten", False), ("previous", False), ("handwritten", True), ("previous", True)]
# Families of the runtime run: built-in configs whose architecture is kept, widths set by flags.
RUNTIME_FAMILIES = ("llama", "qwen3", "phi3", "gemma3-vlm")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--only", default=",".join(RUNTIME_FAMILIES), help="comma-separated built-in families")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=8, help="query heads; kv heads keep the family's ratio")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds (one step per plan each)")
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/runtime.json "
                        "(results/runtime_previous.json with --previous)")
    parser.add_argument("--previous", action="store_true",
                        help="time each handwritten plan against its layout before shared-input reductions")
    return parser.parse_args()


def family_config(name: str, args):
    """The built-in config of ``name`` with the benchmark's widths (kv heads keep the family's ratio)."""
    config = load_config(name)
    options = config.to_dict()
    model_type = options.pop("model_type")
    options.pop("transformers_version", None)
    text = options["text_config"] if isinstance(options.get("text_config"), dict) else options
    ratio = max(1, text["num_attention_heads"] // (text.get("num_key_value_heads") or text["num_attention_heads"]))
    text.update(hidden_size=args.hidden, intermediate_size=args.intermediate, num_attention_heads=args.heads,
                num_key_value_heads=max(1, args.heads // ratio), vocab_size=args.vocab, max_position_embeddings=4 * args.seq)
    if "head_dim" in text:
        text["head_dim"] = args.head_dim
    if text.get("query_pre_attn_scalar") is not None:
        text["query_pre_attn_scalar"] = args.head_dim
    if isinstance(text.get("layer_types"), list):
        kinds = list(dict.fromkeys(text["layer_types"]))
        text["layer_types"] = [kinds[i % len(kinds)] for i in range(args.layers)]
    text["num_hidden_layers"] = args.layers
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(text.get(key), int) and text[key] >= args.vocab:
            text[key] = args.vocab - 1
    if "vision_config" in options:  # text-only inputs: keep the tower, make it cheap to build
        options["vision_config"] = {**options["vision_config"], "num_hidden_layers": 1, "hidden_size": 64,
                                    "intermediate_size": 128, "num_attention_heads": 2}
    return AutoConfig.for_model(model_type, **options)


def step(model, input_ids, device) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = plan_loss(model(input_ids=input_ids), input_ids)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return loss.detach()


def slowest(seconds: float, device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def previous_layout(plan: dict, *, sequence_parallel: bool) -> dict:
    """``plan`` as autotp wrote it before shared inputs' gradients were reduced once (issue 13).

    Norms hand their column projections plain tensors again (each projection all-reduces its own
    input gradient), a parallel block's rows reduce separately, and a whole module beside them
    slices its output back with ``PrepareModuleOutput``. Only the layout changes: parameters stay
    where they are, so the two plans' losses agree and their step times differ by communication.
    """
    old = {}
    for key, style in plan.items():
        if isinstance(style, styles.Boundary) and (style.stream is not None or style.shares_output):
            continue
        if getattr(style, "dtensor", False) and not sequence_parallel:
            continue  # a parallel block's norm on its DTensor stream
        if isinstance(style, styles.Boundary) and style.inputs == "whole":
            continue
        if isinstance(style, styles.Boundary) and style.outputs == "gather":
            style = styles.Boundary(outputs="gather", style=style.style)
        elif isinstance(style, styles.Rowwise) and style.partial_output:
            style = (RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sequence_parallel
                     else RowwiseParallel())
        old[key] = style
    return old


def prepare(args, mesh, dtype, device, rank):
    """``{(family, source, sp): sharded model}``, ``{key: reason}`` for those that could not be built,
    and ``{key: whether the plan equals the handwritten one}`` (equal plans show the noise floor)."""
    models, skipped, equal = {}, {}, {}
    for family in args.only.split(","):
        base = build_model(family_config(family, args), device="cpu", dtype=dtype, seed=0)
        plans = {}
        for source, sp in (PREVIOUS_VARIANTS if args.previous else VARIANTS):
            try:
                if source == "previous":
                    hand = plan_from(base, "handwritten", tp=mesh.size(), sequence_parallel=sp)
                    plans[source, sp] = previous_layout(hand, sequence_parallel=sp)
                    continue
                plans[source, sp] = plan_from(base, source, tp=mesh.size(), sequence_parallel=sp)
            except NoPlan as error:
                skipped[family, source, sp] = f"no plan: {error}"
            except Exception as error:
                skipped[family, source, sp] = f"failed: {one_line(error, 200)}"
        # Compared before any is applied: parallelize_module sets attributes on the style objects.
        for (source, sp), plan in plans.items():
            hand = plans.get(("handwritten", sp))
            equal[family, source, sp] = None if hand is None else plan_diff(base, plan, hand) == {}
        for (source, sp), plan in plans.items():
            try:
                models[family, source, sp] = apply_plan(copy.deepcopy(base).to(device).train(), mesh, plan)
            except Exception as error:
                skipped[family, source, sp] = f"failed: {one_line(error, 200)}"
        if rank == 0:
            print(f"prepared {family}", flush=True)
    return models, skipped, equal


def main() -> None:
    args = parse_args()
    args.load_at_start = os.getloadavg()  # other jobs on the machine: the interleaving spreads their noise
    warnings.filterwarnings("ignore", message="Parallelize plan key")
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("tp",))
    models, skipped, equal = prepare(args, mesh, dtype, args.device, rank)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(args.device)
    keys = list(models)
    first_loss = {key: step(models[key], input_ids, args.device).item() for key in keys}
    for _ in range(args.warmup - 1):
        for key in keys:
            step(models[key], input_ids, args.device)
    times = {key: [] for key in keys}
    start = time.perf_counter()
    for round_ in range(args.repeats):
        order = keys[round_ % len(keys):] + keys[: round_ % len(keys)]  # rotate who goes first
        for key in order:
            dist.barrier()
            t0 = time.perf_counter()
            step(models[key], input_ids, args.device)
            times[key].append(slowest(time.perf_counter() - t0, args.device))
    wall = time.perf_counter() - start
    if rank == 0:
        report(args, world, backend, dtype, times, first_loss, skipped, equal, wall)
    dist.destroy_process_group()


def report(args, world, backend, dtype, times, first_loss, skipped, equal, wall) -> None:
    tokens = args.batch * args.seq
    rows = []
    for (family, source, sp), samples in times.items():
        median = statistics.median(samples)
        rows.append({"family": family, "source": source, "sequence_parallel": sp, "median_step_s": round(median, 5),
                     "min_step_s": round(min(samples), 5), "tokens_per_s": round(tokens / median, 1),
                     "first_step_loss": first_loss[(family, source, sp)], "steps": len(samples),
                     "equal_to_handwritten": equal.get((family, source, sp))})
    for (family, source, sp), reason in skipped.items():
        rows.append({"family": family, "source": source, "sequence_parallel": sp, "status": reason})
    by_key = {(r["family"], r["source"], r["sequence_parallel"]): r for r in rows if "tokens_per_s" in r}
    ratios = []
    for (family, source, sp), row in by_key.items():
        hand = by_key.get((family, "handwritten", sp))
        if source != "handwritten" and hand is not None:
            ratios.append({"family": family, "sequence_parallel": sp, "plan": f"{source}/handwritten",
                           "ratio": round(row["tokens_per_s"] / hand["tokens_per_s"], 4),
                           "ratio_of_fastest_steps": round(hand["min_step_s"] / row["min_step_s"], 4),
                           "loss_diff": abs(row["first_step_loss"] - hand["first_step_loss"]),
                           "plans_equal": row["equal_to_handwritten"]})
    print(f"\n{'family':11s} {'plan':12s} {'sp':3s} {'tokens/s':>10s} {'median s':>9s} {'vs hand':>8s} "
          f"{'loss (step 1)':>14s}  same plan as handwritten")
    for row in rows:
        if "tokens_per_s" not in row:
            print(f"{row['family']:11s} {row['source']:12s} {'sp' if row['sequence_parallel'] else 'tp':3s} {row['status']}")
            continue
        ratio = next((r["ratio"] for r in ratios if (r["family"], r["sequence_parallel"], r["plan"].split("/")[0])
                      == (row["family"], row["sequence_parallel"], row["source"])), None)
        print(f"{row['family']:11s} {row['source']:12s} {'sp' if row['sequence_parallel'] else 'tp':3s} "
              f"{row['tokens_per_s']:>10.1f} {row['median_step_s']:>9.4f} {ratio if ratio else '':>8} "
              f"{row['first_step_loss']:>14.6f}  {'' if row['equal_to_handwritten'] is None else row['equal_to_handwritten']}")
    shape = (f"{args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} heads x "
             f"{args.head_dim}, vocab {args.vocab}, batch {args.batch} x seq {args.seq}, {str(dtype).split('.')[-1]}")
    result = {"device": args.device if args.device == "cuda" else (platform.processor() or platform.machine()) + " cpu",
              "backend": backend, "world_size": world, "model_shape": shape, "timed_rounds": args.repeats,
              "threads_per_rank": torch.get_num_threads(), "timed_wall_s": round(wall, 1),
              "load_average_1_5_15_min": {"start": [round(x, 2) for x in args.load_at_start],
                                          "end": [round(x, 2) for x in os.getloadavg()]},
              "cpu_count": os.cpu_count(),
              "method": "plans interleaved step by step, order rotated each round; step time = slowest rank; "
                        "median over rounds; tokens/s = batch x seq / median step; ratio = tokens/s over the "
                        "handwritten plan's; plans_equal marks pairs whose plans are identical, whose ratio is "
                        "the noise floor of the run",
              "ratios": ratios, "results": rows, "torch": torch.__version__,
              "transformers": transformers.__version__}
    if args.out is None:
        args.out = RESULTS.with_name("runtime_previous.json") if args.previous else RESULTS
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out} (redraw the chart: python benchmarks/bench_plans.py --chart-only)")


if __name__ == "__main__":
    main()
