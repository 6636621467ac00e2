"""The embedded demo model: a tiny Llama with deterministic random weights and a home-made
byte-level BPE tokenizer, written once to a cache directory. No downloads, ever.

``ensure_demo_model()`` is safe to call concurrently from several processes: each writer
builds into a private temporary directory and renames it into place; the loser of the race
discards its copy. Same seed, same bytes: two fresh directories hold identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from engine.cache_dir import default_cache_dir

DEMO_SUBDIR = "demo-model-v1"
DEMO_SEED = 1234
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
TOKENIZER_VOCAB_SIZE = 512
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The corpus the BPE merges are learned from; fixed so the tokenizer never changes.
_CORPUS = """
the of and to in is that it was for on are as with his they at be this from have or by
one had not but what all were when we there can an your which their said if do will each
about how up out them then she many some so these would other into has more her two like
him see time could no make than first been its who now people my made over did down only
way find use may water long little very after words called just where most know get
through back much before go good new write our used me man too any day same right look
think also around another came come work three word must because does part even place
well such here take why things help put years different away again off went old number
great tell men say small every found still between name should home big give air line set
own under read last never us left end along while might next sound below saw something
thought both few those always looked show large often together asked house world going
want school important until form food keep children feet land side without boy once
animals life enough took sometimes four head above kind began almost live page got earth
need far hand high year mother light parts country father let night following picture
being study second eyes soon times story boys since white days ever paper hard near
sentence better best across during today others however sure means knew its try told
young miles sun ways thing whole hear example heard several change answer room sea against
top turned learn point city play toward five using himself usually cache block memory
model token tokens server request requests engine prefix hash store tier host disk redis
bucket reload recompute attention layer layers kernel batch decode prefill latency
hello world question answer chat user assistant system data value key python code test
"""


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte <-> printable-unicode table that the ByteLevel pre-tokenizer uses."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def _learn_merges(words: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE over byte-level words; ties break on the pair itself, so it is deterministic."""
    table = _bytes_to_unicode()
    counts = Counter("".join(table[b] for b in w.encode("utf-8")) for w in words)
    seqs = {w: list(w) for w in counts}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, n in counts.items():
            s = seqs[w]
            for a, b in zip(s, s[1:], strict=False):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, s in seqs.items():
            out: list[str] = []
            i = 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_demo_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """Build the demo byte-level BPE tokenizer in memory (pure function, no I/O).

    Ids: the special tokens first (``<pad>``=0, ``<s>``=1, ``</s>``=2, chat markers), then the
    256 byte symbols, then learned merges up to ``TOKENIZER_VOCAB_SIZE``. Any text round-trips.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[table[b]] = len(vocab)
    # ByteLevel splits words with a leading space ("Ġword"), so learn merges on that form too.
    words = _CORPUS.split()
    merges = _learn_merges(words + [" " + w for w in words], TOKENIZER_VOCAB_SIZE - len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def save_demo_tokenizer(out_dir: str) -> int:
    """Write the demo tokenizer files into ``out_dir``; returns the tokenizer's vocab size."""
    tok = build_demo_tokenizer()
    tok.save_pretrained(out_dir)
    return len(tok)


DEMO_ARCH: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


def _demo_weights() -> dict:  # name -> torch.Tensor
    import torch

    cfg = DEMO_ARCH
    hidden, inter, vocab = (
        int(cfg["hidden_size"]),
        int(cfg["intermediate_size"]),
        int(cfg["vocab_size"]),
    )
    q_out = int(cfg["num_attention_heads"]) * int(cfg["head_dim"])
    kv_out = int(cfg["num_key_value_heads"]) * int(cfg["head_dim"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q_out, hidden),
                p + "self_attn.k_proj.weight": (kv_out, hidden),
                p + "self_attn.v_proj.weight": (kv_out, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_out),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    gen = torch.Generator(device="cpu").manual_seed(DEMO_SEED)
    weights = {}
    for name, shape in shapes.items():  # fixed insertion order -> fixed random stream
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * noise
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = 0.5 * noise
        else:
            weights[name] = noise / shape[-1] ** 0.5  # keeps activations near unit scale
    return weights


def write_demo_model(out_dir: str) -> None:
    """Write every demo-model file into an existing empty ``out_dir`` (deterministic bytes)."""
    from safetensors.torch import save_file

    save_file(
        _demo_weights(), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"}
    )
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(DEMO_ARCH, f, indent=2, sort_keys=True)
    gen_cfg = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen_cfg, f, indent=2, sort_keys=True)
    save_demo_tokenizer(out_dir)


def ensure_demo_model(cache_dir: str | None = None) -> str:
    """Return the demo model directory, writing it first if absent. Safe under concurrent
    first use: each caller builds in its own temp dir and renames atomically; a caller that
    loses the race drops its copy. Raises OSError if the cache directory is not writable."""
    root = Path(cache_dir or default_cache_dir())
    final = root / DEMO_SUBDIR
    if (final / "config.json").is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{DEMO_SUBDIR}-", dir=root)
    try:
        write_demo_model(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise  # not a lost race: a real failure
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
