"""Summaries and the COVERAGE.md table of a coverage sweep (:mod:`coverage`); pure functions of the results."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from coverage import EXCLUSIONS, REASONS

HEADLINE_CASE = (2, False)  # tp=2, plain: the case the 90% target is about


def _case(results: list[dict], tp: int, sp: bool) -> list[dict]:
    return [r for r in results if r["tp"] == tp and r["sp"] == sp]


def _status(part: dict | None) -> str:
    return (part or {}).get("status", "-")


def confusion(results: list[dict]) -> dict:
    """Checker vs verifier over every plan verified: synthesized (all cases) and transformers' (plain).

    A plan is *wrong* when verification failed: a mismatch, a crash of the sharded model, or the plan
    rejected when applied (tied weights placed differently, a style that does not fit its module).
    Plans that never existed (synthesis failed, no transformers plan) or never reached the checker
    (timeout) are not counted; ``checker_crashed`` counts plans where check_plan itself raised.
    """
    def empty():
        return Counter(flagged_wrong=0, flagged_correct=0, unflagged_wrong=0, unflagged_correct=0,
                       checker_crashed=0)

    total, by_source = empty(), {}
    for r in results:
        for source in ("synth", "hf"):
            part = r.get(source) or {}
            if "check" not in part:
                continue
            wrong = part["status"] != "verified"
            flagged = part["check"].get("flagged")
            key = "checker_crashed" if flagged is None else (
                f"{'flagged' if flagged else 'unflagged'}_{'wrong' if wrong else 'correct'}")
            name = f"{source}/{'sp' if r['sp'] else 'plain'}"
            by_source.setdefault(name, empty())[key] += 1
            total[key] += 1
    return {"all": dict(total), **{k: dict(v) for k, v in sorted(by_source.items())}}


def summarize(results: list[dict]) -> dict:
    """Headline numbers: the tp=2 plain target, failure classes, per-case counts, checker confusion."""
    types = sorted({r["model_type"] for r in results})
    classes = {r["model_type"]: r.get("class", "?") for r in results}
    head = {r["model_type"]: r for r in _case(results, *HEADLINE_CASE)}
    decoder = [t for t in types if classes[t] == "decoder-text" and t in head]
    verified = [t for t in decoder if _status(head[t].get("synth")) == "verified"]
    per_case = {}
    for tp in sorted({r["tp"] for r in results}):
        for sp in (False, True):
            rows = _case(results, tp, sp)
            if not rows:
                continue
            key = f"tp{tp}/{'sp' if sp else 'plain'}"
            dec = [r for r in rows if r.get("class") == "decoder-text"]
            verified_dec = [r for r in dec if _status(r.get("synth")) == "verified"]
            per_case[key] = {
                "cases": len(rows),
                # verified and within 0.1 of the Megatron-style parameter bound (issue 12's measure)
                "near_bound_decoder_text": sum(_near_bound(r) for r in verified_dec),
                # verified, and the backward issues no more collectives than the forward (issue 13)
                "backward_le_forward_decoder_text": sum(_backward_le_forward(r) for r in verified_dec),
                # verified, and the backward's collectives move no more bytes than the forward's
                "backward_bytes_le_forward_decoder_text": sum(_backward_bytes_le_forward(r) for r in verified_dec),
                # verified, and the backward's bytes per token at most the forward's (of those measured)
                "backward_per_token_le_forward_decoder_text": sum(
                    _backward_per_token_le_forward(r) is True for r in verified_dec),
                "per_token_measured_decoder_text": sum(
                    _backward_per_token_le_forward(r) is not None for r in verified_dec),
                # issue 13's measure over the near-bound types: bytes per step, and per token
                "near_bound_backward_bytes_le_forward": sum(
                    _backward_bytes_le_forward(r) for r in verified_dec if _near_bound(r)),
                "near_bound_backward_per_token_le_forward": sum(
                    _backward_per_token_le_forward(r) is True for r in verified_dec if _near_bound(r)),
                "near_bound_per_token_measured": sum(
                    _backward_per_token_le_forward(r) is not None for r in verified_dec if _near_bound(r)),
                # verified, and every gradient the size of its parameter's local shard (issue 13)
                "local_grads_decoder_text": sum(_local_grads(r) for r in verified_dec),
                "synth_verified": sum(_status(r.get("synth")) == "verified" for r in rows),
                "synth_verified_decoder_text": f"{sum(_status(r.get('synth')) == 'verified' for r in dec)}/{len(dec)}",
                "synth_failures": dict(Counter(r["synth"].get("reason") for r in rows if _status(r.get("synth")) != "verified")),
                "hf": dict(Counter(_hf_label(r.get("hf")) for r in rows)) if not sp else None,
            }
    headline = {
        "model_types": len(types),
        "by_class": dict(Counter(classes[t] for t in types)),
        "decoder_text_types": len(decoder),
        "tp2_plain_verified_decoder_text": len(verified),
        "tp2_plain_verified_pct": round(100 * len(verified) / len(decoder), 1) if decoder else None,
        "tp2_plain_failure_classes_decoder_text": dict(Counter(
            head[t]["synth"].get("reason") for t in decoder if t not in verified)),
        "tp2_plain_failure_classes_all": dict(Counter(
            r["synth"].get("reason") for r in head.values() if _status(r.get("synth")) != "verified")),
        "checker_confusion": confusion(results)["all"],
    }
    return {"headline": headline, "per_case": per_case, "checker_confusion": confusion(results)}


def _near_bound(r: dict) -> bool:
    bound, frac = r.get("megatron_fraction"), (r.get("synth") or {}).get("param_fraction")
    return bound is not None and frac is not None and frac <= bound + 0.1


def _backward_le_forward(r: dict) -> bool:
    synth = r.get("synth") or {}
    back = synth.get("collectives_backward")
    return back is not None and sum(back.values()) <= sum((synth.get("collectives") or {}).values())


def _backward_bytes_le_forward(r: dict) -> bool:
    synth = r.get("synth") or {}
    back = synth.get("comm_volume_backward")
    return back is not None and back <= synth.get("comm_volume", 0)


def _backward_per_token_le_forward(r: dict) -> bool | None:
    """Whether the backward's bytes per token are at most the forward's (None: not measured)."""
    per_token = (r.get("synth") or {}).get("comm_per_token")
    if per_token is None:
        return None
    return per_token["backward"] <= per_token["forward"] + 1e-9


def _local_grads(r: dict) -> bool:
    synth = r.get("synth") or {}
    return "grads_not_local_size" in synth and not synth["grads_not_local_size"]


def above_bound(results: list[dict]) -> list[dict]:
    """Verified decoder-only text types above the bound at the headline case, with the first module
    kept whole and why."""
    out = []
    for r in sorted(_case(results, *HEADLINE_CASE), key=lambda r: r["model_type"]):
        synth = r.get("synth") or {}
        if r.get("class") != "decoder-text" or _status(synth) != "verified" or _near_bound(r):
            continue
        first = (synth.get("replicated") or [{}])[0]
        out.append({"model_type": r["model_type"], "param_fraction": synth.get("param_fraction"),
                    "bound": r.get("megatron_fraction"), "module": first.get("module", "-"),
                    "reason": first.get("reason", "no module kept whole reported")})
    return out


def _hf_label(part: dict | None) -> str:
    """transformers' plan in the table's words: none / verified / wrong / crashes (or why it did not run)."""
    if not part:
        return "not run"
    if part["status"] == "none":
        return "none"
    if part["status"] == "verified":
        return "verified"
    reason = part.get("reason")
    if reason == "verify-mismatch":
        return "wrong"
    if reason in ("timeout", "worker-died", "config-unbuildable", "unsharded-forward-failed"):
        return reason
    return "crashes"


def _synth_label(part: dict | None, bound: float | None) -> str:
    """``verified``, ``verified (parts replicated)`` when it holds more than the Megatron bound, or the reason."""
    if not part:
        return "-"
    if part["status"] == "verified":
        above = bound is not None and part.get("param_fraction", 0) > bound + 0.01
        return "verified" + (" (parts replicated)" if above else "")
    return part.get("reason", "failed")


def _fmt_collectives(r: dict) -> str:
    counts = (r.get("synth") or {}).get("collectives")
    layers = r.get("layers") or 0
    if not counts or not layers:
        return "-"
    short = {"all_reduce": "AR", "all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS"}
    return " ".join(f"{short.get(k, k)} {v / layers:.1f}" for k, v in sorted(counts.items()))


def _why(r: dict) -> str:
    note = f"heads for tp={r['shrunk_heads_for_tp']}. " if r.get("shrunk_heads_for_tp") else ""
    note += f"layer pattern x{r['layer_pattern_repeated']}. " if r.get("layer_pattern_repeated") else ""
    note += "run twice (worker died). " if r.get("retried_after_worker_death") else ""
    return note + _why_part(r)


def _why_part(r: dict) -> str:
    part = r.get("synth") or {}
    if part.get("status") == "verified":
        rep = part.get("replicated") or []
        if not rep or part.get("param_fraction", 0) <= (r.get("megatron_fraction") or 1) + 0.01:
            return ""
        first = rep[0]
        more = f" (+{len(rep) - 1} more)" if len(rep) > 1 else ""
        return f"replicated `{first['module']}`: {first['reason']}{more}"
    return (part.get("error") or "")[:160]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_markdown(path: Path, meta: dict, summary: dict, results: list[dict]) -> None:
    """COVERAGE.md: how it was run, the headline, checker confusion, then one row per architecture."""
    h = summary["headline"]
    lines = [
        "# Coverage: synthesized and transformers' TP plans on every causal-LM architecture",
        "",
        f"Generated by `{meta['command']}` on {meta['started_utc']} ({meta['machine']}, "
        f"{meta['workers']} workers, {meta['timeout_s']:.0f} s per case); wall time {meta['wall_s']:.0f} s; "
        f"torch {meta['torch']}, transformers {meta['transformers']}. Every number below comes from "
        "`benchmarks/results/coverage.json` of that run.",
        *[f"Then {u['cases']} cases ({', '.join(u['types'])}) were run again and replaced by "
          f"`{u['command']}` on {u['started_utc']} at commit {u['commit']} (wall time {u['wall_s']:.0f} s)."
          for u in meta.get("updates", [])],
        "",
        "Each case builds the tiny random model (`autotp.models.shrink_config` at that tp, `use_cache=False`), "
        "synthesizes a plan, verifies it on simulated ranks (fp32 logits and every parameter gradient "
        "within 1e-5 of the unsharded model, relative for values above 1; differences up to 100x that are "
        "re-run in float64, where a correct plan agrees to ~1e-13), and runs `autotp.check_plan` on it. "
        "Where the unsharded tiny model fails on token ids alone, it is rebuilt with the heads for "
        "2x, then 4x, the ranks (a family that splits heads into a fixed number of groups); where it cannot "
        "be built, its layer pattern is repeated once (a family that ties a block across two layers of a "
        "kind); the row says so. A case whose worker process died is run once more in a fresh worker (a "
        "death can come from an earlier case's damage); only a second death is recorded. transformers' own plan (`autotp.get_plan(model, source=\"hf\")`) goes "
        "through the same verifier and checker in plain "
        "cases (it has no sequence-parallel variant). Its labels: `none` (the model ships no plan), "
        "`verified`, `wrong` (runs, but logits or gradients differ), `crashes` (rejected when applied, "
        "or the sharded model raised), `not run` (the tiny model could not be built or run).",
        "",
        "## Headline",
        "",
        f"- Model types in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: **{h['model_types']}** "
        f"({', '.join(f'{k} {v}' for k, v in sorted(h['by_class'].items()))}).",
        "- Verified **and** sharded near the Megatron-style bound (at most the bound + 0.1 of the parameters "
        "per rank), decoder-only text architectures of " + str(h["decoder_text_types"]) + ": "
        + ", ".join(f"**{c.get('near_bound_decoder_text', '-')}** at {k}" for k, c in summary["per_case"].items())
        + ".",
        "- Of those, the backward's collectives move no more bytes than the forward's: "
        + ", ".join(f"**{c.get('near_bound_backward_bytes_le_forward', '-')}** at {k}"
                    for k, c in summary["per_case"].items())
        + " per step; per token (a second run at twice the batch; weight-gradient reductions, fixed per "
        "step, left out): " + ", ".join(f"**{c.get('near_bound_backward_per_token_le_forward', '-')}** of "
                                        f"{c.get('near_bound_per_token_measured', '-')} measured at {k}"
                                        for k, c in summary["per_case"].items()) + ".",
        f"- Synthesized plan verified at tp=2 plain: {h['tp2_plain_verified_decoder_text']}/"
        f"{h['decoder_text_types']} decoder-only text architectures = {h['tp2_plain_verified_pct']}% (a plan "
        "that keeps a block whole also verifies: the line above is the measure).",
        "- Failure classes at tp=2 plain (decoder-only text): "
        + (", ".join(f"`{k}` {v}" for k, v in sorted(h["tp2_plain_failure_classes_decoder_text"].items())) or "none")
        + "; over all types: "
        + (", ".join(f"`{k}` {v}" for k, v in sorted(h["tp2_plain_failure_classes_all"].items())) or "none") + ".",
        "",
        "**Decoder-only text architecture** (the denominator) is decided from the config and the model "
        "class, not the name: a type is left out when "
        + "; ".join(f"`{k}`: {v}" for k, v in EXCLUSIONS.items())
        + ". Types whose config cannot even be built stay in the denominator (as failures).",
        "",
        "## Per case",
        "",
        "`near bound`: verified decoder-only text types holding at most the Megatron-style bound + 0.1 of the "
        "parameters per rank. `bwd <= fwd`: verified decoder-only text types whose backward issues no more "
        "collectives than their forward; `bwd bytes <= fwd`: whose backward's collectives move no more bytes "
        "(issue 13's measure: an all-reduce counts twice its input, a reduce-scatter its input, an all-gather "
        "its output); `bwd bytes/token <= fwd`: whose backward moves no more bytes per token (measured / of "
        "those measured: the plan verified again at twice the batch, the volumes' difference over the tokens "
        "added). `local grads`: verified decoder-only text types in which every "
        "parameter's gradient has the size of its local shard (no full-size gradient on any rank).",
        "",
        "| case | cases | synthesized verified | of decoder-only text | near bound | bwd <= fwd | bwd bytes <= fwd "
        "| bwd bytes/token <= fwd | local grads | synthesized failures | transformers' plan |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, c in summary["per_case"].items():
        fails = ", ".join(f"{k} {v}" for k, v in sorted(c["synth_failures"].items())) or "-"
        hf = ", ".join(f"{k} {v}" for k, v in sorted((c["hf"] or {}).items())) or "n/a (no SP variant)"
        lines.append(f"| {key} | {c['cases']} | {c['synth_verified']} | {c['synth_verified_decoder_text']} | "
                     f"{c.get('near_bound_decoder_text', '-')} | {c.get('backward_le_forward_decoder_text', '-')} | "
                     f"{c.get('backward_bytes_le_forward_decoder_text', '-')} | "
                     f"{c.get('backward_per_token_le_forward_decoder_text', '-')} / "
                     f"{c.get('per_token_measured_decoder_text', '-')} | "
                     f"{c.get('local_grads_decoder_text', '-')} | {fails} | {hf} |")
    lines += _above_bound_section(results)
    lines += _backward_above_section(results)
    lines += _confusion_section(summary["checker_confusion"])
    lines += ["", "## Reason classes", ""] + [f"- `{k}`: {v}" for k, v in REASONS.items()]
    lines += _table(results)
    path.write_text("\n".join(lines) + "\n")


def _above_bound_section(results: list[dict]) -> list[str]:
    rows = above_bound(results)
    tp, sp = HEADLINE_CASE
    lines = ["", f"## Above the bound (tp={tp} {'SP' if sp else 'plain'})", "",
             f"{len(rows)} verified decoder-only text types hold more than the bound + 0.1; the first module "
             "the synthesizer kept whole, and why. The bound counts every Linear weight, the token embedding "
             "(`get_input_embeddings()`) and every 3-D expert parameter as sharded (position tables, norms, "
             "biases and routers that are not `nn.Linear` replicated, as Megatron keeps them).", "",
             "| architecture | param fraction | bound | first module kept whole | reason |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        reason = r["reason"].replace("|", "\\|")
        lines.append(f"| {r['model_type']} | {r['param_fraction']} | {r['bound']} | `{r['module']}` | {reason} |")
    return lines


def _backward_above_section(results: list[dict]) -> list[str]:
    """Near-bound cases whose backward moves more bytes than their forward, per step or per token."""
    lines = ["", "## Backward above forward (near-bound cases)", "",
             "Bytes of the backward's collectives over the forward's, per step (the sweep's one run) and per "
             "token (the difference of a second run at twice the batch); `fixed`: backward bytes that do not "
             "grow with tokens (weight gradients all-reduced).", "",
             "| architecture | case | bwd / fwd per step | bwd / fwd per token | fixed backward bytes |",
             "| --- | --- | --- | --- | --- |"]
    for r in sorted(results, key=lambda r: (r["model_type"], r["tp"], r["sp"])):
        synth = r.get("synth") or {}
        if r.get("class") != "decoder-text" or _status(synth) != "verified" or not _near_bound(r):
            continue
        per_token = synth.get("comm_per_token")
        if _backward_bytes_le_forward(r) and _backward_per_token_le_forward(r) is not False:
            continue
        step = synth["comm_volume_backward"] / max(synth["comm_volume"], 1)
        token = (f"{per_token['backward'] / max(per_token['forward'], 1e-9):.2f}" if per_token else "not measured")
        fixed = per_token["backward_fixed"] if per_token else "-"
        lines.append(f"| {r['model_type']} | tp{r['tp']} {'SP' if r['sp'] else 'plain'} | {step:.2f} | {token} | "
                     f"{fixed} |")
    if lines[-1] == "| --- | --- | --- | --- | --- |":  # no such case: say so, not an empty table
        lines[-2:] = ["None: in every near-bound case the backward moves no more bytes than the forward, per step "
                      "and, where measured, per token."]
    return lines


def _confusion_section(conf: dict) -> list[str]:
    lines = [
        "",
        "## Checker vs verifier",
        "",
        "`check_plan(model, plan, tp_size=tp)` on every plan that was verified. A plan is *wrong* when "
        "verification failed: logits or gradients differ, the sharded model crashed, or the plan was "
        "rejected when applied. The checker does not model sequence-parallel layouts, so the SP rows "
        "measure it outside its scope; `synth/plain` and `hf/plain` are the fair rows.",
        "",
        "| plans | flagged & wrong | flagged & correct (false positive) | unflagged & wrong (missed) "
        "| unflagged & correct | checker crashed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, c in conf.items():
        lines.append(f"| {name} | {c.get('flagged_wrong', 0)} | {c.get('flagged_correct', 0)} | "
                     f"{c.get('unflagged_wrong', 0)} | {c.get('unflagged_correct', 0)} | {c.get('checker_crashed', 0)} |")
    return lines


def _table(results: list[dict]) -> list[str]:
    by_type: dict[str, dict] = {}
    for r in results:
        by_type.setdefault(r["model_type"], {})[(r["tp"], r["sp"])] = r
    lines = [
        "",
        "## Architectures",
        "",
        "Synthesized plan per case (tp2, tp2 SP, tp4, tp4 SP); parameter fraction per rank (max) and "
        "the Megatron bound, and collectives per layer (total of one forward / layers, so the "
        "embedding and head boundary is included), at tp=2 plain; the reason is the tp=2 plain one.",
        "",
        "| architecture | class | transformers plan (tp2 / tp4) | synthesized tp2 | tp2 SP | tp4 | tp4 SP "
        "| param fraction (bound) | collectives / layer | replicated parts or failure |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in sorted(by_type):
        row = by_type[name]
        r = row.get((2, False)) or next(iter(row.values()))
        synth = [_synth_label((row.get(k) or {}).get("synth"), (row.get(k) or {}).get("megatron_fraction"))
                 for k in ((2, False), (2, True), (4, False), (4, True))]
        hf = " / ".join(_hf_label((row.get(k) or {}).get("hf")) for k in ((2, False), (4, False)))
        frac = (r.get("synth") or {}).get("param_fraction")
        bound = r.get("megatron_fraction")
        frac_text = f"{frac:.3f} ({bound:.3f})" if frac is not None and bound is not None else "-"
        lines.append("| " + " | ".join(_cell(x) for x in [
            name, r.get("class", "?"), hf, *synth, frac_text, _fmt_collectives(r), _why(r)]) + " |")
    return lines


def main() -> None:
    """Re-render the summary and COVERAGE.md from a coverage.json's cases (wording, not numbers)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", default=str(Path(__file__).parent / "results" / "coverage.json"))
    args = parser.parse_args()
    path = Path(args.json)
    data = json.loads(path.read_text())
    data["summary"] = summarize(data["cases"])
    path.write_text(json.dumps(data, indent=1) + "\n")
    out = path.with_name("COVERAGE.md")
    write_markdown(out, data["meta"], data["summary"], data["cases"])
    print(f"wrote {path} (summary) and {out}")


if __name__ == "__main__":
    main()
