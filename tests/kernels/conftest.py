"""Kernel tests run the Triton kernels in the CPU interpreter.

TRITON_INTERPRET is read when a kernel is defined, so it is set here, before any test module
imports the Triton kernels.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
