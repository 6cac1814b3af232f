"""The control plane: pipeline spec, compiler to Argo resources, and the CLI (no training libraries)."""
