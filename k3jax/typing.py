"""Shape letters used across k3jax, declared once.

Einsum strings, docstrings and ``# [B, T, H, K]`` comments use these letters:

    B batch            T query length     S key length
    H heads            K key dim          V value dim
    D model width      E experts          C tile length
    R latent rank      F expert (or MLP) width
    N sources of a Block AttnRes mix (stored blocks, then the live partial sum)

The model description (``docs/model.md``) uses these letters too; public sources often write d for the
model width and D for a head dim.
"""

from typing import TypeAlias

import jax

Array: TypeAlias = jax.Array

__all__ = ["Array"]
