"""Per-request sampling settings (vLLM-compatible names). Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top-k alternatives per token, as OpenAI's chat API allows


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1``
    disables top-p; ``min_p`` (0 = off) drops every token whose probability is below ``min_p``
    times the most likely token's, on the distribution after temperature and before top-k /
    top-p, as vLLM orders them (greedy ignores it: the top token always stays). ``seed``
    makes a request's sampling reproducible regardless of batching.
    ``stop`` strings end generation and are not included in ``.text`` unless
    ``include_stop_str_in_output`` (vLLM's name; the text then ends with the stop string);
    ``stop_token_ids`` and EOS (unless ``ignore_eos``) end it too. ``skip_special_tokens``
    (vLLM's, on by default): special tokens are left out of the text. While fewer than
    ``min_tokens`` tokens are out, EOS and every ``stop_token_ids`` entry are masked from
    sampling (vLLM's ``MinTokensLogitsProcessor`` over ``all_stop_token_ids``: EOS even with
    ``ignore_eos``), greedy included, so the output cannot end early or hold them.
    ``allowed_token_ids`` (None = all): only these ids may be sampled, every other logit is
    masked (before penalties, as vLLM does); ids past the vocabulary are rejected when the
    request is added (``LLMEngine.add_request``). Raises ValueError on bad values.

    Penalties act on the logits before temperature, greedy included, in vLLM's order:
    ``repetition_penalty`` (HF's ``RepetitionPenaltyLogitsProcessor``: over prompt and output
    tokens, a positive logit divided by it, a negative one multiplied; 1 = off), then OpenAI's
    ``frequency_penalty`` (minus penalty x count) and ``presence_penalty`` (minus penalty once)
    over the output tokens only.

    ``logprobs``: None = off, k >= 0 = each sampled token's log-probability plus its top k.
    ``prompt_logprobs``: the same for every prompt token but the first; a request asking for
    them computes its whole prompt (no prefix-cache or tier hit), so that every prompt
    position has logits. Log-probabilities are those of the model's raw distribution (before
    penalties, temperature, top-k/top-p and any grammar mask), as vLLM returns by default.

    ``json_schema`` (JSON text) or ``json_object`` constrain the output with a grammar
    (xgrammar, an optional dependency: engine/runner/structured_output.py)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: str | None = None
    json_object: bool = False
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.allowed_token_ids is not None:  # a list (the wire, the API) becomes a tuple
            allowed = tuple(self.allowed_token_ids)
            object.__setattr__(self, "allowed_token_ids", allowed)
            if not allowed or any(not isinstance(t, int) or t < 0 for t in allowed):
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of token ids >= 0, got {allowed!r}"
                )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):  # also rejects NaN
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):  # OpenAI's range; rejects NaN
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not (0.0 < self.repetition_penalty < float("inf")):  # rejects NaN too
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.json_schema is not None and self.json_object:
            raise ValueError("json_schema and json_object are exclusive")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def has_grammar(self) -> bool:
        return self.json_schema is not None or self.json_object

    @property
    def needs_history(self) -> bool:
        """The model runner needs the request's tokens so far (prompt and output)."""
        return self.has_penalties or self.has_grammar or self.prompt_logprobs is not None
