"""The data plane: what runs inside each pod, and locally, as `python -m stages <stage> --run-dir DIR`.

Import rule: `stages` imports `spec` (the pipeline language it reads from the run directory), `run` (the run
directory it writes) and the training libraries; it never imports `workflows`, the control plane
(tests/test_architecture.py checks the rule).
"""

import logging

# bitsandbytes warns when it is imported on a CPU with AVX512-BF16 that the `kernels` package for its CPU 4-bit GEMM
# is missing. The stages never multiply 4-bit weights on a CPU (QLoRA needs a CUDA GPU): on such machines the line
# would open every stage's output, and the warm-start server's one-line errors.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
