"""Memory model: bytes per replica on each tier (device, host, NVMe).

One module per concept:

- :mod:`~zero_runtime.estimator.formulas`: the model-state accounting, SC20 (ZeRO) and
  SC21 (ZeRO-Infinity), its notation and references (``estimate``,
  ``estimate_for_config``).
- :mod:`~zero_runtime.estimator.results`: the result records (``TierEstimate``,
  ``ModelEstimate``).
- :mod:`~zero_runtime.estimator.units`: what is read from a Keras model: optimizer and
  dtype-policy kinds, units (top-level layers), row-paged embeddings, working memory.
- :mod:`~zero_runtime.estimator.activations`: the activation term, from the traced graph.
- :mod:`~zero_runtime.estimator.model`: ``estimate_for_model`` and
  ``build_model_abstractly``.
- :mod:`~zero_runtime.estimator.choices`: the 18 stage/offload choices, budgets, and the
  smallest choice that fits.

No module of this package imports TensorFlow or Keras at import time.
"""

from __future__ import annotations

from zero_runtime.estimator.activations import activation_bytes
from zero_runtime.estimator.choices import CHOICES, Budgets, estimate_choices, smallest_fit
from zero_runtime.estimator.formulas import (
    ACCOUNTINGS,
    OPTIMIZER_STATE_BYTES,
    PRECISIONS,
    estimate,
    estimate_for_config,
)
from zero_runtime.estimator.model import build_model_abstractly, estimate_for_model
from zero_runtime.estimator.results import TIERS, ModelEstimate, TierEstimate
from zero_runtime.estimator.units import (
    optimizer_kind,
    policy_precision,
    row_cache_bytes,
    state_kind,
)

__all__ = [
    "ACCOUNTINGS",
    "CHOICES",
    "OPTIMIZER_STATE_BYTES",
    "PRECISIONS",
    "TIERS",
    "Budgets",
    "ModelEstimate",
    "TierEstimate",
    "activation_bytes",
    "build_model_abstractly",
    "estimate",
    "estimate_choices",
    "estimate_for_config",
    "estimate_for_model",
    "optimizer_kind",
    "state_kind",
    "policy_precision",
    "row_cache_bytes",
    "smallest_fit",
]
