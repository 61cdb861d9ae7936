"""Loading a saved checkpoint sharded, on 2 gloo processes: transformers' ``from_pretrained(dir,
tp_plan=...)`` with what ``autotp plan DIR --emit hf`` writes, and :func:`autotp.from_pretrained`
with plans transformers has no strings for. Each case's logits must equal the unsharded model's.

A tiny model is saved with ``save_pretrained`` to a temporary folder; the ranks load it from there.
All the cases of a test run inside one pair of processes, to pay their start (seconds) once.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from autotp.cli import main
from autotp.models import build_model, load_config, shrink_config
from gloo_launch import run_on_ranks

TOLERANCE = 1e-5


def _saved(path, name_or_config) -> tuple[str, torch.Tensor, tuple[torch.Tensor, int]]:
    """A tiny model saved to ``path``: (the folder, input ids, (its unsharded logits, its parameter count)).
    """
    model = build_model(name_or_config, tiny=True, tp=2, device="cpu") if isinstance(name_or_config, str) \
        else build_model(name_or_config, device="cpu")
    model.save_pretrained(path)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return str(path), ids, (model(ids).logits, sum(p.numel() for p in model.parameters()))


def _emitted_hf_plan(directory: str, capsys) -> dict[str, str]:
    """What ``autotp plan DIR --tp 2 --emit hf`` prints (the CLI's main, in this process)."""
    capsys.readouterr()
    assert main(["plan", directory, "--tp", "2", "--emit", "hf"]) == 0
    return json.loads(capsys.readouterr().out)


def _whole(logits) -> torch.Tensor:
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def _load_cases(cases: list[tuple]) -> list:
    """On each rank: load every case, return (its logits, the number of parameter elements the rank
    holds). transformers' loading leaves plain local tensors, autotp's DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    import autotp

    mesh = init_device_mesh("cpu", (2,))
    out = []
    for how, directory, ids, options in cases:
        if how == "hf":
            from transformers import DistributedConfig

            config = DistributedConfig(tp_plan=options["tp_plan"], tp_size=2)
            model = AutoModelForCausalLM.from_pretrained(directory, distributed_config=config)
        else:
            model = autotp.from_pretrained(directory, mesh, **options)
        with torch.no_grad():
            logits = _whole(model(ids).logits)
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        # As a list: a tensor crosses the queue as a shared file descriptor, gone if the rank exits first.
        out.append((logits.tolist(), held))
    return out


def _check(results: dict, references: list[tuple[torch.Tensor, int]], names: list[str]) -> None:
    """Each case's logits equal the unsharded model's on every rank, and no rank holds more than
    60% of the parameters (tiny models: everything but the norms is sharded over 2 ranks)."""
    for rank, per_case in results.items():
        for name, (reference, total), (logits, held) in zip(names, references, per_case):
            diff = (torch.tensor(logits) - reference).abs().max().item()
            assert diff < TOLERANCE, f"rank {rank}, {name}: logits differ by {diff}"
            assert held <= 0.6 * total, f"rank {rank}, {name}: holds {held} of {total} parameters"


@pytest.mark.multiprocess
def test_emitted_hf_plan_and_autotp_plan_load_sharded_on_two_gloo_processes(tmp_path, capsys):
    """A saved tiny Llama: transformers' from_pretrained with the ``--emit hf`` strings, then
    autotp.from_pretrained with the sequence-parallel plan (norms with no transformers string):
    each rank's logits equal the unsharded model's, and each rank holds about half the parameters.
    Would catch ``"rowwise"`` on the embedding (transformers: "Embedding has no in_features")."""
    directory, ids, reference = _saved(tmp_path / "llama", "llama")
    tp_plan = _emitted_hf_plan(directory, capsys)
    assert tp_plan["model.embed_tokens"] == "embedding_rowwise"
    cases = [("hf", directory, ids, {"tp_plan": tp_plan}),
             # The handwritten plan named (selection's trace on every rank is the slow test's).
             ("autotp", directory, ids, {"sequence_parallel": True, "tp_shard_plan": "handwritten_plans.plan_for"})]
    results = run_on_ranks(_load_cases, 2, cases, timeout=600.0, what="loading workers")
    _check(results, [reference] * 2, ["from_pretrained(tp_plan=emitted)", "autotp SP"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reordered_layouts_load_sharded_on_two_gloo_processes(tmp_path, capsys):
    """Styles that store rows reordered: Phi-3's fused qkv and gate_up (packed parts) and a Llama
    with one kv head at tp 2 (the head repeated to both ranks), through autotp.from_pretrained; and
    a plan of transformers' strings through autotp.from_pretrained. (Phi-3's --emit hf strings leave
    its packed qkv_proj out, so transformers would run o_proj row-parallel on a whole input: the
    partial export's warning says so; autotp.from_pretrained is the path for such plans.)"""
    phi3, phi3_ids, phi3_reference = _saved(tmp_path / "phi3", "phi3")
    config = shrink_config(load_config("llama"), tp=2)
    config.num_key_value_heads = 1
    one_kv, one_kv_ids, one_kv_reference = _saved(tmp_path / "one_kv", config)
    llama, llama_ids, llama_reference = _saved(tmp_path / "llama", "llama")
    llama_strings = _emitted_hf_plan(llama, capsys)
    cases = [("autotp", phi3, phi3_ids, {}),
             ("autotp", phi3, phi3_ids, {"sequence_parallel": True}),
             ("autotp", one_kv, one_kv_ids, {"loss_parallel": False}),
             ("autotp", llama, llama_ids, {"tp_shard_plan": llama_strings, "loss_parallel": False})]
    results = run_on_ranks(_load_cases, 2, cases, timeout=900.0, what="loading workers")
    _check(results, [phi3_reference, phi3_reference, one_kv_reference, llama_reference],
           ["phi3", "phi3 SP", "one kv head", "llama strings"])


def test_from_pretrained_names_a_missing_folder_and_missing_tensors(tmp_path):
    """Bad input: a folder that does not exist, and files that lack the model's tensors."""
    from safetensors.torch import save_file

    from autotp.loading import LoadingError, empty_model, load_sharded_safetensors

    import autotp

    with pytest.raises(LoadingError, match="not a directory"):
        autotp.from_pretrained(tmp_path / "nowhere", None)
    model = empty_model(shrink_config(load_config("llama"), tp=2))
    save_file({"other.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoadingError, match="are not in its safetensors files"):
        load_sharded_safetensors(model, tmp_path)


def test_load_sharded_safetensors_fills_an_unsharded_meta_model(tmp_path):
    """No mesh: the same loader fills a whole model on meta (buffers kept), equal to the saved one."""
    from autotp.loading import empty_model, load_sharded_safetensors

    directory, ids, reference = _saved(tmp_path / "llama", "llama")
    model = empty_model(build_model("llama", tiny=True, tp=2, device="meta").config)
    assert all(p.is_meta for p in model.parameters())
    load_sharded_safetensors(model, directory)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference[0])


def test_a_meta_buffer_no_checkpoint_holds_is_refused(tmp_path):
    """A model built wholly on meta has its rotary table there too; no file can fill it, and a
    forward would fail far from the cause."""
    from autotp.loading import LoadingError, load_sharded_safetensors

    directory, _, _ = _saved(tmp_path / "llama", "llama")
    with pytest.raises(LoadingError, match="rotary_emb.inv_freq: a buffer no checkpoint holds"):
        load_sharded_safetensors(build_model("llama", tiny=True, tp=2, device="meta"), directory)
