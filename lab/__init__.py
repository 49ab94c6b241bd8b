"""The kernel lab: what tests, tools and benchmarks share (SASS helpers, compile cases), and timing experiments.

Not part of the installed product: `cudnn_moe_jax` never imports it. Scripts run from the checkout's root
(`python -m lab.<module>`); the tests import it because pytest runs from the root (tests/conftest.py).
"""
