"""Training gradients on the Pallas path: every kernel a full forward runs takes the reference's gradient
(``pallas_kernels._autodiff.with_reference_gradient``: kernels forward, ``jax.vjp`` of the tier-1 reference
backward), so ``jax.grad`` of a next-token loss matches the reference path's up to float32 rounding.

Whole models, ``tiny`` (K3: bounded KDA, MLA with q_lora, latent MoE, Block AttnRes) and ``tiny_linear`` (Kimi
Linear: softplus KDA, MLA, plain MoE) cut to two layers (a dense KDA layer, an MoE MLA one), experts as float32
arrays, tokens [2, 37] (two KDA chunks and a ragged tail), the kernels in Pallas interpret mode. The two sides
differ only where the kernels' forward rounds otherwise than the reference's (the backward then runs the same
reference maths from slightly different values), so each parameter's gradient is compared by relative norm:
||g_pallas - g_ref|| <= rtol ||g_ref|| + atol ||all of g_ref||. One-token forwards take other kernels (the matvec
kernel with its mix, activation, conv and add; the decode steps), checked op by op. The errors seen are printed
(``pytest -s``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.functional.attn_res import DepthMix
from k3jax.functional.linear import Activated
from k3jax.functional.moe import situ
from k3jax.implementation import use_implementation
from pallas_kernels._autodiff import with_reference_gradient
from pallas_kernels.kda.ops import gated_kda, short_convs
from pallas_kernels.matvec.ops import project
from small_models import build

TOKENS = (2, 37)
# The builds (``small_models.build``), experts as float32 arrays, each preset cut to two layers: KDA with the dense
# MLP, then MLA with the MoE (tiny: each layer its own AttnRes block). Every kernel of the full forwards runs, at a
# fraction of the compile time of 14 and 7 layers, and the shallow models keep float32 rounding from growing with
# depth (at the presets' full depth the errors below, kernels or not, reach 1e-4: the A_log gradients cancel).
LAYERS = dict(layer_types=("kda", "mla"), packed_experts=False)
BUILDS = {"tiny": dict(LAYERS, attn_res_block_size=1), "tiny_linear": LAYERS}
# Test-speed only: the grad programs compile in about half the time at LLVM's level 0.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
# About 10x the errors seen (float32, CPU): worst parameter 4.1e-6 (tiny) and 2.9e-6 (tiny_linear), all parameters
# together 2.9e-6 and 1.4e-6. That is the float32 reference's own rounding: one ulp on a quarter of the parameters
# moves its gradients by up to 7.6e-6 and 3.8e-6, 4.6e-6 and 2.2e-6 over all.
RTOL = 4e-5  # each parameter
OVERALL_RTOL = 3e-5  # all parameters as one vector
ATOL = 1e-7  # of the whole gradient's norm: parameters whose gradient is zero (the router's correction bias)
OP_RTOL = 3e-6  # the one-token ops: seen 2.3e-7 (the matvec kernel's mix and norm); the others bitwise, a loss
# linear in the outputs giving both paths the same cotangents, and a backward that reads only the inputs


def _loss(graph, tokens):
    """Mean next-token cross-entropy of the full causal forward, as a training step takes it."""
    def loss(params):
        logits = nnx.merge(graph, params)(tokens)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return loss


@functools.cache
def _gradients(name: str) -> dict:
    """{path: (pallas gradient, reference gradient)} for one preset: one compile per path."""
    built = build(name, **BUILDS[name])
    graph, params = nnx.split(built.model)
    tokens = jax.random.randint(jax.random.key(3), TOKENS, 0, built.cfg.vocab_size)
    grads = {}
    for implementation in ("pallas", "reference"):
        with use_implementation(implementation):  # a fresh function per setting, traced inside the block
            traced = jax.jit(jax.grad(_loss(graph, tokens))).trace(params)
        assert ("pallas_call" in str(traced.jaxpr)) == (implementation == "pallas")
        grads[implementation] = traced.lower().compile(FAST_COMPILE)(params)
    flat = {implementation: jax.tree_util.tree_flatten_with_path(g)[0] for implementation, g in grads.items()}
    return {jax.tree_util.keystr(path): (np.asarray(got, np.float64), np.asarray(want, np.float64))
            for (path, got), (_, want) in zip(flat["pallas"], flat["reference"])}


@pytest.mark.parametrize("name", ["tiny", "tiny_linear"])
def test_model_gradients_match_reference(name):
    """Each parameter's gradient, Pallas path against reference path (both traced here: the reference's without a
    kernel)."""
    grads = _gradients(name)
    total = np.sqrt(sum(np.sum(want**2) for _, want in grads.values()))
    errors = {path: (np.linalg.norm(got - want), np.linalg.norm(want)) for path, (got, want) in grads.items()}
    assert all(np.all(np.isfinite(got)) for got, _ in grads.values())
    worst = sorted(errors.items(), key=lambda item: -item[1][0] / max(item[1][1], 1e-30))
    overall = np.sqrt(sum(err**2 for err, _ in errors.values())) / total
    print(f"\n{name}: all parameters {overall:.2e}; worst:" + "".join(
        f"\n  {err / max(norm, 1e-30):.2e} (|g| {norm:.1e}) {path}" for path, (err, norm) in worst[:4]))
    bad = {path: (err, norm) for path, (err, norm) in errors.items() if err > RTOL * norm + ATOL * total}
    assert not bad, bad
    assert overall < OVERALL_RTOL
    assert sum(norm > 0 for _, norm in errors.values()) > 0.9 * len(errors)  # gradients reach the parameters


def _one_token_case(name: str):
    """(function of a dict of float32 arrays, those arrays) for an op a one-token forward runs on kernels:
    D = 48, three KDA heads of 8, as in ``tiny``."""
    keys = iter(jax.random.split(jax.random.key(len(name)), 16))
    normal = lambda *shape, scale=1.0: scale * jax.random.normal(next(keys), shape, jnp.float32)
    if name == "kda_maps":  # batch 1: the matvec kernel reads a Block AttnRes mix, norms it, convs its first outputs
        x = dict(blocks=normal(2, 1, 1, 48), partial=normal(1, 1, 48), mix_norm=1 + normal(48, scale=0.1),
                 query=normal(48, scale=0.3), norm=1 + normal(48, scale=0.1), maps=normal(6, 24, 48, scale=0.15),
                 taps=normal(3, 24, 4, scale=0.5), conv_state=normal(1, 3, 72))

        def fn(x):
            mix = DepthMix(x["blocks"], jnp.int32(2), x["partial"], x["mix_norm"], x["query"], 1e-5)
            return project(mix, list(x["maps"]), norm=(x["norm"], 1e-5),
                           conv=(list(x["taps"]), x["conv_state"], None))
        return fn, x
    if name == "mlp_down":  # batch 1: the kernel applies SiTU in its prologue and adds the residual
        x = dict(gate=normal(1, 1, 72, scale=2.0), up=normal(1, 1, 72, scale=2.0), w=normal(48, 72, scale=0.1),
                 residual=normal(1, 1, 48))
        return (lambda x: project(Activated(situ, x["gate"], x["up"]), [x["w"]], add=(x["residual"],))), x
    if name == "short_convs":  # batch 2: the decode step's conv kernel
        x = dict(xs=normal(3, 2, 1, 24), taps=normal(3, 24, 4, scale=0.5), state=normal(2, 3, 72))
        return (lambda x: short_convs(list(x["xs"]), list(x["taps"]), x["state"])), x
    # batch 2, the softplus gate's decode step (K3's bounded one runs the same wrapper, its fused step kernel tested
    # in tests/kernels/kda)
    x = dict(q=normal(2, 1, 3, 8), k=normal(2, 1, 3, 8), v=normal(2, 1, 3, 8), z=normal(2, 1, 3, 8),
             a_log=normal(3, scale=0.5), dt_bias=normal(3, 8), beta_logits=normal(2, 1, 3), state=normal(2, 3, 8, 8))
    return (lambda x: gated_kda(**x, lower_bound=None)), x


@pytest.mark.parametrize("name", ["kda_maps", "mlp_down", "short_convs", "kda_step"])
def test_one_token_gradients_match_reference(name):
    fn, x = _one_token_case(name)
    weights = [jax.random.normal(jax.random.key(i), y.shape) for i, y in enumerate(jax.eval_shape(fn, x))]
    grads = {}
    for implementation in ("pallas", "reference"):
        # a fresh function per setting (a traced one keeps the setting it was traced under)
        loss = lambda x: sum(jnp.sum(y * w) for y, w in zip(fn(x), weights))  # every output, its own cotangent
        with use_implementation(implementation):
            traced = jax.jit(jax.grad(loss)).trace(x)
        assert ("pallas_call" in str(traced.jaxpr)) == (implementation == "pallas")
        grads[implementation] = traced.lower().compile(FAST_COMPILE)(x)
    errors = {key: float(np.linalg.norm(grads["pallas"][key] - want) / np.linalg.norm(want))
              for key, want in grads["reference"].items()}
    print(f"\n{name}: " + ", ".join(f"{key} {err:.1e}" for key, err in errors.items()))
    assert max(errors.values()) < OP_RTOL


def test_reference_gradient_helper():
    """``with_reference_gradient``: the kernel's values, the reference's gradient (inside ``lax.scan`` too);
    integer inputs get float0 cotangents, static leaves pass through, integer outputs, other containers and
    floating dtypes are taken."""
    def kernel(x, pair, ids, scale):
        w, _ = pair
        y = (jnp.sin(x) * w * scale + 1.0).astype(jnp.bfloat16)  # values unlike the reference's
        return [y, ids * 2]

    def reference(x, pair, ids, scale):
        w, _ = pair
        return jnp.sin(x) * w * scale, ids * 2

    f = with_reference_gradient(kernel, reference)
    x, w, ids = jnp.linspace(0.0, 1.0, 6), jnp.arange(6.0), jnp.arange(6)
    out = f(x, (w, None), ids, 3.0)
    assert out[0].dtype == jnp.bfloat16 and np.array_equal(out[1], ids * 2)

    def loss(x, w):
        y, _ = f(x, (w, None), ids, 3.0)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    ct = 2 * np.asarray(out[0], np.float32)  # the cotangent the kernel's output receives
    want = (ct * np.cos(x) * w * 3.0, ct * np.sin(x) * 3.0)
    scanned = lambda x, w: jax.lax.scan(lambda total, _: (total + loss(x, w), None), 0.0, None, length=2)[0]
    for got, times in ((jax.grad(loss, argnums=(0, 1))(x, w), 1), (jax.grad(scanned, argnums=(0, 1))(x, w), 2)):
        for g, expected in zip(got, want):
            np.testing.assert_allclose(g, times * expected, rtol=1e-5, atol=1e-5)
    ids_grad = jax.grad(lambda ids: jnp.sum(f(x, (w, None), ids, 3.0)[0].astype(jnp.float32)), allow_int=True)(ids)
    assert ids_grad.dtype == jax.dtypes.float0
