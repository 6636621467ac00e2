"""``kvtier serve``'s checks before the engine starts, and how a failed start is reported.

``preflight`` looks at ``--device`` (CUDA present when named) and every file the flags name,
in a second and before any weight is read or a GGUF converted: the model directory or Hugging
Face model id (resolved in the local cache, or downloaded unless ``HF_HUB_OFFLINE``; exists,
has ``config.json`` with a supported architecture and a usable dtype, has weights) or GGUF
file, ``--tokenizer``, ``--chat-template`` (read and compiled), ``--kv-offload-config``
(parsed, and the machine checked for it: host memory, LMDB directory). Each problem is a
``UsageError``: one line naming the flag or the file, exit code 2. ``one_line`` flattens any
other start-up failure (the engine core's message) for the single error line, exit code 1;
tracebacks are logged at debug level only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig

USAGE_EXIT = 2
FAILURE_EXIT = 1


class UsageError(ValueError):
    """A flag or a file it names that cannot work; the message is one line naming it."""


@dataclass(frozen=True, slots=True)
class Checked:
    """What the checks read that the server uses: the chat template's text and what
    ``/health?verbose=1`` says of the model."""

    chat_template: str | None = None
    model_info: dict[str, Any] = field(default_factory=dict)


def one_line(message: object) -> str:
    """``message`` on one line (a multi-line error's lines joined with ' | ')."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    return " | ".join(lines)


def _check_model(model: str | None, dtype: str) -> dict[str, Any]:
    if model is None:
        return {"path": "kvtier-demo (embedded, random weights)"}
    from engine.models.gguf import is_gguf_path
    from engine.models.sources import is_model_id, resolve_hub_model

    if is_gguf_path(model):
        if not os.path.isfile(model):
            raise UsageError(f"model {model}: no such GGUF file")
        return {"path": model, "format": "gguf"}
    model_dir = model
    if is_model_id(model):
        try:
            model_dir = resolve_hub_model(model)  # the cache's snapshot, or a download
        except FileNotFoundError as exc:
            raise UsageError(one_line(exc)) from None
    elif not os.path.exists(model):
        raise UsageError(
            f"model {model}: no such directory (an HF model directory with "
            "config.json and *.safetensors, a .gguf file, or a Hugging Face "
            "model id ORG/NAME)"
        )
    elif not os.path.isdir(model):
        raise UsageError(
            f"model {model}: not a directory (an HF model directory, a .gguf "
            "file or a Hugging Face model id)"
        )
    from engine.models import ModelArchConfig, check_architecture
    from engine.models.hf_files import dtype_name, read_hf_config, safetensors_files

    try:
        hf_config = read_hf_config(model_dir)
        # The architecture first: another family's config may lack fields ours read.
        check_architecture((hf_config.get("architectures") or ["(none in config.json)"])[0])
        arch = ModelArchConfig.from_hf(hf_config)
        safetensors_files(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"model {model}: {one_line(exc)}") from None
    try:
        dtype_used = dtype_name(dtype, hf_config)
    except ValueError as exc:
        raise UsageError(f"--dtype {dtype}: {exc}") from None
    info = {
        "path": model,
        "architecture": arch.architecture,
        "dtype": dtype_used,
        "layers": arch.num_layers,
    }
    if model_dir != model:
        info["snapshot"] = model_dir
    return info


def _check_offload(source: str | dict | None, connector: str) -> None:
    if source is None:
        return
    from engine.kv_connector import check_kv_connector_config

    try:
        check_kv_connector_config(connector, source)
    except ValueError as exc:  # ConfigError: "[FILE: ]tiers[0] (host): field ..."
        message = one_line(exc)
        # Parse errors name the file already; the machine checks (host memory, LMDB path)
        # name only the tier and the field.
        if isinstance(source, (str, os.PathLike)) and not message.startswith(f"{source}:"):
            message = f"{source}: {message}"
        raise UsageError(f"--kv-offload-config {message}") from None


def _check_device(device: str) -> None:
    """The engine core's own device check (``resolve_device``), run first: otherwise a GGUF
    is converted to a bfloat16 directory in the cache (18 s, 260 MB for SmolLM2-135M) before
    the core finds ``--device cuda`` on a host without CUDA. ``auto`` and ``cpu`` cannot fail
    it, so they are not checked here: the check imports torch, ~2 s of the API process's
    start, which otherwise never needs it."""
    if device in ("auto", "cpu"):
        return
    from engine.runner.model_setup import resolve_device

    try:
        resolve_device(device)
    except (RuntimeError, ValueError) as exc:  # torch.device's RuntimeError on a bad string
        raise UsageError(f"--device {device}: {one_line(exc)}") from None


def preflight(config: EngineConfig, chat_template: str | None = None) -> Checked:
    """Checks the device and the files ``config`` and ``chat_template`` (the
    ``--chat-template`` value) name. Raises UsageError. Reads files only (and may create the
    LMDB directory a tier config names, as the tier would)."""
    _check_device(config.device)
    template = None
    if chat_template is not None:
        from engine.tokenizer import load_chat_template

        try:
            template = load_chat_template(chat_template)
        except ValueError as exc:
            raise UsageError(f"--chat-template: {exc}") from None
    _check_offload(config.kv_offload_config, config.kv_connector)
    info = _check_model(config.model, config.dtype)
    if config.tokenizer is not None:
        from engine.tokenizer import tokenizer_dir_problem

        problem = tokenizer_dir_problem(config.tokenizer)
        if problem is not None:
            raise UsageError(f"--tokenizer {config.tokenizer}: {problem}")
        info["tokenizer"] = config.tokenizer
    return Checked(template, info)
