"""The API side of structured output: whether xgrammar is there, and whether a request's
constraint (``response_format`` json_object / json_schema) makes a grammar. Torch-free, so the
API process checks requests without importing torch (``engine.runner.structured_output``, the
model runner's grammar matchers, does).
"""

from __future__ import annotations

INSTALL_HINT = "pip install 'kvtier[structured]' (xgrammar)"


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def check_grammar(params_schema: str | None, json_object: bool) -> None:
    """Raises ImportError (xgrammar missing) or ValueError (a schema xgrammar cannot turn
    into a grammar, in one line) for a request's constraint. No tokenizer needed: the API
    process calls it before the request reaches the engine, so a bad schema never reaches
    the model runner."""
    if params_schema is None and not json_object:
        return
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise ImportError(f"structured output needs xgrammar: {INSTALL_HINT}") from exc
    if params_schema is not None:
        try:
            xgr.Grammar.from_json_schema(params_schema, any_whitespace=False)
        except (RuntimeError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"invalid JSON schema: {first}") from exc
