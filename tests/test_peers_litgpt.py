"""The synthesizer on litgpt's own ``GPT`` class (litgpt 0.5.13), tiny configs with random weights.

Three attention / MLP layouts litgpt builds from one class: grouped-query attention (8 query
heads, 4 kv groups, Llama-3.2-like), a single kv head with a parallel residual (Falcon-like) and
a mixture of experts held as a ``ModuleList`` of per-expert Linears (Mixtral-like). Each plan is
verified against the unsharded model (logits and every gradient) at tp 2 and 4, and its per-rank
parameter fraction is held to what it reaches now, so a plan that silently keeps more whole fails.

Kept out of ``test_peers.py``, whose module-level torchtitan skip would hide these cases: skipped
when litgpt is not installed. litgpt 0.5.13 pins huggingface-hub<1.4, which transformers 5.23 does
not accept, so it is not in the ``peers`` extra; install it beside, without its pins:
``pip install --no-deps litgpt==0.5.13 lightning lightning-utilities torchmetrics psutil``.
"""

import warnings

import pytest
import torch

pytest.importorskip("litgpt", reason="litgpt is installed by hand (--no-deps): see the module docstring")

from litgpt.config import Config
from litgpt.model import GPT

from autotp.synth import synthesize
from autotp.verifier import verify

BASE = dict(block_size=64, vocab_size=128, padded_vocab_size=128, n_layer=2, n_head=8, n_embd=64,
            rotary_percentage=1.0, bias=False)
LLAMA = dict(parallel_residual=False, norm_class_name="RMSNorm", intermediate_size=128)
CONFIGS = {
    "grouped_query": dict(n_query_groups=4, mlp_class_name="LLaMAMLP", **LLAMA),
    "one_kv_head": dict(n_query_groups=1, parallel_residual=True, shared_attention_norm=True),
    "moe_module_list": dict(n_query_groups=4, mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, **LLAMA),
}
# Per-rank parameter fraction reached (tp 2, tp 4). The one-kv-head qkv is fused with k and v parts
# of one head each, which no tp splits: each rank holds them whole beside its share of the query
# heads (they reach the grouped-query repeat through rope), 0.59 / 0.39 when that Linear was whole.
FRACTION = {"grouped_query": (0.51, 0.26), "one_kv_head": (0.52, 0.28), "moe_module_list": (0.51, 0.26)}


def tokens():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_litgpt_plan_is_exact(name, tp, sequence_parallel):
    """Would catch a wrong litgpt plan (logits or a gradient off) and one that shards less than now.
    Under SP the MoE block's dispatch (``x[token_idx]``) must get every token: gathered at entry."""
    torch.manual_seed(0)
    model = GPT(Config(name=name, **BASE, **CONFIGS[name]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = synthesize(model, example_inputs=(tokens(),), tp_size=tp, sequence_parallel=sequence_parallel, verify=False)
        report = verify(model, plan, tp_size=tp, example_inputs=(tokens(),))
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-4 and report.worst_grad[1] <= 1e-4
    assert all(f <= FRACTION[name][tp == 4] for f in report.param_fraction), report.param_fraction
