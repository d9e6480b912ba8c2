"""CPU Adam kernels (installed as ``hf_superoffload.cpu_ext``).

The compiled op library lives in ``csrc/``; ``reference`` is its eager-torch twin.
Use the typed entry points in :mod:`hf_superoffload.ops`.
"""

from . import reference

__all__ = ["reference"]
