"""Where the device time of a jitted call goes: a profiler trace, summed per kernel and per model part,
and the chain of kernels that the call's dependencies force (its critical path).

    times = device_times(run_once, calls=5)
    print(kernel_table(times, paths))
    chain = critical_path(hlo, times)
    print(chain_table(chain, paths))
    print(chain_listing(chain, paths))  # every link, in order
    print(weight_only_table(weight_only(hlo), times, paths))  # work every call repeats on the weights
    use = device_us(run_once, calls=20)  # device busy and span per call: is the GPU waiting?
    print(host_table(use.host))  # and what was the host doing

``run_once()`` makes one call (a closure, so it can thread a donated cache from call to call);
``hlo`` is the optimized HLO text that XLA wrote when run with
``XLA_FLAGS="--xla_dump_to=folder --xla_dump_hlo_as_text --xla_dump_hlo_module_re=..."`` (so nothing
compiles twice): ``dumped_hlo(folder, "decode")``; ``paths`` maps its instruction names to source paths,
``source_paths(hlo)``.

Each kernel's HLO op is mapped to its JAX source path (the ``op_name`` in the compiled HLO's metadata),
so fusions read as "moe/..." (the model's named scopes) rather than "fusion.123"; ops the dump does
not name show as "?". Works on any backend that records device events (GPU); elsewhere the table is
empty. Under the profiler XLA runs a call's kernels one by one rather than in its command buffer (CUDA graph),
unless compiled with ``xla_enable_command_buffers_during_profiling``; the profiles here add
``--xla_gpu_enable_command_buffer=`` to XLA_FLAGS so that the dumped HLO is the one that ran.

The critical path: in the decode step's command buffer in XLA's concurrent order
(``k3jax.inference.DECODE_GPU_OPTIONS``) a kernel starts once the kernels it reads from are done, so the
step takes about its longest chain of dependent kernels, each with one launch gap (about 0.7 us on the
H200), and kernels beside that chain cost nothing (benchmarks/HISTORY.md, 2026-12-02).
``critical_path`` finds that chain in the entry computation's operand graph, weighing each instruction by
its kernels' device time (from a profile with command buffers off) plus a gap per kernel.

Work on the weights alone: ``weight_only`` lists the entry instructions computed from the jitted function's
``weights`` argument and constants only, which every call repeats on the same values. At a `mini` prefill chunk
these were 33 copies of the layers' projection weights, XLA's dot merger joining each layer's matmuls into one
(benchmarks/HISTORY.md, 2026-12-03; the prefill now compiles without it).
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.profiler import ProfileData

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]+)\"", re.M)
_PARAMETER = re.compile(r" parameter\(\d+\)(?:.*?op_name=\"([^\"]*)\")?")
_SKIP_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source code", "TraceMe")


def dumped_hlo(folder: str, module: str) -> str:
    """The optimized HLO text of the newest dumped module whose name contains ``module`` ("" if none)."""
    files = sorted(glob.glob(f"{folder}/**/*{module}*after_optimizations.txt", recursive=True))
    if not files:
        return ""
    with open(files[-1]) as f:
        return f.read()


def source_paths(hlo: str) -> dict[str, str]:
    """HLO instruction name -> JAX op_name (its metadata)."""
    return dict(_OP_NAME.findall(hlo))


def short_path(op_name: str, depth: int = 4) -> str:
    """'jit(f)/moe/jit(g)/grouped_mx_matmul/while/body' -> the first `depth` parts without the jit
    wrappers ('moe/grouped_mx_matmul/while/body'); the model's named scopes come first."""
    parts = [p for p in op_name.split("/") if not p.startswith(("jit(", "pjit(", "checkpoint"))]
    return "/".join(parts[:depth])


def _device_events(profile: ProfileData):
    """(kernel or HLO op name, start in ns, duration in ns) for every event on a device's stream lines."""
    for plane in profile.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name.startswith(_SKIP_LINES):
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                yield str(stats.get("hlo_op", ev.name)), ev.start_ns, ev.duration_ns


def _host_events(profile: ProfileData):
    """(name, duration in ns) for every event on the host's threads but Python's own frames (named "$file:line
    function" when the profiler traces Python): the runtime's annotated work, such as dispatching a jitted call or
    updating and launching its command buffer."""
    for plane in profile.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for ev in line.events:
                if not ev.name.startswith("$"):
                    yield ev.name, ev.duration_ns


def busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """Of (start, duration) intervals: the time at least one of them runs (their union) and the time from
    the first start to the last end."""
    busy, end, first = 0.0, None, None
    for start, duration in sorted(intervals):
        first = start if first is None else first
        stop = start + duration
        if end is None or start >= end:
            busy += duration
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, (end - first if intervals else 0.0)


class DeviceTimes(NamedTuple):
    """Per call: device us by HLO op, kernels by HLO op, and the wall time in us; then the us per call in which
    at least one kernel ran (``busy``) and from the first kernel's start to the last one's end (``span``)."""

    us: dict[str, float]
    kernels: dict[str, float]
    wall: float
    busy: float = 0.0
    span: float = 0.0
    host: dict[str, float] | None = None  # host us per call by event name (nested events each count)


def device_times(run_once: Callable[[], Any], calls: int = 5) -> DeviceTimes:
    """Call ``run_once`` ``calls`` times under the profiler; device microseconds and kernels per call by
    HLO op."""
    jax.block_until_ready(run_once())
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        t = time.perf_counter()
        for _ in range(calls):
            out = run_once()
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t) / calls * 1e6
    files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    us, kernels, intervals = collections.Counter(), collections.Counter(), []
    profile = ProfileData.from_file(files[0]) if files else None  # read once: both event kinds come from it
    for name, start, duration in _device_events(profile) if profile is not None else ():
        us[name] += duration / 1e3 / calls
        kernels[name] += 1 / calls
        intervals.append((start, duration))
    busy, span = busy_and_span(intervals)
    host = collections.Counter()
    for name, duration in _host_events(profile) if profile is not None else ():
        host[name] += duration / 1e3 / calls
    return DeviceTimes(dict(us), dict(kernels), wall, busy / 1e3 / calls, span / 1e3 / calls, dict(host))


class DeviceUse(NamedTuple):
    """Device us per call: ``busy`` (at least one kernel running), ``span`` (first kernel start to last kernel end,
    over all the calls, so the host's gaps between kernels count), the kernels per call, and the host's us per call
    by event name."""

    busy: float
    span: float
    kernels: float
    host: dict[str, float]


def device_us(run_once: Callable[[], Any], calls: int = 20) -> DeviceUse:
    """``run_once``'s device use per call under the profiler; zeros where the backend records no device events (a
    CPU). While the profiler runs, XLA launches a jitted call's kernels one by one, not in its command buffer
    (CUDA graph), unless the call was compiled with ``xla_enable_command_buffers_during_profiling`` (as
    ``XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`` does for every compile). Busy well under span:
    the GPU waited, on the host or on launches."""
    times = device_times(run_once, calls)
    return DeviceUse(times.busy, times.span, sum(times.kernels.values()), times.host or {})


def host_table(host: dict[str, float], top: int = 10, width: int = 100) -> str:
    """The host events that took the most us per call (an event's time includes the events inside it)."""
    return "\n".join(f"{us:9.1f}  {name[:width]}" for name, us in collections.Counter(host).most_common(top))


def device_rounds_table(rounds: dict[str, list[DeviceUse]], title: str, unit: str, digits: int = 3) -> str:
    """The variant scripts' device rounds (variant -> its ``device_us`` rounds): busy, span (ms ``unit``, the median of
    the rounds) and kernels per variant where the device recorded kernels, then each variant's busiest host events in
    its last round; "" when there is neither."""
    lines = []
    if any(use.kernels for uses in rounds.values() for use in uses):
        lines.append(f"\n{title}, ms {unit}, median of the rounds | busy | span | kernels")
        for name, uses in rounds.items():
            lines.append(f"{name} | {np.median([u.busy for u in uses]) / 1e3:.{digits}f} | "
                         f"{np.median([u.span for u in uses]) / 1e3:.{digits}f} | {uses[0].kernels:.1f}")
    for name, uses in rounds.items():
        if uses and uses[-1].host:
            lines += [f"\n{name}: the host's busiest events under the profiler, us {unit} (the last round)",
                      host_table(uses[-1].host)]
    return "\n".join(lines)


def kernel_table(times: DeviceTimes, paths: dict[str, str], top: int = 25) -> str:
    """A text table of device microseconds per call by HLO op and by source path."""
    by_op = collections.Counter(times.us)
    by_path = collections.Counter()
    for name, us in by_op.items():
        by_path[short_path(paths.get(name, name), depth=2)] += us
    lines = [f"device busy {sum(by_op.values()):,.0f} us per call over {sum(times.kernels.values()):.0f} kernels "
             f"(some kernel running {times.busy:,.0f} us, first start to last end {times.span:,.0f}); "
             f"wall {times.wall:,.0f} us per call"]
    lines.append(f"{'us/call':>9} {'n/call':>6}  op -> source")
    for name, us in by_op.most_common(top):
        lines.append(f"{us:9.1f} {times.kernels[name]:6.1f}  {name} -> {short_path(paths.get(name, '?'))}")
    lines.append(f"{'us/call':>9}  by source path")
    for path, us in by_path.most_common(top):
        lines.append(f"{us:9.1f}  {path}")
    return "\n".join(lines)


def _entry_instructions(hlo: str) -> list[tuple[str, list[str], str]]:
    """The entry computation's instructions in order: name, operand names, and the text after ``=``."""
    entry = re.search(r"^ENTRY ", hlo, re.M)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    lines = hlo[entry.start():].split("\n")[1:]
    out = []
    for line in lines:
        if line.startswith("}"):
            break
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, rhs = match.groups()
        i = _skip_parens(rhs, 0) if rhs.startswith("(") else rhs.index(" ")  # the shape
        opened = rhs.index("(", i)
        out.append((name, _NAME.findall(rhs[opened:_skip_parens(rhs, opened)]), rhs))
    return out


def entry_operands(hlo: str) -> list[tuple[str, list[str]]]:
    """The entry computation's instructions in order (operands before users), each with the names of
    its operands (computations it calls and attribute text are not operands)."""
    return [(name, operands) for name, operands, _ in _entry_instructions(hlo)]


def weight_only(hlo: str, argument: str = "weights") -> list[str]:
    """The entry computation's instructions computed from the jitted function's ``argument`` (its parameters named
    ``argument`` or ``argument[...]`` in their metadata) and constants alone, in order: work that every call repeats
    on the same values (XLA's dot merger concatenating weights, pads, converts), which could be done once."""
    derived, out = {}, []
    for name, operands, rhs in _entry_instructions(hlo):
        parameter = _PARAMETER.search(rhs)
        if parameter:  # one without an op_name is not known to be the argument's
            path = parameter.group(1) or ""
            derived[name] = path == argument or path.startswith(argument + "[")
        elif operands:
            derived[name] = all(derived.get(o, False) for o in operands)
            if derived[name]:
                out.append(name)
        else:  # constants, iotas
            derived[name] = True
    return out


def weight_only_table(names: list[str], times: DeviceTimes, paths: dict[str, str], top: int = 25) -> str:
    """The device time per call of the instructions ``weight_only`` found, summed and by instruction."""
    ran = sorted((n for n in names if n in times.us), key=times.us.get, reverse=True)
    us, kernels = sum(times.us[n] for n in ran), sum(times.kernels[n] for n in ran)
    lines = [f"work on the weights and constants alone: {us:,.1f} us per call in {kernels:.0f} kernels"]
    lines += [f"{times.us[n]:9.1f} {times.kernels[n]:6.1f}  {n} -> {short_path(paths.get(n, '?'))}" for n in ran[:top]]
    return "\n".join(lines)


def _skip_parens(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError(f"unbalanced parentheses in HLO: {text[start:start + 80]}")


class ChainLink(NamedTuple):
    """An instruction on the critical path: its kernels' device us per call, its kernels per call, and the
    launch gaps the path counted for them (us)."""

    name: str
    us: float
    kernels: float
    gaps: float


def critical_path(hlo: str, times: DeviceTimes, gap_us: float = 0.7) -> list[ChainLink]:
    """The entry computation's longest chain of dependent instructions, each weighed by its kernels'
    device time per call plus ``gap_us`` per kernel; the instructions on it that run kernels, in order.
    Kernels of instructions inside called computations (a loop's body, a conditional's branches) are not
    entry instructions and count for nothing here (on a GPU the step's Pallas kernels are entry custom calls
    and its fusions entry fusions; in interpret mode on a CPU the kernels are loops)."""
    weight = lambda name: times.us.get(name, 0.0) + gap_us * times.kernels.get(name, 0.0)
    longest, before = {}, {}
    for name, operands in entry_operands(hlo):
        known = [o for o in operands if o in longest]
        before[name] = max(known, key=longest.get, default=None)
        longest[name] = weight(name) + (longest[before[name]] if before[name] else 0.0)
    chain, name = [], max(longest, key=longest.get, default=None)
    while name is not None:
        if name in times.us:
            chain.append(ChainLink(name, times.us[name], times.kernels[name], gap_us * times.kernels[name]))
        name = before[name]
    return chain[::-1]


def chain_table(chain: list[ChainLink], paths: dict[str, str], top: int = 25) -> str:
    """The critical path summed: its kernels' time, its gaps (as ``critical_path`` counted them), and the
    time by source path."""
    kernels, busy = sum(link.kernels for link in chain), sum(link.us for link in chain)
    gaps = sum(link.gaps for link in chain)
    by_path = collections.Counter()
    for link in chain:
        by_path[short_path(paths.get(link.name, link.name), depth=2)] += link.us + link.gaps
    lines = [f"critical path {busy + gaps:,.1f} us: {busy:,.1f} us in {kernels:.0f} kernels + {gaps:,.1f} us of "
             f"launch gaps", f"{'us/call':>9}  by source path (gaps included)"]
    lines += [f"{us:9.1f}  {path}" for path, us in by_path.most_common(top)]
    return "\n".join(lines)


def chain_listing(chain: list[ChainLink], paths: dict[str, str]) -> str:
    """The critical path link by link, in order: each instruction's kernel time, kernels and source path."""
    lines = [f"{'us/call':>9} {'kernels':>7}  instruction  source path"]
    lines += [f"{link.us:9.1f} {link.kernels:7.0f}  {link.name}  {short_path(paths.get(link.name, link.name))}"
              for link in chain]
    return "\n".join(lines)
