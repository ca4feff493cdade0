"""The scoring contract against the stock transformers forward: target-token log-likelihoods of
multi-token targets, the completion loss with the prompt masked, and the objectives' readouts."""

from __future__ import annotations

import pytest
import torch

from distzo.data.batches import NO_TARGET, Batch, Scores, TokenSequence
from distzo.data.objectives import objective_sums
from distzo.engine import resident_engine
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions
from distzo.zo.params import TrainableParams

VOCAB = 300


def completion_batch(pairs, readout="tokens"):
    """(prompt, completion) token lists -> one unit per pair: the completion's tokens, each predicted
    at the position before it."""
    seqs = []
    for i, (prompt, completion) in enumerate(pairs):
        tokens = tuple(prompt + completion)
        scored = tuple(range(len(prompt) - 1, len(tokens) - 1))
        seqs.append(TokenSequence(tokens, scored=scored, targets=tuple(completion), units=(i,) * len(completion)))
    n = len(pairs)
    return Batch(seqs, list(range(n)), list(range(n)), torch.zeros(n, dtype=torch.long), readout=readout)


def pairs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    return [(draw(p), draw(c)) for p, c in [(5, 3), (2, 4), (7, 1), (4, 6)]]


@pytest.mark.parametrize("arch", ["llama", "opt", "qwen2", "gpt_neox"])  # gpt_neox: the general path
def test_target_log_likelihoods_are_the_stock_forwards(arch):
    """Float64: a packed row runs other matrix shapes than each sequence alone, so the two agree to
    float64 rounding (observed ~1e-15), far below any wrong position or target (O(1))."""
    model = random_model(arch, VOCAB, {}, 0, torch.float64)
    engine = resident_engine(model, adapter_for(model), TrainableParams.from_model(model), Directions(0))
    data = pairs()
    with engine.materialized() as weights:
        scores = weights.score(completion_batch(data))
    for i, (prompt, completion) in enumerate(data):
        with torch.inference_mode():
            logp = model(torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
        want = -logp[positions, torch.tensor(completion)].sum()
        assert scores.count[i] == len(completion)
        torch.testing.assert_close(scores.nll[i], want.double(), rtol=1e-10, atol=1e-10)


def test_completion_loss_is_the_stock_loss_with_the_prompt_masked():
    """The token readout's (sum, count) over a batch is the stock model's loss with labels -100 on the
    prompt tokens, averaged over every completion token of the batch (right-padded, pads masked).
    transformers computes its loss from float32 logits even for a float64 model, so the two agree to
    float32 rounding: 1e-6 relative (observed 5e-8); a wrong token or position is off by O(1)."""
    model = random_model("llama", VOCAB, {}, 0, torch.float64)
    engine = resident_engine(model, adapter_for(model), TrainableParams.from_model(model), Directions(0))
    data = pairs(seed=1)
    batch = completion_batch(data)
    with engine.materialized() as weights:
        total, count = objective_sums(weights.score(batch), batch).tolist()
    width = max(len(p) + len(c) for p, c in data)
    ids = torch.zeros(len(data), width, dtype=torch.long)
    labels = torch.full((len(data), width), -100)
    mask = torch.zeros(len(data), width, dtype=torch.long)
    for i, (p, c) in enumerate(data):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        mask[i, :len(p) + len(c)] = 1
    with torch.inference_mode():
        stock = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert count == sum(len(c) for _, c in data)
    assert abs(total / count - float(stock)) < 1e-6 * float(stock)


def test_candidate_logits_and_targets_in_one_batch():
    """A label-word position (candidate logits) and target positions of another unit: each readout sees
    its own, the logits equal the full head's columns at that position."""
    model = random_model("llama", VOCAB, {}, 0, torch.float64)
    engine = resident_engine(model, adapter_for(model), TrainableParams.from_model(model), Directions(0))
    seqs = [TokenSequence((5, 6, 7), scored=(2,), targets=(NO_TARGET,), units=(0,)),
            TokenSequence((8, 9, 10, 11), scored=(1, 2), targets=(10, 11), units=(1, 1))]
    batch = Batch(seqs, [0, 1], [0, 1], torch.tensor([0, 0]), candidates=torch.tensor([4, 250]))
    with engine.materialized() as weights:
        scores = weights.score(batch)
    with torch.inference_mode():
        full = model(torch.tensor([[5, 6, 7]])).logits[0, -1]
    torch.testing.assert_close(scores.logits[0], full[[4, 250]], rtol=1e-10, atol=1e-10)
    assert scores.count.tolist() == [0.0, 2.0] and scores.nll[0] == 0.0 and scores.nll[1] > 0


def test_likelihood_readout_scores_candidates_by_their_mean_token_log_likelihood():
    batch = Batch([TokenSequence((1,)), TokenSequence((2,))], [0, 1], [0, 0, 0, 1, 1], torch.tensor([2, 0]),
                  readout="likelihoods")
    nll = torch.tensor([3.0, 4.0, 1.0, 0.5, 6.0], dtype=torch.float64)
    count = torch.tensor([1.0, 2.0, 2.0, 1.0, 3.0], dtype=torch.float64)
    scores = Scores(nll, count)
    # example 0: candidates score -3, -2, -0.5 -> the third (label 2) wins; example 1: -0.5, -2 -> the first
    assert objective_sums(scores, batch, "accuracy").tolist() == [-2.0, 2.0]
    loss, n = objective_sums(scores, batch, "loss").tolist()
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    expect = (torch.logsumexp(f64([-3.0, -2.0, -0.5]), 0) + 0.5) + (torch.logsumexp(f64([-0.5, -2.0]), 0) + 0.5)
    assert n == 2.0 and abs(loss - float(expect)) < 1e-12


def branched_batch(examples):
    """(prompt, [candidates]) token lists -> one sequence per example, its candidates as branches."""
    from distzo.data.tasks import candidate_sequence

    seqs, units = [], []
    for e, (prompt, cands) in enumerate(examples):
        seqs.append(candidate_sequence(prompt, cands, len(units)))
        units += [e] * len(cands)
    return Batch(seqs, list(range(len(examples))), units, torch.zeros(len(examples), dtype=torch.long),
                 readout="likelihoods")


def mc_examples(seed=2):
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(3, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    return [(draw(6), [draw(3), draw(1), draw(4), draw(2)]), (draw(3), [draw(2), draw(5)]),
            (draw(9), [draw(1), draw(1)]),
            (draw(2), [draw(1), draw(2)])]  # 5 tokens: within mistral's window of 8, branched there too


@pytest.mark.parametrize("arch", ["llama", "opt", "mistral", "gpt2", "gemma3_text"])
def test_candidates_after_a_shared_prompt_score_as_the_stock_forward_of_each(arch):
    """Candidates packed as branches after their example's prompt (several examples per row) get the
    log-likelihoods the stock model gives prompt + candidate run alone. mistral's and Gemma 3's random
    configs have a sliding window of 8 tokens (Gemma 3 on two of its three layers): their branched
    sequences longer than that are scored unbranched (Batch.pack), the others branched. gpt2 and
    gemma3_text run on the general path, which hands the branch masks to the stock forward. Float64;
    agreement to rounding (observed ~1e-15)."""
    model = random_model(arch, VOCAB, {}, 0, torch.float64)
    engine = resident_engine(model, adapter_for(model), TrainableParams.from_model(model), Directions(0))
    data = mc_examples()
    batch = branched_batch(data)
    with engine.materialized() as weights:
        scores = weights.score(batch)
        unbranched = weights.score(batch.unbranched())
    packed = engine.pack(batch)
    if arch in ("mistral", "gemma3_text"):
        assert packed.segment is not None and packed.input_ids.numel() > batch.tokens  # some unbranched
    else:
        assert packed.input_ids[packed.real].numel() == batch.tokens  # the prompts once each
    unit = 0
    for prompt, cands in data:
        for cand in cands:
            with torch.inference_mode():
                logp = model(torch.tensor([prompt + cand])).logits[0].log_softmax(-1)
            positions = torch.arange(len(prompt) - 1, len(prompt) + len(cand) - 1)
            want = -logp[positions, torch.tensor(cand)].sum().double()
            torch.testing.assert_close(scores.nll[unit], want, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(unbranched.nll[unit], want, rtol=1e-10, atol=1e-10)
            assert scores.count[unit] == len(cand)
            unit += 1
