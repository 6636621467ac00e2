"""``tiers.yaml_file``: a YAML file's errors on one line, naming the file and the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiers.yaml_file import read_yaml


def test_errors_name_the_file_and_the_line_on_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("a: 1\nb: [1, 2\n")
    with pytest.raises(ValueError) as info:
        read_yaml(path)
    message = str(info.value)
    assert message.startswith(f"{path}: line 3, column 1: ") and "\n" not in message
    assert "<unicode string>" not in message
    path.write_text("a: 1\n  b: 2\n")
    with pytest.raises(ValueError, match=rf"^{path}: line 2, column 4: mapping values are not "):
        read_yaml(path)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'absent.yaml'}: cannot read it \(No such"):
        read_yaml(tmp_path / "absent.yaml")
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match=rf"^{path}: "):
        read_yaml(path)


def test_a_good_file_parses(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("tiers:\n  - {kind: host, capacity: 4GiB}\n")
    assert read_yaml(path) == {"tiers": [{"kind": "host", "capacity": "4GiB"}]}
    path.write_text("")
    assert read_yaml(path) is None
