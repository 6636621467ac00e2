"""The KV offload benchmark, run as ``python -m bench.offload`` (``main``): ``parts`` builds the
run (sizes, model, engines), ``qa`` and ``sweep`` are its multi-round QA and cost-model sweep
sections."""
