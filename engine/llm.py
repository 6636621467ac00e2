"""``LLM``: the offline, vLLM-style API over ``LLMEngine``.

    llm = LLM("path/to/hf-model", num_gpu_blocks=256, max_num_batched_tokens=512)
    outs = llm.generate(["Hello", "The capital of"], SamplingParams(temperature=0.0))

``tokenizer="DIR"`` loads the tokenizer from another directory than the weights (vLLM's
``tokenizer`` argument); every other keyword is an EngineConfig, CacheConfig or
SchedulerConfig field.

Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.kv_stats import KVStats
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import encode_chat

Prompt = str | list[int]
Conversation = list[dict[str, str]]

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"cache", "scheduler"}
_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}


def build_engine_config(model: str | None, **kwargs: Any) -> EngineConfig:
    """Map flat keyword arguments onto EngineConfig / CacheConfig / SchedulerConfig fields.
    Raises TypeError naming unknown keywords, ValueError on bad values."""
    unknown = sorted(set(kwargs) - _ENGINE_FIELDS - _CACHE_FIELDS - _SCHEDULER_FIELDS)
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
    cache = CacheConfig(**{k: v for k, v in kwargs.items() if k in _CACHE_FIELDS})
    scheduler = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in _SCHEDULER_FIELDS})
    engine_kwargs = {k: v for k, v in kwargs.items() if k in _ENGINE_FIELDS}
    if engine_kwargs.get("kv_offload_config") is not None and "kv_offload" not in engine_kwargs:
        engine_kwargs["kv_offload"] = True  # a tier config asks for offload (as in `kvtier serve`)
    return EngineConfig(model=model, cache=cache, scheduler=scheduler, **engine_kwargs)


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # one tokenized prompt
    for p in prompts:
        if not isinstance(p, (str, list)):
            raise TypeError(
                f"a prompt must be a str or a list of token ids, got {type(p).__name__}"
            )
    return prompts  # type: ignore[return-value]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        from engine.llm_engine import LLMEngine

        self.config = build_engine_config(model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def kv_stats(self) -> KVStats:
        """KV reuse statistics (``LLMEngine.kv_stats``; ``engine.kv_stats.KVStats`` lists the
        keys): GPU hits, loaded and recomputed tokens, per-tier hit blocks, bytes moved, load
        time, decisions, failed loads. A plain dict; no side effect."""
        return self.engine.kv_stats()

    def close(self) -> None:
        """Write out offloaded KV, close the tiers and the request log. Idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; finished outputs in input order. Raises ValueError
        for a rejected prompt (no request of this call is left running)."""
        items = _normalize_prompts(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            param_list = [params] * len(items)
        else:
            param_list = list(params)
            if len(param_list) != len(items):
                raise ValueError(f"{len(param_list)} SamplingParams for {len(items)} prompts")
        req_ids: list[str] = []
        try:
            for prompt, p in zip(items, param_list, strict=True):
                req_id = f"llm-{next(self._ids)}"
                self.engine.add_request(req_id, prompt, p)
                req_ids.append(req_id)
        except Exception:
            for req_id in req_ids:
                self.engine.abort_request(req_id)
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return self._run(req_ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant reply to one conversation (a list of {role, content}) or to
        each of several, through ``chat_template`` (a Jinja string, as vLLM's) or else the
        tokenizer's chat template."""
        convs: list[Conversation]
        if messages and isinstance(messages[0], dict):
            convs = [list(messages)]  # type: ignore[arg-type]
        else:
            convs = [list(c) for c in messages]  # type: ignore[arg-type]
        prompts: list[Prompt] = [
            encode_chat(self.tokenizer, c, chat_template=chat_template) for c in convs
        ]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(req_ids)
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(req_ids), desc="generate")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.req_id in wanted:
                        finals[out.req_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        # Idle now: blocks freed by the last step go to the tiers before generate returns.
        self.engine.flush_kv()
        return [finals[r] for r in req_ids]
