"""``POST /tokenize`` and ``POST /detokenize`` on the real HTTP server (uvicorn, the tiny
random-weight llama, its tokenizer loaded from another directory as ``--tokenizer`` does), and
``--chat-template`` applied by both ``/tokenize`` and ``/v1/chat/completions``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.async_engine import AsyncEngine
from engine.tokenizer import load_tokenizer
from tests.engine.hf_models import make_tiny_model
from tests.engine.test_server import run_server

pytestmark = pytest.mark.timeout(120)
MODEL = "tiny"
MAX_MODEL_LEN = 96
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "where does an evicted block go?"}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(model dir without tokenizer files, tokenizer dir)."""
    root = tmp_path_factory.mktemp("tok")
    model_dir = make_tiny_model(root, "llama", seed=3)
    tok_dir = root / "tokenizer"
    tok_dir.mkdir()
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.move(os.path.join(model_dir, name), tok_dir / name)
    return model_dir, str(tok_dir)


@pytest.fixture(scope="module")
def engine(dirs: tuple[str, str]) -> Iterator[AsyncEngine]:
    model_dir, tok_dir = dirs
    config = EngineConfig(
        model=model_dir,
        tokenizer=tok_dir,
        device="cpu",
        cache=CacheConfig(num_gpu_blocks=32),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN),
    )
    engine = AsyncEngine.from_config(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def base(engine: AsyncEngine) -> Iterator[str]:
    with run_server(engine, MODEL, api_key="sk-test", chat_template=TEMPLATE) as url:
        yield url


def _post(base: str, path: str, body: object, key: str | None = "sk-test") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base}{path}", json=body, headers=headers, timeout=30)


def test_the_tokenizer_comes_from_its_own_directory(dirs: tuple[str, str]) -> None:
    model_dir, tok_dir = dirs
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(model_dir)  # the weights' directory has none: --tokenizer is needed
    from engine.llm import LLM

    llm = LLM(model_dir, tokenizer=tok_dir, device="cpu", num_gpu_blocks=16)
    try:
        assert llm.tokenizer.encode("hello") == load_tokenizer(tok_dir).encode("hello")
    finally:
        llm.close()


def test_tokenize_a_prompt_and_back(base: str, dirs: tuple[str, str]) -> None:
    tok = load_tokenizer(dirs[1])
    text = "the cache keeps every block"
    r = _post(base, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {
        "count": len(tok.encode(text)),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": tok.encode(text),
        "token_strs": None,
    }
    assert body["tokens"][0] == tok.bos_token_id  # add_special_tokens defaults to true
    plain = _post(
        base, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    ).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False)
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    back = _post(base, "/detokenize", {"model": MODEL, "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}


def test_tokenize_messages_uses_the_servers_chat_template(base: str, dirs: tuple[str, str]) -> None:
    tok = load_tokenizer(dirs[1])
    body = _post(base, "/tokenize", {"messages": MESSAGES}).json()
    rendered = "[user] where does an evicted block go?\n"  # TEMPLATE, not the tokenizer's own
    assert body["tokens"] == tok.encode(rendered, add_special_tokens=False)
    assert _post(base, "/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": rendered}
    # The chat endpoint renders with the same template: its prompt is those tokens.
    chat = _post(
        base,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_and_detokenize_refuse_bad_requests(base: str) -> None:
    cases = [
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"promt": "x"}, 400, "prompt"),
        ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "chat_template"),
        (
            "/tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", {"prompt": "word " * 4 * MAX_MODEL_LEN}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens.1"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ]
    for path, body, status, param in cases:
        r = _post(base, path, body)
        assert r.status_code == status, (path, body, r.text)
        assert r.json()["error"]["param"] == param, r.text


def test_tokenize_and_detokenize_need_the_api_key_when_one_is_set(base: str) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert _post(base, path, body, key=None).status_code == 401
        assert _post(base, path, body, key="wrong").status_code == 401
        assert _post(base, path, body).status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200  # probes stay open


def test_chat_template_values_and_errors(tmp_path: Path) -> None:
    from engine.tokenizer import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE  # a file
    assert load_chat_template(TEMPLATE) == TEMPLATE  # inline
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m['content'] }\n")
    with pytest.raises(ValueError, match=rf"^{bad}: line 2: ") as info:
        load_chat_template(str(bad))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="cannot read chat template file 'nope.jinja'"):
        load_chat_template("nope.jinja")
