"""Offline engine vs the reference `transformers` Qwen3-VL on the bench-size checkpoint.

Measures, on the same image + text prompt: prefill tokens/s (vision tower + LM over the
prompt; the reference's `generate` of one token), and decode tokens/s at batch 1 and batch
16 (reference: the time between consecutive steps inside `generate`, stamped by a logits
processor; ours: each `decode_step` over sequences prefilled without prefix reuse). Runs
alternate between the two so background load hits both alike. Prints medians and
our/reference ratios. Goals: decode >= 1.0x at batch 1, >= 3x at batch 16.

    .venv/bin/python benchmarks/engine_bench.py [--decode-tokens 32] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
from timing import image_question

from common.engine import Engine
from common.models.sequence import LmSequence
from common.models.tiny import default_checkpoint
from common.multimodal.params import Modality
from common.processing.processor import ProcessedPrompt
from common.sampling import SamplingParams


def ref_inputs(engine: Engine, p: ProcessedPrompt, batch: int) -> dict[str, torch.Tensor]:
    ids = torch.tensor([p.prompt_token_ids] * batch)
    types = torch.zeros_like(ids)
    types[ids == engine.config.image_token_id] = 1
    types[ids == engine.config.video_token_id] = 2
    out = {"input_ids": ids, "mm_token_type_ids": types, "attention_mask": torch.ones_like(ids)}
    chosen = [i for i, it in enumerate(p.params.items) if it.modality == Modality.IMAGE]
    out["pixel_values"] = torch.cat([p.vision_inputs(chosen)[0]] * batch)  # float32 values
    out["image_grid_thw"] = torch.tensor([p.grid_thw[i] for i in chosen] * batch)
    return out


def ours(engine: Engine, p: ProcessedPrompt, batch: int, steps: int) -> tuple[float, list[float]]:
    """(prefill seconds of the first prompt, seconds of each decode step at `batch`)."""
    sampling = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    prefill = 0.0
    seqs: list[LmSequence] = []
    for i in range(batch):
        start = time.perf_counter()
        params = engine.encode(p)
        seqs.append(engine.prefill(p.prompt_token_ids, params, sampling, use_prefix_cache=False))
        if i == 0:
            prefill = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.decode_step(seqs)
        times.append(time.perf_counter() - start)
    for s in seqs:
        engine.release(s)
    return prefill, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    args = parser.parse_args()
    import transformers  # the reference; a benchmark-only dependency

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = default_checkpoint("bench")
    engine = Engine.from_pretrained(folder, num_blocks=2048, max_batch=16)
    ref = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32
    ).eval()
    ref.generation_config.eos_token_id = None
    p = engine.process(image_question())
    n = len(p.prompt_token_ids)
    steps = args.decode_tokens
    print(f"checkpoint {folder}; prompt {n} tokens; {torch.get_num_threads()} threads")

    class Clock(transformers.LogitsProcessor):
        """Stamps the time at every generation step (called once per step with its logits)."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.stamps.append(time.perf_counter())
            return scores

    def ref_run(batch: int) -> tuple[float, list[float]]:
        """(prefill seconds, seconds of each decode step) of the reference `generate`."""
        inputs = ref_inputs(engine, p, batch)
        clock = Clock()
        start = time.perf_counter()
        with torch.no_grad():
            ref.generate(
                **inputs,
                max_new_tokens=steps + 1,
                do_sample=False,
                logits_processor=transformers.LogitsProcessorList([clock]),
            )
        stamps = clock.stamps
        return stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)]

    # Warm up both, then alternate them so background load hits both alike; per-step medians
    # shrug off load spikes.
    ref_run(1)
    ours(engine, p, 1, 2)
    samples: dict[str, list[float]] = {}
    add = samples.setdefault
    for batch in (1, 16):
        for _ in range(args.repeats):
            for side, run in (("ref", ref_run), ("epd", lambda b: ours(engine, p, b, steps))):
                prefill, step_times = run(batch)
                add(f"decode tok/s b={batch} {side}", []).extend(batch / t for t in step_times)
                if batch == 1:
                    add(f"prefill tok/s {side}", []).append(n / prefill)
    print(f"{'(medians)':22s}{'reference':>12s}{'epd':>12s}{'ratio':>8s}")
    for name in ("prefill tok/s", "decode tok/s b=1", "decode tok/s b=16"):
        ref_rate = statistics.median(samples[f"{name} ref"])
        our_rate = statistics.median(samples[f"{name} epd"])
        print(f"{name:22s}{ref_rate:12.1f}{our_rate:12.1f}{our_rate / ref_rate:7.2f}x")


if __name__ == "__main__":
    main()
