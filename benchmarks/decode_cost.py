"""What greedy decoding costs in evaluation, against full forwards: the KV cache at work.

Decodes N answers of exactly T tokens (no early stop) with `distzo.data.decoding.greedy_decode` (the
stock `generate`, cached), and times one full forward of the same left-padded prompts. Without a
cache every generated token would cost a full forward over the prompt and what was generated, so
decoding would cost at least T full forwards; the printed ratio is decoding time over (T x one
forward), both timed in this one run, interleaved over rounds, medians:

    python benchmarks/decode_cost.py                          # embedded default, 64 trivia answers of 16 tokens
    python benchmarks/decode_cost.py --model tiny --answers 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--answers", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)

    from distzo.config.compose import compose_config
    from distzo.data.decoding import greedy_decode
    from distzo.data.tasks import PromptTask
    from distzo.models import load_model

    cfg = compose_config([f"model={ns.model}", "task=trivia"])
    model, tokenizer = load_model(cfg.model)
    model.eval()
    task = PromptTask(cfg.task, tokenizer)
    prompts = task._prompts["validation"][:ns.answers]
    chunks = [prompts[i:i + ns.batch] for i in range(0, len(prompts), ns.batch)]

    def forward_once() -> None:
        for chunk in chunks:
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, p in enumerate(chunk):
                ids[r, width - len(p):], mask[r, width - len(p):] = torch.tensor(p), 1
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=mask)

    def decode() -> None:
        for chunk in chunks:  # stop "" and min_new_tokens: every answer is exactly T tokens
            greedy_decode(model, tokenizer, chunk, ns.tokens, "", tokenizer.pad_token_id, min_new_tokens=ns.tokens)

    forward_once(), decode()  # warm-up
    forwards, decodes = [], []
    for _ in range(ns.rounds):
        started = time.perf_counter()
        forward_once()
        forwards.append(time.perf_counter() - started)
        started = time.perf_counter()
        decode()
        decodes.append(time.perf_counter() - started)
    ratio = statistics.median(d / (ns.tokens * f) for d, f in zip(decodes, forwards))
    result = {"model": ns.model, "answers": len(prompts), "tokens_per_answer": ns.tokens,
              "forward_s": round(statistics.median(forwards), 4), "decode_s": round(statistics.median(decodes), 4),
              "decode_over_full_forwards": round(ratio, 3)}
    print(json.dumps(result, indent=2))
    print(f"decoding {len(prompts)} answers of {ns.tokens} tokens costs {ratio:.3f} x {ns.tokens} full forwards "
          f"({1 / ratio:.1f}x cheaper than one full forward per token)")


if __name__ == "__main__":
    main()
