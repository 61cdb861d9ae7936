"""Fixtures shared by the test modules, and the rules that split the suite into two tiers."""

import os

import hashlib

import pytest
import torch

from autotp.models import build_model

# One intra-op thread per test process. The tests' models are tiny: their ops gain nothing from
# threads, and two xdist workers with two threads each on a 2-core machine spent 1.7x the CPU time of
# one thread each (synthesize + verify of two families, measured with /usr/bin/time). Child
# processes (gloo workers, isolated runs, the CLI) inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def meta_llama():
    """Llama-3.1-8B on the meta device: real shapes, no storage. Do not shard it in place."""
    return build_model("llama")


@pytest.fixture(autouse=True)
def _plan_cache_per_test(monkeypatch, tmp_path_factory, request):
    """Each test gets its own (empty, created on first write) plan cache directory: a plan
    ``parallelize`` cached in one test (or in the user's ~/.cache) never decides another."""
    root = tmp_path_factory.getbasetemp() / "plan-cache"
    name = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:16]
    monkeypatch.setenv("AUTOTP_CACHE_DIR", str(root / name))


@pytest.fixture
def no_shape_fixes(monkeypatch):
    """Synthesis without the shape proof's last resort (``stages.shape_fix``: rewrites of sizes the
    code writes as constants, :mod:`autotp.synth.literal_sizes`), for tests of what serves code no
    rewrite localizes: DTensor regions, per-group readings, an attention kept whole and warned."""
    from autotp.synth import stages

    stages.load_idioms()  # registered first, so that nothing registers into the empty table later
    monkeypatch.setattr(stages, "_SHAPE_FIXES", {})


# ------------------------------------------------------------------------------------ test tiers
#
# The default run is the regression net: one case of every behaviour. The slow tier
# (`python -m pytest -n 2 -m slow`) holds what repeats a default case or exercises code outside the
# library; it still has to pass before a change to synthesis is submitted.

# Whole files in the slow tier, with the default-tier tests that cover the same library code.
SLOW_FILES = {
    "test_coverage.py": "benchmark code (coverage.run_case); synthesis per model: test_synth_matrix, test_synth_plans",
    "test_bench_plans.py": "benchmark code (bench_plans); plans and collectives: test_backward_comm, test_handwritten",
    "test_fuzz.py": "hypothesis fuzz of synthesis; the idioms it draws: test_synth_passes, test_plain_idioms",
    "test_peers.py": "torchtitan's models; the same idioms as toys: test_synth_matrix (TitanLlama), test_loop_experts",
    "test_peers_olmo.py": "olmo-core's models; the same idioms as toys: test_synth_matrix, test_plain_idioms",
    "test_peers_litgpt.py": "litgpt's models (installed by hand); toys: test_synth_matrix (NanoGPT)",
}

# The real-gloo tests the default tier keeps: the simulator against real processes, one training
# step, one checkpoint round trip. Every other `multiprocess` test is in the slow tier.
DEFAULT_MULTIPROCESS = (
    "tests/test_multiprocess.py::test_sp_plan_verifies_on_two_gloo_processes",
    "tests/test_training.py::test_dp1_tp2_step_matches_single_process",
)
# test_checkpoint's gloo round trip (15-20 s of process start) is in the slow tier; its in-process
# round trips (test_unsharded_model_and_optimizer_round_trip, the full_state_dict tests) and the gloo
# path of test_multiprocess / test_training stay in the default one.

# Single default-tier cases in the slow tier (each over 5 s), with the default tests that hold the
# same behaviour.
SLOW_TESTS = {
    # The matrix's plain (tp) cases of families whose SP case runs in the default tier (the same
    # column / row pairs, plus the sequence-parallel norms); llama, mixtral, gemma3-vlm, nanogpt and
    # parallel_block keep both. test_handwritten holds every family's plain handwritten plan.
    **{f"tests/test_synth_matrix.py::test_synthesized_plan_is_exact_and_megatron_optimal[{family}-2-tp]":
       f"its [{family}-2-sp] case" for family in (
        "gemma3",
        "glm4",
        "qwen2",
        "qwen3",
        "olmo2",
        "qwen3_moe",
        "phi3",
        "starcoder2",
        "granite",
        "phi",
        "gpt_neox",
        "cohere",
        "mistral",
        "titan_llama",
    )},
    "tests/test_synth_verify.py::test_tp_above_kv_heads_replicates_kv_heads_exactly[sp-8-llama]":
        "its [sp-4-llama] case (kv heads replicated beyond tp)",
    "tests/test_width_statistics.py::test_other_sum_based_statistics_are_sharded[var]":
        "its [rms] case (another sum-based statistic over the sharded width)",
    **{f"tests/test_joined_shards.py::test_layouts_it_cannot_realise_keep_their_projections_whole[{case}]":
       "its [JoinedIntoHeads] and [ConstantSizedState] cases (a layout it cannot realise, kept whole, exact)"
       for case in ("JoinedIntoRow", "JoinedCutInside", "JoinedTimesContiguous", "FoldedRowsReduced")},
    "tests/test_value_branches.py::test_value_dependent_expert_loop_is_sharded_and_exact[sp]":
        "test_value_branches::test_value_dependent_expert_loop_is_traced_with_real_values_and_marked (the trace), "
        "test_split_experts::test_routed_query_attention_is_proven_on_its_values_and_sharded[2-sp] (a plan "
        "proven on real values, sharded and exact)",
    "tests/test_partial_inputs.py::test_routed_query_input_gradient_is_reduced_once[2-sp]":
        "test_backward_comm::test_moe_block_input_reduced_once[qwen3_moe-sp], "
        "test_loop_experts::test_moe_block_beside_attention_reduces_their_shared_input_once[2-sp] (an input "
        "gradient reduced once)",
    "tests/test_outside_positions.py::test_hyper_connections[2-sp]":
        "test_sp_stream::test_hyper_connections_run_on_the_sequence_shard[2-sp] (the same blocks, exact under SP)",
    "tests/test_backward_comm.py::test_moe_block_input_reduced_once_at_tp4[sp]":
        "test_backward_comm::test_moe_block_input_reduced_once[qwen3_moe-sp] (the same reduction at tp 2)",
    "tests/test_grouped_parts.py::test_two_state_groups_at_tp4_are_copied_per_rank[sp]":
        "test_grouped_parts::test_one_state_group_is_copied_per_rank[2-sp] (state groups copied per rank)",
    "tests/test_loop_experts.py::test_router_inside_a_moe_block_reduces_the_block_input_once_under_sequence_parallel[2]":
        "test_loop_experts::test_moe_block_beside_attention_reduces_their_shared_input_once[2-sp], "
        "test_backward_comm::test_moe_block_input_reduced_once[qwen3_moe-sp]",
    "tests/test_isolated.py::test_bad_plan_raises_in_the_caller_as_it_would_in_process":
        "test_isolated::test_isolated_run_reports_what_the_in_process_run_does (the isolated run), "
        "test_self_check::test_broken_plan_is_refused_by_default_naming_the_parameter (the refusal)",
    "tests/test_check_kv_heads.py::test_one_kv_head_plans_have_no_finding_and_verify[gemma3-2]":
        "test_check_kv_heads::test_cli_verifies_gemma3_with_its_one_kv_head (gemma3's one kv head through the "
        "checker and the verifier)",
    "tests/test_check.py::test_routed_query_left_replicated_beside_sharded_kv_is_flagged":
        "test_check::test_experts_columns_packed_unlike_their_parts_are_flagged (a flagged plan), "
        "test_check::test_verified_plan_with_routed_experts_columns_is_not_flagged[2-sp] (the routed model)",
    "tests/test_recurrent_params.py::test_a_parameter_also_read_whole_is_not_sharded":
        "test_recurrent_params::test_a_decayed_state_also_read_whole_keeps_the_mixer_exact (a parameter read "
        "whole beside its per-step reads)",
    "tests/test_literal_sizes.py::test_the_checker_replays_the_rewrite_and_the_plan_without_it_fails[literal_split]":
        "its [literal_slices] (fails loudly without the rewrite) and [literal_heads] (silently) cases",
    "tests/test_literal_sizes.py::test_the_checker_replays_the_rewrite_and_the_plan_without_it_fails[literal_unflatten]":
        "its [literal_slices] and [literal_heads] cases",
    "tests/test_literal_sizes.py::test_the_checker_replays_the_rewrite_and_the_plan_without_it_fails[literal_inferred]":
        "its [literal_slices] and [literal_heads] cases",
    "tests/test_literal_sizes.py::test_the_rewritten_plan_is_exact_at_shapes_it_was_not_traced_at[literal_unflatten]":
        "its [literal_split] case (the same rules at one token and another batch)",
    "tests/test_literal_sizes.py::test_the_rewritten_plan_is_exact_at_shapes_it_was_not_traced_at[literal_slices]":
        "its [literal_split] case",
    "tests/test_hf_loading.py::test_emitted_hf_plan_and_autotp_plan_load_sharded_on_two_gloo_processes":
        "test_hf_loading (the loader on one process), test_emit (the strings), test_multiprocess (gloo)",
    "tests/test_selection.py::test_real_size_model_whose_transformers_plan_tp_does_not_divide_falls_through":
        "test_selection::test_tied_weights_sharded_two_ways_fall_through_to_a_plan_that_verifies, "
        "test_cli::test_a_tp_size_no_source_can_serve_is_one_short_line_with_one_tp_list",
    "tests/test_handwritten_more.py::test_qwen3_5_synthesized_plan_with_a_padded_batch[sp]":
        "test_qwen3_5_plan_survives_a_padded_batch[2-sp] (the mixer's masked input), "
        "test_joined_shards::test_joined_delta_mixer_is_sharded_and_exact[2-sp] (the synthesized mixer)",
    "tests/test_check.py::test_synthesized_plans_have_no_finding[phi3]": "the [llama] and [gemma3] cases",
    "tests/test_check.py::test_synthesized_plans_have_no_finding[olmo2]": "the [llama] and [gemma3] cases",
    "tests/test_check.py::test_synthesized_plans_have_no_finding[qwen3]": "the [llama] and [gemma3] cases",
    "tests/test_synth_verify.py::test_sp_plans_with_shared_experts_and_inner_rows_are_exact[afmoe]":
        "its [qwen2_moe] case, test_shared_expert_moe",
    "tests/test_synth_verify.py::test_sp_plans_with_shared_experts_and_inner_rows_are_exact[deepseek_v3]":
        "its [qwen2_moe] case, test_shared_expert_moe",
    "tests/test_untraced_siblings.py::test_zamba2_with_two_hybrid_layers_verifies":
        "test_untraced_siblings::test_each_layers_own_adapter_is_sharded[2] (adapters the trace never called)",
    "tests/test_cli.py::test_console_script_prints_json":
        "test_cli's in-process --json tests, test_module_entry_point_reports_errors_without_traceback (a real "
        "subprocess entry)",
    "tests/test_handwritten_more.py::test_qwen3_5_plan_equals_the_synthesized_one[sp]":
        "test_joined_shards::test_joined_delta_mixer_is_sharded_and_exact[2-sp] (a delta-rule mixer sharded by "
        "heads), test_handwritten_more's qwen3_5 cases (the handwritten plan, exact, with a padded batch)",
    "tests/test_synth_plans.py::test_gemma3_both_plans_exact_and_synthesized_shards_more":
        "test_synth_matrix[gemma3-2-sp] (the synthesized plan: exact, fractions, collectives), "
        "test_handwritten[gemma3] (the handwritten plan)",
    "tests/test_cli.py::test_a_closed_pipe_ends_quietly":
        "test_cli::test_a_closed_pipe_inside_a_command_is_its_exit_status (the handler, in process), "
        "test_module_entry_point_reports_errors_without_traceback (the entry point in a subprocess)",
    "tests/test_cli.py::test_verify_auto_source_on_tiny_qwen3":
        "test_check_kv_heads::test_cli_verifies_gemma3_with_its_one_kv_head (verify, auto source, through main)",
}

TP_PARAMS = ("tp", "tp_size")

# Files whose every tp=2 case stays in the default tier: the synthesis matrix (exact parameter
# fractions and collective counts per family and mode), the handwritten plans of the families
# NeMo's optimized plans cover, the silently-wrong toys.
FULL_MATRIX_FILES = ("test_synth_matrix.py", "test_handwritten.py", "test_silent_wrong.py")
# Files that keep every value of every parameter once (base-choice coverage): each family and mode
# of the other handwritten plans, each kv-head layout (gathered, copies) runs, not each combination.
EACH_VALUE_FILES = ("test_handwritten_more.py", "test_kv_replication.py")
# The parameters that choose plain TP or sequence parallel. Outside the files above a test's base
# case runs sequence parallel: an SP plan holds the plain plan's columns and rows and adds the
# sequence boundaries, so the case covers more of the code; the plain case is in the slow tier.
MODE_PARAMS = ("sequence_parallel", "sp")


def _params(item) -> dict:
    return getattr(getattr(item, "callspec", None), "params", {})


def _tp_of(item) -> tuple[str, int] | None:
    params = _params(item)
    for name in TP_PARAMS:
        if isinstance(params.get(name), int):
            return name, params[name]
    return None


def _sibling_key(item, name: str, tp: int) -> tuple:
    params = dict(item.callspec.params)
    params[name] = tp
    return item.nodeid.partition("[")[0], tuple(sorted((k, repr(v)) for k, v in params.items()))


def _is_slow(item, at_two: set, base: dict) -> bool:
    if item.path.name in SLOW_FILES or item.nodeid in SLOW_TESTS:
        return True
    if item.get_closest_marker("multiprocess") and item.nodeid.partition("[")[0] not in DEFAULT_MULTIPROCESS:
        return True
    # A case repeated at a larger tp, when the same test also runs at tp 2 with every other
    # parameter equal. A test that only runs at tp 4 or 8 (fewer kv groups than ranks) stays.
    found = _tp_of(item)
    if found and found[1] > 2 and _sibling_key(item, found[0], 2) in at_two:
        return True
    # A test with several parameters (an idiom toy in variants x modes, a family sweep x sources x
    # modes) keeps its base case: each parameter at its first value, the mode sequence parallel. In
    # EACH_VALUE_FILES also every case that differs from the base in one parameter.
    params, first = _params(item), base.get(item.nodeid.partition("[")[0])
    if item.path.name in FULL_MATRIX_FILES or first is None:
        return False
    differ = [name for name in params if name not in TP_PARAMS and repr(params[name]) != repr(first.get(name))]
    if len(params) < 2 and not (set(params) & set(MODE_PARAMS)):
        return False  # one parameter that is not the mode: distinct inputs (families, modules), each kept
    # Each value of a parameter other than the mode: a test whose only choice is the mode keeps its
    # sequence-parallel case there too.
    each_value = item.path.name in EACH_VALUE_FILES and set(params) - set(MODE_PARAMS) - set(TP_PARAMS)
    return len(differ) > (1 if each_value else 0)


def _base_cases(items) -> dict:
    """Each parametrized test's base parameters: its first case, with the mode sequence parallel
    where the test runs both modes (outside EACH_VALUE_FILES, which keep every value anyway)."""
    base: dict = {}
    for item in items:
        params = _params(item)
        if not params:
            continue
        name = item.nodeid.partition("[")[0]
        if name not in base:
            base[name] = params
        elif any(base[name].get(m) is False and params.get(m) is True for m in MODE_PARAMS) and all(
            repr(params[k]) == repr(base[name][k]) for k in params if k not in MODE_PARAMS
        ):
            base[name] = params  # the first case, in sequence parallel
    return base


def pytest_collection_modifyitems(config, items):
    at_two, base = set(), _base_cases(items)
    for item in items:
        found = _tp_of(item)
        if found and found[1] == 2:
            at_two.add(_sibling_key(item, found[0], 2))
    for item in items:
        if _is_slow(item, at_two, base):
            item.add_marker(pytest.mark.slow)
