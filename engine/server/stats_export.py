"""Generic Prometheus export of an engine ``stats()`` snapshot, so that keys the KV offload
connector (or anyone) adds appear in ``/metrics`` without a change here.

Rules, applied recursively (every sample also carries ``model_name``):

- a number (booleans as 0/1) -> ``kvtier_<path>``, the path's keys joined by ``_``; a counter
  when the name ends in ``_total``, else a gauge:
  ``{"kv_loaded_tokens_total": 96}`` -> ``kvtier_kv_loaded_tokens_total 96``
- a dict under a plural key (``...s``) or a ``..._by_<label>`` key is keyed by label values;
  the label is the singular (or ``<label>``):
  ``{"decisions": {"reload": 3}}`` -> ``kvtier_decisions{decision="reload"} 3``;
  ``{"hits_by_tier_total": {"host": 2}}`` -> ``kvtier_hits_total{tier="host"} 2``
- rows under a plural key, as a dict of dicts or a list of dicts with a ``"name"``, become
  labelled samples named after the singular:
  ``{"tiers": {"host": {"hit_blocks": 5}}}`` or ``{"tiers": [{"name": "host", "hit_blocks": 5}]}``
  -> ``kvtier_tier_hit_blocks{tier="host"} 5``
- any other dict is a namespace: ``{"kv": {"store": {"load_pins": 1}}}`` ->
  ``kvtier_kv_store_load_pins 1``

Strings and other values are skipped; a family whose name is in ``reserved`` (the server's own
metrics) is skipped; a second shape (other label names) of one family name is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_INVALID = re.compile(r"[^a-zA-Z0-9_]")
Labels = tuple[tuple[str, str], ...]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bool is an int: exported as 0/1


def _label_of(key: str) -> tuple[str, str] | None:
    """(label name, the key without its label part) for a key whose dict is keyed by label
    values, else None."""
    name, sep, label = key.partition("_by_")
    if sep and label:
        suffix = "_total" if label.endswith("_total") else ""
        return label.removesuffix("_total"), name + suffix
    if key.endswith("s") and not key.endswith("ss") and len(key) > 1:
        return key[:-1], key
    return None


class _Families:
    def __init__(self, model: str, reserved: Collection[str]) -> None:
        self._model = model
        self._reserved = reserved
        self._families: dict[str, tuple[Metric, tuple[str, ...]]] = {}

    def add(self, path: list[str], value: float, labels: Labels) -> None:
        name = "kvtier_" + "_".join(_INVALID.sub("_", p) for p in path if p)
        if name.removesuffix("_total") in self._reserved:
            return
        label_names = ("model_name", *(_INVALID.sub("_", n) for n, _ in labels))
        if len(set(label_names)) != len(label_names):
            return  # a label nested under itself: no valid sample
        entry = self._families.get(name)
        if entry is None:
            kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
            family = kind(name, "engine stats() value", labels=list(label_names))
            entry = self._families[name] = (family, label_names)
        if entry[1] != label_names:
            return
        entry[0].add_metric([self._model, *(v for _, v in labels)], float(value))

    def values(self) -> Iterable[Metric]:
        return (family for family, _ in self._families.values())


def _walk(path: list[str], value: Any, labels: Labels, out: _Families) -> None:
    if _is_number(value):
        out.add(path, value, labels)
        return
    label = _label_of(path[-1]) if path else None
    if label is not None and isinstance(value, Mapping | list):
        label_name, metric_key = label
        if isinstance(value, Mapping):
            rows = [(str(k), v) for k, v in value.items()]
        else:
            rows = [(str(r["name"]), r) for r in value if isinstance(r, Mapping) and "name" in r]
        for label_value, row in rows:
            row_labels = (*labels, (label_name, label_value))
            if _is_number(row):
                out.add([*path[:-1], metric_key], row, row_labels)
            elif isinstance(row, Mapping):
                for leaf, v in row.items():
                    if leaf != "name":
                        _walk([*path[:-1], label_name, str(leaf)], v, row_labels, out)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _walk([*path, str(k)], v, labels, out)


def stats_families(
    stats: Mapping[str, Any], model: str, *, skip_keys: Collection[str], reserved: Collection[str]
) -> Iterable[Metric]:
    """Families for every exportable value of ``stats`` except the top-level ``skip_keys``
    (exported elsewhere). Pure; a new set of families per call."""
    out = _Families(model, reserved)
    for key, value in stats.items():
        if key not in skip_keys:
            _walk([str(key)], value, (), out)
    return out.values()
