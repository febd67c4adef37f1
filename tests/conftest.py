"""Settings every test module needs before it is imported.

Triton decides whether a kernel runs in its CPU interpreter when the kernel is defined, and its
own library functions (tl.sum, tl.max, ...) are defined when triton is first imported, which
importing transformers' Llama model already does. So TRITON_INTERPRET is set here, before pytest
imports any test module; bench/gpu_check.sh sets TRITON_INTERPRET=0 to run tests/gpu on a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
