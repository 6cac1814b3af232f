"""The pipeline language: YAML in, a validated `PipelineSpec` out (sections, loading, profiles, `--set`, variants).

Import rule: `spec` imports nothing of this project's other packages (`run`, `workflows`, `stages`) and no runtime
(no torch, no hera, no Kubernetes client): both planes read it, the light control plane and the pods.
"""
