"""Greedy decoding for evaluation: the stock `generate` with its KV cache, batched, left-padded.

Each prompt's answer is the tokens generated after it, cut at the task's stop text (`task.stop`, a
newline by default: the completions are trained to end with it) or at the end-of-sequence token,
whichever comes first, and at most `max_new_tokens`. Decoding stops early once every prompt of a
batch has reached its stop. The KV cache makes a generated token cost one position of a forward, not
a forward over the whole prompt (`benchmarks/decode_cost.py` measures it).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class StopAtText:
    """A stopping rule for `generate`: a row is done once its generated text contains `stop`."""

    def __init__(self, tokenizer, stop: str, prompt_length: int):
        self.tokenizer, self.stop, self.start = tokenizer, stop, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.start:], skip_special_tokens=True)
        return torch.tensor([self.stop in t for t in texts], dtype=torch.bool, device=input_ids.device)


def answer_text(tokenizer, tokens: Sequence[int], stop: str) -> str:
    """The generated tokens as the answer: decoded, cut at the stop text, stripped."""
    text = tokenizer.decode(list(tokens), skip_special_tokens=True)
    if stop and stop in text:
        text = text[:text.index(stop)]
    return text.strip()


@torch.inference_mode()
def greedy_decode(model: nn.Module, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop: str,
                  pad_id: int, use_cache: bool = True, min_new_tokens: int = 0) -> list[str]:
    """The greedy answers of `model` to `prompts` (token id lists), as text (`answer_text`).
    min_new_tokens: no end-of-sequence before that many tokens (benchmarks decode a fixed length)."""
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[r, width - len(p):] = 1
    criteria = StoppingCriteriaList([StopAtText(tokenizer, stop, width)]) if stop else None
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                         do_sample=False, num_beams=1, pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id,
                         stopping_criteria=criteria, use_cache=use_cache, temperature=None, top_p=None, top_k=None,
                         min_new_tokens=min_new_tokens)
    return [answer_text(tokenizer, row[width:].tolist(), stop) for row in out]
