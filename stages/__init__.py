"""The data plane: what runs inside each pod, and locally, as `python -m stages <stage> --run-dir DIR`.

Import rule: `stages` imports `spec` (the pipeline language it reads from the run directory) and the training
libraries; it does not import `workflows`, the control plane (tests/test_architecture.py checks the rule and
lists the imports not moved yet).
"""
