"""CPU Adam kernels (installed as ``hf_superoffload.cpu_ext``).

The compiled op library lives in ``csrc/`` and is built just in time on first use (see ``_build``);
``reference`` is its eager-torch twin. Use the typed entry points in :mod:`hf_superoffload.ops`. Every AdamW
function of the package takes its hyper-parameters as one :class:`AdamWHyper` ([Note: one AdamW signature] in
``_hyper.py``).
"""

from . import reference
from ._build import DISABLE_ENV, ISA_ENV, SCHEDULE_ENV, LoadState, load_library, load_state
from ._hyper import AdamWHyper

__all__ = [
    "DISABLE_ENV", "ISA_ENV", "SCHEDULE_ENV", "AdamWHyper", "LoadState", "load_library", "load_state", "reference",
]
