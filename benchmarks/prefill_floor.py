"""How close a 512-token text prefill is to its kernels' floor on this CPU.

Times, in one process with one torch thread, (a) `Engine.prefill` of one 512-token text
prompt (no prefix reuse) and (b) only the kernels that forward cannot avoid, at its exact
shapes, on the engine's own weights and projection kernels (`linear.Dense`): per layer but
the last, the four projections (q/k/v fused, o, gate/up fused, down) and one causal grouped-query
`scaled_dot_product_attention`; in the last layer the q/k/v GEMM over every row (its K/V go
to the cache) and the rest for the last row only (nothing reads the other rows' outputs);
then the lm_head on the last row. (b) is a floor for any fp32 engine doing the same
arithmetic on one core: whatever (a) spends beyond it is norms, rotary, activations, KV
writes and per-op overhead. `--full-last-layer` times the last layer on every row, as the
floor of an engine that does not skip it. Medians of `--reps` alternating runs (CPU time of
this process).

    .venv/bin/python benchmarks/prefill_floor.py [--tokens 512] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from common.engine import Engine
from common.models.tiny import default_checkpoint
from common.multimodal.params import MultimodalParams
from common.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--full-last-layer", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = args.tokens
    engine = Engine.from_pretrained(default_checkpoint("small"), num_blocks=1024)
    model = engine.runner.model
    c = model.config
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    empty = MultimodalParams((), {}, 0)

    def prefill(rep: int) -> None:
        prompt = [(rep * 131 + j * 7 + 3) % 1000 for j in range(n)]
        engine.release(engine.prefill(prompt, empty, one, use_prefix_cache=False))

    x = torch.randn(n, c.hidden_size)
    mlp_in = torch.randn(n, c.intermediate_size)
    attn_in = torch.randn(n, c.num_attention_heads * c.head_dim)
    q = torch.randn(1, c.num_attention_heads, n, c.head_dim)
    kv = torch.randn(1, c.num_key_value_heads, n, c.head_dim)

    last = len(model.layers) - 1

    def kernels(rep: int) -> None:
        with torch.inference_mode():
            for i, layer in enumerate(model.layers):
                layer.qkv(x)
                if i < last or args.full_last_layer:
                    F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
                    layer.o_proj(attn_in)
                    layer.gate_up(x)
                    layer.down(mlp_in)
                else:  # the last row's query over every key, and its MLP
                    F.scaled_dot_product_attention(q[:, :, -1:], kv, kv, enable_gqa=True)
                    layer.o_proj(attn_in[-1:])
                    layer.gate_up(x[-1:])
                    layer.down(mlp_in[-1:])
            model.lm_head(x[-1:])

    runs: dict[str, list[float]] = {"engine prefill": [], "unavoidable kernels": []}
    for fn in (prefill, kernels):  # warm-up
        fn(999)
    for rep in range(args.reps):
        for name, fn in (("engine prefill", prefill), ("unavoidable kernels", kernels)):
            start = time.process_time()
            fn(rep)
            runs[name].append(time.process_time() - start)
    engine_s = statistics.median(runs["engine prefill"])
    floor_s = statistics.median(runs["unavoidable kernels"])
    print(f"{n}-token text prefill, 1 thread, medians of {args.reps} (CPU time):")
    print(f"  engine prefill       {engine_s * 1e3:7.2f} ms   {n / engine_s:8.0f} tok/s")
    print(f"  unavoidable kernels  {floor_s * 1e3:7.2f} ms   {n / floor_s:8.0f} tok/s")
    print(f"  engine / floor       {engine_s / floor_s:7.2f}x")


if __name__ == "__main__":
    main()
