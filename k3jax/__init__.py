"""k3jax: Kimi K3 (the kimi_linear family) in JAX and Flax.

    from k3jax import K3Model, preset, load, Generator, Sampling, use_implementation
"""

from k3jax import sharding
from k3jax.checkpoint import load
from k3jax.config import ConfigError, K3Config, from_hf_config
from k3jax.implementation import KernelPolicy, get_implementation, use_implementation
from k3jax.inference import Generation, Generator
from k3jax.model import K3Model, MixWeights
from k3jax.presets import preset, preset_hf_config
from k3jax.sampling import Sampling

__all__ = [
    "ConfigError", "Generation", "Generator", "K3Config", "K3Model", "KernelPolicy", "MixWeights", "Sampling", "from_hf_config",
    "get_implementation", "load", "preset", "preset_hf_config", "sharding", "use_implementation",
]
