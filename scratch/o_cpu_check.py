"""CPU interpret check of scratch/o_moe_dot.py against the dense reference and the baseline kernel."""
import sys
sys.path.insert(0, "scratch")
import itertools
import jax, jax.numpy as jnp, numpy as np
from k3jax.mx import MXTensor
from k3jax.functional.moe import moe_dense, situ
import o_moe_dot, o_moe_base

def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

E, F, R, k, T = 5, 128, 256, 3, 4
keys = jax.random.split(jax.random.key(21), 5)
w1, w3 = (MXTensor.quantize(jax.random.normal(kk, (E, F, R)) * R**-0.5) for kk in keys[:2])
w2 = MXTensor.quantize(jax.random.normal(keys[2], (E, R, F)) * F**-0.5)
experts = jnp.array([[2, 2, 0], [4, 1, 2], [0, 3, 1], [3, 3, 3]], jnp.int32)
weights = jax.random.uniform(keys[4], (T, k))
for dtype in (jnp.float32, jnp.bfloat16):
    x = jax.random.normal(keys[3], (T, R)).astype(jnp.bfloat16).astype(dtype)
    ref = moe_dense(x.astype(jnp.float32), *(w.decode(jnp.float32) for w in (w1, w3, w2)), weights, experts, situ)
    base = o_moe_base.fused_moe_mx(x, w1, w3, w2, weights, experts, situ, out_dtype=jnp.float32)
    for orient, (bf, bk, br), lf in itertools.product(("wx",), ((32, 256, 256), (64, 128, 64), (32, 64, 128), (32, 32, 256)), (False, True)):
        if lf and (bk != R or br != R):
            continue
        out = o_moe_dot.fused_moe_dot(x, w1, w3, w2, weights, experts, situ, bf=bf, bk=bk, br=br,
                                      loads_first=lf, out_dtype=jnp.float32)
        print(dtype.__name__, orient, bf, bk, br, lf, f"ref {rel(out, ref):.1e} base {rel(out, base):.1e}")
