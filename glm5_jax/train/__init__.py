"""Training: experiment configs and ``--set`` overrides (`experiment`), the DSA stages (`stage`), the jitted
step (`step`), the loop (`loop`, what train.py runs), losses, optimizers, ``init_from``, libtpu flags and the
AOT compile report (``python -m glm5_jax.train.compile_report``)."""
