"""CuTe DSL device code of cudnn_moe_jax (installed as `cudnn_moe_jax.kernels`).

scheduler.py   persistent grouped tile scheduler (group of each M tile computed on device from padded_offsets)
epilogue.py    fused epilogue math (alpha, prob, bias, amax; the activation through the table)
activations.py device functions of the activation table (value; value and derivatives)
sm90/          Hopper kernel family: config.py (Config, supports, default_config), mainloop.py (wgmma k-loops),
               gemm.py (the kernel class), jax_bridge.py (TensorSpecs / output shapes for cutlass_call)
"""
