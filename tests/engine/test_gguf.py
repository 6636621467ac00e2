"""The GGUF resolver's cache logic (engine/models/gguf.py, engine/models/sources.py) without a real
conversion: tests/engine/test_real_model.py converts the real SmolLM2 GGUF."""

from __future__ import annotations

import json
import os

import pytest

from engine.models import gguf
from engine.models.loader import model_fingerprint
from engine.models.sources import resolve_model_dir


def _fake_gguf(path, payload: bytes = b"not really a model") -> str:
    path.write_bytes(gguf.GGUF_MAGIC + payload)
    return str(path)


def _final_dir(cache, digest: str):
    return cache / gguf.GGUF_SUBDIR / f"{digest[:32]}-v{gguf.CONVERTER_VERSION}"


def test_a_complete_conversion_is_reused_by_content_not_by_name(tmp_path):
    src = _fake_gguf(tmp_path / "a.gguf")
    digest = gguf.file_sha256(src)
    final = _final_dir(tmp_path / "cache", digest)
    final.mkdir(parents=True)
    (final / gguf.MARKER_FILE).write_text(json.dumps({"gguf_sha256": digest}))
    assert resolve_model_dir(src, str(tmp_path / "cache")) == str(final)
    copy = _fake_gguf(tmp_path / "renamed.GGUF")  # same bytes, other name: same directory
    assert gguf.ensure_converted(copy, str(tmp_path / "cache")) == str(final)
    other = _fake_gguf(tmp_path / "b.gguf", b"other bytes")  # other bytes: converts (and fails)
    with pytest.raises(ValueError, match="transformers cannot read GGUF"):
        gguf.ensure_converted(other, str(tmp_path / "cache"))


def test_a_half_written_conversion_is_redone(tmp_path):
    src = _fake_gguf(tmp_path / "m.gguf")
    final = _final_dir(tmp_path / "cache", gguf.file_sha256(src))
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # no marker: a conversion that died midway
    with pytest.raises(ValueError, match="transformers cannot read GGUF"):
        gguf.ensure_converted(src, str(tmp_path / "cache"))
    assert not final.exists()  # removed before the retry; no temp directory left either
    assert [p for p in final.parent.iterdir() if p.is_dir() and p.name != "index"] == []


def test_the_sha256_memo_follows_the_file(tmp_path):
    src = tmp_path / "m.gguf"
    _fake_gguf(src)
    root = tmp_path / "root"
    first = gguf._cached_sha256(str(src), root)
    assert first == gguf.file_sha256(str(src))
    assert gguf._cached_sha256(str(src), root) == first  # from the memo
    _fake_gguf(src, b"changed, and longer than before")
    assert gguf._cached_sha256(str(src), root) == gguf.file_sha256(str(src)) != first


def test_bad_paths_get_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        resolve_model_dir(str(tmp_path / "missing.gguf"), str(tmp_path))
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model_dir(str(tmp_path / "x.gguf"), str(tmp_path))
    assert resolve_model_dir(str(tmp_path), str(tmp_path)) == str(tmp_path)  # a dir: as is


def test_the_fingerprint_covers_the_gguf_sha256_in_the_safetensors_header(tmp_path):
    import torch
    from safetensors.torch import save_file

    from engine.models.demo_model import DEMO_ARCH

    fps = []
    for digest in ("a" * 64, "b" * 64):
        d = tmp_path / digest[0]
        os.makedirs(d)
        (d / "config.json").write_text(json.dumps(DEMO_ARCH))
        save_file(
            {"w": torch.zeros(2)},
            str(d / "model.safetensors"),
            metadata={"format": "pt", "kvtier_gguf_sha256": digest},
        )
        fps.append(model_fingerprint(str(d), "float32"))
    assert fps[0] != fps[1]
