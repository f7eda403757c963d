"""benchmarks/variants.py: each variant is the default KernelPolicy with exactly its named fields changed, each
of which turns a choice off."""

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
import variants  # noqa: E402
from k3jax import KernelPolicy  # noqa: E402


@pytest.mark.parametrize("changes", [variants.DECODE, variants.PREFILL])
def test_each_variant_differs_from_the_default_in_its_fields_only(changes):
    built = variants.policies(changes, [])
    assert list(built) == ["default", *changes] and built["default"] == KernelPolicy()
    default = dataclasses.asdict(KernelPolicy())
    for name, fields in changes.items():
        policy = dataclasses.asdict(built[name])
        differ = {f for f in default if policy[f] != default[f]}
        assert differ == set(fields), name


def test_named_variants_and_unknown_names():
    assert list(variants.policies(variants.PREFILL, ["mix by XLA"])) == ["default", "mix by XLA"]
    with pytest.raises(SystemExit, match="unknown variants"):
        variants.policies(variants.PREFILL, ["no such variant"])
