"""Pallas kernels for k3jax, one folder per op:

- ``kda``: Kimi Delta Attention (chunked prefill, decode step) and its short convs;
- ``moe``: the router's selection and the routed experts (split, tiled, sorted forms);
- ``mx_matmul``: MXFP4-weight matmuls, dense and grouped;
- ``matvec``: a layer's maps of one input in one kernel (decode-step projections);
- ``attn_res``: a Block AttnRes mix and the norm after it;
- ``mla``: MLA's latent cache write and prefill flash attention.

Each folder has four parts: ``reference.py`` (the maths it computes: the ``k3jax.functional`` functions,
its oracle and fallback), the kernel files named by lowering (``triton*.py``, ``mosaic_gpu*.py``,
``tpu.py``), ``ops.py`` (the op's one entry, which picks reference or kernel and the lowering; choices
between kernels are fields of ``k3jax.implementation.KernelPolicy``), and ``README.md`` (the maths, the
tiling, where each kernel runs and the measurements behind it, the tests, the limits). The layers call
only the ``ops`` entries, under ``k3jax.use_implementation("pallas", policy=...)``.

Shared helpers: ``_platform`` (interpret mode, JAX version, where the Mosaic GPU kernels run),
``_triton`` (Triton compiler parameters, dot widths, the online-softmax step, 32-bit offset limits),
``_mosaic_gpu`` (interpret parameters, shared-memory swizzles, inline Mosaic GPU helpers).
"""
