"""One pipeline run on disk: the directory, its records and the names both planes read and write.

Import rule: `run` imports `spec` and nothing else of this project (no `workflows`, no `stages`) and no runtime
(no torch, no transformers, no mlflow, no Kubernetes client): the control plane and the pods both read it.
"""
