"""The ``autotp`` command: print a model's tensor-parallel plan, or verify it on a tiny copy.

``autotp plan MODEL`` builds the real-size model on the meta device (milliseconds, no weights),
chooses a plan, and prints it as a table with the parameter memory each rank would hold.
``autotp check MODEL`` reads a plan (chosen, or a user's ``--plan FILE.py:NAME``) against the model's
dataflow graph and prints what would make it wrong. ``autotp verify MODEL`` builds a tiny random
model of the same architecture on CPU, shards it over simulated ranks and compares it with the
unsharded model. This is the only module that prints.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

import torch
from torch import nn

from autotp import models
from autotp.apply import check_divisible
from autotp.check import Finding, check_plan
from autotp.errors import AutoTPError, MeshError
from autotp.memory import format_bytes, param_bytes_per_rank
from autotp.plan import Plan, base_style, describe_plan, describe_style
from autotp.selection import get_plan, load_plan_file
from autotp.verifier import verify

SOURCES = ("auto", "handwritten", "hf", "synth")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Exit codes: 1 = verification found a difference, or the checker found a problem in the plan;
# 2 = bad input (argparse uses 2 too).
EXIT_MISMATCH, EXIT_ERROR = 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except AutoTPError as error:
        print(f"autotp: error: {error}", file=sys.stderr)
        return EXIT_ERROR


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotp", description="Tensor-parallel plans for PyTorch language models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = (
        f"a built-in name ({', '.join(models.builtin_names())}), "
        "a transformers model type, or a path to a config.json"
    )

    plan = commands.add_parser("plan", help="print the plan and per-rank parameter memory")
    plan.add_argument("model", metavar="MODEL", help=model_help)
    _add_plan_options(plan, default_tp=8)
    plan.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="parameter dtype for memory")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("--explain", action="store_true", help="also print why each module got its role")
    plan.add_argument(
        "--check", action="store_true",
        help="check the plan against the model's graph (as `autotp check`): exit 2 unless tp divides "
             "every head count and sharded dim (otherwise only a warning), 1 if the checker finds a problem",
    )
    plan.set_defaults(run=_run_plan)

    check = commands.add_parser("check", help="find what would make a plan wrong, statically (no numerics)")
    check.add_argument("model", metavar="MODEL", help=model_help)
    _add_plan_options(check, default_tp=8)
    check.add_argument("--json", action="store_true", help="print the findings as JSON")
    check.set_defaults(run=_run_check)

    verify = commands.add_parser("verify", help="check the plan numerically on a tiny model")
    verify.add_argument("model", metavar="MODEL", help=model_help)
    _add_plan_options(verify, default_tp=None)
    verify.add_argument(
        "--procs", type=_positive_int, default=None, metavar="N",
        help="run the N ranks as real gloo processes instead of simulating them in one process",
    )
    verify.add_argument("--seed", type=int, default=0, help="seed for the tiny model's weights")
    verify.add_argument("--no-backward", action="store_true", help="compare logits only")
    verify.set_defaults(run=_run_verify)
    return parser


def _add_plan_options(parser: argparse.ArgumentParser, *, default_tp: int | None) -> None:
    shown = default_tp or "--procs, else 2"
    parser.add_argument("--tp", type=_positive_int, default=default_tp, help=f"tp size (default {shown})")
    parser.add_argument("--sp", action="store_true", help="sequence-parallel variant of the plan")
    parser.add_argument(
        "--source", choices=SOURCES, default="auto",
        help="where the plan comes from; auto = handwritten, hf, synthesized, in that order",
    )
    parser.add_argument(
        "--plan", metavar="FILE.py:NAME", default=None,
        help="use your own plan: NAME in FILE.py, a plan dict or a function f(model, sequence_parallel=...)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def choose_plan(model: nn.Module, *, source: str = "auto", sequence_parallel: bool = False,
                plan_file: str | None = None, tp_size: int | None = None) -> tuple[Plan, str]:
    """The plan for ``model`` from ``plan_file`` or else ``source`` (a :data:`SOURCES` name), and
    where it came from.

    Raises:
        PlanError: the file or the source has no plan for this model.
    """
    if plan_file is not None:
        return load_plan_file(plan_file, model, sequence_parallel=sequence_parallel), plan_file
    choice = get_plan(
        model, sequence_parallel=sequence_parallel, source="synthesized" if source == "synth" else source,
        tp_size=tp_size,
    )
    return choice.plan, choice.source


# --- autotp plan -------------------------------------------------------------------------------


def _run_plan(args: argparse.Namespace) -> int:
    model = models.build_model(args.model, dtype=DTYPES[args.dtype])
    try:
        plan, source = _args_plan(args, model, args.tp)
    except MeshError as error:  # a synthesized plan checked for --tp: shown anyway, with the warning
        if args.check:
            raise
        print(f"autotp: warning: {error}", file=sys.stderr)
        plan, source = choose_plan(model, source=args.source, sequence_parallel=args.sp, plan_file=args.plan)
    try:
        check_divisible(model, args.tp, plan)
    except MeshError as error:
        if args.check:
            raise
        print(f"autotp: warning: {error}", file=sys.stderr)
    per_rank, total = param_bytes_per_rank(model, plan, args.tp)
    explanation = None
    if args.explain:
        from autotp.synth import explain  # traces the model: only when asked

        explanation = explain(model, sequence_parallel=args.sp)
    findings = check_plan(model, plan, tp_size=args.tp) if args.check else None
    if args.json:
        print(json.dumps(_plan_json(args, model, plan, source, per_rank, total, explanation, findings), indent=2))
        return EXIT_MISMATCH if findings else 0
    print(_plan_heading(args, model, source))
    print()
    print(format_table(["pattern", "style", "input", "output", "local", "options"], plan_rows(plan)))
    print()
    share = per_rank / total if total else 1.0
    print(
        f"parameters per rank at tp={args.tp} ({args.dtype}): {format_bytes(per_rank)} "
        f"of {format_bytes(total)} ({share:.1%})"
    )
    if findings is not None:
        print(f"check: tp={args.tp} divides every head count and every sharded dimension")
        print(_findings_text(findings))
    if explanation is not None:
        print()
        print("why each module got its role (synthesizer):")
        print(format_table(["module", "role", "style", "reason"], [_explain_row(r) for r in explanation]))
    return EXIT_MISMATCH if findings else 0


def _args_plan(args: argparse.Namespace, model: nn.Module, tp: int) -> tuple[Plan, str]:
    return choose_plan(model, source=args.source, sequence_parallel=args.sp, plan_file=args.plan, tp_size=tp)


def _explain_row(record) -> list[str]:
    return [record.key, record.role, record.style.split("(", 1)[0], record.reason]


def _plan_heading(args: argparse.Namespace, model: nn.Module, source: str) -> str:
    entry = models.BUILTIN.get(args.model)
    origin = f", config of {entry.source}" if entry else ""
    count = sum(p.numel() for p in model.parameters()) / 1e9
    sp = "on" if args.sp else "off"
    return (
        f"{args.model}: {type(model).__name__} ({count:.2f}B parameters{origin})\n"
        f"plan source: {source}, tp={args.tp}, sequence parallel: {sp}"
    )


def _plan_json(args, model, plan, source, per_rank, total, explanation, findings=None) -> dict:
    return {
        "model": args.model,
        "model_class": type(model).__name__,
        "source": source,
        "tp": args.tp,
        "sequence_parallel": args.sp,
        "plan": describe_plan(plan),
        "memory": {"dtype": args.dtype, "per_rank_bytes": per_rank, "total_bytes": total},
        **({"explanation": [_record_json(r) for r in explanation]} if explanation is not None else {}),
        **({"findings": [_finding_json(f) for f in findings]} if findings is not None else {}),
    }


def _finding_json(finding: Finding) -> dict:
    return {"module": finding.module, "kind": finding.kind, "problem": finding.problem, "fix": finding.fix}


def _findings_text(findings: list[Finding]) -> str:
    if not findings:
        return "check: no finding (every shard is closed, fused outputs packed, norms exact)"
    rows = [[f.module, f.kind, f.problem, f.fix] for f in findings]
    return f"check: {len(findings)} finding(s)\n" + format_table(["module", "kind", "problem", "fix"], rows)


# --- autotp check ------------------------------------------------------------------------------


def _run_check(args: argparse.Namespace) -> int:
    """Check the plan statically on the real-size model (meta device: shapes only)."""
    model = models.build_model(args.model)
    plan, source = _args_plan(args, model, args.tp)
    findings = check_plan(model, plan, tp_size=args.tp)
    if args.json:
        print(json.dumps({"model": args.model, "model_class": type(model).__name__, "source": source,
                          "tp": args.tp, "sequence_parallel": args.sp,
                          "findings": [_finding_json(f) for f in findings]}, indent=2))
    else:
        print(_plan_heading(args, model, source))
        print(_findings_text(findings))
    return EXIT_MISMATCH if findings else 0


def _record_json(record) -> dict:
    return {"key": record.key, "role": record.role, "style": record.style, "reason": record.reason,
            "evidence": list(record.evidence)}


# Option names read into the input / output / local columns; the rest go to "options".
_INPUT = ("input_layouts", "input_kwarg_layouts", "sequence_sharding")
_DESIRED_INPUT = ("desired_input_layouts", "desired_input_kwarg_layouts")
_OUTPUT = ("output_layouts", "sequence_sharding")
_DESIRED_OUTPUT = ("desired_output_layouts",)
_SHOWN = {*_INPUT, *_DESIRED_INPUT, *_OUTPUT, *_DESIRED_OUTPUT, "use_local_output", "style", "with_kwargs"}


def plan_rows(plan: Plan) -> list[list[str]]:
    """One table row per plan key: pattern, style, input and output layouts, local output, options.

    A layout change reads ``from -> to``; placements are abbreviated (``R``, ``S(-1)``, ``P``).

    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> plan_rows({"model.layers.*.mlp.up_proj": ColwiseParallel()})
    [['model.layers.*.mlp.up_proj', 'ColwiseParallel', 'R', 'S(-1)', 'yes', '']]
    """
    rows = []
    for key, style in plan.items():
        # describe_style leaves out desired_input_layouts (RowwiseParallel rewrites it when
        # applied), but for PrepareModuleInput it is the point of the style: read it here.
        base = base_style(style)  # a wrapper (OwnedOutput) shows the layouts of the style it wraps
        desc = {**describe_style(base), **{k: _as_data(getattr(base, k, None)) for k in _DESIRED_INPUT}}
        if base is not style:
            desc["style"] = f"{type(style).__name__}({desc['style']})"
        local = desc.get("use_local_output")
        options = ", ".join(f"{k}={_short(v)}" for k, v in desc.items() if k not in _SHOWN and v is not None)
        rows.append([
            key,
            desc["style"],
            _layout_change(desc, _INPUT, _DESIRED_INPUT),
            _layout_change(desc, _OUTPUT, _DESIRED_OUTPUT),
            "" if local is None else ("yes" if local else "no"),
            options,
        ])
    return rows


def _as_data(value):
    """Placements (or tuples / dicts of them) as their reprs, like ``describe_style`` gives them."""
    if isinstance(value, (tuple, list)):
        return [_as_data(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_data(v) for k, v in value.items()}
    return value if value is None else repr(value)


def _layout_change(desc: dict, current: tuple[str, ...], desired: tuple[str, ...]) -> str:
    before = next((desc[k] for k in current if desc.get(k)), None)
    after = next((desc[k] for k in desired if desc.get(k)), None)
    if before is None:
        return "" if after is None else _short(after)
    return _short(before) if after is None or after == before else f"{_short(before)} -> {_short(after)}"


def _short(value) -> str:
    """Abbreviate placements: ``['Shard(dim=1)', None]`` -> ``S(1),-``."""
    if isinstance(value, dict):
        return ",".join(f"{k}:{_short(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(_short(v) for v in value)
    if value is None:
        return "-"
    text = str(value)
    text = re.sub(r"Shard\(dim=(-?\d+)\)", r"S(\1)", text)
    text = text.replace("Replicate()", "R")
    return re.sub(r"Partial\([^)]*\)", "P", text)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by `` | ``, with a rule under the header.

    >>> print(format_table(["a", "bb"], [["xyz", "1"]]))
    a   | bb
    ----+---
    xyz | 1
    """
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


# --- autotp verify -----------------------------------------------------------------------------


def _run_verify(args: argparse.Namespace) -> int:
    tp = _verify_tp(args)
    model = models.build_model(args.model, tiny=True, tp=tp, device="cpu", seed=args.seed)
    plan, source = _args_plan(args, model, tp)
    where = f"{args.procs} gloo processes" if args.procs else "simulated ranks"
    print(f"{args.model}: tiny {type(model).__name__}, plan source: {source}, tp={tp} on {where}")
    backward = not args.no_backward
    if args.procs:
        from autotp.multiprocess import verify_multiprocess  # starts processes: only when asked

        report = verify_multiprocess(model, plan, procs=tp, backward=backward)
    else:
        report = verify(model, plan, tp_size=tp, backward=backward)
    print(report)
    return 0 if report.ok else EXIT_MISMATCH


def _verify_tp(args: argparse.Namespace) -> int:
    """The tp size: ``--tp``, else ``--procs`` (one rank per process), else 2."""
    if args.procs and args.tp and args.procs != args.tp:
        raise AutoTPError(
            f"--procs {args.procs} and --tp {args.tp} disagree: each process is one tp rank; "
            "give one of them, or the same number to both."
        )
    return args.tp or args.procs or 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
