"""Pallas TPU kernels for GLM-5's hot spots, each beside its plain-XLA reference.

Every kernel folder holds ``kernel.py`` (Pallas), ``reference.py`` (readable XLA, the oracle) and
``ops.py`` (the ``impl`` switch and the ``jax.custom_vjp`` wiring).
"""
