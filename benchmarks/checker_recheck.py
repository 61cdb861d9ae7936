"""Re-check the sweep's known false findings: the checker on the synthesized plans of chosen types.

The committed coverage sweep (``results/coverage.json``, 2026-11-27) recorded 16 plans that
verified and yet had checker findings (group copies of Mamba-hybrid types: bamba, falcon_h1,
granitemoehybrid, zamba2 at tp 2 and 4, plain and SP). This script synthesizes those types' tiny
models as the sweep builds them (``coverage._tiny_model``) and runs :func:`autotp.check_plan` on
each plan (no numerics: the sweep verified them), printing the findings per case and writing
``results/checker_recheck.json``. The whole sweep takes 1.5 hours; this takes about 3 minutes.

    python benchmarks/checker_recheck.py [--types bamba falcon_h1 granitemoehybrid zamba2] [--tp 2 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from coverage import _tiny_model  # noqa: E402

import autotp  # noqa: E402
from autotp.check import check_plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", default=["bamba", "falcon_h1", "granitemoehybrid", "zamba2"])
    parser.add_argument("--tp", nargs="*", type=int, default=[2, 4])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = {}
    for name in args.types:
        for tp in args.tp:
            for sp in (False, True):
                start = time.time()
                model = _tiny_model(name, tp)
                plan = autotp.synthesize(model, tp_size=tp, sequence_parallel=sp, verify=False)
                findings = [f"{f.kind}: {f.module}" for f in check_plan(model, plan, tp_size=tp)]
                case = f"{name} tp{tp}{' sp' if sp else ''}"
                rows[case] = {"findings": findings, "seconds": round(time.time() - start, 1)}
                print(case, len(findings), findings[:3], flush=True)
    flagged = sum(bool(r["findings"]) for r in rows.values())
    summary = f"{len(rows)} cases, {flagged} with findings"
    print(summary)
    (HERE / "results" / "checker_recheck.json").write_text(
        json.dumps({"command": " ".join(sys.argv), "summary": summary, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
