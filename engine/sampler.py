"""Token sampling: greedy, temperature, top-k, top-p, with batch-independent per-request seeds.

Every non-greedy row is sampled by inverse CDF over its sorted, filtered distribution with
ONE uniform number. For a request with a seed that number comes from a fresh CPU generator
seeded by a stable hash of ``(seed, num_output_tokens)``, so output token ``n`` depends only on
the seed, ``n`` and the logits, never on which other requests share the batch or on the
device. Requests without a seed draw from one engine-level generator seeded by
``config.seed`` (reproducible for the same sequence of batches).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One logits row to sample: its settings and how many tokens the request already has."""

    params: SamplingParams
    num_output_tokens: int


def seeded_uniform(seed: int, num_output_tokens: int) -> float:
    """The uniform draw in [0, 1) for token ``num_output_tokens`` of a seeded request."""
    digest = hashlib.blake2b(f"{seed}:{num_output_tokens}".encode(), digest_size=8).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)
    return float(torch.rand((), generator=gen, dtype=torch.float64))


class Sampler:
    """Stateful only through the engine-level generator (not thread-safe)."""

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
        """``logits [n, vocab]`` (one row per entry of ``requests``) -> n token ids.

        Does not modify ``logits``. Raises ValueError if the row count differs."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        if not requests:
            return []
        out = logits.float().argmax(dim=-1).tolist()  # greedy rows keep this
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if rows:
            sampled = self._sample_rows(logits[rows].float(), [requests[i] for i in rows])
            for i, tok in zip(rows, sampled, strict=True):
                out[i] = tok
        return out

    def _sample_rows(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
        device = logits.device
        vocab = logits.shape[-1]
        temps = torch.tensor([r.params.temperature for r in requests], device=device).unsqueeze(1)
        probs = torch.softmax(logits / temps, dim=-1)
        # Stable sort: equal probabilities keep vocab order, so results are reproducible.
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
        top_k = torch.tensor(
            [r.params.top_k if r.params.top_k > 0 else vocab for r in requests], device=device
        ).unsqueeze(1)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_probs = sorted_probs.masked_fill(ranks >= top_k, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        # Top-p keeps the minimal prefix whose mass reaches top_p: token i stays if the mass
        # strictly before it is still below top_p (so the most likely token always stays).
        # top_p == 1 must keep everything, even tokens after float rounding made the mass 1.
        top_p = torch.tensor(
            [r.params.top_p if r.params.top_p < 1.0 else 2.0 for r in requests], device=device
        ).unsqueeze(1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        cdf = sorted_probs.cumsum(dim=-1)
        uniforms = self._uniforms(requests)
        targets = torch.tensor(uniforms, dtype=cdf.dtype, device=device).unsqueeze(1) * cdf[:, -1:]
        picks = torch.searchsorted(cdf, targets, right=True)
        # Rounding can put the target at the very end of the cdf: clamp to the last kept token.
        num_kept = (sorted_probs > 0).sum(dim=-1, keepdim=True)
        picks = torch.minimum(picks, num_kept - 1)
        return sorted_ids.gather(1, picks).squeeze(1).tolist()

    def _uniforms(self, requests: list[SampleRequest]) -> list[float]:
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        shared = torch.rand(len(unseeded), generator=self._generator, dtype=torch.float64).tolist()
        draws = dict(zip(unseeded, shared, strict=True))
        return [
            draws[i] if r.params.seed is None else seeded_uniform(r.params.seed, r.num_output_tokens)
            for i, r in enumerate(requests)
        ]
