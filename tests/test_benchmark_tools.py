"""Helpers of the A/B benchmarks (benchmarks/switches.py, benchmarks/kernel_profile.py): variant switches that
share an attribute, the time a profile's kernels keep the GPU busy against their span, the host's events."""

import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # after the repo: benchmarks/convert.py is not the package
from kernel_profile import DeviceUse, busy_and_span, device_rounds_table, device_us, host_table  # noqa: E402
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


def test_device_rounds_table():
    """Busy and span as the median of a variant's rounds, kernels from its first, the host's events from its last;
    no kernel table where no round recorded kernels (a CPU), nothing at all without host events either."""
    rounds = {"a": [DeviceUse(1000.0, 3000.0, 12.0, {"x": 1.0}), DeviceUse(3000.0, 5000.0, 12.0, {"y": 9.0}),
                    DeviceUse(2000.0, 4000.0, 12.0, {"z": 4.0})]}
    table = device_rounds_table(rounds, "probe", "a step", digits=2)
    assert "\na | 2.00 | 4.00 | 12.0\n" in table
    assert table.endswith("(the last round)\n" + host_table({"z": 4.0}))
    cpu = {"a": [DeviceUse(0.0, 0.0, 0, {"PjitFunction(f)": 5.0})]}
    assert "busy" not in device_rounds_table(cpu, "probe", "a step") and "PjitFunction(f)" in device_rounds_table(
        cpu, "probe", "a step")
    assert device_rounds_table({"a": [DeviceUse(0.0, 0.0, 0, {})]}, "probe", "a step") == ""
