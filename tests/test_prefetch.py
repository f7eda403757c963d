"""The batch-1 decode step's L2 prefetch: the plan's wiring in a traced step (which weights each
prefetch asks for, what it waits for, which matvec takes its token), the kernel's boxes, and the
kernel's Mosaic GPU lowering for CUDA on the CPU (a prefetch changes no value, so interpret mode does
not run it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallas_kernels.matvec as matvec
import pallas_kernels.prefetch as kernel
from k3jax import K3Model, preset, use_implementation
from k3jax.layers import prefetch
from pallas_kernels.prefetch import BOX, box_grid, box_origin, prefetch_l2


@pytest.mark.parametrize("shape", [(300, 520), (96, 64), (2 * BOX, BOX), (1000, 8)])
def test_boxes_cover_the_array_inside_its_bounds(shape):
    rows, cols, total = box_grid(shape)
    assert rows <= BOX and cols <= BOX
    seen = np.zeros(shape, bool)
    for row0, col0 in zip(*(np.asarray(a) for a in box_origin(np.arange(total), shape))):
        assert 0 <= row0 <= shape[0] - rows and 0 <= col0 <= shape[1] - cols
        seen[row0 : row0 + rows, col0 : col0 + cols] = True
    assert seen.all()


def test_lowers_for_cuda_through_mosaic_gpu():
    """Three arrays (a float32 router, bf16 maps, one narrower than a box), after one operand."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in
            [((64, 2048), jnp.float32), ((600, 2048), jnp.bfloat16), ((512, 96), jnp.bfloat16), ((1, 2048), jnp.bfloat16)]]
    fn = lambda a, b, c, r: prefetch_l2([a, b, c], after=(r,), programs=8, interpret=False)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        prefetch_l2([])
    with pytest.raises(ValueError, match="2-D bf16 or float32"):
        prefetch_l2([jnp.ones((4, 8), jnp.int32)])
    with pytest.raises(ValueError, match="16 bytes"):
        prefetch_l2([jnp.ones((4, 6), jnp.bfloat16)])


@pytest.mark.parametrize("start", ["output", "input"])
def test_plan_prefetches_each_next_group_for_its_matvec(start, monkeypatch):
    """A traced one-token tiny step (unrolled layers) with the plan on: one prefetch per sub-block
    after the first, of exactly the weights the next input matvec reads, started after the previous
    input matvec's output (``START = "output"``), and its token is that matvec's ``after``."""
    model = K3Model(preset("tiny"), rngs=nnx.Rngs(0))
    groups, prefetches, calls = [], [], []
    real_matvecs = matvec.matvecs

    def recording_prefetch(arrays, after=()):
        token = jnp.full((1,), float(len(prefetches)))
        prefetches.append((tuple(arrays), tuple(after), token))
        return token

    def recording_matvecs(x, weights, *args, after=(), **kwargs):
        outs = real_matvecs(x, weights, *args, after=after, **kwargs)
        calls.append((tuple(weights), tuple(after), outs))
        return outs

    monkeypatch.setattr(prefetch, "ENABLED", True)
    monkeypatch.setattr(prefetch, "START", start)
    monkeypatch.setattr(kernel, "prefetch_l2", recording_prefetch)
    monkeypatch.setattr(matvec, "matvecs", recording_matvecs)
    graph, params = nnx.split(model)

    def step(params):
        m = nnx.merge(graph, params)
        groups.extend(g for layer in m.layers for g in layer.input_weights())  # the traced weights
        cache = m.init_cache(1, 8, scan_layers=False)
        return m.extend(jnp.zeros((1, 1), jnp.int32), cache, jnp.zeros((1,), jnp.int32), None, scan_layers=False)

    with use_implementation("pallas"):
        jax.eval_shape(step, params)
    assert len(prefetches) == len(groups) - 1
    inputs = [c for c in calls if any(c[0][0] is g[0] for g in groups)]  # the input matvecs, in order
    assert len(inputs) == len(groups)
    same = lambda a, b: len(a) == len(b) and all(x is y for x, y in zip(a, b))
    for k, (arrays, after, token) in enumerate(prefetches):
        weights, prior_after, prior_outs = inputs[k]
        assert same(arrays, inputs[k + 1][0]) and same(inputs[k + 1][1], (token,))
        assert same(prior_after, () if k == 0 else (prefetches[k - 1][2],))
        assert same(after, (prior_outs[0],)) == (start == "output")
