"""Write a HF model directory with random weights in a real shape (GPU hosts: the offline
benchmarks and soaks need a model a user could point ``kvtier serve`` at).

Usage: python -m bench.random_model OUT_DIR [--shape llama-3-8b] [--device cuda] [--max-positions N]

The weights are normal(0, 0.02) (norms 1) in bf16, drawn on ``--device`` and saved as
safetensors shards of at most 4 GiB; the tokenizer is the demo tokenizer (vocab 512, a chat
template), so prompts are words of that vocabulary. Prints the directory and its size.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.offload.parts import LLAMA3_8B, TINY

SHAPES = {"llama-3-8b": {**LLAMA3_8B, "vocab_size": 512}, "tiny": TINY}
SHARD_BYTES = 4 << 30


def hf_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """``(name, shape, is_norm)`` of every HF Llama tensor of ``cfg``."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (v, h), False)]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h), False),
            (p + "self_attn.k_proj.weight", (kv, h), False),
            (p + "self_attn.v_proj.weight", (kv, h), False),
            (p + "self_attn.o_proj.weight", (h, q), False),
            (p + "mlp.gate_proj.weight", (i, h), False),
            (p + "mlp.up_proj.weight", (i, h), False),
            (p + "mlp.down_proj.weight", (h, i), False),
            (p + "input_layernorm.weight", (h,), True),
            (p + "post_attention_layernorm.weight", (h,), True),
        ]
    out += [("model.norm.weight", (h,), True), ("lm_head.weight", (v, h), False)]
    return out


def write_model(
    out: str,
    shape: str = "llama-3-8b",
    device: str = "cuda",
    max_positions: int | None = None,
    seed: int = 0,
) -> str:
    """Writes (or reuses, if complete) ``out``; returns it."""
    from safetensors.torch import save_file

    from engine.models.demo_model import save_demo_tokenizer

    cfg = dict(SHAPES[shape])
    if max_positions:
        cfg["max_position_embeddings"] = max_positions
    done = os.path.join(out, ".complete")
    if os.path.exists(done):
        return out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, f)
    save_demo_tokenizer(out)
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}
    names = hf_tensors(cfg)

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, index = {}, 0, index + 1

    for name, dims, is_norm in names:
        if is_norm:
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = (
                (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02)
                .to(torch.bfloat16)
                .cpu()
            )
        nbytes = t.numel() * 2
        if size + nbytes > SHARD_BYTES:
            flush()
        shard[name] = t
        size += nbytes
    flush()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    open(done, "w").close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-positions", type=int, default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    out = write_model(args.out, args.shape, args.device, args.max_positions)
    total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(
        json.dumps(
            {"model_dir": out, "bytes": total, "seconds": round(time.perf_counter() - start, 1)}
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
