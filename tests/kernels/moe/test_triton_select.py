"""The one-kernel expert selection (pallas_kernels/moe/triton_select.py, interpret mode on CPU) and its per-slot
picks by rank (which the split MoE's first kernel makes itself) against the reference selection
(k3jax.functional.moe.select_experts: sigmoid, lax.top_k, renormalize)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.functional.moe import select_experts as reference
from mx_inputs import router_case
from pallas_kernels.moe.triton_select import (expert_ranks, padded_router_inputs, select_experts, slot_expert,
                                              slot_weight)


@pytest.mark.parametrize("experts,k,renormalize,tokens,block_logits", [
    (48, 6, True, 5, 1024),  # one block of 8 tokens, 3 of them padding
    (64, 8, False, 37, 1024),  # three blocks of 16
    (64, 8, True, 5, 0),  # a token per program
])
def test_matches_reference_on_random_logits(experts, k, renormalize, tokens, block_logits):
    kl, kb = jax.random.split(jax.random.key(experts + tokens))
    logits = 2.0 * jax.random.normal(kl, (tokens, experts), jnp.float32)
    bias = 0.3 * jax.random.normal(kb, (experts,), jnp.float32)
    weights, chosen = select_experts(logits, bias, k, renormalize, 2.5, block_logits=block_logits)
    ref_weights, ref_chosen = reference(logits, bias, k, renormalize, 2.5)
    np.testing.assert_array_equal(chosen, ref_chosen)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6, atol=0)


def test_ties_go_to_the_lower_index_and_bias_only_selects():
    logits = jnp.array([[0.0, 1.0, 1.0, -1.0, 1.0, 0.5, 0.0, -2.0]], jnp.float32)
    bias = jnp.array([0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0], jnp.float32)
    weights, chosen = select_experts(logits, bias, 3, False, 1.0)
    np.testing.assert_array_equal(chosen, [[3, 1, 2]])  # 3 by its bias; 1 before 2 and 4 on the tie
    np.testing.assert_allclose(weights, jax.nn.sigmoid(logits[:, jnp.array([3, 1, 2])]), rtol=1e-6)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="correction_bias"):
        select_experts(jnp.zeros((2, 8)), jnp.zeros((7,)), 2, True, 1.0)
    with pytest.raises(ValueError, match="k = 9"):
        select_experts(jnp.zeros((2, 8)), jnp.zeros((8,)), 9, True, 1.0)


@pytest.mark.parametrize("tokens,experts", [(1, 64), (2048, 64), (64, 896)])
def test_lowers_for_cuda_through_triton(tokens, experts):
    """Pallas' Triton lowering of the kernel at a decode step's, a prefill chunk's and K3's widths, on the CPU."""
    f = lambda logits, bias: select_experts(logits, bias, 8, True, 1.0, interpret=False)
    args = [jax.ShapeDtypeStruct((tokens, experts), jnp.float32), jax.ShapeDtypeStruct((experts,), jnp.float32)]
    assert "xla.gpu.triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("renormalize", [True, False])
def test_slot_picks_by_rank_equal_select_experts(renormalize):
    """Each slot's (expert, weight) by ranks against ``select_experts`` (lax.top_k), 12 experts in 16 lanes."""
    k, tokens = 4, 3
    logits, bias = router_case(tokens)
    weights, experts = reference(logits, bias, k, renormalize, 2.5)
    assert np.all(np.asarray(experts[:, :3]) == [7, 2, 5])
    padded, padded_bias = padded_router_inputs(logits, bias)
    for t in range(tokens):
        for slot in range(k):
            scores, rank = expert_ranks(padded[t], padded_bias[0])
            expert, weight = slot_expert(rank, slot), slot_weight(scores, rank, slot, k, renormalize, 2.5)
            assert int(expert) == int(experts[t, slot])
            np.testing.assert_allclose(float(weight), float(weights[t, slot]), rtol=1e-6)
