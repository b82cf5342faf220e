"""The mixture-of-experts FFN: routing (`layer`), the routed experts' grouped SwiGLU (`experts`; `blocked` for
XLA:CPU), expert parallelism (`expert_parallel`), and packed INT4 expert weights (`int4_weights`, `int4_swiglu`)."""
