"""Reference ops and the GPU kernels that replace them (``backend.py`` chooses per op).

Every kernel here was tuned and checked with Triton's floating-point contraction on (a*b+c as one
FMA), Triton's default up to 3.9; 3.10 turns it off by default. Pin it on unless the user chose.
"""

import os

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
