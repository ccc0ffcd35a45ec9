"""dflash: the domain library of dflash-stages.

Drafter model, anchor sampling, attention masks, loss, target-model wrapper, corpus schema, hidden-state cache
format, length buckets and batch mixing, checkpoint format and metrics. Knows nothing of Dask, the CLI or the
process layout (those live in ``stages/`` and ``pipelines/``).
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
