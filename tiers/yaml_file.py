"""Reading a YAML configuration file with errors that fit on one line and name the file.

PyYAML's own message spans several lines and, for a document parsed from a string, names it
``"<unicode string>"``; ``read_yaml`` parses the open file instead and reduces any error to
``PATH: line L, column C: PROBLEM`` (``yaml_error_line``). Used for ``--kv-offload-config``
and ``kvtier serve --config``. Torch-free.
"""

from __future__ import annotations

import os
from typing import Any


def yaml_error_line(path: str | os.PathLike[str], exc: Exception) -> str:
    """One line for a ``yaml.YAMLError`` (or an OSError) met reading ``path``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None)
    if isinstance(exc, OSError):
        return f"{path}: cannot read it ({exc.strerror or exc})"
    if mark is None:
        return f"{path}: invalid YAML ({' '.join(str(exc).split())})"
    context = getattr(exc, "context", None)
    detail = f"{problem} ({context})" if context and context != problem else str(problem)
    return f"{path}: line {mark.line + 1}, column {mark.column + 1}: {detail}"


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The parsed document of ``path`` (None for an empty file). Raises ValueError with
    ``yaml_error_line``'s message."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(yaml_error_line(path, exc)) from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
