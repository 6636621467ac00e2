"""Tokenizer loading, chat templates, incremental detokenization and stop strings.

``load_tokenizer`` reads a local directory only (no hub access, ever). ``load_chat_template``
reads a ``--chat-template`` value (a file or the template itself, as vLLM takes it) and checks
its Jinja syntax; ``render_chat`` applies it, or the tokenizer's own template. ``IncrementalDetokenizer``
turns a growing list of output token ids into text deltas for streaming: it never emits a
partial UTF-8 character, never re-emits text, and holds back any tail that could be the start
of a stop string until it is known not to be one. Not thread-safe (one per request).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Tokens of the prompt decoded along with the output, so that decoders which depend on the
# left context (SentencePiece's leading space, byte-level merges) produce the same text.
_PREFIX_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


NO_TOKENIZER_LIMIT = 1 << 62  # "no limit": the engine enforces max_model_len itself


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot hold a tokenizer (no such directory, no tokenizer files), or None.
    Cheap: looks at file names only."""
    if not os.path.exists(path):
        return "no such directory"
    if not os.path.isdir(path):
        return "not a directory"
    if not any(os.path.exists(os.path.join(path, n)) for n in TOKENIZER_FILES):
        # transformers would guess a slow tokenizer and ask for sentencepiece instead
        return f"no tokenizer files there (none of {', '.join(TOKENIZER_FILES)})"
    return None


# ``tokenizer_class`` values that transformers 5's AutoTokenizer resolves to ``TokenizersBackend``
# (the ``tokenizer.json`` tokenizer, no model-specific class), and the model types for which it
# does so whatever it finds in the model's config: no tokenizer class registered for the type
# that would take precedence, and not on its list of repositories shipping a wrong class (e.g.
# ``qwen2`` there gets ``Qwen2Tokenizer``). Llama-3's own directories and the demo tokenizer's
# are of this kind. Anything else goes through AutoTokenizer.
_BACKEND_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
_BACKEND_MODEL_TYPES = frozenset({"llama"})


def _backend_class(model_dir: str) -> Any | None:
    """``TokenizersBackend`` when AutoTokenizer would load that class for ``model_dir`` (see
    ``_BACKEND_CLASSES``), else None. AutoTokenizer first builds the model's config through
    AutoConfig, whose import pulls in torch and torch.distributed (~4 s of the API process's
    ~6.6 s start on the 2-core VM); the class itself imports in ~1.3 s without torch."""
    import json

    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            tok_config = json.load(f)
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            model_config = json.load(f)
    except (OSError, ValueError):
        return None
    if not (isinstance(tok_config, dict) and isinstance(model_config, dict)):
        return None
    if (
        tok_config.get("tokenizer_class") not in _BACKEND_CLASSES
        or "auto_map" in tok_config
        or model_config.get("model_type") not in _BACKEND_MODEL_TYPES
        or not os.path.exists(os.path.join(model_dir, "tokenizer.json"))
    ):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers 4: AutoTokenizer's own path
        return None
    return TokenizersBackend


def load_tokenizer(model_dir: str) -> Any:  # -> transformers.PreTrainedTokenizerBase
    """AutoTokenizer from a local directory, with no length limit of its own. Raises
    ValueError if it has no tokenizer files. Where AutoTokenizer would load
    ``TokenizersBackend`` (``_backend_class``), that class is loaded directly."""
    problem = tokenizer_dir_problem(model_dir)
    if problem is not None:
        raise ValueError(f"cannot load a tokenizer from {model_dir!r}: {problem}")
    try:
        backend = _backend_class(model_dir)
        if backend is not None:
            tokenizer = backend.from_pretrained(model_dir, local_files_only=True)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {model_dir!r}: {exc}") from exc
    # The engine bounds lengths by its own max_model_len (model config or --max-model-len);
    # the tokenizer's model_max_length (often a stale 2K/4K) would only log a warning per
    # long prompt and play no part.
    tokenizer.model_max_length = NO_TOKENIZER_LIMIT
    return tokenizer


# Length bound before a full tokenization (``encode_within``): a text longer than
# BOUND_CHARS_PER_TOKEN characters per allowed token is first counted in pieces of
# BOUND_PIECE_CHARS, each cut allowed BOUND_CUT_SLACK extra tokens (a word cut in two).
BOUND_CHARS_PER_TOKEN = 4
BOUND_PIECE_CHARS = 4096
BOUND_CUT_SLACK = 4


class TooManyTokens(ValueError):
    """A text that surely has more tokens than allowed; ``at_least`` is a lower bound."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"more than {limit} tokens (at least {at_least})")
        self.at_least = at_least


def check_token_bound(tokenizer: Any, text: str, max_tokens: int) -> None:
    """Raises TooManyTokens when ``text`` surely has more than ``max_tokens`` tokens, having
    tokenized only about ``max_tokens`` tokens' worth of it; returns at once for a text of at
    most ``BOUND_CHARS_PER_TOKEN * max_tokens`` characters (see ``encode_within``)."""
    if len(text) > max(BOUND_CHARS_PER_TOKEN * max_tokens, BOUND_PIECE_CHARS):
        count = 0
        for cuts, start in enumerate(range(0, len(text), BOUND_PIECE_CHARS), 1):
            piece = text[start : start + BOUND_PIECE_CHARS]
            count += len(tokenizer.encode(piece, add_special_tokens=False))
            if count > max_tokens + BOUND_CUT_SLACK * cuts:
                raise TooManyTokens(count - BOUND_CUT_SLACK * cuts, max_tokens)


def encode_within(
    tokenizer: Any, text: str, max_tokens: int, add_special_tokens: bool = True
) -> list[int]:
    """``tokenizer.encode(text)``, unless ``text`` surely has more than ``max_tokens`` tokens:
    then raises TooManyTokens having tokenized only about ``max_tokens`` tokens' worth of it
    (a 50 MB body took 38 s to tokenize whole before its length was refused). A text of at
    most ``BOUND_CHARS_PER_TOKEN * max_tokens`` characters is encoded directly (that cost is
    the one of a legitimate prompt); a longer one is counted piece by piece first, stopping
    as soon as the count passes the limit, and encoded whole only if it never does."""
    check_token_bound(tokenizer, text, max_tokens)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def encode_prompt(
    tokenizer: Any, prompt: str | Sequence[int], max_tokens: int | None = None
) -> list[int]:
    """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS); ids pass
    through as ints. With ``max_tokens``: raises TooManyTokens for a text that surely has
    more (``encode_within``)."""
    if isinstance(prompt, str):
        if max_tokens is not None:
            return encode_within(tokenizer, prompt, max_tokens)
        return list(tokenizer.encode(prompt))
    return [int(t) for t in prompt]


def load_chat_template(value: str) -> str:
    """The template of a ``--chat-template`` value: the file's text when ``value`` names a
    readable file, else ``value`` itself when it looks like a template (has ``{``, ``}`` or a
    newline; ``\\n`` escapes become newlines, as on vLLM's command line). Raises ValueError,
    one line: a path that cannot be read, or a Jinja syntax error with its line number."""
    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
        where = f"{value}: "
    except OSError as exc:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"cannot read chat template file {value!r}: {exc.strerror or exc}"
            ) from None
        template = value.replace("\\n", "\n")
        where = ""
    check_chat_template(template, where)
    return template


def check_chat_template(template: str, where: str = "") -> None:
    """Raises ValueError (``where`` + 'line N: message') if ``template`` is not valid Jinja,
    compiled as transformers compiles chat templates (sandboxed)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    try:
        env.parse(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{where}line {exc.lineno}: {exc.message}") from None


def render_chat(
    tokenizer: Any,
    conversation: Sequence[dict[str, str]],
    chat_template: str | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """``conversation`` rendered by ``chat_template`` (else the tokenizer's own), with the
    assistant generation prompt unless told otherwise (``continue_final_message``: the last
    message left open, for the model to continue). ``template_kwargs``: more variables for
    the template (vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``). Raises
    ValueError when there is no template, or when the template fails on these messages
    (``raise_exception``, a bad variable)."""
    from jinja2 import TemplateError

    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template (pass --chat-template)")
    try:
        return tokenizer.apply_chat_template(
            list(conversation),
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except TemplateError as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc


def encode_chat(
    tokenizer: Any,
    conversation: Sequence[dict[str, str]],
    max_tokens: int | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of ``conversation`` rendered by ``render_chat`` (``chat_template``: instead
    of the tokenizer's). The template writes BOS itself, so no special tokens are added
    again. Raises ValueError when there is no chat template; TooManyTokens as
    ``encode_prompt`` does. ``chat_tokens.ChatTokenCache`` gives the same ids without
    re-tokenizing a conversation's earlier rounds."""
    text = render_chat(tokenizer, conversation, chat_template)
    if max_tokens is not None:
        return encode_within(tokenizer, text, max_tokens, add_special_tokens=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def eos_token_ids(tokenizer: Any) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset({int(eos)})


# Vocabularies above this size are checked in batches of this many single-token decodes.
TEXTLESS_BATCH = 8192


def textless_token_ids(tokenizer: Any, vocab_size: int) -> frozenset[int]:
    """Ids below ``vocab_size`` that decode alone to no text: special tokens (skipped, as the
    detokenizer skips them) and pieces of a UTF-8 character (byte-level and byte-fallback
    vocabularies), which the detokenizer holds back until the character is whole. A request
    whose outputs are all such tokens has shown its user nothing yet: the scheduler keeps its
    next step short (``engine/sched/first_tokens.py``). Alone is an approximation: two such
    pieces may complete a character, and then the request is counted one step late."""
    try:
        return _textless_in_batches(
            min(vocab_size, len(tokenizer)),
            lambda ids: tokenizer.batch_decode(
                [[t] for t in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False
            ),
        )
    except Exception:  # a tokenizer that cannot: no step is kept short for text, as before
        log.warning("could not find the tokens that decode to no text", exc_info=True)
        return frozenset()


def _textless_in_batches(
    size: int, decode_each: Callable[[list[int]], Sequence[str]]
) -> frozenset[int]:
    """The ids below ``size`` whose text alone (``decode_each``: one text per id, in order) is
    empty or only part of a character, decoded ``TEXTLESS_BATCH`` ids at a time."""
    out: set[int] = set()
    for start in range(0, size, TEXTLESS_BATCH):
        ids = list(range(start, min(size, start + TEXTLESS_BATCH)))
        texts = decode_each(ids)
        out.update(t for t, text in zip(ids, texts, strict=True) if _textless(text))
    return frozenset(out)


def textless_token_ids_from_file(tokenizer_dir: str, vocab_size: int) -> frozenset[int] | None:
    """``textless_token_ids`` from the directory's ``tokenizer.json`` through the Rust
    ``tokenizers`` library alone, without transformers (whose AutoTokenizer imports cost the
    engine core ~3.5 CPU s at start); None where there is no such file or it cannot be read.
    The same single-token decodes as through a fast tokenizer (``skip_special_tokens``, no
    clean-up); a class that decodes otherwise (one that overrides ``_decode``) may differ
    here, which would only shift which first steps are kept short, never an output."""
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        return _textless_in_batches(
            min(vocab_size, tok.get_vocab_size(with_added_tokens=True)),
            lambda ids: tok.decode_batch([[t] for t in ids], skip_special_tokens=True),
        )
    except Exception:  # unreadable here: the caller goes through transformers instead
        log.debug("tokenizer.json at %s not read directly", tokenizer_dir, exc_info=True)
        return None


def _textless(text: str) -> bool:
    return not text or text.strip(_REPLACEMENT_CHAR) == ""


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """Text added by one ``update`` call; ``stop_string`` is set when a stop string ended it
    (the text then stops right before it)."""

    new_text: str
    stop_string: str | None = None


def rust_decoder(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` under a transformers fast tokenizer whose ``decode`` adds
    nothing to it once ``clean_up_tokenization_spaces=False`` (the class does not override
    ``_decode``), else None. The detokenizer decodes twice per token of every stream; through
    the wrapper each call cost ~33 us on the 2-core CPU (argument conversion, kwargs
    plumbing), on the API's output thread, against ~8 us for the Rust call itself."""
    try:
        from tokenizers import Tokenizer
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or not isinstance(tokenizer, TokenizersBackend):
        return None
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return backend


class IncrementalDetokenizer:
    """Per-request streaming detokenizer with stop-string handling.

    ``text`` is everything emitted so far. Stop strings are searched only in text not yet
    emitted and only once ``min_tokens`` outputs exist; the held-back tail is released by
    ``flush`` when the request ends for another reason. ``include_stop``: the text ends with
    the stop string that ended it, and nothing is held back (it would be emitted either way).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = rust_decoder(tokenizer)
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PREFIX_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_outputs = 0
        self._min_tokens = min_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._decoded = ""  # all complete output text, held-back tail included
        self.text = ""  # emitted so far

    @classmethod
    def for_params(
        cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        """The detokenizer of a request sampled with ``params`` (its stop strings,
        ``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output``)."""
        return cls(
            tokenizer,
            prompt_token_ids,
            params.stop,
            params.min_tokens,
            skip_special_tokens=params.skip_special_tokens,
            include_stop=params.include_stop_str_in_output,
        )

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            text: str = self._backend.decode(ids, skip_special_tokens=self._skip_special)
            return text
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _decode_new(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def update(self, new_token_ids: Sequence[int], *, decode: bool = True) -> DetokenizerUpdate:
        """Add output tokens and return the text that became final. ``decode=False`` appends
        ids without turning them into text (a stop token or EOS is not part of the text)."""
        self._num_outputs += len(new_token_ids)
        if not decode:
            return DetokenizerUpdate("")
        self._ids.extend(new_token_ids)
        self._decoded += self._decode_new()
        return self._emit()

    def _emit(self) -> DetokenizerUpdate:
        emitted = len(self.text)
        if self._stop and self._num_outputs >= self._min_tokens:
            found = [(self._decoded.find(s, self._search_from(emitted, s)), s) for s in self._stop]
            hits = [(i, s) for i, s in found if i >= 0]
            if hits:
                index, stop = min(hits)
                end = index + len(stop) if self._include_stop else index
                new_text = self._decoded[emitted:end]
                self.text += new_text
                return DetokenizerUpdate(new_text, stop)
            held = 0 if self._include_stop else self._held_back_len(emitted)
            end = len(self._decoded) - held
        else:
            end = len(self._decoded)
        new_text = self._decoded[emitted:end] if end > emitted else ""
        self.text += new_text
        return DetokenizerUpdate(new_text)

    def _search_from(self, emitted: int, stop: str) -> int:
        """Where to look for ``stop``: in text not yet emitted, or, when nothing is held back
        (``include_stop``), also in a tail of emitted text that a stop string may end after."""
        return max(0, emitted - len(stop) + 1) if self._include_stop else emitted

    def _held_back_len(self, emitted: int) -> int:
        """Length of the longest unemitted tail that is a proper prefix of a stop string."""
        tail = self._decoded[emitted:]
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(tail)), best, -1):
                if tail.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The request ended without a stop string: release held-back text and any trailing
        bytes that never completed a character. Returns the text newly emitted."""
        full_text = self._decode(self._ids[self._prefix_offset :])
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        if len(full_text) > len(prefix_text):
            self._decoded += full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset = len(self._ids)
        new_text = self._decoded[len(self.text) :]
        self.text += new_text
        return new_text
