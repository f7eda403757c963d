"""The Kimi K3 / Kimi Linear decoder: layers from the layer-type pattern, Block AttnRes, the head.

Each layer is its own module (the canonical, unscanned parameter layout). At run time, repeated
groups of layers (the (KDA, KDA, KDA, MLA) pattern) have their parameters stacked and run under one
``lax.scan``, so a 93-layer model compiles 9 layer bodies instead of 93. The AttnRes block commit
is decided from the (traced) layer index, so groups need not align with the 12-layer blocks.

Block AttnRes state machine (K3, spec section 2), per layer L:
    partial_in = x;  h = mix(blocks, partial_in)            # = partial_in while no block is stored
    if L % block_size == 0: blocks.append(partial_in); partial = 0   else: partial = partial_in
    partial += attn(input_layernorm(h));  h = mix(blocks, partial)
    x = partial + ffn(post_attention_layernorm(h))
then x = mix(blocks, partial) with the output query, model.norm and lm_head. Blocks live in a fixed
buffer [N, B, T, D] with a count, N = ceil(layers / block_size).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.arguments import ids
from k3jax.config import K3Config
from k3jax.layers.attn_res import AttnRes
from k3jax.layers.basic import Embed, Keys, Linear, RMSNorm, Rngs
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.mlp import DenseMLP, activation
from k3jax.layers.moe import MoE
from k3jax.sharding.mesh import hold_batch
from k3jax.typing import Array


class MixWeights(NamedTuple):
    """Block AttnRes mixing weights (research output): per layer [L, 2 (attn, mlp), N+1, B, T] and
    the final output mix [N+1, B, T]; the last index, N, is the live partial sum; unused blocks weigh 0."""

    layers: Array
    output: Array


class LayerStats(NamedTuple):
    """What ``K3Model.inspect`` reads in each layer: expert_load [E] (top-k picks per expert over the
    batch's tokens; zeros in a dense layer) and retention [H*K] (KDA: the mean over tokens of exp(g),
    the fraction of its state each channel keeps per token; zeros in an MLA layer)."""

    expert_load: Array
    retention: Array


class Inspection(NamedTuple):
    """``K3Model.inspect``'s result: logits [B, T, V] float32, the Block AttnRes ``MixWeights`` (None
    without AttnRes) and ``LayerStats`` stacked over layers ([L, E] and [L, H*K])."""

    logits: Array
    mix: "MixWeights | None"
    stats: LayerStats


class DecoderLayer(nnx.Module):
    """One layer: attention (KDA or MLA) and feed-forward (dense MLP or MoE), each pre-normed."""

    def __init__(self, cfg: K3Config, layer: int, *, rngs: Rngs, param_dtype=jnp.float32, packed_experts=False):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.input_layernorm = RMSNorm(d, eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, param_dtype=param_dtype)
        if cfg.layer_types[layer] == "kda":
            self.self_attn = KDA(d, cfg.kda, eps, rngs=rngs, param_dtype=param_dtype)
        else:
            self.self_attn = MLA(d, cfg.mla, rngs=rngs, param_dtype=param_dtype)
        act = activation(cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        if cfg.is_moe_layer(layer):
            self.block_sparse_moe = MoE(d, cfg.moe, act, eps, rngs=rngs, param_dtype=param_dtype,
                                        packed_experts=packed_experts)
        else:
            self.mlp = DenseMLP(d, cfg.dense_intermediate_size, act, rngs=rngs, param_dtype=param_dtype)
        if cfg.attn_res_block_size:
            self.self_attention_res = AttnRes(d, eps, param_dtype=param_dtype)
            self.mlp_res = AttnRes(d, eps, param_dtype=param_dtype)

    def attention(self, h: Array, cache=None, ctx: "Positions | None" = None, residual: Array | None = None,
                  stats: bool = False):
        """Attention of the normed input, plus ``residual`` when given; with a cache (``ctx`` given) it
        continues the sequence. Returns (output, cache), and with ``stats`` the KDA retention [H*K]
        (zeros for MLA) third."""
        kda = isinstance(self.self_attn, KDA)
        with jax.named_scope("kda" if kda else "mla"):  # names the kernels in profiles
            norm = self.input_layernorm
            if kda:
                return self.self_attn(h, cache, None if ctx is None else ctx.valid, norm=norm, residual=residual,
                                      stats=stats)
            if ctx is None:
                out = self.self_attn(h, norm=norm, residual=residual), None
            else:
                out = self.self_attn.extend(h, cache, ctx.start, ctx.window, norm=norm, residual=residual)
            return (*out, jnp.zeros((self.cfg.kda.num_heads * self.cfg.kda.head_dim,), jnp.float32)) if stats else out

    def ffn(self, h: Array, residual: Array | None = None, stats: bool = False):
        """The feed-forward of the normed input, plus ``residual`` when given (added by the last
        projection's kernel where ``project`` takes it); with ``stats``, (output, expert load [E])."""
        moe = hasattr(self, "block_sparse_moe")
        with jax.named_scope("moe" if moe else "mlp"):
            if moe:
                return self.block_sparse_moe(h, norm=self.post_attention_layernorm, residual=residual, stats=stats)
            out = self.mlp(h, norm=self.post_attention_layernorm, residual=residual)
            return (out, jnp.zeros((self.cfg.moe.num_experts,), jnp.float32)) if stats else out

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """KDA: conv inputs and the float32 state; MLA: the latent cache of max_len positions."""
        if isinstance(self.self_attn, KDA):
            return self.self_attn.initial_state(batch)
        return self.self_attn.init_cache(batch, max_len, dtype)

    def residual(self, x: Array, cache=None, ctx=None, stats: bool = False):
        """Kimi Linear's plain residual. Returns (x, no mixing weights, cache); with ``stats`` the middle
        entry is (no mixing weights, ``LayerStats``)."""
        x, cache, *retention = self.attention(x, cache, ctx, residual=x, stats=stats)
        x, *load = _split(self.ffn(x, residual=x, stats=stats), stats)
        mix = jnp.zeros((), x.dtype)
        return x, (mix, LayerStats(load[0], retention[0])) if stats else mix, cache

    def attn_res(self, carry: tuple[Array, Array, Array], commit: "bool | Array", cache=None, ctx=None,
                 stats: bool = False):
        """K3's Block AttnRes step. carry = (blocks [N, B, T, D], n_blocks, x); ``commit`` (a Python
        bool for unrolled layers, a traced one in a scan) says this layer starts a block. Returns the
        new carry, the two mixes' weights [2, N+1, B, T] (with ``stats``: and the ``LayerStats``) and
        the layer's cache."""
        blocks, n, partial = carry
        h = self.self_attention_res.deferred(blocks, n, partial)  # computed by its reader (``project``)
        with jax.named_scope("attn_res"):
            w_attn = h.weights()
        blocks, n = _store_block(blocks, n, partial, commit)
        partial, cache, *retention = self.attention(h, cache, ctx, residual=_kept_partial(partial, commit),
                                                    stats=stats)
        h = self.mlp_res.deferred(blocks, n, partial)
        with jax.named_scope("attn_res"):
            w_mlp = h.weights()
        x, *load = _split(self.ffn(h, residual=partial, stats=stats), stats)
        mix = jnp.stack([w_attn, w_mlp])
        return (blocks, n, x), (mix, LayerStats(load[0], retention[0])) if stats else mix, cache


def _held(out: tuple) -> tuple:
    """A layer step's (carry, outputs, cache) with the carry's activations held split by batch on a mesh
    (``k3jax.sharding.hold_batch``; nothing without one)."""
    carry, ys, cache = out
    return hold_batch(carry), ys, cache


def _split(out, stats: bool) -> tuple:
    """A feed-forward's result as a tuple: (y,) or, with ``stats``, (y, expert load)."""
    return out if stats else (out,)


def _kept_partial(partial: Array, commit: "bool | Array") -> Array | None:
    """What the attention's output adds to: nothing where the layer starts a block (a Python True),
    else the partial sum (zeros where a traced commit is true)."""
    if isinstance(commit, bool):
        return None if commit else partial
    return jnp.where(commit, jnp.zeros_like(partial), partial)


def _store_block(blocks: Array, n: Array, partial: Array, commit) -> tuple[Array, Array]:
    """(blocks, n) after a layer that starts a block when ``commit``: partial stored as block n. A
    Python bool decides while tracing (no update at all where it is False: XLA would not always drop a
    slot written back onto itself); a traced one selects."""
    if isinstance(commit, bool):
        return (jax.lax.dynamic_update_index_in_dim(blocks, partial, n, axis=0), n + 1) if commit else (blocks, n)
    slot = jax.lax.dynamic_index_in_dim(blocks, n, axis=0, keepdims=False)
    blocks = jax.lax.dynamic_update_index_in_dim(blocks, jnp.where(commit, partial, slot), n, axis=0)
    return blocks, n + commit.astype(n.dtype)


def _stack(ys: list):
    """Per-layer outputs (arrays or pytrees of them) stacked on a new leading axis."""
    return jax.tree.map(lambda *a: jnp.stack(a), *ys)


def _token_at(x: Array, index: Array) -> Array:
    """x [..., B, T, D] -> [..., B, 1, D]: token index[b] of each sequence b."""
    return x[..., jnp.arange(x.shape[-3]), index, :][..., None, :]


class Positions(NamedTuple):
    """Where new tokens go in each cached sequence: start [B] (position of the first new token)
    and valid [B, T] (real tokens; a prefix of each row, the rest right padding; None: every new
    token is real, as in a decode step, so nothing is masked); window (a static
    int, or None for all): how many leading MLA cache positions the attention reads."""

    start: Array
    valid: Array | None
    window: int | None = None


def layer_groups(cfg: K3Config, scan: bool = True) -> list[tuple[int, int, int]]:
    """Split the stack into (first layer, layers per group, repeats): consecutive identical groups of
    ``cfg.scan_period`` layers are one scanned run; the rest (layer 0's dense group, a short tail)
    run once. K3: [(0, 4, 1), (4, 4, 22), (92, 1, 1)]. ``scan=False`` unrolls: [(0, L, 1)]."""
    P, L = cfg.scan_period, cfg.num_layers
    if not scan:
        return [(0, L, 1)]

    def signature(start: int) -> tuple:
        end = min(start + P, L)
        return tuple((cfg.layer_types[i], cfg.is_moe_layer(i)) for i in range(start, end))

    runs = []
    for sig, starts in itertools.groupby(range(0, L, P), key=signature):
        starts = list(starts)
        if len(sig) == P:
            runs.append((starts[0], P, len(starts)))
        else:
            runs.extend((s, len(sig), 1) for s in starts)
    return runs


class K3Model(nnx.Module):
    """tokens [B, T] int -> logits [B, T, V] float32 (and, on request, the AttnRes mixing weights).

    ``packed_experts`` (default: ``cfg.mx_experts``, true for K3) keeps routed experts as MXFP4
    ``MXTensor`` parameters; False stores them as ``param_dtype`` arrays.
    """

    def __init__(self, cfg: K3Config, *, rngs: Rngs, param_dtype=jnp.float32, packed_experts: bool | None = None):
        self.cfg = cfg
        d = cfg.hidden_size
        rngs = Keys.of(rngs)
        packed = cfg.mx_experts if packed_experts is None else packed_experts
        self.embed_tokens = Embed(cfg.vocab_size, d, rngs=rngs, param_dtype=param_dtype)
        self.layers = nnx.List([
            DecoderLayer(cfg, i, rngs=rngs, param_dtype=param_dtype, packed_experts=packed)
            for i in range(cfg.num_layers)
        ])
        if cfg.attn_res_block_size:
            self.output_attn_res = AttnRes(d, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = Linear(d, cfg.vocab_size, rngs=rngs, param_dtype=param_dtype)

    def _run(self, start: int, size: int, repeats: int, carry, step, caches):
        """Apply layers [start, start + size * repeats) with
        ``step(layer, carry, index, cache) -> (carry, y, cache)``; ``caches`` holds one entry per
        position in the group, stacked over the repeats for a scanned run (None without a cache)."""
        if repeats == 1:
            ys, new_caches = [], []
            for p in range(size):
                carry, y, c = step(self.layers[start + p], carry, start + p, caches[p])
                ys.append(y)
                new_caches.append(c)
            return carry, _stack(ys), new_caches
        graphs, stacks = [], []
        for p in range(size):
            split = [nnx.split(self.layers[start + r * size + p]) for r in range(repeats)]
            graphs.append(split[0][0])
            stacks.append(jax.tree.map(lambda *a: jnp.stack(a), *[s for _, s in split]))

        def body(carry, xs):
            first, states, layer_caches = xs
            ys, new_caches = [], []
            for p in range(size):
                carry, y, c = step(nnx.merge(graphs[p], states[p]), carry, first + p, layer_caches[p])
                ys.append(y)
                new_caches.append(c)
            return carry, (_stack(ys), new_caches)

        firsts = jnp.arange(start, start + size * repeats, size, dtype=jnp.int32)
        carry, (ys, new_caches) = jax.lax.scan(body, carry, (firsts, stacks, caches))
        return carry, jax.tree.map(lambda y: y.reshape(repeats * size, *y.shape[2:]), ys), new_caches

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, scan_layers: bool = True) -> list:
        """An empty inference cache: per layer group, per position in the group, stacked over the
        group's repeats (the layout the scan consumes). MLA latents are kept in ``dtype``."""
        cache = []
        for start, size, repeats in layer_groups(self.cfg, scan_layers):
            entries = []
            for p in range(size):
                per_layer = [self.layers[start + r * size + p].init_cache(batch, max_len, dtype) for r in range(repeats)]
                entries.append(per_layer[0] if repeats == 1 else jax.tree.map(lambda *a: jnp.stack(a), *per_layer))
            cache.append(entries)
        return cache

    def _forward(
        self, tokens: Array, cache: list | None, ctx: Positions | None, scan_layers: bool = True,
        logits_at: Array | None = None, head: bool = True, stats: bool = False,
    ):
        cfg = self.cfg
        x = self.embed_tokens(tokens)
        block = cfg.attn_res_block_size
        if block:
            blocks = jnp.zeros((-(-cfg.num_layers // block), *x.shape), x.dtype)
            carry = (blocks, jnp.asarray(0, jnp.int32), x)
            step = lambda layer, c, i, lc: layer.attn_res(c, i % block == 0, lc, ctx, stats)
        else:
            carry = x
            step = lambda layer, c, i, lc: layer.residual(c, lc, ctx, stats)
        layer_step = step
        step = lambda layer, c, i, lc: _held(layer_step(layer, c, i, lc))
        weights, new_cache = [], []
        for g, run in enumerate(layer_groups(cfg, scan_layers)):
            caches = cache[g] if cache is not None else [None] * run[1]
            carry, ys, run_cache = self._run(*run, carry, step, caches)
            weights.append(ys)
            new_cache.append(run_cache)
        out_weights = None
        if block:
            blocks, n, partial = carry
            if logits_at is not None:  # mix only the tokens the head reads
                blocks, partial = _token_at(blocks, logits_at), _token_at(partial, logits_at)
            with jax.named_scope("attn_res"):
                x, out_weights = self.output_attn_res(blocks, n, partial)
        else:
            x = carry if logits_at is None else _token_at(carry, logits_at)
        ys = jax.tree.map(lambda *a: jnp.concatenate(a), *weights)
        weights, layer_stats = ys if stats else (ys, None)
        mix = MixWeights(weights, out_weights) if block else None
        if stats:
            mix = (mix, layer_stats)
        return (self.logits(x) if head else x), mix, new_cache

    def logits(self, x: Array) -> Array:
        """Final hidden states [..., D] (after the output mix) -> logits [..., V] float32: the norm and the head."""
        with jax.named_scope("lm_head"):
            return self.lm_head(self.norm(x)).astype(jnp.float32)

    def __call__(self, tokens: Array, return_mix_weights: bool = False, scan_layers: bool = True):
        """Full causal forward of tokens [B, T] (no cache): logits [B, T, V] float32.

        ``scan_layers`` runs repeated layer groups under ``lax.scan`` (compiles a few layer bodies;
        stacks their weights on every call); False unrolls every layer (longer compile, no copies). ``tokens``: an
        integer array or nested lists, ids in [0, vocab_size), checked by value unless traced (under jit: shape and
        dtype only); TypeError or ValueError name the argument."""
        tokens = ids("tokens", tokens, self.cfg.vocab_size, ("B", "T"))
        logits, mix, _ = self._forward(tokens, None, None, scan_layers)
        if not return_mix_weights:
            return logits
        if mix is None:
            raise ValueError("return_mix_weights: this model has no Block AttnRes (attn_res_block_size is unset)")
        return logits, mix

    def inspect(self, tokens: Array, scan_layers: bool = True) -> Inspection:
        """The full forward of tokens [B, T] with what it reads inside: the logits, the AttnRes mixing
        weights and each layer's ``LayerStats`` (expert load, KDA retention). Training reads the expert
        load for the router's bias update; the research notebooks read all three."""
        tokens = ids("tokens", tokens, self.cfg.vocab_size, ("B", "T"))
        logits, (mix, stats), _ = self._forward(tokens, None, None, scan_layers, stats=True)
        return Inspection(logits, mix, stats)

    def extend(
        self, tokens: Array, cache: list, start: Array, lengths: Array | None, scan_layers: bool = True,
        logits_at: Array | None = None, window: int | None = None, head: bool = True,
    ) -> tuple[Array, list]:
        """Continue cached sequences: tokens [B, T] at positions start[b] + t; a sequence's tokens at
        or beyond lengths[b] are right padding (lengths None: none is). Returns (logits [B, T, V]
        float32, the new cache). Used for prefill chunks (T tokens) and decode steps (T = 1); the cache must have been made
        by ``init_cache`` with the same ``scan_layers``. ``logits_at`` [B] (indices into the T new
        tokens) computes the head at one token per sequence only: logits [B, 1, V]. ``window``
        (static) lets the MLA layers read only the first ``window`` cache positions; it must exceed
        the position of every real new token. ``head`` False returns the final hidden states [B, T or 1, D]
        instead of logits (``logits`` makes them), for a prefill chunk that ends no prompt."""
        valid = None if lengths is None else start[:, None] + jnp.arange(tokens.shape[1]) < lengths[:, None]
        out, _, cache = self._forward(tokens, cache, Positions(start, valid, window), scan_layers, logits_at, head)
        return out, cache


__all__ = ["K3Model", "DecoderLayer", "Inspection", "LayerStats", "MixWeights", "Positions", "layer_groups"]
