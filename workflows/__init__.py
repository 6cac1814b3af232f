"""The control plane: the compiler to Argo resources, submission, the local runner and the CLI.

Import rule: `workflows` imports `spec` (the pipeline language) and never a training library (torch,
transformers, TRL, PEFT, accelerate, MLflow...), so the CLI stays light. It does not import `stages`: what the
runner needs of a stage it reads from the run directory or gets from a subprocess, as the pod does
(tests/test_architecture.py checks the rule and lists the imports not moved yet).
"""
