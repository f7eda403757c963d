"""benchmarks/kernel_profile.py: the decode step's critical path (the longest chain of dependent kernels in an
HLO module's entry computation, each weighed by its device time plus a launch gap), the work a call repeats on its
weights alone, the time a profile's kernels keep the GPU busy against their span, and the host's events."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
from kernel_profile import (DeviceTimes, DeviceUse, busy_and_span, chain_listing, chain_table,  # noqa: E402
                            critical_path, device_rounds_table, device_us, entry_operands, host_table, source_paths,
                            weight_only, weight_only_table)

# Two chains into k3 (k1 -> k3, k2 -> k3 through a tuple and a get-tuple-element) and k4 on its own; a called
# computation, tuple shapes, a TPU-style layout with parentheses and a backend config holding '%' names
# must not read as operands.
HLO = """HloModule decode, entry_computation_layout={(f32[2]{0})->f32[2]{0}}

%fused_computation.1 (param_0: f32[2]) -> f32[2] {
  %param_0 = f32[2]{0} parameter(0)
  ROOT %k9 = f32[2]{0} sine(%param_0)
}

ENTRY %main.9 (a: f32[2], b: (f32[2], s32[])) -> (f32[2], f32[2]) {
  %a = f32[2]{0} parameter(0), metadata={op_name="a"}
  %b = (f32[2]{0:T(8,128)}, s32[]) parameter(1)
  %gte = f32[2]{0} get-tuple-element(%b), index=0
  %k1 = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/kda/mix"}
  %k2 = f32[2]{0} fusion(%gte), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/moe/pick"}
  %pair = (f32[2]{0}, f32[2]{0}) tuple(%k1, %k2)
  %k2b = f32[2]{0} get-tuple-element(%pair), index=1
  %k3 = f32[2]{0} custom-call(%k1, %k2b), custom_call_target="triton", backend_config={"ir": "%k4 = %a"}, metadata={op_name="jit(step)/moe/down"}
  %k4 = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(step)/head"}
  ROOT %out = (f32[2]{0}, f32[2]{0}) tuple(%k3, %k4)
}
"""
PATHS = {"k1": "jit(step)/kda/mix", "k2": "jit(step)/moe/pick", "k3": "jit(step)/moe/down", "k4": "jit(step)/head"}


def test_entry_operands_reads_only_the_operand_lists():
    operands = dict(entry_operands(HLO))
    assert list(operands) == ["a", "b", "gte", "k1", "k2", "pair", "k2b", "k3", "k4", "out"]
    assert operands["b"] == [] and operands["gte"] == ["b"] and operands["k1"] == ["a"]
    assert operands["k3"] == ["k1", "k2b"] and operands["out"] == ["k3", "k4"]


@pytest.mark.parametrize("gap,k2_us,expected", [
    (1.0, 3.0, ["k1", "k3"]),         # k1 -> k3: 6 + 3 = 9 > k4: 8.5 > k2 -> k3: 4 + 3 = 7
    (1.0, 6.0, ["k2", "k3"]),         # k2 -> k3: 7 + 3 = 10
    (0.0, 3.0, ["k4"]),               # without gaps k4 alone (7.5) outweighs k1 -> k3 (5 + 2)
])
def test_critical_path_by_hand(gap, k2_us, expected):
    times = DeviceTimes({"k1": 5.0, "k2": k2_us, "k3": 2.0, "k4": 7.5}, {"k1": 1, "k2": 1, "k3": 1, "k4": 1}, 0.0)
    chain = critical_path(HLO, times, gap)
    assert [link.name for link in chain] == expected
    total = sum(times.us[n] + gap for n in expected)
    assert chain_table(chain, PATHS).startswith(f"critical path {total:,.1f} us: ")
    assert f"+ {gap * len(expected):,.1f} us of launch gaps" in chain_table(chain, PATHS)
    links = chain_listing(chain, PATHS).splitlines()[1:]
    assert [line.split()[2] for line in links] == expected
    assert [float(line.split()[0]) for line in links] == [times.us[n] for n in expected]


@pytest.mark.parametrize("k3_kernels,expected", [(1, ["k4"]), (2, ["k1", "k3"])])
def test_each_kernel_of_an_instruction_pays_a_gap(k3_kernels, expected):
    """k3's 2 us as one kernel: k1 -> k3 weighs 6 + 3 = 9 < k4's 9.7; as two kernels 6 + 4 = 10 > 9.7."""
    times = DeviceTimes({"k1": 5.0, "k3": 2.0, "k4": 8.7}, {"k1": 1, "k3": k3_kernels, "k4": 1}, 0.0)
    assert [link.name for link in critical_path(HLO, times, 1.0)] == expected


def test_compiled_modules_parse_in_operand_order():
    """On a real optimized module every operand of an entry instruction is an earlier entry instruction."""
    def f(x, w):
        h = jnp.tanh(x @ w)
        return (h @ w.T).sum(), jnp.sin(x).mean()

    hlo = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile().as_text()
    seen = set()
    for name, operands in entry_operands(hlo):
        assert set(operands) <= seen, (name, operands)
        seen.add(name)
    assert len(seen) >= 4


# Weights w0, w1, an activation x and a parameter y without metadata: a copy of the two weights joined (cat), a pad of
# that with a constant (pad), zeros from a constant (zeros), two instructions that read x (mix directly, out through
# mix) and one that reads y (scaled: y is not known to be a weight).
WEIGHTS_HLO = """HloModule prefill, entry_computation_layout={(f32[2]{0}, f32[2]{0}, f32[4]{0})->f32[4]{0}}

ENTRY %main.3 (weights_0_.1: f32[2], weights_1_.1: f32[2], x.1: f32[4], y.1: f32[4]) -> (f32[4], f32[4]) {
  %weights_0_.1 = f32[2]{0} parameter(0), metadata={op_name="weights[0]"}
  %weights_1_.1 = f32[2]{0} parameter(1), metadata={op_name="weights[1]"}
  %x.1 = f32[4]{0} parameter(2), metadata={op_name="x"}
  %y.1 = f32[4]{0} parameter(3)
  %c = f32[] constant(0)
  %cat = f32[4]{0} fusion(%weights_0_.1, %weights_1_.1), kind=kLoop, calls=%f, metadata={op_name="jit(g)/kda/dot"}
  %pad = f32[6]{0} fusion(%cat, %c), kind=kLoop, calls=%f, metadata={op_name="jit(g)/moe/pad"}
  %zeros = f32[4]{0} broadcast(%c), dimensions={}
  %mix = f32[4]{0} fusion(%x.1, %cat), kind=kLoop, calls=%f, metadata={op_name="jit(g)/kda/mix"}
  %scaled = f32[4]{0} fusion(%y.1, %c), kind=kLoop, calls=%f
  ROOT %out = (f32[4]{0}, f32[4]{0}) tuple(%mix, %zeros)
}
"""


def test_weight_only_work_by_hand():
    """Instructions from the weights and constants alone, in order; none that reads x, directly or not."""
    assert weight_only(WEIGHTS_HLO) == ["cat", "pad", "zeros"]
    assert weight_only(WEIGHTS_HLO, argument="x") == ["zeros"]  # x alone reads nothing computed
    times = DeviceTimes({"cat": 3.0, "pad": 1.5, "mix": 9.0}, {"cat": 1, "pad": 1, "mix": 1}, 0.0)
    table = weight_only_table(weight_only(WEIGHTS_HLO), times, {"cat": "jit(g)/kda/dot", "pad": "jit(g)/moe/pad"})
    lines = table.splitlines()
    assert lines[0] == "work on the weights and constants alone: 4.5 us per call in 2 kernels"
    assert [line.split()[2] for line in lines[1:]] == ["cat", "pad"] and lines[1].endswith("-> kda/dot")


def test_weight_only_work_in_a_compiled_module():
    """A real optimized module: the weights' scaling is found, and nothing found depends on x."""
    def g(weights, x):
        a, b = weights
        return x @ (a.T * 2.0) + jnp.sin(b)[None, :8] * x

    weights, x = [jnp.ones((8, 8)), jnp.ones((16,))], jnp.ones((4, 8))
    hlo = jax.jit(g).lower(weights, x).compile().as_text()
    paths = source_paths(hlo)
    found = weight_only(hlo)
    reads_x = {name for name, path in paths.items() if path == "x"}  # the parameter, then all downstream of it
    assert reads_x
    for name, operands in entry_operands(hlo):
        if set(operands) & reads_x:
            reads_x.add(name)
    assert found and not set(found) & reads_x
    assert any(paths.get(name, "").endswith("/mul") for name in found)


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
