"""Registers and SASS instructions of the Pallas Triton kernels a step lowers to, on a machine without a GPU.

JAX lowers each Pallas Triton kernel to Triton IR on any host (here: for CUDA, on the CPU); the ``triton``
package (``pip install triton``; not a k3jax dependency) compiles that IR for the H200 (sm_90) with its
bundled ptxas, and its cuobjdump reads back the registers, spills and instructions. Its Triton is not the
one inside jaxlib, so the numbers are close, not equal (the batch-1 MoE's hidden kernel: 108 registers
here, 110 measured by ncu on the H200, benchmarks/RESULTS.md, issue 4, fourteenth session). What it
answers without device time: does a kernel spill, how many programs fit on an SM, how many instructions a
weight element costs, how many come before the first weight load.

    python3 benchmarks/triton_sass.py [moe|matvec|mix|conv] [--preset mini] [--sass]

moe: the batch-1 routed MoE's two kernels (``routed_moe_mx_split``); matvec: the KDA layer's input maps at
one row with the short convs after them (``pallas_kernels.matvec``); mix: an AttnRes mix with its norm
(``pallas_kernels.depth_mix``); conv: a 2048-token prefill chunk's short convs and SiLU
(``pallas_kernels.short_conv.conv_silu_chunk``).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[.\s]")


class TritonKernel(NamedTuple):
    name: str
    ir: str
    num_warps: int
    num_stages: int


def lowered_kernels(fn: Callable, *args) -> list[TritonKernel]:
    """Each Pallas Triton kernel of ``jax.jit(fn)`` lowered for CUDA at ``args`` (arrays or shape structs):
    its Triton IR and launch options. Reads them from JAX's private Pallas Triton lowering (JAX 0.10-0.11).
    JAX's caches are cleared first: a kernel lowered before in the process (the same function, or a module
    flag read while tracing changed since) would otherwise come from the cache, unseen."""
    from jax._src.pallas.triton import lowering, pallas_call_registration as registration

    jax.clear_caches()

    kernels, lower = [], lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *rest, **kwargs):
        result = lower(jaxpr, *rest, **kwargs)
        caller = sys._getframe(1).f_locals  # pallas_call_lowering: its launch options
        kernels.append(TritonKernel(jaxpr.debug_info.func_name, result.module.operation.get_asm(),
                                    caller["num_warps"], caller["num_stages"]))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    if not kernels:
        raise ValueError(f"{getattr(fn, '__name__', fn)} lowers to no Pallas Triton kernel")
    return kernels


class Compiled(NamedTuple):
    registers: int
    spill_bytes: int
    shared_bytes: int
    sass: list[str]  # opcodes in program order


def compile_sm90(kernel: TritonKernel) -> Compiled:
    """The kernel compiled for sm_90 by the ``triton`` package: registers, local (spill) bytes, shared
    bytes, and its SASS opcodes."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise SystemExit("benchmarks/triton_sass.py needs the triton package: pip install triton") from e
    folder = Path(tempfile.mkdtemp())
    (folder / "kernel.ttir").write_text(kernel.ir)
    compiled = triton.compile(str(folder / "kernel.ttir"), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
    (folder / "kernel.cubin").write_bytes(compiled.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([cuobjdump, "-res-usage", folder / "kernel.cubin"], capture_output=True, text=True,
                           check=True).stdout
    field = lambda key: int(re.search(rf"{key}:(\d+)", usage).group(1))
    sass = subprocess.run([cuobjdump, "-sass", folder / "kernel.cubin"], capture_output=True, text=True,
                          check=True).stdout
    opcodes = [m.group(2) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    return Compiled(field("REG"), field("LOCAL"), field("SHARED"), opcodes)


def report(kernel: TritonKernel, compiled: Compiled, top: int = 12) -> str:
    """One kernel's registers, how many of its programs fit on an SM by registers (65536 a SM, whole
    warps), its instructions, its barriers (each a shared-memory step: a reduction across warps or a
    layout conversion), the first global load's place among them, and its commonest opcodes."""
    threads = 32 * kernel.num_warps
    per_sm = 65536 // (max(compiled.registers, 1) * threads)
    first_load = next((i for i, op in enumerate(compiled.sass) if op == "LDG"), None)
    lines = [f"{kernel.name}: {kernel.num_warps} warps, {kernel.num_stages} stages; {compiled.registers} registers "
             f"({per_sm} programs a SM by registers), {compiled.spill_bytes} bytes spilled, "
             f"{compiled.shared_bytes} bytes shared; {len(compiled.sass)} instructions, {compiled.sass.count('BAR')} "
             f"barriers, the first global load at {first_load}"]
    counts = collections.Counter(compiled.sass).most_common(top)
    lines.append("  " + ", ".join(f"{op} {n}" for op, n in counts))
    return "\n".join(lines)


def _targets(preset_name: str) -> dict[str, tuple[Callable, tuple]]:
    from k3jax import preset
    from k3jax.layers.mlp import activation
    from k3jax.mx import MXTensor

    cfg = preset(preset_name)
    moe, kda = cfg.moe, cfg.kda
    R, F, E = moe.latent_size or cfg.hidden_size, moe.intermediate_size, moe.num_experts
    act = activation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
    u8 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.uint8)
    stack = lambda n, k: MXTensor(u8(E, n, k // 2), u8(E, n, k // 32), "mxfp4")
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    def routed(x, w1, w3, w2, logits, bias):
        from pallas_kernels.mx_matmul import routed_moe_mx_split

        return routed_moe_mx_split(x, w1, w3, w2, logits, bias, act, k=moe.experts_per_token,
                                   renormalize=moe.renormalize, scaling_factor=moe.routed_scaling_factor,
                                   out_dtype=jnp.float32, interpret=False)

    D = cfg.hidden_size
    qk, v = kda.num_heads * kda.head_dim, kda.num_heads * kda.head_dim
    maps = [bf16(qk, D), bf16(qk, D), bf16(v, D), bf16(kda.head_dim, D), bf16(kda.num_heads, D),
            bf16(kda.head_dim, D)]

    W = kda.conv_size
    taps = [f32(qk, W), f32(qk, W), f32(v, W)]

    def matvec(x, *operands):
        from pallas_kernels.matvec import matvecs

        weights, taps, state = operands[:6], operands[6:9], operands[9]
        return matvecs(x, list(weights), [jnp.bfloat16] * len(weights), conv=(taps, state), interpret=False)

    def mix(partial, blocks, count, query, proj, norm):
        from pallas_kernels.depth_mix import mix_norm

        return mix_norm(partial, blocks, count, query, proj, 1e-6, (norm, 1e-6), interpret=False)

    def conv(*operands):
        from pallas_kernels.short_conv import conv_silu_chunk

        return conv_silu_chunk(operands[:3], operands[3:6], operands[6], interpret=False)

    chunk = 2048
    return {
        "conv": (conv, (bf16(1, chunk, qk), bf16(1, chunk, qk), bf16(1, chunk, v), *taps, f32(1, W - 1, 2 * qk + v))),
        "moe": (routed, (bf16(1, R), stack(F, R), stack(F, R), stack(R, F), f32(1, E), f32(E))),
        "matvec": (matvec, (bf16(1, D), *maps, *taps, f32(1, W - 1, 2 * qk + v))),
        "mix": (mix, (bf16(1, D), bf16(8, 1, D), jax.ShapeDtypeStruct((), jnp.int32), bf16(D), bf16(D), bf16(D))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", nargs="?", default="moe", choices=["moe", "matvec", "mix", "conv"])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--sass", action="store_true", help="also print every kernel's opcodes in program order")
    args = ap.parse_args()
    fn, shapes = _targets(args.preset)[args.target]
    for kernel in lowered_kernels(fn, *shapes):
        compiled = compile_sm90(kernel)
        print(report(kernel, compiled))
        if args.sass:
            print(" ".join(compiled.sass))


if __name__ == "__main__":
    main()
