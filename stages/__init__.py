"""The data plane: what runs inside each pod, and locally, as `python -m stages <stage> --run-dir DIR`.

Import rule: `stages` imports `spec` (the pipeline language it reads from the run directory), `run` (the run
directory it writes) and the training libraries; it never imports `workflows`, the control plane
(tests/test_architecture.py checks the rule).
"""
