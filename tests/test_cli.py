"""The ``autotp`` command line (autotp.cli), driven through ``main([...])`` and once as a script."""

import doctest
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, SequenceParallel

from autotp import cli, cli_text
from autotp.cli import main, plan_rows


def test_plan_prints_table_and_per_rank_memory(capsys):
    assert main(["plan", "llama", "--source", "handwritten"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM (8.03B parameters, config of meta-llama/Llama-3.1-8B)" in out
    assert "plan source: handwritten, tp=8" in out
    assert re.search(r"model\.layers\.\*\.self_attn\.o_proj +\| RowwiseParallel", out)
    assert "parameters per rank at tp=8 (bfloat16): 1.87 GiB of 14.96 GiB (12.5%)" in out


def test_plan_json_reports_plan_and_memory(capsys):
    assert main(["plan", "llama", "--source", "handwritten", "--tp", "4", "--dtype", "float32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "handwritten" and report["tp"] == 4
    assert report["plan"]["lm_head"]["style"] == "ColwiseParallel"
    memory = report["memory"]
    assert memory["total_bytes"] == 8_030_261_248 * 4
    assert memory["total_bytes"] / 4 < memory["per_rank_bytes"] < memory["total_bytes"] / 4 * 1.01


def test_plan_sp_variant_shows_sequence_parallel_norms(capsys):
    assert main(["plan", "llama", "--source", "handwritten", "--sp"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel: on" in out
    assert "SequenceParallel" in out


def test_plan_check_passes_when_tp_divides(capsys):
    assert main(["plan", "llama", "--source", "handwritten", "--check"]) == 0
    assert "check: tp=8 divides" in capsys.readouterr().out


def test_plan_check_fails_with_message_when_heads_do_not_divide(capsys):
    """Qwen2.5-7B has 28 query heads: tp=8 cannot split them."""
    assert main(["plan", "qwen2", "--source", "handwritten", "--check"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("autotp: error: Qwen2ForCausalLM: num_attention_heads=28")
    assert "use tp in (1, 2, 4)" in captured.err
    assert "Traceback" not in captured.err


def test_plan_without_check_only_warns_about_indivisible_heads(capsys):
    assert main(["plan", "qwen2", "--source", "handwritten"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("autotp: warning: Qwen2ForCausalLM: num_attention_heads=28")
    assert "parameters per rank at tp=8" in captured.out


def test_unknown_model_exits_2_naming_the_builtins(capsys):
    assert main(["plan", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotp: error: unknown model 'no-such-model'")
    assert "llama-70b" in err


def test_source_without_a_plan_exits_2(capsys):
    assert main(["plan", "qwen3-moe", "--source", "handwritten"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autotp: error: no handwritten plan for") and "Qwen3MoeForCausalLM" in err


def test_bad_arguments_exit_2_via_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "llama", "--tp", "0"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["plan", "llama", "--source", "guess"])


def test_verify_tiny_model_passes_and_prints_report(capsys):
    assert main(["verify", "llama", "--tp", "2", "--source", "handwritten"]) == 0
    out = capsys.readouterr().out
    assert "llama: tiny LlamaForCausalLM, plan source: handwritten, tp=2" in out
    assert "tp=2  OK" in out


def test_verify_exits_1_when_the_plan_is_wrong(capsys, monkeypatch):
    """A plan that shards the MLP output but never reduces it must be reported, not trusted."""
    wrong = {"model.layers.*.mlp.up_proj": ColwiseParallel(), "model.layers.*.mlp.down_proj": ColwiseParallel()}
    monkeypatch.setattr(cli, "choose_plan", lambda model, **_: (wrong, "custom"))
    assert main(["verify", "llama", "--tp", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out or "MISMATCH" in out


def test_verify_procs_hands_model_and_plan_to_the_multiprocess_verifier(capsys, monkeypatch):
    from autotp import multiprocess
    from autotp.verifier import VerifyReport

    calls = []

    def fake(model, plan, *, procs, backward):
        calls.append((model.config.num_key_value_heads, sorted(plan), procs, backward))
        return VerifyReport(tp_size=procs, tolerance=1e-5, logits_max_abs_diff=[0.0] * procs)

    monkeypatch.setattr(multiprocess, "verify_multiprocess", fake)
    assert main(["verify", "llama", "--procs", "4", "--source", "handwritten", "--no-backward"]) == 0
    (kv_heads, keys, procs, backward), = calls
    assert (kv_heads, procs, backward) == (4, 4, False)  # the tiny model is built for tp = procs
    assert "model.layers.*.self_attn.o_proj" in keys
    assert "tp=4 on 4 gloo processes" in capsys.readouterr().out


def test_verify_procs_and_tp_must_agree(capsys):
    assert main(["verify", "llama", "--procs", "2", "--tp", "4"]) == 2
    assert "--procs 2 and --tp 4 disagree" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_verify_procs_runs_real_gloo_processes():
    """End to end through the console entry point: 2 forked gloo ranks must agree with the reference."""
    done = subprocess.run(
        [sys.executable, "-m", "autotp", "verify", "llama", "--procs", "2", "--source", "handwritten"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tp=2  OK" in done.stdout


def test_plan_auto_source_names_the_source_it_used(capsys):
    assert main(["plan", "llama", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] in {"custom", "handwritten", "hf", "synthesized"}


def test_verify_auto_source_on_tiny_qwen3(capsys):
    assert main(["verify", "qwen3", "--tp", "2"]) == 0


def test_plan_synth_source_reports_synthesized(capsys):
    assert main(["plan", "llama", "--source", "synth", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "synthesized"


def test_plan_explain_adds_the_synthesizer_reasons(capsys):
    assert main(["plan", "qwen3", "--source", "synth", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "why each key has its style (synthesizer):" in out
    assert re.search(r"model\.layers\.\*\.self_attn\.q_norm +\| head_norm", out)


def test_plan_accepts_a_config_json_path(tmp_path, capsys):
    from autotp.models import load_config

    (tmp_path / "config.json").write_text(json.dumps(load_config("mistral").to_dict()))
    assert main(["plan", str(tmp_path / "config.json"), "--source", "handwritten", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_class"] == "MistralForCausalLM"


def test_plan_rows_show_layout_changes_and_options():
    plan = {
        "norm": SequenceParallel(),
        "head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "proj": ColwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    rows = {row[0]: row[1:] for row in plan_rows(plan)}
    assert rows["norm"] == ["SequenceParallel", "S(1)", "S(1)", "no", ""]
    assert rows["head"][:2] == ["PrepareModuleInput", "S(1) -> R"]
    assert rows["proj"] == ["ColwiseParallel", "R", "S(1)", "no", ""]


def test_doctests_pass():
    assert doctest.testmod(cli).failed == 0


def test_console_script_prints_json():
    script = Path(sys.executable).with_name("autotp")
    assert script.exists(), "the autotp console script is not installed: pip install -e ."
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [str(script), "plan", "mistral", "--source", "handwritten", "--json"],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model_class"] == "MistralForCausalLM"


def test_module_entry_point_reports_errors_without_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "autotp", "plan", "nope"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    assert done.stderr.strip().startswith("autotp: error: unknown model 'nope'")


# --- autotp check and --plan FILE.py:NAME ----------------------------------------------------------

_PLANS_FILE = '''
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

# Phi3's fused gate_up_proj split contiguously: runs, gives wrong logits.
CONTIGUOUS_GATE_UP = {
    "model.layers.*.mlp.gate_up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}
# A Llama MLP whose column outputs reach no row-parallel Linear.
UNCLOSED_MLP = {"model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel()}


def llama_mlp(model, sequence_parallel=False):
    return {**UNCLOSED_MLP, "model.layers.*.mlp.down_proj": RowwiseParallel()}
'''


@pytest.fixture
def plans_file(tmp_path):
    path = tmp_path / "my_plans.py"
    path.write_text(_PLANS_FILE)
    return path


def test_check_of_a_handwritten_plan_finds_nothing(capsys):
    assert main(["check", "llama"]) == 0
    assert "check: no finding" in capsys.readouterr().out


def test_check_names_a_contiguously_split_fused_projection_and_its_fix(capsys, plans_file):
    """Would catch the checker missing the silent-wrong-logits case the issue names (Phi3 gate_up)."""
    assert main(["check", "phi3", "--plan", f"{plans_file}:CONTIGUOUS_GATE_UP"]) == 1
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.gate_up_proj | fused_contiguous" in out
    assert "use Colwise(sizes=(8192, 8192))" in out


def test_check_json_reports_an_unmatched_key_once_and_nothing_spurious(capsys, plans_file):
    assert main(["check", "llama", "--plan", f"{plans_file}:CONTIGUOUS_GATE_UP", "--json"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert sorted(f["kind"] for f in findings) == ["row_without_shard", "unmatched_key"]
    unmatched = next(f for f in findings if f["kind"] == "unmatched_key")
    assert unmatched["module"] == "model.layers.*.mlp.gate_up_proj"


def test_plan_check_prints_findings_and_exits_1(capsys, plans_file):
    assert main(["plan", "llama", "--plan", f"{plans_file}:UNCLOSED_MLP", "--check"]) == 1
    out = capsys.readouterr().out
    assert "unclosed_column" in out or "missing_row" in out


def test_verify_runs_a_plan_function_from_a_file_and_reports_the_mismatch(capsys, plans_file):
    """``llama_mlp`` is a correct MLP plan (a function of the model): it verifies. UNCLOSED_MLP
    leaves down_proj reading half the features as if they were all: exit 1."""
    assert main(["verify", "llama", "--plan", f"{plans_file}:llama_mlp"]) == 0
    assert main(["verify", "llama", "--plan", f"{plans_file}:UNCLOSED_MLP"]) == 1
    assert "plan source: " + f"{plans_file}:UNCLOSED_MLP" in capsys.readouterr().out


def test_plan_file_without_the_name_exits_2(capsys, plans_file):
    assert main(["check", "llama", "--plan", f"{plans_file}:NOPE"]) == 2
    assert capsys.readouterr().err.startswith(f"autotp: error: --plan '{plans_file}:NOPE': ")


def test_synthesized_plan_at_tp_above_the_kv_heads_replicates_them(capsys):
    """Llama-3.1-70B has 8 kv heads: at --tp 16 the synthesized plan gives each rank its kv head
    instead of cutting heads in half (or refusing, as transformers does)."""
    assert main(["plan", "llama-70b", "--tp", "16", "--source", "synth", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["model.layers.*.self_attn.k_proj"]["style"] == "ReplicatedKVColwise"
    assert plan["model.layers.*.self_attn"]["style"] == "ShardCounts"
    assert plan["model.layers.*.self_attn"]["query_heads"] == 64


# --- rough edges: one-line errors, --version, fast --help, warnings ---------------------------------


def _one_line_error(err: str) -> bool:
    return err.startswith("autotp: error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_help_loads_neither_torch_nor_transformers():
    """``autotp --help`` must not pay for importing torch (1.5 s alone on this machine)."""
    code = ("import sys\nfrom autotp.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "plan" in done.stdout and done.stdout.strip().endswith("[]")


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert re.fullmatch(r"autotp \S+\n", capsys.readouterr().out)


@pytest.mark.parametrize("name, family", [("t5", "T5Config"), ("clip", "CLIPConfig")])
def test_a_model_type_that_is_no_causal_lm_exits_2_in_one_line(name, family, capsys):
    assert main(["plan", name]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err), err
    assert f"'{name}' is a {family}" in err and "causal LMs only" in err and "Closest causal-LM names" in err


def test_a_misspelt_model_gets_the_closest_names(capsys):
    assert main(["plan", "lama"]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and "causal LMs only" in err
    assert "Closest names: llama," in err


def test_an_unexpected_error_is_one_line_and_traceback_shows_it(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise IndexError("index 1536 is out of bounds")

    monkeypatch.setattr(cli, "build", broken)
    assert main(["plan", "llama"]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and "IndexError: index 1536" in err and "--traceback" in err
    for argv in (["--traceback", "plan", "llama"], ["plan", "llama", "--traceback"]):
        assert main(argv) == 2  # the traceback is shown; the exit status is still an error's
        err = capsys.readouterr().err
        assert err.startswith("Traceback") and "IndexError: index 1536" in err


def test_a_closed_pipe_ends_quietly():
    """``autotp plan ... | head``: the reader is gone before the table is written."""
    done = subprocess.Popen([sys.executable, "-m", "autotp", "plan", "llama", "--source", "handwritten"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    done.stdout.close()
    err = done.stderr.read().decode()
    assert done.wait(timeout=120) == cli.EXIT_BROKEN_PIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err


class _ClosedPipe:
    """A stdout whose reader is gone: every write and flush raises ``BrokenPipeError``."""

    def __init__(self, fd: int):
        self.fd = fd

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self.fd


def test_a_closed_pipe_inside_a_command_is_its_exit_status(monkeypatch, tmp_path, capsys):
    """The handler ``autotp plan ... | head`` meets: the command's first write raises, ``main``
    returns EXIT_BROKEN_PIPE with stdout pointed at /dev/null (a second flush at exit would raise
    again) and prints nothing on stderr. Would catch the error escaping as a traceback, or the
    one-line error path (exit 2) taking it."""
    with open(tmp_path / "stdout", "w") as target:
        monkeypatch.setattr(sys, "stdout", _ClosedPipe(target.fileno()))
        status = main(["plan", "llama", "--source", "handwritten"])
        monkeypatch.undo()
    assert status == cli.EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""
    assert (tmp_path / "stdout").read_text() == ""  # /dev/null was put under the closed stream


_EMBEDDING_ONLY = '''
from torch.distributed.tensor import Replicate
from autotp.styles import VocabParallelEmbedding

PLAN = {"model.embed_tokens": VocabParallelEmbedding(input_layouts=Replicate())}
'''


def test_plan_warns_when_large_linears_stay_replicated(capsys, tmp_path):
    path = tmp_path / "embedding_only.py"
    path.write_text(_EMBEDDING_ONLY)
    assert main(["plan", "llama", "--tp", "2", "--plan", f"{path}:PLAN"]) == 0
    err = capsys.readouterr().err
    assert "autotp: warning: each rank holds 96.7% of the parameters at tp=2 (ideal 50.0%)" in err
    assert "model.layers.*.mlp.gate_proj (1879.0M)" in err and "and 3 more" in err


def test_a_plan_sharding_every_linear_gets_no_replication_warning():
    import handwritten_plans
    from autotp.models import build_model

    model = build_model("llama")
    assert cli.replicated_linears(model, handwritten_plans.plan_for(model)) == []


def test_warnings_are_summarized_one_line_per_kind(capsys):
    import warnings

    with cli_text.summarized_warnings():
        for key in ("experts", "shared_experts.gate_proj", "experts"):
            warnings.warn(f"Parallelize plan key '{key}' could not be resolved: no submodule matching "
                          f"token '{key}' in module Block(\n  (mlp): MLP()\n), skipping this plan entry.")
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("autotp: warning: UserWarning (3x): Parallelize plan key '...' could not be resolved")
    assert "['experts', 'shared_experts.gate_proj']" in err


def test_verify_prints_the_tiny_model_sizes(capsys):
    assert main(["verify", "llama", "--source", "handwritten", "--no-backward"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"tiny model: hidden_size=\d+, num_hidden_layers=2, num_attention_heads=8, "
                     r"num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256", out)


def test_verify_checks_the_real_config_first(capsys):
    """Qwen2.5-7B's 28 heads do not split over tp=8, though the tiny model would (it is built for 8)."""
    assert main(["verify", "qwen2", "--tp", "8", "--source", "handwritten"]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and "num_attention_heads=28" in err and "use tp in (1, 2, 4)" in err


def test_verify_at_tp_3_suggests_the_real_models_tp_sizes(capsys):
    assert main(["verify", "llama", "--tp", "3", "--source", "handwritten"]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and "use tp in (1, 2, 4, 8)" in err
    assert "64)" not in err  # the tiny vocabulary (256) would suggest up to 64


_HARD_CODED = '''
from torch.distributed.tensor.parallel import RowwiseParallel
from autotp.styles import Colwise

PHI3_MLP = {"model.layers.*.mlp.gate_up_proj": Colwise(sizes=(8192, 8192)),
            "model.layers.*.mlp.down_proj": RowwiseParallel()}


def indexed(model, sequence_parallel=False):
    model.model.embed_tokens.weight[1536]  # a row of the real vocabulary, past the tiny one
    return PHI3_MLP
'''


def test_verify_a_plan_with_sizes_hard_coded_for_the_real_model_exits_2(capsys, tmp_path):
    path = tmp_path / "hard_coded.py"
    path.write_text(_HARD_CODED)
    assert main(["verify", "phi3", "--plan", f"{path}:PHI3_MLP"]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and "sizes (8192, 8192)" in err and "hard-coded for the real model" in err
    assert main(["verify", "phi3", "--plan", f"{path}:indexed"]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and "IndexError" in err and "compute sizes from the model" in err


def test_plan_names_the_sources_it_skipped(capsys):
    """transformers' Starcoder2 plan shards the tied embedding and head two ways: skipped, with why."""
    assert main(["plan", "starcoder2", "--tp", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "synthesized"
    hf = next(s for s in report["skipped"] if s["source"] == "hf")
    assert "tied_weights" in hf["reason"]


def _explained_keys(out: dict) -> dict[str, str]:
    """Plan key -> style class, from the ``--explain --json`` records that name plan keys."""
    return {r["key"]: r["style"].split("(", 1)[0] for r in out["explanation"] if r["style"] != "replicated"}


def test_explain_describes_the_synthesized_plan_shown_with_kv_replication(capsys):
    """tp=16 over 8 kv heads: the table's k_proj is ReplicatedKVColwise, and so is the explanation's
    (it once re-ran the synthesizer without tp and explained a plain ColwiseParallel)."""
    assert main(["plan", "qwen3", "--tp", "16", "--source", "synth", "--explain", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    table = {key: entry["style"] for key, entry in out["plan"].items()}
    assert _explained_keys(out) == table
    assert table["model.layers.*.self_attn.k_proj"] == "ReplicatedKVColwise"
    roles = {r["key"]: r["role"] for r in out["explanation"]}
    assert roles["model.layers.*.self_attn.k_proj"] == "kv_column"


def test_explain_describes_the_transformers_plan_when_it_is_chosen(capsys):
    assert main(["plan", "olmo2", "--tp", "4", "--source", "hf", "--explain", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "hf"
    assert _explained_keys(out) == {key: entry["style"] for key, entry in out["plan"].items()}
    assert {r["role"] for r in out["explanation"]} <= {"hf", "replicate"}


# --- issue 41: one-line refusals, missing paths, quiet tracebacks, partial exports, string plans ----

# A llama small enough to trace in a moment: 4 query heads, 2 kv heads; tp=3 divides neither.
_TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


@pytest.fixture
def tiny_llama_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_TINY_LLAMA))
    return str(path)


@pytest.mark.parametrize("command", ["plan", "check", "verify"])
def test_a_tp_size_no_source_can_serve_is_one_short_line_with_one_tp_list(command, tiny_llama_config, capsys):
    """Would catch `plan` printing a table no source can run (it once did, exit 0), or the ~900-character
    NoPlanError with each source's own "use tp in" list."""
    assert main([command, tiny_llama_config, "--tp", "3"]) == 2
    captured = capsys.readouterr()
    assert _one_line_error(captured.err) and len(captured.err.rstrip("\n")) < 200, captured.err
    assert captured.err.count("use tp in") == 1 and "use tp in (1, 2) or your own plan" in captured.err
    assert "LlamaForCausalLM: no plan source passes the checker at tp=3" in captured.err
    assert "parameters per rank" not in captured.out


def test_a_missing_config_path_is_no_such_file(tmp_path, capsys):
    missing = tmp_path / "no-such-dir" / "config.json"
    assert main(["plan", str(missing)]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and err.startswith(f"autotp: error: no such file: '{missing}'")
    assert "Closest names" not in err and "unknown model" not in err


def test_a_missing_plan_file_is_no_such_file(tmp_path, capsys):
    assert main(["check", "llama", "--plan", f"{tmp_path / 'nope.py'}:PLAN"]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and f"no such file: '{tmp_path / 'nope.py'}'" in err


_CRASHING = '''
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

# up_proj row-parallel reads a hidden-size input as if it were sharded: a shape error in the sharded run.
PLAN = {"model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": RowwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel()}
'''


def test_a_failed_verify_prints_no_torch_traceback_unless_asked(tmp_path, capsys):
    """torch logs a failed meta kernel's whole traceback (fake_tensor: "failed while attempting to run
    meta for aten.mm") on its way to the error the report states in one line. Read at torch's own
    handler: it writes to the stream it found at import, which no capture fixture sees."""
    import logging

    class Recorder(logging.Handler):
        def emit(self, record):
            records.append(record)

    path = tmp_path / "crashing.py"
    path.write_text(_CRASHING)
    logger, recorder, records = logging.getLogger("torch._subclasses.fake_tensor"), Recorder(), []
    logger.addHandler(recorder)
    try:
        assert main(["verify", "llama", "--plan", f"{path}:PLAN", "--no-backward"]) == 1
        assert "FAILED: the sharded model raised RuntimeError" in capsys.readouterr().out
        assert not [r for r in records if r.exc_info]
        assert main(["--traceback", "verify", "llama", "--plan", f"{path}:PLAN", "--no-backward"]) == 1
        assert [r for r in records if r.exc_info]
    finally:
        logger.removeHandler(recorder)


def test_traceback_keeps_the_error_exit_status(capsys):
    assert main(["verify", "llama", "--procs", "2", "--tp", "4", "--traceback"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "--procs 2 and --tp 4 disagree" in err


def test_emit_hf_writes_strings_transformers_applies_to_each_module(capsys):
    """transformers 5.23 refuses "rowwise" on an nn.Embedding ("Embedding has no `in_features`"):
    an embedding must get "embedding_rowwise", and a Linear string must go on a Linear."""
    from torch import nn
    from transformers.distributed import tensor_parallel as hf_tp

    from autotp.models import build_model
    from autotp.plan import matched_modules

    assert main(["plan", "llama", "--source", "handwritten", "--tp", "2", "--emit", "hf"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["model.embed_tokens"] == "embedding_rowwise"
    model = build_model("llama")
    for key, string in exported.items():
        style = hf_tp.ALL_PARALLEL_STYLES[string]
        for fqn in matched_modules(model, key):
            module = model.get_submodule(fqn)
            if isinstance(style, (hf_tp.ColwiseParallel, hf_tp.RowwiseParallel)):
                assert isinstance(module, nn.Linear), (key, string)
            if isinstance(module, nn.Embedding):
                assert isinstance(style, hf_tp.EmbeddingParallel), (key, string)


_STRING_PLANS = '''
# transformers' format: what from_pretrained(tp_plan=...) takes.
ATTENTION_AND_MLP = {
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
# down_proj column-parallel too: the MLP's column shards are never closed.
UNCLOSED = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "colwise"}
UNKNOWN = {"model.layers.*.mlp.up_proj": "diagonal"}
NOT_A_STYLE = {"model.layers.*.mlp.up_proj": 3}
'''


@pytest.fixture
def string_plans(tmp_path):
    path = tmp_path / "string_plans.py"
    path.write_text(_STRING_PLANS)
    return path


def test_a_plan_of_transformers_strings_is_translated_for_plan(string_plans, capsys):
    """It once crashed with `TypeError: vars() argument must have __dict__ attribute`."""
    assert main(["plan", "llama", "--tp", "2", "--plan", f"{string_plans}:ATTENTION_AND_MLP"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"model\.layers\.\*\.self_attn\.o_proj +\| RowwiseParallel", out)
    assert "parameters per rank at tp=2" in out


def test_a_plan_of_transformers_strings_is_checked(string_plans, capsys):
    """It once read as "no finding" whatever the strings said: the checker saw no styles at all."""
    assert main(["check", "llama", "--tp", "2", "--plan", f"{string_plans}:UNCLOSED"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"model\.layers\.0\.mlp\.up_proj +\| breaks_shard", out), out


def test_a_plan_of_transformers_strings_is_verified(string_plans, capsys):
    """It once failed, blamed on sizes hard-coded for the real model."""
    assert main(["verify", "llama", "--plan", f"{string_plans}:ATTENTION_AND_MLP", "--no-backward"]) == 0
    assert "tp=2  OK" in capsys.readouterr().out


@pytest.mark.parametrize("name, said", [("UNKNOWN", "'diagonal' is not a transformers style string"),
                                        ("NOT_A_STYLE", "int 3 is neither a ParallelStyle nor")])
def test_a_plan_value_that_is_no_style_is_one_line(string_plans, name, said, capsys):
    assert main(["check", "llama", "--plan", f"{string_plans}:{name}"]) == 2
    err = capsys.readouterr().err
    assert _one_line_error(err) and said in err


def test_the_api_takes_a_plan_of_strings():
    """get_plan / check_plan / verify read transformers' strings as the CLI does."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from autotp import check_plan, get_plan, verify
    from autotp.models import build_model

    model = build_model("llama", tiny=True, tp=2, device="cpu")
    strings = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
               "model.layers.*.mlp.down_proj": "rowwise"}
    choice = get_plan(model, tp_shard_plan=strings, tp_size=2)
    assert isinstance(choice.plan["model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert check_plan(model, strings, tp_size=2) == []
    assert check_plan(model, {**strings, "model.layers.*.mlp.down_proj": "colwise"}, tp_size=2)
    assert verify(model, strings, tp_size=2, backward=False).ok


def test_version_is_read_only_when_asked(monkeypatch, capsys):
    """Reading the package metadata costs every command start-up time; only --version needs it."""
    def unexpected():
        raise AssertionError("the version was read")

    monkeypatch.setattr(cli, "_version", unexpected)
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0 and "MODEL" in capsys.readouterr().out


def test_check_keeps_the_checkers_answer_between_runs(tiny_llama_config, tmp_path, monkeypatch, capsys):
    """`autotp check --source NAME` re-ran the checker (a torch.export of the model and the per-rank
    shape proof) on every run: the second run must print the same without checking, and the library
    outside the command must never read the cache. (With ``--source auto`` selection checks every
    source on the synthesizer's own trace, which the cache does not hold.)"""
    from autotp import check
    from autotp.models import build_model

    cache = tmp_path / "cache"
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(cache))
    assert main(["check", tiny_llama_config, "--tp", "2", "--source", "handwritten"]) == 0
    first = capsys.readouterr().out
    assert len(list(cache.glob("findings-*.json"))) == 1

    def checked_again(*args, **kwargs):
        raise AssertionError("the checker ran again")

    monkeypatch.setattr(check, "_findings", checked_again)
    assert main(["check", tiny_llama_config, "--tp", "2", "--source", "handwritten"]) == 0
    assert capsys.readouterr().out == first
    model = build_model(tiny_llama_config, device="meta")
    with pytest.raises(AssertionError, match="ran again"):
        check.check_plan(model, {}, tp_size=2)


def test_plan_keeps_its_answer_between_runs(tiny_llama_config, tmp_path, monkeypatch, capsys):
    """A second `autotp plan` with the same arguments, config bytes and code prints the first run's
    answer without running the command (no torch import: 0.1 s against 8 s cold for `plan llama`,
    docs/cli.md); other arguments or an edited config run it again; an error is not kept."""
    from autotp import cli

    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(tmp_path / "cache"))
    command = ["plan", tiny_llama_config, "--tp", "2", "--source", "handwritten"]
    assert main(command) == 0
    first = capsys.readouterr()
    assert "plan source: handwritten" in first.out, first.out

    def ran(args):
        raise RuntimeError("ran again")

    monkeypatch.setattr(cli, "_run_plan", ran)
    assert main(command) == 0
    again = capsys.readouterr()
    assert (again.out, again.err) == (first.out, first.err)
    assert main([*command, "--sp"]) == 2 and "ran again" in capsys.readouterr().err  # other arguments
    config = json.loads(Path(tiny_llama_config).read_text())
    Path(tiny_llama_config).write_text(json.dumps({**config, "vocab_size": config["vocab_size"] * 2}))
    assert main(command) == 2 and "ran again" in capsys.readouterr().err  # an edited config
    assert main(command) == 2  # the error was not kept


def test_plan_entry_points_take_a_plan_of_strings():
    """validate_tp_mesh / check_divisible, param_bytes_per_rank and the exports read transformers'
    strings as get_plan, check_plan and verify do (check_divisible and param_bytes_per_rank ignored
    them: tp=3 passed and nothing counted as sharded)."""
    from autotp.apply import check_divisible
    from autotp.errors import MeshError
    from autotp.memory import param_bytes_per_rank
    from autotp.models import build_model

    model = build_model("llama", tiny=True, tp=2)
    strings = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
               "model.layers.*.mlp.down_proj": "rowwise"}
    check_divisible(model, 2, strings)
    with pytest.raises(MeshError, match="tp=3"):
        check_divisible(model, 3, strings)
    from autotp.emit import emit_hf, emit_python

    assert "RowwiseParallel()" in emit_python(model, strings)
    assert emit_hf(model, strings)[0]["model.layers.*.mlp.down_proj"] == "rowwise"
    per_rank, total = param_bytes_per_rank(model, strings, 2)
    assert per_rank < total and param_bytes_per_rank(model, strings, 2) == param_bytes_per_rank(
        model, __import__("autotp").hf_plans.as_styles(model, strings), 2)
