"""The reload-versus-recompute cost model.

- ``model``: the pricing (reload versus recompute, and the split between them), pure functions.
- ``online``: ``OnlineCostModel``, those prices fed by live measurements.
- ``calibration``: measuring the priors at start (prefill, tier transfers, host hop).

Torch-free (calibration times device work through callbacks the engine hands in). Importing the
package itself imports nothing.
"""
