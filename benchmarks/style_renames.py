"""Read a style's repr written before issue 40's folds of the public styles (43 -> 28 -> 20) in the new names.

The fold kept what each style shards and communicates and changed how it is spelled: 16 classes
became options of 4 (``Colwise``, ``Rowwise``, ``Boundary``, ``ExpertsParallel``; a per-head
norm is ``ReplicatedWithGradAllReduce``). :func:`canonical` parses a repr (``Name(key=value,
...)``, nested styles too), rewrites the old spellings into the new ones, and prints it with its
options sorted, so two trees' plans compare option by option whichever names they use.

>>> canonical("OwnedOutput(PartialRowwiseParallel(local=True))")
'Boundary(copy_output=True, style=Rowwise(input_layouts=(Shard(dim=-1),), output_layouts=(Partial(sum),), use_local_output=True))'
>>> canonical("PartialGradInput(style=OwnedOutput(ColwiseParallel()))") == canonical(
...     "Boundary(inputs='replicate', input_grad='partial', copy_output=True, style=ColwiseParallel())")
True
>>> canonical("SharedReplicatedInput(columns=('q', 'k'), partial_grad=True)")
"Boundary(columns=('q', 'k'), input_grad='partial', inputs='replicate')"
>>> canonical("SequenceParallelAllGather(use_local_output=False)")
"Boundary(local_outputs=False, outputs='gather', style=SequenceParallel(sequence_dim=1, use_local_output=False))"
"""

from __future__ import annotations

import re

_CALL = re.compile(r"^([A-Za-z_]\w*)\((.*)\)$", re.S)
_ROW_LAYOUTS = {"input_layouts": "(Shard(dim=-1),)", "output_layouts": "(Partial(sum),)"}


def _split(inner: str) -> list[str]:
    """``inner`` split at its top-level commas (not inside brackets or quotes)."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(inner):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    tail = inner[start:].strip()
    return [p for p in [*parts, tail] if p]


def _parse(text: str):
    """``(name, [positional], {keyword: value})`` for a call whose name starts upper case, else the text."""
    match = _CALL.match(text.strip())
    if not match or not match.group(1)[0].isupper() or match.group(1) in ("Shard", "Partial", "Replicate"):
        return text.strip()
    name, inner = match.groups()
    positional, keywords = [], {}
    for part in _split(inner):
        key = re.match(r"^([a-z_]\w*)=(.*)$", part, re.S)
        if key:
            keywords[key.group(1)] = _parse(key.group(2))
        else:
            positional.append(_parse(part))
    return name, positional, keywords


def _renamed(node):
    """The old spelling of one parsed style in the new names (its nested styles first)."""
    if isinstance(node, str):
        return node
    name, positional, kw = node
    positional = [_renamed(p) for p in positional]
    kw = {k: _renamed(v) for k, v in kw.items()}
    if name == "PackedColwiseParallel":
        return "Colwise", positional, kw
    if name == "ColwiseParallelInOut":
        return "Colwise", positional, {**kw, "weight_in_out": "True"}
    if name in ("PackedRowwiseParallel", "BroadcastRowwiseParallel"):
        return "Rowwise", positional, kw
    if name == "RowwiseParallelInOut":
        return "Rowwise", positional, {**kw, "weight_in_out": "True"}
    if name == "PartialRowwiseParallel":
        local = kw.pop("local", "False")
        return "Rowwise", positional, {**_ROW_LAYOUTS, "use_local_output": local, **kw}
    if name == "HeadShardedNorm":
        return "ReplicatedWithGradAllReduce", positional, kw
    if name == "PartialExpertsParallel":
        return "ExpertsParallel", positional, {**kw, "partial_output": "True"}
    if name == "LinearParams":  # its raw-weight options always printed; HeadParams prints those set
        return "HeadParams", positional, {k: v for k, v in kw.items() if v not in ("()", "False")}
    if name == "KVHeadCounts":
        renamed = {"heads": "query_heads", "attribute": "ratio", "kv_attributes": "kv_names",
                   "head_attributes": "head_names"}
        return "ShardCounts", positional, {renamed.get(k, k): v for k, v in kw.items()}
    if name == "ReplicatedParams":
        return "ReplicatedWithGradAllReduce", positional, {"dtensor": "True"}
    boundary = _boundary(name, positional, kw)
    return ("Boundary", [], boundary) if boundary is not None else (name, positional, kw)


def _boundary(name: str, positional: list, kw: dict) -> dict | None:
    """The options of the ``Boundary`` an old boundary style became; None for any other style."""
    dim = {"sequence_dim": kw["sequence_dim"]} if kw.get("sequence_dim", "1") != "1" else {}
    local = {"local_inputs": "False"} if kw.get("use_local_output") == "False" else {}
    if name == "ReplicatedOutput":
        return {"output_grad": "'partial'"} if kw.get("partial_grad") == "True" else {"outputs": "'replicate'"}
    if name == "AllReduceOutput":
        return {"outputs": "'sum'"}
    if name == "ReplicatedInputs":
        return {"inputs": "'replicate'", "outputs": "'local'"}
    if name == "SliceSequenceInput":
        return {"inputs": "'slice'", **dim}
    if name == "ReplicatedModule":
        spans = {"reduce_grad_features": kw["reduce_grad_features"]} if "reduce_grad_features" in kw else {}
        return {"inputs": "'whole'", **spans}
    if name == "GatherSequenceInput":
        reshard = kw.get("reshard_output", "False")
        outputs = {"True": {"outputs": "'shard'"}, "'all'": {"outputs": "'shard_all'"}}.get(reshard, {})
        return {"inputs": "'gather'", **outputs, **local, **dim}
    if name == "SequenceParallelMoEBlock":
        return {"inputs": "'gather'", "outputs": "'sum_shard'", **local, **dim}
    if name == "OwnedOutput":
        return _merged({"copy_output": "True"}, positional[0])
    if name == "PartialGradInput":
        return _merged({"inputs": "'replicate'", "input_grad": "'partial'"}, kw["style"])
    return _boundary_second_fold(name, kw, dim)


_SEQUENCE_PARALLEL = "SequenceParallel(sequence_dim=1, use_local_output=False)"


def _boundary_second_fold(name: str, kw: dict, dim: dict) -> dict | None:
    """The boundary styles folded in the fold's second step (43 -> 28 -> 20 styles)."""
    if name == "ReplicatedStream":
        return {"inputs": "'replicate'", "outputs": "'local'", "stream": kw.get("stream", "0")}
    if name == "SequenceParallelAllGather":
        local = {"local_outputs": "False"} if kw.get("use_local_output") == "False" else {}
        grad = {"output_grad": "'partial'"} if kw.get("partial_grad") == "True" else {}
        return {"outputs": "'gather'", **local, **grad, "style": _SEQUENCE_PARALLEL}
    if name == "OwnPositionsOutput":
        return {"outputs": "'slice'", "output_grad": "'partial'", **dim, "style": "ReplicatedWithGradAllReduce()"}
    if name == "SharedReplicatedInput":
        grad = {"input_grad": "'partial'"} if kw.get("partial_grad") == "True" else {}
        inner = {"style": kw["style"]} if "style" in kw else {}
        return {"inputs": "'replicate'", "columns": kw["columns"], **grad, **inner}
    if name == "ReducedInputGrads":
        inner = {"style": "ReplicatedWithGradAllReduce()"} if kw.get("partial_params") == "True" else {}
        return {"inputs": "'reduce_grad'", **inner}
    return None


def _merged(options: dict, inner) -> dict:
    """``options`` around the style ``inner``: folded into it when it is a ``Boundary`` itself."""
    if isinstance(inner, tuple) and inner[0] == "Boundary":
        return {**inner[2], **options}
    return {**options, "style": inner}


def _render(node) -> str:
    if isinstance(node, str):
        return node
    name, positional, kw = node
    args = [_render(p) for p in positional] + [f"{k}={_render(v)}" for k, v in sorted(kw.items())]
    return f"{name}({', '.join(args)})"


def canonical(text: str) -> str:
    """``text`` (a style's repr, old or new names) in the new names with its options sorted."""
    return _render(_renamed(_parse(text)))
