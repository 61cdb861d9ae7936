"""Each style folded in issue 40 against its new spelling: the same module, inputs, values and collectives.

For every old style (``PackedColwiseParallel(sizes=...)``, ``ReplicatedOutput()``, ... 18 classes)
a child process in the tree before the fold applies it to a small module on 2 simulated ranks, runs
a forward and a backward on fixed inputs, and records the output (its layout, and its values on
each rank, made whole where it is a DTensor), every gradient (parameters and
input, whole), the collectives of both passes (``CommDebugMode``), what the style declares to the
checker and which parameter dims it shards. A child in this tree does the same with the new
spelling (``Colwise(sizes=...)``, ``Boundary(outputs='replicate')``). The records must be equal:
values to the bit, counts exactly.

    mkdir ../autotp-base && git archive <commit before the fold> | tar -x -C ../autotp-base
    python benchmarks/fold_equality.py --step 1 --base ../autotp-base

The second step (``--step 2``, the default: ``ReplicatedStream``, ``SequenceParallelAllGather``,
``OwnPositionsOutput``, ``SharedReplicatedInput`` and ``ReducedInputGrads`` into ``Boundary``;
``LinearParams``, ``KVHeadCounts`` and ``ReplicatedParams`` into options of ``HeadParams``,
``ShardCounts`` and ``ReplicatedWithGradAllReduce``) is measured against the tree before it.

Writes ``results/fold_equality.json`` (step 1) or ``results/fold_equality_step2.json``; exit status 1
when any pair differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from plan_equality import run_in_tree, tree_name

HERE = Path(__file__).resolve().parent

# name -> (module, input kind, old spelling, new spelling). Modules: a Linear, transformers' Conv1D,
# a LayerNorm, a block around a Linear (whose Linear is ColwiseParallel in "block_columns", and
# ColwiseParallel(input_layouts=Shard(1)) in "block_sequence", for the styles that hand it DTensors). Inputs: "plain" (b, t, 16) replicated,
# "half" (b, t, 8) a row's local shard, "seq" a Shard(1) DTensor of the (b, t, 16) stream.
PAIRS = {
    "packed column": ("linear", "plain", "PackedColwiseParallel(sizes=(8, 4, 4))", "Colwise(sizes=(8, 4, 4))"),
    "column (in, out)": ("conv1d", "plain", "ColwiseParallelInOut()", "Colwise(weight_in_out=True)"),
    "packed column (in, out)": ("conv1d", "plain", "ColwiseParallelInOut(sizes=(8, 8))",
                                "Colwise(weight_in_out=True, sizes=(8, 8))"),
    "packed row": ("linear", "half", "PackedRowwiseParallel(sizes=(8, 8))", "Rowwise(sizes=(8, 8))"),
    "row, spans reduced": ("linear", "half", "BroadcastRowwiseParallel(reduce_grad_features=((0, 4),))",
                           "Rowwise(reduce_grad_features=((0, 4),))"),
    "row (in, out)": ("conv1d", "half", "RowwiseParallelInOut()", "Rowwise(weight_in_out=True)"),
    "partial row": ("linear", "half", "PartialRowwiseParallel()",
                    "Rowwise(output_layouts=Partial(), use_local_output=False)"),
    "partial row, local": ("linear", "half", "PartialRowwiseParallel(local=True)", "Rowwise(output_layouts=Partial())"),
    "per-head norm": ("norm", "plain", "HeadShardedNorm()", "ReplicatedWithGradAllReduce()"),
    "norm output shared": ("norm", "plain", "ReplicatedOutput()", "Boundary(outputs='replicate')"),
    "norm output, partial gradient": ("norm", "plain", "ReplicatedOutput(partial_grad=True)",
                                      "Boundary(output_grad='partial')"),
    "output summed": ("linear", "plain", "AllReduceOutput()", "Boundary(outputs='sum')"),
    "output slice, gradient reduced": ("linear", "plain", "GradAllReduceOutputSlice(width=4)",
                                       "Boundary(reduce_grad_features=((12, 16),))"),
    "inputs replicated": ("block_columns", "plain", "ReplicatedInputs()", "Boundary(inputs='replicate', outputs='local')"),
    "column, partial input gradient": ("linear", "plain", "PartialGradInput(style=ColwiseParallel())",
                                       "Boundary(inputs='replicate', input_grad='partial', style=ColwiseParallel())"),
    "owned output": ("linear", "plain", "OwnedOutput(ColwiseParallel(output_layouts=Replicate()))",
                     "Boundary(copy_output=True, style=ColwiseParallel(output_layouts=Replicate()))"),
    "gather": ("block", "seq", "GatherSequenceInput()", "Boundary(inputs='gather')"),
    "gather, DTensor inside": ("block_columns", "seq", "GatherSequenceInput(use_local_output=False)",
                               "Boundary(inputs='gather', local_inputs=False)"),
    "gather, sliced back": ("block", "seq", "GatherSequenceInput(reshard_output=True)",
                            "Boundary(inputs='gather', outputs='shard')"),
    "gather, every output sliced back": ("block", "seq", "GatherSequenceInput(reshard_output='all')",
                                         "Boundary(inputs='gather', outputs='shard_all')"),
    "MoE block": ("block", "seq", "SequenceParallelMoEBlock()", "Boundary(inputs='gather', outputs='sum_shard')"),
    "slice": ("block_sequence", "plain", "SliceSequenceInput()", "Boundary(inputs='slice')"),
    "kept whole": ("block", "seq", "ReplicatedModule()", "Boundary(inputs='whole')"),
    "kept whole, spans reduced": ("block", "plain", "ReplicatedModule(reduce_grad_features=((0, 4),))",
                                  "Boundary(inputs='whole', reduce_grad_features=((0, 4),))"),
}

# The second step (28 -> 20 styles), measured against the tree before it. Modules added: "raw" (a
# module multiplying raw weights wq, wo), "counts" (a module whose output reads its head-count
# attributes), "block_partial_columns" (the block's Linear a column handing back a partial input gradient).
SECOND = {
    "raw weights": ("raw", "plain", "LinearParams(shard_dims={'wq': 0, 'wo': 1}, columns=('wq',), rows=('wo',))",
                    "HeadParams(shard_dims={'wq': 0, 'wo': 1}, columns=('wq',), rows=('wo',))"),
    "raw weights, back to the stream": (
        "raw", "plain", "LinearParams(shard_dims={'wq': 0, 'wo': 1}, columns=('wq',), rows=('wo',), seq_output=True)",
        "HeadParams(shard_dims={'wq': 0, 'wo': 1}, columns=('wq',), rows=('wo',), seq_output=True)"),
    "kv heads over the ranks": ("counts", "plain", "KVHeadCounts(heads=8, kv_attributes=('n_kv',), head_attributes=('n_heads',))",
                                "ShardCounts(query_heads=8, kv_names=('n_kv',), head_names=('n_heads',))"),
    "kv heads, ratio elsewhere": ("counts", "plain", "KVHeadCounts(heads=8, attribute='n_rep')",
                                  "ShardCounts(query_heads=8, ratio='n_rep')"),
    "own parameters as DTensors": ("norm", "seq", "ReplicatedParams()", "ReplicatedWithGradAllReduce(dtensor=True)"),
    "stream as a DTensor": ("block_columns", "plain", "ReplicatedStream()",
                            "Boundary(inputs='replicate', outputs='local', stream=0)"),
    "norm all-gathered, plain": ("norm", "seq", "SequenceParallelAllGather()",
                                 "Boundary(outputs='gather', style=SequenceParallel())"),
    "norm all-gathered, DTensor": ("norm", "seq", "SequenceParallelAllGather(use_local_output=False)",
                                   "Boundary(outputs='gather', local_outputs=False, style=SequenceParallel())"),
    "norm all-gathered, partial gradient": ("norm", "seq", "SequenceParallelAllGather(partial_grad=True)",
                                            "Boundary(outputs='gather', output_grad='partial', style=SequenceParallel())"),
    "own positions": ("linear", "plain", "OwnPositionsOutput(sequence_dim=1)",
                      "Boundary(outputs='slice', output_grad='partial', style=ReplicatedWithGradAllReduce())"),
    "columns share their input": ("block_columns", "plain", "SharedReplicatedInput(columns=('proj',))",
                                  "Boundary(inputs='replicate', columns=('proj',))"),
    "columns share, partial gradient": ("block_columns", "plain", "SharedReplicatedInput(columns=('proj',), partial_grad=True)",
                                        "Boundary(inputs='replicate', columns=('proj',), input_grad='partial')"),
    "inputs' gradients reduced at entry": ("block_partial_columns", "plain", "ReducedInputGrads()",
                                           "Boundary(inputs='reduce_grad')"),
    "... with the module's parameters": ("block_partial_columns", "plain", "ReducedInputGrads(partial_params=True)",
                                         "Boundary(inputs='reduce_grad', style=ReplicatedWithGradAllReduce())"),
}
STEPS = {1: (PAIRS, HERE / "results" / "fold_equality.json"), 2: (SECOND, HERE / "results" / "fold_equality_step2.json")}

CHILD = r"""
import json, sys, warnings
from dataclasses import asdict
warnings.simplefilter("ignore")
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from transformers.pytorch_utils import Conv1D
import autotp
assert autotp.__file__.startswith({tree!r}), autotp.__file__
from autotp import styles
from autotp._simulate import per_rank, simulated_mesh
from autotp.plan import sharded_param_dims
from autotp.styles.declared import chain_declaration
pairs = json.loads({pairs!r})
side = {side!r}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x) * 2


class Raw(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wo = nn.Parameter(torch.randn(16, 16) / 4), nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return torch.relu(x @ self.wq.T) @ self.wo.T


class Counts(nn.Linear):
    def __init__(self):
        super().__init__(16, 16)
        self.n_heads, self.n_kv, self.num_key_value_groups, self.n_rep = 8, 2, 4, 4

    def forward(self, x):
        scale = self.n_heads + 10 * self.n_kv + 100 * self.num_key_value_groups + 1000 * self.n_rep
        return super().forward(x) * scale


def module(kind):
    torch.manual_seed(0)
    return {{"linear": lambda: nn.Linear(16, 16), "conv1d": lambda: Conv1D(16, 16), "norm": lambda: nn.LayerNorm(16),
             "raw": Raw, "counts": Counts}}.get(kind, Block)()


INNER = {{"block_columns": ColwiseParallel(), "block_sequence": ColwiseParallel(input_layouts=Shard(1)),
          "block_partial_columns": styles.Boundary(inputs="replicate", input_grad="partial", style=ColwiseParallel())}}


def whole(value):
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value


def values(value):
    return [t.tolist() for t in per_rank(whole(value).detach(), 2)]


out = {{}}
for name, (kind, inputs, old, new) in pairs.items():
    spelling = old if side == "old" else new
    try:
        namespace = {{**vars(styles), "ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
                      "SequenceParallel": SequenceParallel, "Partial": Partial, "Replicate": Replicate, "Shard": Shard}}
        style = eval(spelling, namespace)
        with simulated_mesh(2) as mesh:
            mod = module(kind)
            if kind in INNER:
                INNER[kind]._apply(mod.proj, mesh)
            mod = style._apply(mod, mesh)
            torch.manual_seed(1)
            x = torch.randn(2, 4, 8 if inputs == "half" else 16, requires_grad=True)
            arg = x
            if inputs == "seq":
                arg = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
            with CommDebugMode() as comm:
                y = mod(arg)
                first = y[0] if isinstance(y, (tuple, list)) else y
                loss = (whole(first) ** 2).sum()
                loss.backward()
            grads = {{n: values(p.grad) for n, p in sorted(mod.named_parameters()) if p.grad is not None}}
            out[name] = {{
                "output_layout": repr(first.placements) if isinstance(first, DTensor) else "plain",
                "output": values(first), "input_grad": values(x.grad), "grads": grads,
                "comms": {{str(k): v for k, v in sorted(comm.get_comm_counts().items(), key=str)}},
                "declared": {{k: repr(v) for k, v in asdict(chain_declaration(style)).items()}},
                "param_dims": sharded_param_dims(module(kind), style)}}
    except Exception as error:
        out[name] = {{"error": type(error).__name__ + ": " + str(error)[:300]}}
print(json.dumps(out))
"""


def records(tree: Path, side: str, pairs: dict) -> dict:
    return run_in_tree(tree, CHILD.format(tree=str(tree), pairs=json.dumps(pairs), side=side))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the tree before the fold")
    parser.add_argument("--new", type=Path, default=HERE.parent, help="the tree after it (default: this checkout)")
    parser.add_argument("--step", type=int, choices=sorted(STEPS), default=2,
                        help="which fold: 1 (43 -> 28 styles, base 0a05dd8) or 2 (28 -> 20, base 1ee74df). Default: 2")
    args = parser.parse_args()
    pairs, results = STEPS[args.step]
    start = time.time()
    old, new = records(args.base.resolve(), "old", pairs), records(args.new.resolve(), "new", pairs)
    differ = {}
    for name, (_, _, before, after) in pairs.items():
        a, b = old[name], new[name]
        fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if "error" in a or "error" in b:
            fields = fields or ["error"]
        status = "differ: " + ", ".join(fields) if fields else "equal"
        print(f"{name:34s} {before}  ->  {after}: {status}")
        if fields:
            differ[name] = {k: {"base": a.get(k), "new": b.get(k)} for k in fields}
    summary = f"{len(pairs)} folded spellings: {len(pairs) - len(differ)} equal, {len(differ)} differ"
    print(summary)
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps({"command": " ".join(sys.argv), "base": tree_name(args.base), "summary": summary,
                                   "seconds": round(time.time() - start, 1), "pairs": {
                                       name: {"old": p[2], "new": p[3], "record": new[name]} for name, p in pairs.items()},
                                   "differ": differ}, indent=1))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
