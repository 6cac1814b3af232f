"""The control plane: the compiler to Argo resources, submission, the local runner and the CLI.

Import rule: `workflows` imports `spec` (the pipeline language) and `run` (the run directory) and never a training
library (torch, transformers, TRL, PEFT, accelerate), so the CLI stays light; MLflow's client only inside the
commands that talk to the registry. It never imports `stages`: what the runner needs of a stage it reads from the
run directory or gets from a subprocess (`python -m stages ...`), as the pod does (tests/test_architecture.py
checks the rule).
"""
