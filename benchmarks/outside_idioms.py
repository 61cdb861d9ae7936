"""Plain-PyTorch idioms of other libraries' models: per idiom, tp 2 and 4, plain and SP, whether the
synthesized plan runs, is right, and how close it holds to the bound (issue 42's table).

The models are the tests' (``tests/outside_models.py``: position terms and residual streams;
``tests/outside_attention_models.py``: attention idioms), each a two-layer decoder that differs from
a plain one in one idiom. For every case: ``autotp.synthesize`` (without its self-check, so a wrong
plan is seen here, not refused), then ``autotp.verify`` against the unsharded model (logits and
every gradient). A case is

- ``verified``: the verifier passes; ``fraction`` is the parameters per rank over the model's, beside
  the ``bound`` (every parameter cut ``1/tp`` but norms, row biases and the idiom's own small mixing
  weights, as each test file defines it);
- ``wrong``: the plan runs and the verifier reports a difference (silently wrong);
- ``crash``: running the plan raises; ``no plan``: ``synthesize`` raises (an error naming the module).

Also counted: the cases whose synthesis warned that an attention is kept whole. Prints the table and
writes ``results/outside_idioms.json`` and ``results/outside_idioms.md``.

    python benchmarks/outside_idioms.py [--tp 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import outside_attention_models as attention  # noqa: E402
import outside_models as positions  # noqa: E402
from test_outside_positions import bound_bytes  # noqa: E402

import autotp  # noqa: E402
from autotp.errors import WholeAttentionWarning  # noqa: E402

RESULTS = HERE / "results"
# Attention idioms whose bound keeps a small weight of their own whole (as their tests say).
WHOLE = {"talking_heads": ("talking_heads.weight",), "memory_tokens": ("memory_tokens",)}


def cases():
    for name, build in positions.BUILDERS.items():
        yield name, build, positions.tokens, lambda model, tp: bound_bytes(model, tp) / _bytes(model)
    for name, build in attention.IDIOMS.items():
        yield name, build, attention.tokens, lambda model, tp, name=name: attention.bound_fraction(
            model, tp, WHOLE.get(name, ()))


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_case(build, tokens, bound, tp: int, sequence_parallel: bool) -> dict:
    model = build()
    inputs = (tokens(),)
    row = {"bound": round(bound(model, tp), 4)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = autotp.synthesize(model, example_inputs=inputs, tp_size=tp,
                                     sequence_parallel=sequence_parallel, verify=False)
        except Exception as error:  # noqa: BLE001 - recorded, the table counts it
            return {**row, "status": "no plan", "error": f"{type(error).__name__}: {str(error)[:200]}"}
        try:
            report = autotp.verify(model, plan, tp_size=tp, example_inputs=inputs)
        except Exception as error:  # noqa: BLE001
            return {**row, "status": "crash", "error": f"{type(error).__name__}: {str(error)[:200]}"}
    row["whole_warning"] = any(issubclass(w.category, WholeAttentionWarning) for w in caught)
    if report.error:  # the verifier caught the plan's run raising
        return {**row, "status": "crash", "error": report.error[:200]}
    row["status"] = "verified" if report.ok else "wrong"
    row["fraction"] = round(max(report.param_fraction), 4)
    row["logits_max_abs_diff"] = max(report.logits_max_abs_diff)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", nargs="*", type=int, default=[2, 4])
    args = parser.parse_args()
    start, rows = time.time(), {}
    for name, build, tokens, bound in cases():
        for tp in args.tp:
            for sequence_parallel in (False, True):
                case = f"{name} tp{tp}{' sp' if sequence_parallel else ''}"
                rows[case] = {"idiom": name, "tp": tp, "sp": sequence_parallel,
                              **run_case(build, tokens, bound, tp, sequence_parallel)}
                print(case, json.dumps(rows[case]), file=sys.stderr, flush=True)
    idioms = list(dict.fromkeys(r["idiom"] for r in rows.values()))
    modes = [(tp, sp) for tp in args.tp for sp in (False, True)]
    head = " | ".join(f"tp{tp}{' SP' if sp else ''}" for tp, sp in modes)
    lines = [f"| idiom | {head} |", "| --- |" + " --- |" * len(modes)]
    for idiom in idioms:
        cells = []
        for tp, sp in modes:
            row = next(r for r in rows.values() if (r["idiom"], r["tp"], r["sp"]) == (idiom, tp, sp))
            cell = row["status"] if row["status"] != "verified" else f"ok {row['fraction']:.3f} / {row['bound']:.3f}"
            cells.append(cell + (" (kept whole, warned)" if row.get("whole_warning") else ""))
        lines.append(f"| {idiom} | {' | '.join(cells)} |")
    counts = {status: sum(r["status"] == status for r in rows.values())
              for status in ("verified", "wrong", "crash", "no plan")}
    at_bound = sum(r["status"] == "verified" and r["fraction"] <= r["bound"] + 1e-3 for r in rows.values())
    summary = (f"{len(rows)} cases: {counts['verified']} verified ({at_bound} at the bound), {counts['wrong']} "
               f"silently wrong, {counts['crash']} crash when run, {counts['no plan']} no plan; "
               f"{sum(bool(r.get('whole_warning')) for r in rows.values())} kept an attention whole with a warning")
    print("\n".join(lines))
    print(summary)
    RESULTS.mkdir(exist_ok=True)
    meta = {"command": " ".join(sys.argv), "seconds": round(time.time() - start, 1), "cpus": os.cpu_count()}
    (RESULTS / "outside_idioms.json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=2))
    (RESULTS / "outside_idioms.md").write_text(
        "# Outside idioms: fraction of parameters per rank / bound (`python benchmarks/outside_idioms.py`)\n\n"
        + "\n".join(lines) + f"\n\n{summary}\n")


if __name__ == "__main__":
    main()
