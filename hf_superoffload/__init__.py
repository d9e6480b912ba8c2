"""hf_superoffload: SuperOffload for Hugging Face.

Full-parameter training with fp32 master weights and Adam states in host memory, a SIMD CPU Adam
overlapped with the GPU (speculation-then-validation), a GPU-resident tail of buckets, and casts placed
where the link makes them cheapest.
"""

from .config import SuperOffloadConfig
from .optimizer import SuperOffloadOptimizer
from .planning.plan import OffloadPlan

__version__ = "0.1.0"

__all__ = ["OffloadPlan", "SuperOffloadConfig", "SuperOffloadOptimizer", "__version__"]
