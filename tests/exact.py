"""Checks shared by the tests of the tiny and the real model: multi-turn rows, vLLM's log-probs."""
import torch

from rollouts import make_batch



def assert_sampled_ids_are_trained(batch, sampled) -> list[list[int]]:
    """Every sampled completion sits verbatim in its episode's row with mask 1, and nothing else is
    trained. `sampled`: one list of (prefix, Sample) per generate call. Returns the unpadded rows."""
    rows = [batch.tokens[r, : int(batch.attn[r].sum())].tolist() for r in range(len(batch))]
    trained = [0] * len(rows)
    for call in sampled:
        for prefix, s in call:
            (r,) = [r for r, row in enumerate(rows) if row[: len(prefix)] == prefix]
            end = len(prefix) + len(s.ids)
            assert rows[r][len(prefix) : end] == s.ids and batch.mask[r, len(prefix) : end].sum() == len(s.ids)
            trained[r] += len(s.ids)
    assert batch.mask.sum(1).tolist() == trained  # the rest (prompt, replies, padding) is masked out
    return rows


def gap(pol, prefixes, samples) -> torch.Tensor:
    """|the sampler's log-prob (vLLM's) - the trainer's| for every sampled token."""
    batch = make_batch(prefixes, samples, [0.0] * len(samples), pol.pad_id)
    with torch.no_grad():
        logp = pol.score(batch, slice(None))[0]
    mask = batch.mask > 0
    return (logp[mask] - batch.logp[mask]).abs()
