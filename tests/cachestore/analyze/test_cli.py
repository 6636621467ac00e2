"""`kvtier analyze` end to end: formats, capacities, JSON/Markdown/PNG outputs, exact numbers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from cachestore.analyze.cli import parse_capacity, parse_tier
from cachestore.analyze.traces import detect_format, read_trace
from cachestore.hashing import Namespace, hash_request_tokens
from engine.cli import main as kvtier

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
SYNTHETIC = TRACES / "synthetic_trace.jsonl.gz"


def _lines(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_parse_capacity_units() -> None:
    assert parse_capacity("inf", 512, None) is None
    assert parse_capacity("1000blocks", 512, None) == 1000
    assert parse_capacity("1000 blocks", 512, None) == 1000
    assert parse_capacity("3Mtok", 512, None) == 3_000_000 // 512
    assert parse_capacity("1Mitok", 16, None) == 65536
    # 64 GiB of Llama-3-8B KV in 512-token blocks of 64 MiB each: 1024 blocks.
    assert parse_capacity("64GiB", 512, 131072) == 1024
    assert parse_capacity("64Gi", 512, 131072) == 1024
    assert parse_capacity("1GB", 16, 131072) == 10**9 // (2 << 20)
    assert parse_capacity("64G", 512, 131072) == 64 * 10**9 // (64 << 20) == 953  # decimal G
    with pytest.raises(ValueError, match="--kv-bytes-per-token"):
        parse_capacity("64GiB", 512, None)
    with pytest.raises(ValueError, match="cannot parse size 'lots'"):
        parse_capacity("lots", 512, None)
    with pytest.raises(ValueError, match=r"^capacity: '1000' has no unit; write bytes as 4GiB"):
        parse_capacity("1000", 512, None)  # bare numbers were blocks here, bytes in YAML
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        parse_capacity("2.5blocks", 512, None)
    spec, size = parse_tier("ssd=10blocks:lfu", "lru", 16, None)
    assert (spec.name, spec.capacity_blocks, spec.policy) == ("ssd", 10, "lfu")
    assert (size.unit, size.text) == ("blocks", "10blocks")
    with pytest.raises(ValueError, match="unknown policy"):
        parse_tier("ssd=10blocks:fifo", "lru", 16, None)


def test_request_log_and_access_log_formats(tmp_path: Path) -> None:
    h = [f"{i:064x}" for i in range(5)]
    log = _lines(
        tmp_path / "req.jsonl",
        [
            {
                "ts": 2.0,
                "req_id": "b",
                "prompt_tokens": 40,
                "block_hashes": [h[0], h[1]],
                "hit_tiers": ["gpu"],
                "decision": "load_prefix",
                "ttft_s": 0.01,
            },
            {
                "ts": 1.0,
                "req_id": "a",
                "prompt_tokens": 35,
                "block_hashes": [h[0], h[2]],
                "hit_tiers": [],
                "decision": "recompute",
                "ttft_s": 0.02,
            },
            {
                "ts": 2.0,
                "req_id": "c",
                "prompt_tokens": 16,
                "block_hashes": [h[0], h[0]],
                "hit_tiers": [],
                "decision": "recompute",
                "ttft_s": 0.02,
            },
        ],
    )
    assert detect_format(log) == "request-log"
    t = read_trace(log)
    assert (t.format, t.block_tokens, t.num_unique_blocks) == ("request-log", 16, 3)
    # Stable timestamp order (a, b, c) and the repeated block of c kept once.
    assert t.input_tokens.tolist() == [35, 40, 16]
    assert np.diff(t.offsets).tolist() == [2, 2, 1]
    assert t.block_ids[t.offsets[0]] == t.block_ids[t.offsets[1]] == t.block_ids[t.offsets[2]]
    acc = _lines(
        tmp_path / "acc.jsonl",
        [
            {"ts": 1.0, "op": "put", "namespace": "n1", "keys": ["k1", "k2"]},
            {"ts": 2.0, "op": "get", "namespace": "n1", "keys": ["k1", "k2"]},
            {"ts": 3.0, "op": "lookup", "namespace": "n2", "keys": ["k1"]},
        ],
    )
    assert detect_format(acc) == "access-log"
    t = read_trace(acc)
    # put lines are skipped; the same key in two namespaces is two blocks.
    assert (t.num_requests, t.num_unique_blocks, t.block_tokens) == (2, 3, 16)


def test_prompts_are_tokenized_and_hashed(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]"] + [f"w{i}" for i in range(64)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        tmp_path / "tk"
    )
    shared = " ".join(f"w{i}" for i in range(32))
    prompts = _lines(
        tmp_path / "p.jsonl", [{"prompt": shared + " w40 w41"}, {"prompt": shared + " w50"}]
    )
    assert detect_format(prompts) == "prompts"
    t = read_trace(prompts, tokenizer_dir=str(tmp_path / "tk"))
    # 34 and 33 tokens -> two full 16-token blocks each, both shared.
    assert t.input_tokens.tolist() == [34, 33]
    assert t.block_ids.tolist() == [0, 1, 0, 1]
    text = _lines(tmp_path / "p.txt", [shared, "w1 w2"])
    assert detect_format(text) == "prompts"
    t2 = read_trace(text, tokenizer_dir=str(tmp_path / "tk"), block_tokens=8)
    assert t2.input_tokens.tolist() == [32, 2] and t2.num_block_refs == 4
    ns = Namespace(model_fingerprint="analyze:tk", block_size=16)
    assert len(hash_request_tokens(ns, list(range(1, 33)))) == 2
    with pytest.raises(ValueError, match="--tokenizer"):
        read_trace(prompts)


def test_cli_outputs_on_the_synthetic_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if not SYNTHETIC.exists():
        pytest.skip(f"{SYNTHETIC} absent")
    out_json, png, md = tmp_path / "a.json", tmp_path / "a.png", tmp_path / "a.md"
    rc = kvtier(
        [
            "analyze",
            str(SYNTHETIC),
            "--tier",
            "host=2000blocks",
            "--tier",
            "lmdb=6Mtok",
            "--model-profile",
            "llama-3-8b",
            "--sweep",
            "host=0blocks,1000blocks,inf",
            "--json",
            str(out_json),
            "--plot",
            str(png),
            "--report",
            str(md),
            "--quiet",
        ]
    )
    assert rc == 0
    doc = json.loads(out_json.read_text())
    trace = read_trace(SYNTHETIC)
    assert (doc["requests"], doc["block_refs"], doc["unique_blocks"]) == (3993, 121877, 43924)
    assert [t["capacity_blocks"] for t in doc["tiers"]] == [2000, 6_000_000 // 512]
    total = 2000 + 6_000_000 // 512
    from tests.cachestore.analyze.test_simulate import reference_lru

    ref_blocks, ref_tokens = reference_lru(trace, total)
    assert doc["hit_blocks"] == ref_blocks == sum(t["hit_blocks"] for t in doc["tiers"])
    assert doc["hit_tokens"] == ref_tokens
    assert doc["block_hit_ratio"] == ref_blocks / 121877
    assert doc["token_hit_ratio"] == ref_tokens / int(trace.input_tokens.sum())
    assert doc["tiers"][0]["read_bytes"] == doc["tiers"][0]["hit_blocks"] * 512 * 131072
    rd = doc["reuse_distance"]
    assert rd["reuse_refs"] + rd["cold_refs"] == 121877 and rd["p50"] <= rd["p90"] <= rd["p99"]
    assert (
        0 < doc["restore_seconds"] and 0 < doc["net_saved_seconds"] <= doc["saved_prefill_seconds"]
    )
    sw = doc["sweep"]
    assert sw["method"] == "mattson" and sw["capacities_blocks"] == [0, 1000, None]
    assert sw["block_hit_ratio"][2] == doc["infinite_capacity"]["block_hit_ratio"]
    assert sw["block_hit_ratio"][0] == reference_lru(trace, 6_000_000 // 512)[0] / 121877
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    report = md.read_text()
    assert "| block_hit_ratio |" in report and "a.png" in report and "## Sweep" in report
    table = capsys.readouterr().out
    assert "host" in table and "lmdb" in table and "reuse distance" in table


def test_cli_replay_matches_mattson_and_reports_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    if not SYNTHETIC.exists():
        pytest.skip(f"{SYNTHETIC} absent")
    head = tmp_path / "head.jsonl"
    head.write_text(
        "".join(gzip.open(SYNTHETIC, "rt", encoding="utf-8").read().splitlines(keepends=True)[:400])
    )
    docs = []
    for extra in ([], ["--replay"]):
        assert (
            kvtier(
                [
                    "analyze",
                    str(head),
                    "--tier",
                    "host=300blocks",
                    "--tier",
                    "s3=900blocks",
                    "--json",
                    "-",
                    "--quiet",
                ]
                + extra
            )
            == 0
        )
        docs.append(json.loads(capsys.readouterr().out))
    assert (docs[0]["method"], docs[1]["method"]) == ("mattson", "replay")
    for key in ("hit_blocks", "hit_tokens", "tiers", "saved_prefill_seconds", "restore_seconds"):
        assert docs[0][key] == docs[1][key]
    # Byte capacities without a profile use llama-3-8b's KV size, as --help says.
    same = []
    for extra in ([], ["--model-profile", "llama-3-8b"]):
        assert (
            kvtier(["analyze", str(head), "--tier", "host=64GiB", "--quiet", "--json", "-", *extra])
            == 0
        )
        same.append(json.loads(capsys.readouterr().out))
    assert same[0] == same[1]
    assert kvtier(["analyze", str(head), "--tier", "tape=10blocks", "--quiet"]) == 2
    assert "no cost for tier 'tape'" in capsys.readouterr().err


def test_cli_prices_losslessly_compressed_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--kv-compression lossless``: blocks take the hi4 format's bytes (the codec's own
    payload size for the profile's geometry), so a byte capacity holds more blocks, reads move
    fewer bytes and restores cost less; it needs the layer count of a model profile."""
    if not SYNTHETIC.exists():
        pytest.skip(f"{SYNTHETIC} absent")
    from connectors.device.kv_compress import Hi4Codec

    head = tmp_path / "head.jsonl"
    head.write_text(
        "".join(gzip.open(SYNTHETIC, "rt", encoding="utf-8").read().splitlines(keepends=True)[:400])
    )
    docs = []
    for compression in ("none", "lossless"):
        assert (
            kvtier(
                [
                    "analyze",
                    str(head),
                    "--tier",
                    "host=20GiB",
                    "--tier",
                    "lmdb=inf",
                    "--model-profile",
                    "llama-3-8b",
                    "--kv-compression",
                    compression,
                    "--json",
                    "-",
                    "--quiet",
                ]
            )
            == 0
        )
        docs.append(json.loads(capsys.readouterr().out))
    raw, packed = docs
    stored = Hi4Codec(2 * 32, 16 * 8 * 128).payload_bytes // 16  # a 16-token block, per token
    assert (raw["kv_bytes_per_token"], packed["kv_bytes_per_token"]) == (131072, stored)
    assert packed["kv_compression"] == "lossless" and raw["kv_compression"] == "none"
    assert raw["tiers"][0]["capacity_blocks"] == 20 * 2**30 // (131072 * 512)
    assert packed["tiers"][0]["capacity_blocks"] == 20 * 2**30 // (stored * 512)
    assert packed["hit_blocks"] == raw["hit_blocks"]  # lmdb=inf: every reuse hits somewhere
    assert packed["tiers"][0]["hit_blocks"] >= raw["tiers"][0]["hit_blocks"]
    assert packed["restore_seconds"] < raw["restore_seconds"]
    assert (
        kvtier(
            [
                "analyze",
                str(head),
                "--kv-bytes-per-token",
                "1000",
                "--kv-compression",
                "lossless",
                "--quiet",
            ]
        )
        == 2
    )
    assert "needs --model-profile" in capsys.readouterr().err


def test_stored_bytes_per_token_matches_the_codec_and_refuses_bad_geometry() -> None:
    from cachestore.kv_format import stored_bytes_per_token
    from connectors.device.kv_compress import Hi4Codec

    for layers, heads in ((32, 8), (28, 4), (80, 8)):
        kv = layers * heads * 128 * 2 * 2
        codec = Hi4Codec(2 * layers, 16 * heads * 128)
        assert stored_bytes_per_token(kv, layers, "lossless") == -(-codec.payload_bytes // 16)
        assert stored_bytes_per_token(kv, layers, "none") == kv
    with pytest.raises(ValueError, match="does not split"):
        stored_bytes_per_token(1000, 3, "lossless")
    with pytest.raises(ValueError, match="unknown KV compression"):
        stored_bytes_per_token(1000, 3, "zstd")


def test_a_trace_that_cannot_be_read_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "nope.jsonl"
    assert kvtier(["analyze", str(missing), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvtier analyze: cannot read {missing}: No such file or directory\n"
