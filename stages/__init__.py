"""The data plane: what runs inside each PyTorchJob pod, and locally, as `python -m stages <stage> --run-dir DIR`."""
