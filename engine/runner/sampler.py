"""Token sampling: greedy, temperature, min-p, top-k, top-p, with batch-independent
per-request seeds. Min-p comes after temperature and before top-k/top-p, as in vLLM.

Every non-greedy row is sampled by inverse CDF over its sorted, filtered distribution with
ONE uniform number. For a request with a seed that number comes from a fresh CPU generator
seeded by a stable hash of ``(seed, num_output_tokens)``, so output token ``n`` depends only on
the seed, ``n`` and the logits, never on which other requests share the batch or on the
device. Requests without a seed draw from one engine-level generator seeded by
``config.seed`` (reproducible for the same sequence of batches).

On CUDA, unseeded top-k/top-p rows use FlashInfer's fused sampling kernel (rejection sampling,
no sort) with a CUDA generator seeded by ``config.seed``; seeded rows keep the inverse-CDF path
above so their tokens stay batch- and device-independent. ``sample`` returns the token ids as
a device tensor without synchronizing; ``__call__`` adds the one copy back to the host.
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


def apply_min_p(scaled: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """``scaled`` (logits after temperature, one row per request) with every token whose
    probability is below ``min_p`` times the top token's at -inf; ``scaled`` itself when no
    row sets min_p. In logit space, where softmax's normalizer cancels: ``p_i < min_p * p_max``
    iff ``s_i - s_max < log(min_p)``, so no extra softmax, and min_p 0 (log = -inf) keeps
    every token of its row."""
    min_p = [r.params.min_p for r in requests]
    if not any(min_p):
        return scaled
    log_min_p = torch.tensor(min_p, dtype=torch.float64).log().to(scaled.dtype)
    log_min_p = log_min_p.to(scaled.device, non_blocking=True).unsqueeze(1)
    below = scaled - scaled.amax(dim=-1, keepdim=True) < log_min_p
    return scaled.masked_fill(below, float("-inf"))


def _flashinfer_sampling() -> object | None:
    try:
        import flashinfer.sampling
    except ImportError:
        return None
    return flashinfer.sampling


class Sampler:
    """Stateful only through the engine-level generators (not thread-safe)."""

    def __init__(self, seed: int, device: torch.device | str | None = None) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._cuda_generator: torch.Generator | None = None
        self._gpu_kernels: object | None = None
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type == "cuda":
            self._gpu_kernels = _flashinfer_sampling()
            if self._gpu_kernels is not None:
                self._cuda_generator = torch.Generator(device=dev).manual_seed(seed)

    @property
    def uses_flashinfer(self) -> bool:
        return self._gpu_kernels is not None

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[int]:
        """``logits [n, vocab]`` (one row per entry of ``requests``) -> n token ids.

        Does not modify ``logits``. Raises ValueError if the row count differs."""
        return self.sample(logits, requests).tolist()

    def sample(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        """Like ``__call__`` but returns int64 ``[n]`` on ``logits.device``, no host sync."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(requests)} requests")
        logits = logits.float()
        out = logits.argmax(dim=-1)  # greedy rows keep this
        seeded = [
            i for i, r in enumerate(requests) if not r.params.greedy and r.params.seed is not None
        ]
        unseeded = [
            i for i, r in enumerate(requests) if not r.params.greedy and r.params.seed is None
        ]
        if unseeded:
            rows = [requests[i] for i in unseeded]
            if self._gpu_kernels is not None and logits.is_cuda:
                picked = self._sample_rows_flashinfer(logits[unseeded], rows)
            else:
                picked = self._sample_rows(logits[unseeded], rows)
            out[unseeded] = picked
        if seeded:
            out[seeded] = self._sample_rows(logits[seeded], [requests[i] for i in seeded])
        return out

    def _sample_rows_flashinfer(
        self, logits: torch.Tensor, requests: list[SampleRequest]
    ) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        params = [r.params for r in requests]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(
            device, non_blocking=True
        )
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], dtype=torch.int32)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        picked = self._gpu_kernels.top_k_top_p_sampling_from_logits(  # type: ignore[attr-defined]
            apply_min_p(logits / temps.unsqueeze(1), requests),
            top_k.to(device, non_blocking=True),
            top_p.to(device, non_blocking=True),
            filter_apply_order="top_k_first",
            deterministic=True,
            generator=self._cuda_generator,
        )
        return picked.long()

    def _sample_rows(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[-1]
        temps = torch.tensor([r.params.temperature for r in requests], device=device).unsqueeze(1)
        probs = torch.softmax(apply_min_p(logits / temps, requests), dim=-1)
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
        return sorted_ids.gather(1, picks).squeeze(1)

    def _uniforms(self, requests: list[SampleRequest]) -> list[float]:
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        shared = torch.rand(len(unseeded), generator=self._generator, dtype=torch.float64).tolist()
        draws = dict(zip(unseeded, shared, strict=True))
        return [
            draws[i]
            if r.params.seed is None
            else seeded_uniform(r.params.seed, r.num_output_tokens)
            for i, r in enumerate(requests)
        ]
