"""Time ``autotp.synth.synthesize`` on real-size Llama and Phi3 configs built on the meta device.

Depth 2 vs 80 shows that tracing one block per distinct layer type keeps the cost flat in depth.
Writes medians (and, separately, the cold first call) to ``benchmarks/results/synthesis.json``.

    python benchmarks/bench_synthesis.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from autotp.synth import synthesize

# name -> (config class, model class, shape, tp). Phi3 exercises the localize pass (fused qkv cut
# with head-count attributes); Llama-70B at tp=16 > 8 kv heads exercises kv-head replication.
SHAPES = {
    "llama-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=128256), 8),
    "llama-70b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
        vocab_size=128256), 8),
    "llama-70b-tp16": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
        vocab_size=128256), 16),
    "phi3-mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=3072, num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192,
        vocab_size=32064, pad_token_id=0), 8),
}
DEPTHS = (2, 80)
RESULTS = Path(__file__).parent / "results" / "synthesis.json"


def build(name: str, layers: int) -> torch.nn.Module:
    config_class, model_class, shape, _ = SHAPES[name]
    config = getattr(transformers, config_class)(**shape, num_hidden_layers=layers)
    with torch.device("meta"):
        return getattr(transformers, model_class)(config)


def time_synthesis(model: torch.nn.Module, repeats: int, **options) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        synthesize(model, verify=False, **options)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    start = time.perf_counter()
    synthesize(build("llama-8b", 2), verify=False)
    first_call = time.perf_counter() - start
    rows = []
    for name, (*_, tp) in SHAPES.items():
        for layers in DEPTHS:
            model = build(name, layers)
            for sp in (False, True):
                times = time_synthesis(model, args.repeats, sequence_parallel=sp, tp_size=tp)
                rows.append({"model": name, "tp": tp, "layers": layers, "sequence_parallel": sp,
                             "median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
                             "repeats": args.repeats})
                print(f"{name:10s} layers={layers:3d} sp={sp!s:5s} median {rows[-1]['median_s']:.3f} s")
    result = {"first_call_s (includes torch.export warm-up)": round(first_call, 3), "results": rows,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "transformers": transformers.__version__, "cpu_threads": torch.get_num_threads()}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
