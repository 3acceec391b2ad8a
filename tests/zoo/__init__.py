"""A zoo of small models written the way JAX users write them (issue #9).

Each module exposes ``step(...)`` and ``example_args(size="small"|"paper")``: ``"small"`` gives
tiny random arrays for equivalence tests on CPU, ``"paper"`` gives ``jax.ShapeDtypeStruct``s at
Llama-3-8B / Gemma-2-9B sizes (batch 16, context 4096, bf16) for analysis only. The module
docstrings name the data-movement ops each model contains. ``tests/test_zoo.py`` checks every
model against ``jax.jit``.
"""
