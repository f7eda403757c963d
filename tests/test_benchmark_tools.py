"""Helpers of the A/B benchmarks (benchmarks/switches.py, benchmarks/kernel_profile.py): variant switches that
share an attribute, the time a profile's kernels keep the GPU busy against their span, the host's events."""

import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # after the repo: benchmarks/convert.py is not the package
from kernel_profile import busy_and_span, device_us, host_table  # noqa: E402
from switches import Switches, command_buffer_candidates  # noqa: E402


def test_variants_that_share_an_attribute_each_set_their_own_value():
    """A change and two candidates on one options dict, a change on another attribute: each variant leaves every
    attribute at its original value except the ones it names, whatever the order the settings were given in."""
    owner = types.SimpleNamespace(options={"a": 1}, flag=True)
    candidates = command_buffer_candidates(owner, "options")
    switches = Switches({"options off": (owner, "options", {}), "flag off": (owner, "flag", False)}, candidates)
    assert "all candidates" not in switches.variants  # the candidates all set `options`
    expected = {
        "default": ({"a": 1}, True),
        "options off": ({}, True),
        "flag off": ({"a": 1}, False),
        "all off": ({}, False),
        "skip temp updates": ({"a": 1, "xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}, True),
        "no command buffer": ({"a": 1, "xla_gpu_enable_command_buffer": ""}, True),
        "exclusive lock": ({"a": 1, "xla_gpu_require_exclusive_lock": True}, True),
    }
    for variant in [*expected, "default", "skip temp updates", "all off"]:
        switches.use(variant)
        assert (owner.options, owner.flag) == expected[variant], variant


@pytest.mark.parametrize("intervals, expected", [
    ([], (0.0, 0.0)),
    ([(0.0, 2.0)], (2.0, 2.0)),
    ([(10.0, 1.0), (0.0, 2.0), (5.0, 3.0)], (6.0, 11.0)),  # three apart, given out of order: gaps of 3 and 2
    ([(0.0, 4.0), (1.0, 2.0), (3.0, 3.0), (8.0, 1.0)], (7.0, 9.0)),  # one inside another, one past its end
    ([(0.0, 2.0), (2.0, 2.0)], (4.0, 4.0)),  # end to end
])
def test_busy_and_span(intervals, expected):
    assert busy_and_span(intervals) == expected


def test_host_events_of_a_jitted_call():
    """On the CPU (no device events) the profile still has the host's: the jitted function's dispatch, named for
    it, and the time it took."""

    def probe_call(x):
        return jnp.sin(x) @ x

    f, x = jax.jit(probe_call), jnp.ones((64, 64))
    use = device_us(lambda: f(x), calls=3)
    assert (use.busy, use.span, use.kernels) == (0.0, 0.0, 0)
    assert use.host["PjitFunction(probe_call)"] > 0
    assert "PjitFunction(probe_call)" in host_table(use.host, top=len(use.host))
