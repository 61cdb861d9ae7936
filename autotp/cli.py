"""The ``autotp`` command: print a model's tensor-parallel plan, or verify it on a tiny copy.

``autotp plan MODEL`` builds the real-size model on the meta device (milliseconds, no weights),
chooses a plan, and prints it as a table with the parameter memory each rank would hold (or, with
``--emit``, as an importable Python module or transformers' style strings).
``autotp check MODEL`` reads a plan (chosen, or a user's ``--plan FILE.py:NAME``) against the model's
dataflow graph and prints what would make it wrong. ``autotp verify MODEL`` builds a tiny random
model of the same architecture on CPU, shards it over simulated ranks and compares it with the
unsharded model. This module (with :mod:`autotp.cli_text`, its tables and warning summaries) is
the only one that prints.

torch and transformers are imported inside the commands, not here: ``autotp --help`` and
``autotp --version`` answer without loading them.

Long because it is the whole command line: argument parsing, the three subcommands and their
text and JSON output; the table formatting lives in :mod:`autotp.cli_text`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from collections.abc import Sequence

from autotp.cli_text import format_table, plan_rows, quiet_torch_tracebacks, quiet_transformers, summarized_warnings

__all__ = ["main", "plan_rows", "format_table", "choose_plan", "build", "replicated_linears"]

SOURCES = ("auto", "handwritten", "hf", "synth")
DTYPES = ("float32", "bfloat16", "float16")
# Exit codes: 1 = verification found a difference, or the checker found a problem in the plan;
# 2 = an error (bad input, a tp size no plan source can serve; argparse's too).
EXIT_MISMATCH, EXIT_ERROR = 1, 2
# A write to a closed pipe (``autotp plan ... | head``): what a shell reports for SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13
# Linear weights left whole by a plan above this share of the parameters get a warning.
REPLICATED_WARN_SHARE = 0.10


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    Errors print as one line (``autotp: error: ...``) and exit 2; ``--traceback`` shows the full
    traceback instead (still exit 2), and the tracebacks torch logs on its way, which are dropped
    otherwise. Warnings torch and transformers raise while the command runs are summarized at the
    end, one line per kind.
    """
    from autotp import check_cache  # stdlib only: no torch at import

    args = _parser().parse_args(argv)
    try:
        with check_cache.enabled():
            key = _output_key(args)
            kept = check_cache.cached_output(key)
            if kept is not None:  # the same plan command on the same code and config: its answer
                sys.stderr.write(kept["stderr"])
                sys.stdout.write(kept["stdout"])
                sys.stdout.flush()
                return kept["status"]
            with _Tee("stdout") as out, _Tee("stderr") as err:
                with summarized_warnings(), quiet_transformers(), quiet_torch_tracebacks(not args.traceback):
                    status = args.run(args)
            check_cache.keep_output(key, out.text(), err.text(), status)
        sys.stdout.flush()  # a closed pipe raises here, inside the handler, not at exit
        return status
    except BrokenPipeError:
        # The reader went away; flushing stdout again at exit would raise once more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 130
    except Exception as error:
        if args.traceback:
            traceback.print_exc()
        else:
            print(f"autotp: error: {_one_line_error(error)}", file=sys.stderr)
        return EXIT_ERROR


def _output_key(args: argparse.Namespace) -> str | None:
    """The output cache's key of a ``plan`` run (None for other commands and for ``--plan FILE``)."""
    from autotp import check_cache

    if args.command != "plan" or args.plan is not None:
        return None
    arguments = {name: value for name, value in vars(args).items() if name != "run"}
    return check_cache.output_key(arguments, args.model)


class _Tee:
    """Inside, ``sys.<name>`` writes go to the stream and are kept too (:meth:`text`)."""

    def __init__(self, name: str):
        self.name, self.kept = name, []

    def __enter__(self) -> _Tee:
        self.stream = getattr(sys, self.name)
        setattr(sys, self.name, self)
        return self

    def __exit__(self, *exc) -> None:
        setattr(sys, self.name, self.stream)

    def write(self, text: str) -> int:
        self.kept.append(text)
        return self.stream.write(text)

    def text(self) -> str:
        return "".join(self.kept)

    def __getattr__(self, name: str):  # flush, fileno, isatty, encoding: the stream's
        return getattr(self.stream, name)


def _one_line_error(error: Exception) -> str:
    """An :class:`AutoTPError`'s message (a :class:`NoPlanError`'s short form), or ``Type: first
    line`` of anything else with the hint."""
    from autotp.errors import AutoTPError, NoPlanError, one_line

    if isinstance(error, NoPlanError) and error.found:  # its message lists every source's reasons
        return f"{error.module}: {error.found}; {error.fix}"
    if isinstance(error, AutoTPError):
        return " ".join(str(error).split())
    return f"{one_line(error)} (unexpected; rerun with --traceback for the full traceback)"


class _BuiltinNames:
    """The built-in model names, read only when a help text is printed (importing
    :mod:`autotp.models` loads torch and transformers, seconds that ``--help`` should not cost)."""

    def __str__(self) -> str:
        from autotp import models

        return ", ".join(models.builtin_names())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autotp", description="Tensor-parallel plans for PyTorch causal language models."
    )
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = _command(commands, "plan", "print the plan and per-rank parameter memory")
    _add_plan_options(plan, default_tp=8)
    plan.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="parameter dtype for memory")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("--explain", action="store_true", help="also print why each module got its role")
    plan.add_argument(
        "--check", action="store_true",
        help="check the plan against the model's graph (as `autotp check`): exit 2 unless tp divides "
             "every head count and sharded dim (otherwise only a warning), 1 if the checker finds a problem",
    )
    plan.add_argument(
        "--emit", choices=("python", "hf"), default=None,
        help="print the plan as code: 'python' an importable module with a function "
             "f(model, sequence_parallel=...), 'hf' transformers' tp_plan strings as JSON "
             "(keys whose style has none are left out, named in a warning)",
    )
    plan.set_defaults(run=_run_plan)

    check = _command(commands, "check", "find what would make a plan wrong, statically (no numerics)")
    _add_plan_options(check, default_tp=8)
    check.add_argument("--json", action="store_true", help="print the findings as JSON")
    check.set_defaults(run=_run_check)

    verify = _command(commands, "verify", "check the plan numerically on a tiny model")
    _add_plan_options(verify, default_tp=None)
    verify.add_argument(
        "--procs", type=_positive_int, default=None, metavar="N",
        help="run the N ranks as real gloo processes instead of simulating them in one process",
    )
    verify.add_argument("--seed", type=int, default=0, help="seed for the tiny model's weights")
    verify.add_argument("--no-backward", action="store_true", help="compare logits only")
    verify.set_defaults(run=_run_verify)
    return parser


def _command(commands, name: str, help_text: str) -> argparse.ArgumentParser:
    """A subcommand taking MODEL (and ``--traceback`` after the command name too)."""
    sub = commands.add_parser(name, help=help_text, description=help_text)
    action = sub.add_argument(
        "model", metavar="MODEL",
        help="a causal LM: a built-in name (%(builtins)s), a transformers model type of a causal LM, "
             "or a path to a config.json",
    )
    action.builtins = _BuiltinNames()  # read by argparse's %-formatting of the help text only
    sub.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS,
                     help="show the full traceback of an error")
    return sub


class _VersionAction(argparse.Action):
    """``--version``, with the version read only when asked (the package metadata lookup costs
    every other run a few hundredths of a second of start-up)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autotp")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "(not installed)"


def _add_plan_options(parser: argparse.ArgumentParser, *, default_tp: int | None) -> None:
    shown = default_tp or "--procs, else 2"
    parser.add_argument("--tp", type=_positive_int, default=default_tp, help=f"tp size (default {shown})")
    parser.add_argument("--sp", action="store_true", help="sequence-parallel variant of the plan")
    parser.add_argument(
        "--source", choices=SOURCES, default="auto",
        help="where the plan comes from; auto = handwritten, hf, synthesized, in that order, "
             "skipping a source whose plan the checker rejects",
    )
    parser.add_argument(
        "--plan", metavar="FILE.py:NAME", default=None,
        help="use your own plan: NAME in FILE.py, a plan dict or a function f(model, sequence_parallel=...)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# --- models: causal LMs only ----------------------------------------------------------------------


def build(name: str, **options):
    """:func:`autotp.models.build_model` for a causal LM named on the command line.

    Raises:
        AutoTPError: the name is unknown, or names a model family that is not a causal LM; the
            message lists the closest causal-LM names.
    """
    from autotp import models
    from autotp.errors import AutoTPError

    try:
        config = models.load_config(name)
    except AutoTPError as error:
        if not str(error).startswith("unknown model"):
            raise
        raise AutoTPError(
            f"unknown model {name!r}: autotp plans causal LMs only; MODEL is a built-in name, the "
            f"model type of a transformers causal LM, or a config.json path. Closest names: "
            f"{', '.join(_closest(name))}. Built-in names: {', '.join(models.builtin_names())}."
        ) from None
    if not _is_causal_lm(config):
        raise AutoTPError(
            f"{name!r} is a {type(config).__name__}, which has no causal-LM class in transformers: "
            f"autotp plans causal LMs only. Closest causal-LM names: {', '.join(_closest(name))}."
        )
    return models.build_model(config, **options)


def _is_causal_lm(config) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _closest(name: str, limit: int = 5) -> list[str]:
    """Built-in names and causal-LM model types closest to ``name`` (difflib), best first."""
    import difflib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from autotp import models

    names = list(dict.fromkeys([*models.builtin_names(), *MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]))
    close = difflib.get_close_matches(name.lower(), names, n=limit, cutoff=0.5)
    return close or difflib.get_close_matches(name.lower(), names, n=limit, cutoff=0.0)


# --- choosing the plan ----------------------------------------------------------------------------


def choose_plan(model, *, source: str = "auto", sequence_parallel: bool = False,
                plan_file: str | None = None, tp_size: int | None = None, check: bool | None = None):
    """The plan for ``model`` from ``plan_file`` or else ``source`` (a :data:`SOURCES` name), and
    where it came from.

    Raises:
        PlanError: the file or the source has no plan for this model (NoPlanError: every source
            of ``auto`` was rejected).
    """
    choice = select(model, source=source, sequence_parallel=sequence_parallel, plan_file=plan_file,
                    tp_size=tp_size, check=check)
    return choice.plan, choice.source


def select(model, *, source: str = "auto", sequence_parallel: bool = False, plan_file: str | None = None,
           tp_size: int | None = None, check: bool | None = None):
    """:func:`choose_plan` as a :class:`~autotp.selection.PlanChoice` (with the skipped sources)."""
    from autotp.selection import PlanChoice, get_plan, load_plan_file

    if plan_file is not None:
        return PlanChoice(load_plan_file(plan_file, model, sequence_parallel=sequence_parallel), plan_file)
    return get_plan(model, sequence_parallel=sequence_parallel, tp_size=tp_size, check=check,
                    source="synthesized" if source == "synth" else source)


def _skipped_lines(choice) -> list[str]:
    """A line per rejected source, then why the winner won among those that passed."""
    lines = [f"skipped source {name}: {reason}" for name, reason in getattr(choice, "skipped", [])]
    return lines + ([f"sources considered: {choice.why}"] if getattr(choice, "why", "") else [])


# --- autotp plan -------------------------------------------------------------------------------


def _run_plan(args: argparse.Namespace) -> int:
    import torch

    from autotp.apply import check_divisible
    from autotp.errors import MeshError, NoPlanError

    model = build(args.model, dtype=getattr(torch, args.dtype))
    try:
        choice = _args_choice(args, model, args.tp)
    except NoPlanError:  # no source gives a plan that runs at this tp: nothing to show
        raise
    except MeshError as error:  # the user's own --plan, sizes tp does not divide: shown with a warning
        if args.check or args.emit:
            raise
        print(f"autotp: warning: {' '.join(str(error).split())}", file=sys.stderr)
        choice = select(model, source=args.source, sequence_parallel=args.sp, plan_file=args.plan, check=False)
    if args.emit:
        return _emit(args, model, choice)
    try:
        check_divisible(model, args.tp, choice.plan)
    except MeshError as error:
        if args.check:
            raise
        print(f"autotp: warning: {error}", file=sys.stderr)
    return _print_plan(args, model, choice)


def _args_choice(args: argparse.Namespace, model, tp: int):
    return select(model, source=args.source, sequence_parallel=args.sp, plan_file=args.plan, tp_size=tp)


def _print_plan(args: argparse.Namespace, model, choice) -> int:
    from autotp.check import check_plan
    from autotp.memory import format_bytes, param_bytes_per_rank

    plan = choice.plan
    per_rank, total = param_bytes_per_rank(model, plan, args.tp)
    replicated = replicated_linears(model, plan) if args.tp > 1 else []
    if replicated:
        print(f"autotp: warning: {_replicated_text(replicated, per_rank, total, args.tp)}", file=sys.stderr)
    explanation = _explanation(model, choice, args) if args.explain else None
    findings = None
    if args.check:  # selection's own check passed for this plan at this tp: not traced a second time
        findings = [] if _checked_by_selection(args, choice) else check_plan(model, plan, tp_size=args.tp)
    if args.json:
        print(json.dumps(_plan_json(args, model, choice, per_rank, total, explanation, findings), indent=2))
        return EXIT_MISMATCH if findings else 0
    print(_plan_heading(args, model, choice.source))
    for line in _skipped_lines(choice):
        print(line)
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
        print(f"why each key has its style ({_explained_by(choice)}):")
        print(format_table(["module", "role", "style", "reason"], [_explain_row(r) for r in explanation]))
    return EXIT_MISMATCH if findings else 0


def _checked_by_selection(args: argparse.Namespace, choice) -> bool:
    """Whether selection already checked ``choice`` at ``args.tp`` with no finding (``auto``: each
    candidate is checked, and the one returned passed)."""
    return args.plan is None and args.source == "auto" and choice.source in ("handwritten", "hf", "synthesized")


def replicated_linears(model, plan, share: float = None) -> list[tuple[str, int]]:
    """Linear-like weights (2-D, not an embedding table) the plan leaves whole, as
    ``(pattern, parameters)`` with layer indices folded to ``*``, largest first, when together they
    pass ``share`` (default :data:`REPLICATED_WARN_SHARE`) of the model's parameters; else ``[]``."""
    share = REPLICATED_WARN_SHARE if share is None else share
    from torch import nn

    from autotp.errors import PlanError
    from autotp.plan import resolve, sharded_param_dims

    try:
        resolved = resolve(model, plan)
    except PlanError:  # keys matching nothing: the checker reports them, this warning cannot count
        return []
    total = sum(p.numel() for p in model.parameters())
    whole: dict[str, int] = {}
    for fqn, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.Embedding) or not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            continue
        if fqn in resolved and "weight" in sharded_param_dims(module, resolved[fqn][1]):
            continue
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", fqn)
        whole[pattern] = whole.get(pattern, 0) + weight.numel()
    if not total or not whole or sum(whole.values()) < share * total:
        return []
    return sorted(whole.items(), key=lambda item: -item[1])


def _replicated_text(replicated: list[tuple[str, int]], per_rank: int, total: int, tp: int) -> str:
    names = ", ".join(f"{pattern} ({count / 1e6:.1f}M)" for pattern, count in replicated[:5])
    more = f" and {len(replicated) - 5} more" if len(replicated) > 5 else ""
    return (f"each rank holds {per_rank / total:.1%} of the parameters at tp={tp} (ideal {1 / tp:.1%}): "
            f"Linear weights left whole: {names}{more}; `autotp plan ... --explain` gives the "
            "synthesizer's reasons, or write the plan for them (--plan FILE.py:NAME)")


def _explanation(model, choice, args) -> list:
    """Records that describe exactly ``choice.plan``: the synthesizer's reasons when it wrote the
    plan (its own analysis, not a second trace), else the plan's own keys with their source, and the
    Linear weights that plan leaves whole."""
    from autotp.synth.api import ExplainRecord, describe

    if choice.analysis is not None:
        return describe(choice.analysis, choice.plan)
    origin = f"{choice.source} plan" + (f" ({choice.detail})" if choice.detail else "")
    records = [ExplainRecord(key, choice.source, repr(style), f"written in the {origin}", ())
               for key, style in choice.plan.items()]
    for pattern, count in replicated_linears(model, choice.plan, share=0.0):
        records.append(ExplainRecord(pattern, "replicate", "replicated",
                                     f"not sharded by the {choice.source} plan ({count:,} parameters)", ()))
    return records


def _explained_by(choice) -> str:
    if choice.analysis is not None:
        return "synthesizer"
    return f"{choice.source} plan; `--source synth --explain` gives the synthesizer's reasons"


def _explain_row(record) -> list[str]:
    return [record.key, record.role, record.style.split("(", 1)[0], record.reason]


def _plan_heading(args: argparse.Namespace, model, source: str) -> str:
    from autotp import models

    entry = models.BUILTIN.get(args.model)
    origin = f", config of {entry.source}" if entry else ""
    count = sum(p.numel() for p in model.parameters()) / 1e9
    sp = "on" if args.sp else "off"
    return (
        f"{args.model}: {type(model).__name__} ({count:.2f}B parameters{origin})\n"
        f"plan source: {source}, tp={args.tp}, sequence parallel: {sp}"
    )


def _plan_json(args, model, choice, per_rank, total, explanation, findings=None) -> dict:
    from autotp.plan import describe_plan

    return {
        "model": args.model,
        "model_class": type(model).__name__,
        "source": choice.source,
        "skipped": [{"source": name, "reason": reason} for name, reason in getattr(choice, "skipped", [])],
        "considered": [{"source": c.source, "params_fraction": c.fraction, "verdict": c.verdict,
                        "collective_bytes_per_token": c.collective_bytes} for c in getattr(choice, "considered", [])],
        "why": getattr(choice, "why", ""),
        "tp": args.tp,
        "sequence_parallel": args.sp,
        "plan": describe_plan(choice.plan),
        "memory": {"dtype": args.dtype, "per_rank_bytes": per_rank, "total_bytes": total},
        **({"explanation": [_record_json(r) for r in explanation]} if explanation is not None else {}),
        **({"findings": [_finding_json(f) for f in findings]} if findings is not None else {}),
    }


def _finding_json(finding) -> dict:
    return {"module": finding.module, "kind": finding.kind, "problem": finding.problem, "fix": finding.fix}


def _findings_text(findings) -> str:
    if not findings:
        return "check: no finding (every shard is closed, fused outputs packed, norms exact)"
    rows = [[f.module, f.kind, f.problem, f.fix] for f in findings]
    return f"check: {len(findings)} finding(s)\n" + format_table(["module", "kind", "problem", "fix"], rows)


def _emit(args: argparse.Namespace, model, choice) -> int:
    """Print the plan as a Python module (``--emit python``) or transformers strings (``--emit hf``)."""
    from autotp.emit import emit_hf, emit_python, function_name

    for line in _skipped_lines(choice):
        print(f"autotp: {line}", file=sys.stderr)
    if args.emit == "python":
        sp = " --sp" if args.sp else ""
        origin = f"`autotp plan {args.model} --tp {args.tp}{sp} --emit python`, plan source: {choice.source}"
        print(emit_python(model, choice.plan, name=function_name(args.model), sequence_parallel=args.sp,
                          origin=origin), end="")
        return 0
    tp_plan, missing = emit_hf(model, choice.plan)
    print(json.dumps(tp_plan, indent=2))
    if missing:
        left_out = ", ".join(f"{key} ({style.split('(', 1)[0]})" for key, style in missing.items())
        print(f"autotp: warning: --emit hf left out {len(missing)} plan key(s) whose style has no transformers "
              f"tp_plan string: {left_out}. The strings above are not the whole plan: check them before use "
              "(`autotp check MODEL --plan FILE.py:NAME` reads a dict of them), or load the whole plan with "
              "autotp.from_pretrained.", file=sys.stderr)
    return 0


# --- autotp check ------------------------------------------------------------------------------


def _run_check(args: argparse.Namespace) -> int:
    """Check the plan statically on the real-size model (meta device: shapes only)."""
    from autotp.check import check_plan

    model = build(args.model)
    if args.plan is None and args.source == "auto":
        # Selection checks each source and falls through: the plan it returns has no finding. When
        # every source is rejected, NoPlanError is one error line (--source NAME shows one's findings).
        choice, findings = select(model, sequence_parallel=args.sp, tp_size=args.tp), []
    else:  # the plan named is the one under test: checked here, not by selection
        choice = select(model, source=args.source, sequence_parallel=args.sp, plan_file=args.plan,
                        tp_size=args.tp, check=False)
        findings = check_plan(model, choice.plan, tp_size=args.tp)
    if args.json:
        print(json.dumps({"model": args.model, "model_class": type(model).__name__, "source": choice.source,
                          "tp": args.tp, "sequence_parallel": args.sp,
                          "findings": [_finding_json(f) for f in findings]}, indent=2))
    else:
        print(_plan_heading(args, model, choice.source))
        for line in _skipped_lines(choice):
            print(line)
        print(_findings_text(findings))
    return EXIT_MISMATCH if findings else 0


def _record_json(record) -> dict:
    return {"key": record.key, "role": record.role, "style": record.style, "reason": record.reason,
            "evidence": list(record.evidence)}


# --- autotp verify -----------------------------------------------------------------------------

# Config sizes printed for the tiny model verify builds (those the config has).
_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "moe_intermediate_size", "num_experts", "n_routed_experts", "vocab_size")


def _run_verify(args: argparse.Namespace) -> int:
    tp = _verify_tp(args)
    source = _check_real_config(args, tp)
    model = _build_tiny(args, tp)
    try:
        plan, source = choose_plan(model, source=source, sequence_parallel=args.sp, plan_file=args.plan,
                                   tp_size=tp, check=False)
    except Exception as error:
        raise _tiny_error(args, tp, error) from error
    where = f"{args.procs} gloo processes" if args.procs else "simulated ranks"
    print(f"{args.model}: tiny {type(model).__name__}, plan source: {source}, tp={tp} on {where}")
    print(f"tiny model: {tiny_sizes(model)}")
    if args.plan:
        check_plan_sizes(model, plan, spec=args.plan)
    backward = not args.no_backward
    try:
        if args.procs:
            from autotp.multiprocess import verify_multiprocess  # starts processes: only when asked

            report = verify_multiprocess(model, plan, procs=tp, backward=backward)
        else:
            from autotp.verifier import verify

            report = verify(model, plan, tp_size=tp, backward=backward)
    except Exception as error:
        raise _tiny_error(args, tp, error) from error
    print(report)
    return 0 if report.ok else EXIT_MISMATCH


def _check_real_config(args: argparse.Namespace, tp: int) -> str:
    """Check ``tp`` against the REAL config (meta, no weights) before building the tiny model.

    The tiny model is built to divide by ``tp``, so it would verify a tp size the real model cannot
    use. For ``--source auto`` the real model's plan is selected (falling through rejected sources)
    and that source is the one verified on the tiny model.

    Returns:
        The source to verify: the one chosen for the real model, or ``args.source``.

    Raises:
        MeshError, NoPlanError: the real config does not divide by ``tp`` (its sizes, not the tiny
            model's, and the tp sizes that would work).
    """
    from autotp.apply import check_divisible

    real = build(args.model)
    choice = select(real, source=args.source, sequence_parallel=args.sp, plan_file=args.plan, tp_size=tp)
    for line in _skipped_lines(choice):
        print(line)
    check_divisible(real, tp, choice.plan)
    return {"synthesized": "synth", "custom": "auto"}.get(choice.source, choice.source) if not args.plan else "auto"


def _build_tiny(args: argparse.Namespace, tp: int):
    """The tiny model of ``args.model`` for ``tp``; a failure says it is the tiny model that failed.

    A config with fewer kv heads than ``tp`` keeps them (Gemma-3-1B's one kv head at tp 2), so the
    plan verified is the one the real model runs (kv heads replicated or gathered)."""
    from autotp.errors import AutoTPError, one_line

    try:
        return build(args.model, tiny=True, tp=tp, device="cpu", seed=args.seed, keep_kv_heads=True)
    except AutoTPError:
        raise
    except Exception as error:
        raise AutoTPError(
            f"{args.model}: building the tiny model for tp={tp} failed ({one_line(error)}); the real config "
            "divides by this tp, but tiny models are built for tp 2, 4 and 8: verify at one of those."
        ) from error


def _tiny_error(args: argparse.Namespace, tp: int, error: Exception) -> Exception:
    """A one-line error for a failure on the tiny model, saying that its sizes are not the real ones."""
    from autotp.errors import AutoTPError, MeshError, PlanError, one_line

    if isinstance(error, MeshError):
        text = re.sub(r"; use tp in \([^)]*\)", "", str(error))
        return MeshError(f"the tiny model verify builds cannot be split at tp={tp} although the real config "
                         f"can: {text} Verify at tp 2, 4 or 8, the sizes tiny models are built for.")
    if isinstance(error, AutoTPError) or not args.plan:
        return error
    return PlanError(
        f"--plan {args.plan!r} failed on the tiny model verify builds ({one_line(error)}); a plan that "
        "hard-codes sizes of the real model does not fit it: compute them from the model the function "
        f"gets (module.out_features, model.config), as `autotp plan {args.model} --emit python` writes them."
    )


def tiny_sizes(model) -> str:
    """The tiny model's main sizes, from its (text) config: ``hidden_size=64, ...``."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    sizes = [(n, getattr(config, n, None)) for n in _SIZES]
    return ", ".join(f"{n}={v}" for n, v in sizes if isinstance(v, int) and not isinstance(v, bool))


def check_plan_sizes(model, plan, *, spec: str) -> None:
    """Refuse a plan whose fused-part ``sizes`` do not add up to its module's width.

    Raises:
        PlanError: names the key, the sizes, the module's width, and the fix.
    """
    from autotp.errors import PlanError
    from autotp.plan import base_style, resolve

    for fqn, (key, style) in resolve(model, plan).items():
        sizes = getattr(base_style(style), "sizes", None)
        weight = getattr(model.get_submodule(fqn), "weight", None)
        if sizes and weight is not None and sum(sizes) not in weight.shape:
            raise PlanError(
                f"{fqn}: --plan {spec!r} gives {type(base_style(style)).__name__} sizes {tuple(sizes)} "
                f"(sum {sum(sizes)}) for plan key {key!r}, but the module's weight is {tuple(weight.shape)} "
                "in the tiny model verify builds: the sizes are hard-coded for the real model. Compute "
                "them from the model the plan function gets (module.out_features, model.config)."
            )


def _verify_tp(args: argparse.Namespace) -> int:
    """The tp size: ``--tp``, else ``--procs`` (one rank per process), else 2."""
    from autotp.errors import AutoTPError

    if args.procs and args.tp and args.procs != args.tp:
        raise AutoTPError(
            f"--procs {args.procs} and --tp {args.tp} disagree: each process is one tp rank; "
            "give one of them, or the same number to both."
        )
    return args.tp or args.procs or 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
