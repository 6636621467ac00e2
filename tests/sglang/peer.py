"""A second process for tests/sglang: builds the backend through SGLang's factory over the
tiers in a JSON spec, reads ``num_pages`` pages (keys from ``seed``) into an empty pool and
prints, as JSON, ``exists`` and the read pages' bytes as hex. ``python -m tests.sglang.peer
SPEC.json``."""

from __future__ import annotations

import json
import sys

from tests.sglang.helpers import indices, make_backend, page_bytes, page_keys
from tests.sglang.host_pool import HostPoolStandIn


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    pool = HostPoolStandIn(spec.get("layout", "page_first"))
    backend = make_backend(
        spec["tiers"], pool, tp_rank=spec.get("tp_rank", 0), tp_size=spec.get("tp_size", 1)
    )
    keys = page_keys(spec["num_pages"], seed=spec["seed"])
    out = {
        "exists": backend.batch_exists(keys),
        "got": backend.batch_get_v1(keys, indices(0, len(keys))),
    }
    out["pages"] = [page_bytes(pool, p).hex() for p in range(len(keys))]
    backend.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
