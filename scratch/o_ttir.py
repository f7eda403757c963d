"""Print the TTIR of scratch/o_moe_dot.py variants (and the baseline) at mini's shape, lowered for CUDA on the CPU.
Usage: o_ttir.py OUTDIR name=bf,bk,br,warps,loads_first,one_loop ..."""
import sys, os, contextlib, io
sys.path.insert(0, "scratch")
import jax, jax.numpy as jnp
from k3jax.mx import MXTensor
from k3jax.functional.moe import situ
import o_moe_dot, o_moe_base
from jax._src.pallas.triton import lowering as tl_lowering
_lower = tl_lowering.lower_jaxpr_to_triton_module
CAPTURED = []
def _capture(*a, **kw):
    res = _lower(*a, **kw)
    CAPTURED.append(res.module.operation.get_asm(enable_debug_info=False))
    return res
tl_lowering.lower_jaxpr_to_triton_module = _capture
from pallas_kernels.mx_matmul.kernel import MXBlocks

E, F, R, K = 64, 768, 1024, 8
out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
T = int(os.environ.get("O_T", "1"))
args = [jax.ShapeDtypeStruct((T, R), jnp.bfloat16), jax.ShapeDtypeStruct((T, K), jnp.float32),
        jax.ShapeDtypeStruct((T, K), jnp.int32), jax.ShapeDtypeStruct((E, F, R // 2), jnp.uint8),
        jax.ShapeDtypeStruct((E, F, R // 32), jnp.uint8), jax.ShapeDtypeStruct((E, R, F // 2), jnp.uint8),
        jax.ShapeDtypeStruct((E, R, F // 32), jnp.uint8)]
mx = lambda c, s: MXTensor(c, s, "mxfp4")
for spec in sys.argv[2:]:
    name, rest = spec.split("=")
    if rest == "base":
        fn = lambda x, wt, ex, c1, s1, c2, s2: o_moe_base._fused_moe_mx(x, mx(c1, s1), mx(c1, s1), mx(c2, s2), wt, ex, act=situ, blocks=o_moe_base.FUSED_MOE_BLOCKS, bf=32, br=1024, out_dtype=jnp.float32, interpret=False)
        # debug flag: patch pallas_call
    else:
        bf, bk, br, nw, lf, ol = rest.split(",")
        bf, bk, br, nw, lf, ol = int(bf), int(bk), int(br), int(nw), lf == "1", ol == "1"
        blocks = MXBlocks(bm=1, bn=bf, bk=bk, num_warps=nw, num_stages=2, gemv=True)
        fn = lambda x, wt, ex, c1, s1, c2, s2: o_moe_dot._fused(x, mx(c1, s1), mx(c1, s1), mx(c2, s2), wt, ex, act=situ, blocks=blocks, bf=bf, bk=bk, br=br,
                                                out_dtype=jnp.float32, interpret=False, loads_first=lf, one_loop=ol)
    CAPTURED.clear()
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    open(f"{out_dir}/{name}.ttir", "w").write(CAPTURED[-1])
    print(name, len(CAPTURED[-1]))
