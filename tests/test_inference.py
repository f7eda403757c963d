"""Inference: cached decode equals the full forward at every position, chunked prefill equals one
shot, absorbed MLA equals expanded MLA, sampling and stopping behave, bad input is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from small_models import build, randomize_zero_params
from k3jax.implementation import KernelPolicy, use_implementation
from k3jax.inference import DECODE_GPU_OPTIONS, DETERMINISTIC_GPU_OPTIONS, PREFILL_GPU_OPTIONS, Generator, on_gpu
from k3jax.layers.mla import MLA
from k3jax.model import K3Model, layer_groups
from k3jax.presets import preset
from k3jax.sampling import Sampling, token_logprobs
from k3jax.sampling import sample as sample_tokens
from reference_numpy import rel_err

PROMPT_LENGTHS = [5, 19, 12]  # ragged, not multiples of 16; 19 spans two 16-token prefill chunks
DECODE_STEPS = 5


# Whole-model float32 tolerance, above the models' own rounding noise. tiny's random 14-layer Block AttnRes stack
# amplifies rounding: perturbing its parameters by float32 unit roundoff (relative 1.2e-7, random) moves its logits,
# in this file's measure (the worst of the steps below), by 1.5e-4 to 2.1e-3 over 8 draws, tiny_linear's by 5e-6 to
# 1.8e-5; cached and uncached paths round differently, so they agree only to that level (the earlier bars, 2e-4 and
# 1e-5, sat inside it, and an exact rewrite of the short conv crossed one). A wrong conv state after a ragged
# prefill (off by one token) errs by 0.5-1.4 (twenty-eighth session).
TOLERANCE = {"tiny": 5e-3, "tiny_linear": 5e-5}


@pytest.fixture(scope="module")
def generators(small_model):
    return {
        # attend_block 16: the MLA layers read 16, 32, then all 40 cache positions as sequences grow; generate runs
        # 3 decode steps a call, so 4 new tokens take one call and 6 or 8 take several
        "chunked": Generator(small_model.model, max_len=40, prefill_chunk=16, attend_block=16, steps_per_call=3),
        "one_shot": Generator(small_model.model, max_len=40, prefill_chunk=64, scan_layers=True),
    }


def sequences(cfg, seed=0, total=max(PROMPT_LENGTHS) + DECODE_STEPS):
    return np.asarray(jax.random.randint(jax.random.key(seed), (len(PROMPT_LENGTHS), total), 0, cfg.vocab_size))


def test_decode_logits_equal_full_forward_at_every_position(small_model, generators):
    gen = generators["chunked"]
    seqs = sequences(small_model.cfg)
    full = small_model.forward(small_model.params, jnp.asarray(seqs))  # [B, T, V]
    prompts = [list(seqs[b, :n]) for b, n in enumerate(PROMPT_LENGTHS)]
    last, cache = gen.prefill(prompts, gen.init_cache(len(prompts)))
    rows = np.arange(len(prompts))
    lengths = np.array(PROMPT_LENGTHS)
    tol = TOLERANCE[small_model.cfg.name]
    assert rel_err(last, full[rows, lengths - 1]) < tol
    for step in range(DECODE_STEPS):
        pos = lengths + step
        _, logits, cache = gen.decode_step(jnp.asarray(seqs[rows, pos]), cache, jnp.asarray(pos), jax.random.key(0),
                                           window=gen.window(int(pos.max()) + 1))
        assert rel_err(logits, full[rows, pos]) < tol, step


def per_layer(cache, cfg, scan_layers):
    """The cache as one entry per layer, whatever the grouping (scanned runs are stacked)."""
    layers = []
    for (start, size, repeats), entries in zip(layer_groups(cfg, scan_layers), cache):
        for r in range(repeats):
            layers += [e if repeats == 1 else jax.tree.map(lambda a: a[r], e) for e in entries]
    return layers


def test_chunked_prefill_equals_one_shot(small_model, generators):
    """16-token chunks through unrolled layers against one chunk through scanned layer groups."""
    prompts = [list(r[:n]) for r, n in zip(sequences(small_model.cfg, seed=1), PROMPT_LENGTHS)]
    results = {}
    for name, gen in generators.items():
        last, cache = gen.prefill(prompts, gen.init_cache(len(prompts)))
        results[name] = last, per_layer(cache, small_model.cfg, gen.scan_layers)
    (a, cache_a), (b, cache_b) = results["chunked"], results["one_shot"]
    tol = TOLERANCE[small_model.cfg.name]
    assert rel_err(a, b) < tol
    for x, y in zip(jax.tree.leaves(cache_a), jax.tree.leaves(cache_b)):
        # MLA cache positions past each prompt hold padding, which differs by chunking; compare the rest
        if x.ndim >= 3 and x.shape[-2] == 40:
            mask = (np.arange(40)[None, :] < np.array(PROMPT_LENGTHS)[:, None])
            mask = mask.reshape((1,) * (x.ndim - 3) + mask.shape + (1,))
            x, y = jnp.where(mask, x, 0), jnp.where(mask, y, 0)
        assert float(jnp.max(jnp.abs(x - y))) <= tol * (1 + float(jnp.max(jnp.abs(y))))


def test_absorbed_mla_equals_expanded():
    cfg = preset("tiny").mla
    mla = MLA(37, cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (2, 11, 37))
    expanded = mla(x)
    cache = mla.init_cache(2, 16)
    whole, _ = mla.extend(x, cache, jnp.zeros(2, jnp.int32))
    assert rel_err(whole, expanded) < 1e-5
    outs = []
    for t in range(11):
        o, cache = mla.extend(x[:, t : t + 1], cache, jnp.full((2,), t, jnp.int32))
        outs.append(o)
    assert rel_err(jnp.concatenate(outs, axis=1), expanded) < 1e-5


def test_bf16_mla_stays_near_float32():
    """A bf16 MLA (weights, inputs, cache; on GPU the attention matmuls then take bf16 operands)
    stays within bf16 rounding of the float32 expanded attention, in both forms."""
    cfg = preset("tiny").mla
    mla = MLA(37, cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (2, 11, 37))
    exact = mla(x)
    graph, params = nnx.split(mla)
    half = nnx.merge(graph, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))
    xb = x.astype(jnp.bfloat16)
    absorbed, _ = half.extend(xb, half.init_cache(2, 16, jnp.bfloat16), jnp.zeros(2, jnp.int32))
    for out in (half(xb), absorbed):
        assert out.dtype == jnp.bfloat16
        assert rel_err(out.astype(jnp.float32), exact) < 3e-2


# 6 new tokens after a prompt of 14: two calls of 3 steps, the first reading past the 16-position window at its last
# step; 8 after a prompt of 32: the cache's 40 positions filled, the third call's last step past them (held at the
# last slot, its token dropped). The logprobs come from the logits, so a call that reads too few cache positions
# fails here even where its argmax does not flip.
@pytest.mark.parametrize("prompt_lengths, new_tokens", [([5, 14, 12], 6), ([5, 19, 32], 8)])
def test_greedy_generation_matches_full_forward_argmax(small_model, generators, prompt_lengths, new_tokens):
    gen = generators["chunked"]
    prompts = [list(r[:n]) for r, n in zip(sequences(small_model.cfg, seed=2, total=40), prompt_lengths)]
    out = gen.generate(prompts, max_new_tokens=new_tokens)
    # the uncached model on right-padded rows (causal: padding after a position cannot change it)
    seqs = np.zeros((len(prompts), max(prompt_lengths) + new_tokens), np.int32)
    lengths = np.array(prompt_lengths)
    for b, p in enumerate(prompts):
        seqs[b, : len(p)] = p
    rows, logprobs = np.arange(len(prompts)), []
    for _ in range(new_tokens):
        logits = small_model.forward(small_model.params, jnp.asarray(seqs))[rows, lengths - 1]
        seqs[rows, lengths] = np.asarray(jnp.argmax(logits, axis=-1))
        logprobs.append(np.asarray(jax.nn.log_softmax(logits, axis=-1))[rows, seqs[rows, lengths]])
        lengths = lengths + 1
    for b, (prompt, new) in enumerate(zip(prompts, out.tokens)):
        assert new == list(seqs[b, len(prompt) : len(prompt) + new_tokens])
    for step, expected in enumerate(logprobs):
        assert rel_err(np.array(out.logprobs)[:, step], expected) < TOLERANCE[small_model.cfg.name], step


def test_decode_steps_in_one_call_equal_steps_one_by_one(small_model, generators):
    """Sampled, so each step's key (folded from the step index carried on the device) must match too."""
    gen = generators["chunked"]
    prompts = [list(r[:n]) for r, n in zip(sequences(small_model.cfg, seed=4), PROMPT_LENGTHS)]
    warm, key = Sampling(temperature=1.3, top_k=50, top_p=0.9), jax.random.key(3)
    logits, prefilled = gen.prefill(prompts, gen.init_cache(len(prompts)))
    first, positions = jnp.argmax(logits, -1).astype(jnp.int32), jnp.asarray(PROMPT_LENGTHS)
    window = gen.window(max(PROMPT_LENGTHS) + 3)
    tokens, cache, one_by_one, logprobs = first, jax.tree.map(jnp.copy, prefilled), [], []
    for s in range(3):
        tokens, logits, cache = gen.decode_step(tokens, cache, positions + s, key, warm, window, jnp.int32(s))
        one_by_one.append(np.asarray(tokens))
        logprobs.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[np.arange(3), tokens])
    in_one_call, logprobs_in_one_call, _ = gen.decode_steps(first, prefilled, positions, key, 3, warm, window)
    np.testing.assert_array_equal(np.asarray(in_one_call), np.stack(one_by_one))
    np.testing.assert_allclose(np.asarray(logprobs_in_one_call), np.stack(logprobs), rtol=1e-5, atol=1e-5)


def test_sampling_is_reproducible_and_stops_per_sequence(small_model, generators):
    gen = generators["chunked"]
    prompts = [list(r[:n]) for r, n in zip(sequences(small_model.cfg, seed=3), PROMPT_LENGTHS)]
    warm = Sampling(temperature=1.3, top_k=50, top_p=0.9)
    a = gen.generate(prompts, 6, warm, seed=11).tokens
    assert a == gen.generate(prompts, 6, warm, seed=11).tokens
    assert a != gen.generate(prompts, 6, warm, seed=12).tokens
    eos = a[1][2]  # stop the second sequence at its third token
    streamed = [[] for _ in prompts]

    def on_token(tokens, active):
        for b in np.flatnonzero(active):
            streamed[b].append(int(tokens[b]))

    stopped = gen.generate(prompts, 6, warm, seed=11, eos_id=eos, on_token=on_token).tokens
    assert stopped[1] == a[1][: a[1].index(eos) + 1]
    # the other sequences run on as without the stop (each step is dispatched before the last one's tokens are read)
    assert [t for b, t in enumerate(stopped) if b != 1 and eos not in t] == [
        t for b, t in enumerate(a) if b != 1 and eos not in t]
    assert all(len(t) <= 6 for t in stopped)
    assert streamed == stopped


def test_sample_filters():
    logits = jax.random.normal(jax.random.key(5), (4, 97)) * 3
    key = jax.random.key(6)
    sample = jax.jit(sample_tokens, static_argnames="sampling")
    greedy = jnp.argmax(logits, -1)
    assert (sample(logits, key, Sampling()) == greedy).all()
    assert (sample(logits, key, Sampling(2.0, 1, 1.0)) == greedy).all()  # top-k 1 is greedy at any temperature
    assert (sample(logits, key, Sampling(2.0, 0, 1e-6)) == greedy).all()  # top-p tiny keeps only the top token
    top5 = jnp.argsort(-logits, -1)[:, :5]
    for seed in range(20):
        k = jax.random.key(seed)
        assert bool((top5 == sample(logits, k, Sampling(5.0, 5))[:, None]).any(-1).all())
        # a filter that keeps every token draws what plain temperature sampling draws
        assert (sample(logits, k, Sampling(1.5, 97)) == sample(logits, k, Sampling(1.5))).all()


def test_token_logprobs_are_the_log_softmax_at_the_tokens():
    """Large bf16 logits (a naive exp overflows float32); against float64 NumPy."""
    logits = (jax.random.normal(jax.random.key(7), (3, 97)) * 60).astype(jnp.bfloat16)
    tokens = jnp.array([0, 50, 96], jnp.int32)
    exact = np.asarray(logits.astype(jnp.float32), np.float64)
    exact = exact - exact.max(-1, keepdims=True)
    exact = exact - np.log(np.exp(exact).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(token_logprobs(logits, tokens)), exact[np.arange(3), tokens], rtol=1e-5,
                               atol=1e-4)


def test_top_p_keeps_the_smallest_nucleus():
    """Probabilities 0.5, 0.3, 0.15, 0.05: top-p 0.7 keeps the first two (mass above the third is 0.8)."""
    logits = jnp.log(jnp.array([[0.15, 0.5, 0.05, 0.3]]))
    drawn = {int(sample_tokens(logits, jax.random.key(s), Sampling(1.0, 0, 0.7))[0]) for s in range(64)}
    assert drawn == {1, 3}


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[1, 2], [3, 999999]], {}, r"prompts\[1\]: token id 999999 outside"),
        ([[1, 2], []], {}, r"prompts\[1\]: empty prompt"),
        ([], {}, "empty batch"),
        ([list(range(30))], {"max_new_tokens": 20}, r"exceed the cache \(max_len 40\)"),
        ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_requests_are_refused(small_model, generators, prompts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generators["chunked"].generate(prompts, **{"max_new_tokens": 4, **kwargs})


def test_attention_window_sizes(small_model, generators):
    gen = generators["chunked"]  # attend_block 16, max_len 40
    assert [gen.window(end) for end in (1, 16, 17, 32, 33, 40)] == [16, 16, 32, 32, 40, 40]
    for kwargs, match in [({"attend_block": 0}, "attend_block"), ({"max_len": 1}, "max_len"),
                          ({"prefill_chunk": 0}, "prefill_chunk"), ({"steps_per_call": 0}, "steps_per_call")]:
        with pytest.raises(ValueError, match=match):
            Generator(small_model.model, **kwargs)


@pytest.mark.parametrize(
    "kwargs, match", [({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"),
                      ({"top_p": 1.5}, "top_p")]
)
def test_invalid_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


def test_gpu_options_are_xla_compile_options(monkeypatch):
    """The decode step's and the prefill's GPU compile options (the concurrent command-buffer schedule; the dot
    merger off), each with the deterministic ones as ``on_gpu`` merges them, are XLA options a compile accepts (on
    any backend) and that leave the result as it is, where a misspelt value is refused."""
    merged = lambda x, a, b: (x @ a, x @ b)  # two matmuls of one input: what the dot merger joins
    x, a, b = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate([(4, 8), (8, 16), (8, 8)]))
    want = merged(x, a, b)
    assert on_gpu(DECODE_GPU_OPTIONS, deterministic=True) is None  # none off a GPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert on_gpu(PREFILL_GPU_OPTIONS) == PREFILL_GPU_OPTIONS
    both = [on_gpu(options, deterministic=True) for options in (DECODE_GPU_OPTIONS, PREFILL_GPU_OPTIONS)]
    assert both == [{**options, **DETERMINISTIC_GPU_OPTIONS} for options in (DECODE_GPU_OPTIONS, PREFILL_GPU_OPTIONS)]
    monkeypatch.undo()
    for options in (DECODE_GPU_OPTIONS, PREFILL_GPU_OPTIONS, *both):
        got = jax.jit(merged, compiler_options=options).lower(x, a, b).compile()(x, a, b)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    misspelt = {name: value[:-1] for name, value in DECODE_GPU_OPTIONS.items()}
    with pytest.raises(Exception, match="not a valid enum value"):
        jax.jit(merged, compiler_options=misspelt).lower(x, a, b).compile()


def test_pallas_batch_one_decode_matvec_kernel_equals_einsums():
    """The Pallas path end to end at batch 1 (kernels in interpret mode: chunked KDA prefill, the KDA
    decode step, expert selection, the MoE), decode steps with the one-row kernels (each AttnRes mix and
    the norm after it in one, then the matvecs) against the same steps with XLA's mixes and einsums, from
    one prefilled cache (tiny: every K3 feature; its experts as float32 arrays, since the MXFP4 kernels
    read bf16 activations, where a one-ulp float32 difference can flip a rounding that tiny's random
    14-layer stack amplifies: seen at 3.4e-3). In float32 throughout the two forms differ in summation
    order only; a wrong mix moves the logits by tens of percents (checked: mixing the unused blocks too,
    32-99%; the blocks reversed, 124-151%)."""
    model = K3Model(preset("tiny"), rngs=nnx.Rngs(0), packed_experts=False)
    randomize_zero_params(model)
    seq = sequences(model.cfg, seed=3)[0, :10]
    steps = {}
    with use_implementation("pallas"):
        with_kernel = Generator(model, max_len=16, prefill_chunk=16, attend_block=16)
        _, prefilled = with_kernel.prefill([list(seq[:7])], with_kernel.init_cache(1))
    einsums = KernelPolicy(matvec_max_rows=0, mix_kernel_any_rows=False)
    for name, policy in (("kernel", KernelPolicy()), ("einsums", einsums)):
        with use_implementation("pallas", policy=policy):  # read when the decode step is traced
            gen = with_kernel if name == "kernel" else Generator(model, max_len=16, attend_block=16)
            cache = jax.tree.map(jnp.copy, prefilled)  # each decode donates its cache
            logits = []
            for pos in range(7, 10):
                _, step_logits, cache = gen.decode_step(jnp.asarray(seq[pos : pos + 1]), cache, jnp.asarray([pos]),
                                                        jax.random.key(0), window=16)
                logits.append(step_logits[0])
            steps[name] = logits
    for got, want in zip(steps["kernel"], steps["einsums"]):
        assert rel_err(got, want) < 1e-4  # seen 1.7e-5: float32 order, through 14 random layers
