"""Test-session setup. CPU only: with the CUDA plugin installed and no driver, JAX would otherwise try
(and noisily fail) to initialise a GPU. Must run before anything imports jax."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
