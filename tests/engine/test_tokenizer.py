"""Tokenizer loading, chat template, incremental detokenization and stop strings (demo BPE)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from engine.models.demo_model import DEMO_ARCH, save_demo_tokenizer
from engine.tokenizer import (
    IncrementalDetokenizer,
    _backend_class,
    encode_chat,
    encode_prompt,
    eos_token_ids,
    load_tokenizer,
    rust_decoder,
    textless_token_ids,
    textless_token_ids_from_file,
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("tok")
    save_demo_tokenizer(str(out))
    return load_tokenizer(str(out))


def stream(
    tok: Any, text: str, stop: tuple[str, ...] = (), prompt: str = "Q:"
) -> tuple[list[str], IncrementalDetokenizer, str | None]:
    """Feed ``text``'s tokens one at a time; returns the deltas and the stop string hit."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), stop=stop)
    deltas: list[str] = []
    for t in ids:
        upd = detok.update([t])
        deltas.append(upd.new_text)
        if upd.stop_string is not None:
            return deltas, detok, upd.stop_string
    deltas.append(detok.flush())
    return deltas, detok, None


def test_load_encode_and_eos(tok: Any, tmp_path: Path) -> None:
    ids = encode_prompt(tok, "hello world")
    assert ids[0] == 1  # BOS from the post-processor
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    assert encode_prompt(tok, [5, 6]) == [5, 6]
    assert eos_token_ids(tok) == frozenset({2})
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))


def test_chat_template(tok: Any) -> None:
    ids = encode_chat(tok, [{"role": "user", "content": "hi there"}])
    assert ids[0] == 1 and ids.count(1) == 1  # BOS once, from the template
    text = tok.decode(ids)
    assert text == "<s><|user|>\nhi there<|end|>\n<|assistant|>\n"


def test_multibyte_text_streams_without_broken_characters(tok: Any) -> None:
    text = "héllo → 世界 🙂 naïve café"
    deltas, detok, stop = stream(tok, text)
    assert stop is None
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # Byte-level tokens split the multi-byte characters, so some steps must emit nothing.
    assert deltas.count("") > 0


def test_random_tokens_concatenate_to_the_full_decode(tok: Any) -> None:
    rng = random.Random(7)
    for _ in range(5):
        out_ids = [rng.randrange(3, len(tok)) for _ in range(40)]
        detok = IncrementalDetokenizer(tok, [1, 50, 60])
        deltas = [detok.update([t]).new_text for t in out_ids]
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(out_ids, skip_special_tokens=True)
        # Before the flush no delta ends in the middle of a character.
        assert all(not d.endswith("\ufffd") for d in deltas[:-1])


def test_the_detokenizer_decodes_through_the_rust_tokenizer_as_the_wrapper_does(tok: Any) -> None:
    """The output thread's decodes skip transformers' wrapper where it adds nothing: the same
    text for special tokens kept or skipped; a class with its own ``_decode`` keeps it."""
    backend = rust_decoder(tok)
    assert backend is not None and IncrementalDetokenizer(tok, [1])._backend is backend
    rng = random.Random(11)
    for skip in (True, False):
        for _ in range(20):
            ids = [rng.randrange(0, len(tok)) for _ in range(rng.randrange(1, 30))]
            want = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert backend.decode(ids, skip_special_tokens=skip) == want
            detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
            assert detok._decode(ids) == want

    class OwnDecode(type(tok)):  # type: ignore[misc]
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return "own"

    tok.__class__, cls = OwnDecode, tok.__class__
    try:
        assert rust_decoder(tok) is None
        assert IncrementalDetokenizer(tok, [])._decode([5, 6]) == "own"
    finally:
        tok.__class__ = cls


def test_stop_string_excluded_and_held_back(tok: Any) -> None:
    deltas, detok, stop = stream(tok, "hello world, stop here please", stop=("stop",))
    assert stop == "stop"
    assert detok.text == "hello world, " == "".join(deltas)
    # "s", "st", "sto" are held back until the stop string is complete.
    assert all("s" not in d for d in deltas)


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_include_stop_keeps_the_stop_string_and_holds_nothing_back(
    tok: Any, min_tokens: int
) -> None:
    """vLLM's ``include_stop_str_in_output``: the text ends with the stop string, and a stop
    string whose start was already emitted (nothing is held back) is still found."""
    ids = tok.encode("hello world, stop here please", add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tok, [1], stop=("stop",), min_tokens=min_tokens, include_stop=True
    )
    deltas: list[str] = []
    for t in ids:
        update = detok.update([t])
        deltas.append(update.new_text)
        if update.stop_string is not None:
            break
    assert update.stop_string == "stop"
    assert detok.text == "hello world, stop" == "".join(deltas)
    # "s" went out before "top" came: without the hold-back the start is in emitted text.
    assert any(d.endswith("s") or d.endswith("st") or d.endswith("sto") for d in deltas[:-1])


def test_false_start_of_stop_string_is_released(tok: Any) -> None:
    deltas, detok, stop = stream(tok, "a sto b stop c", stop=("stop",))
    assert stop == "stop"
    assert detok.text == "a sto b "
    deltas, detok, stop = stream(tok, "ends with st", stop=("stop",))
    assert stop is None
    assert "".join(deltas) == detok.text == "ends with st"
    assert deltas[-1].endswith("st")  # only the flush released the tail


def test_earliest_of_several_stop_strings_wins(tok: Any) -> None:
    _, detok, stop = stream(tok, "one two three four", stop=("four", "two", "hree"))
    assert stop == "two"
    assert detok.text == "one "


def _run_min_tokens(tok: Any, min_tokens: int) -> tuple[str | None, str]:
    ids = tok.encode("x stop y stop z", add_special_tokens=False)
    assert len(ids) == 11  # x, " st", o, p, " ", y, " st", o, p, " ", z
    detok = IncrementalDetokenizer(tok, [1], stop=("stop",), min_tokens=min_tokens)
    for t in ids:
        stop = detok.update([t]).stop_string
        if stop:
            return stop, detok.text
    detok.flush()
    return None, detok.text


def test_min_tokens_defers_stop_strings(tok: Any) -> None:
    # Stop strings count only once min_tokens outputs exist, and only in text not yet emitted.
    assert _run_min_tokens(tok, 0) == ("stop", "x ")
    assert _run_min_tokens(tok, 5) == ("stop", "x stop y ")
    assert _run_min_tokens(tok, 9) == (None, "x stop y stop z")


def test_stop_token_is_not_detokenized(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, [1])
    ids = tok.encode("abc", add_special_tokens=False)
    detok.update(ids)
    last = tok.encode("def", add_special_tokens=False)
    assert detok.update(last, decode=False).new_text == ""
    assert detok.flush() == ""
    assert detok.text == "abc"


def test_a_chat_template_given_replaces_the_tokenizers(tok: Any) -> None:
    from engine.chat_tokens import ChatTokenCache
    from engine.tokenizer import render_chat

    conv = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    assert render_chat(tok, conv, template) == "USER: hi\n"
    assert render_chat(tok, conv) != render_chat(tok, conv, template)  # the tokenizer's own
    ids = encode_chat(tok, conv, chat_template=template)
    assert ids == tok.encode("USER: hi\n", add_special_tokens=False)
    assert ChatTokenCache(tok, chat_template=template).encode(conv).token_ids == ids
    with pytest.raises(ValueError, match="TemplateError: no system"):
        render_chat(tok, conv, "{{ raise_exception('no system') }}")


def test_tokenizer_directory_problems_are_named(tmp_path: Path) -> None:
    from engine.tokenizer import tokenizer_dir_problem

    assert tokenizer_dir_problem(str(tmp_path / "absent")) == "no such directory"
    (tmp_path / "f").write_text("")
    assert tokenizer_dir_problem(str(tmp_path / "f")) == "not a directory"
    assert tokenizer_dir_problem(str(tmp_path)).startswith("no tokenizer files there")
    save_demo_tokenizer(str(tmp_path))
    assert tokenizer_dir_problem(str(tmp_path)) is None
    with pytest.raises(
        ValueError, match="cannot load a tokenizer from .*absent.*no such directory"
    ):
        load_tokenizer(str(tmp_path / "absent"))


def test_textless_tokens_are_the_ones_a_stream_emits_nothing_for(tok: Any, monkeypatch) -> None:
    """A token is textless when the detokenizer, fed it alone after a prompt, emits nothing:
    checked against the streaming detokenizer for every token of the demo vocabulary, in
    batches smaller than the vocabulary. ASCII letters show text; the special tokens and the
    lone bytes of a multi-byte character do not."""
    monkeypatch.setattr("engine.tokenizer.TEXTLESS_BATCH", 100)
    textless = textless_token_ids(tok, 10**6)
    prompt = tok.encode("Q:", add_special_tokens=False)
    emits_nothing = {
        t for t in range(len(tok)) if IncrementalDetokenizer(tok, prompt).update([t]).new_text == ""
    }
    assert textless == emits_nothing
    assert not textless & set(tok.encode("abc xyz", add_special_tokens=False))
    assert tok.eos_token_id in textless
    first_byte = tok.encode("\u00e9", add_special_tokens=False)  # é: two bytes
    assert len(first_byte) == 2 and first_byte[0] in textless
    assert textless_token_ids(tok, 10) == {t for t in textless if t < 10}


def test_textless_tokens_from_tokenizer_json_alone_equal_the_tokenizers(
    tok: Any, tmp_path: Path, monkeypatch
) -> None:
    """The engine core finds them from ``tokenizer.json`` through the Rust library, without
    transformers: the same set as through the loaded tokenizer (in batches, and cut at the
    model's vocabulary); None where there is no such file or it is not a tokenizer."""
    save_demo_tokenizer(str(tmp_path))
    monkeypatch.setattr("engine.tokenizer.TEXTLESS_BATCH", 100)
    assert textless_token_ids_from_file(str(tmp_path), 10**6) == textless_token_ids(tok, 10**6)
    assert textless_token_ids_from_file(str(tmp_path), 10) == textless_token_ids(tok, 10)
    assert textless_token_ids_from_file(str(tmp_path / "absent"), 10) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert textless_token_ids_from_file(str(tmp_path), 10) is None


def test_a_tokenizer_that_cannot_decode_alone_gives_no_textless_tokens() -> None:
    """Finding them is an optimisation: a tokenizer that fails gives none (steps as before)."""

    class Broken:
        def __len__(self) -> int:
            return 10

        def batch_decode(self, *args: object, **kwargs: object) -> list[str]:
            raise RuntimeError("no")

    assert textless_token_ids(Broken(), 10) == frozenset()


def _tokenizer_dir(path: Path, model_type: str = "llama", **tok_config: Any) -> str:
    """The demo tokenizer beside a model config of ``model_type`` (tokenizer_config.json
    entries overridden by ``tok_config``)."""
    save_demo_tokenizer(str(path))
    (path / "config.json").write_text(json.dumps({**DEMO_ARCH, "model_type": model_type}))
    if tok_config:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**cfg, **tok_config}))
    return str(path)


@pytest.mark.parametrize("declared", ["TokenizersBackend", "PreTrainedTokenizerFast"])
def test_a_tokenizers_backend_directory_loads_as_autotokenizer_would(
    tmp_path: Path, declared: str
) -> None:
    """A Llama directory whose tokenizer_config names the plain tokenizer.json class is loaded
    through that class directly (no AutoConfig, whose import pulls in torch): the same class,
    vocabulary, special tokens, encodings, chat template and decoding as AutoTokenizer's."""
    from transformers import AutoTokenizer

    d = _tokenizer_dir(tmp_path, tokenizer_class=declared)
    assert _backend_class(d) is not None
    direct = load_tokenizer(d)
    auto = AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert type(direct) is type(auto)
    assert direct.get_vocab() == auto.get_vocab()
    assert direct.all_special_ids == auto.all_special_ids
    assert (direct.bos_token_id, direct.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    rng = random.Random(3)
    texts = ["hello world", "  two  spaces\nand a line", "naïve café 日本語 🙂", "</s><s> raw"]
    for text in texts:
        for special in (True, False):
            assert direct.encode(text, add_special_tokens=special) == auto.encode(
                text, add_special_tokens=special
            )
    chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": texts[2]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    assert encode_chat(direct, chat) == encode_chat(auto, chat)
    ids = [rng.randrange(len(auto)) for _ in range(200)]
    for skip in (True, False):
        assert direct.decode(ids, skip_special_tokens=skip) == auto.decode(
            ids, skip_special_tokens=skip
        )


def test_other_tokenizer_directories_take_autotokenizers_path(tmp_path: Path) -> None:
    """Only the case above is loaded directly: another model type (qwen2 gets its own class
    from AutoTokenizer whatever the directory says), another declared class, remote code, or
    no model config all go through AutoTokenizer."""
    assert _backend_class(_tokenizer_dir(tmp_path / "q", model_type="qwen2")) is None
    assert _backend_class(_tokenizer_dir(tmp_path / "g", tokenizer_class="GPT2Tokenizer")) is None
    remote = _tokenizer_dir(tmp_path / "r", auto_map={"AutoTokenizer": ["x.T", None]})
    assert _backend_class(remote) is None
    save_demo_tokenizer(str(tmp_path / "n"))
    assert _backend_class(str(tmp_path / "n")) is None
    assert type(load_tokenizer(str(tmp_path / "q"))).__name__  # AutoTokenizer's pick, loaded
