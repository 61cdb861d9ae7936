"""Time ``autotp.synth.synthesize`` on 8B- and 70B-shaped Llama configs built on the meta device.

Depth 2 vs 80 shows that tracing one block per distinct layer type keeps the cost flat in depth.
Writes medians to ``benchmarks/results/synthesis.json``.

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

SHAPES = {
    "llama-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                     vocab_size=128256),
    "llama-70b": dict(hidden_size=8192, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
                      vocab_size=128256),
}
DEPTHS = (2, 80)
RESULTS = Path(__file__).parent / "results" / "synthesis.json"


def build(shape: dict, layers: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(**shape, num_hidden_layers=layers)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def time_synthesis(model: torch.nn.Module, repeats: int, **options) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        synthesize(model, tp_size=8, **options)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    start = time.perf_counter()
    synthesize(build(SHAPES["llama-8b"], 2))
    first_call = time.perf_counter() - start
    rows = []
    for name, shape in SHAPES.items():
        for layers in DEPTHS:
            model = build(shape, layers)
            for sp in (False, True):
                times = time_synthesis(model, args.repeats, sequence_parallel=sp)
                rows.append({"model": name, "layers": layers, "sequence_parallel": sp,
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
