"""Where the device time of a jitted call goes: a profiler trace, summed per kernel and per model part.

    table = kernel_table(run_once, paths, calls=5)

``run_once()`` makes one call (a closure, so it can thread a donated cache from call to call);
``paths`` maps HLO instruction names to source paths: ``dumped_source_paths(folder, "decode")`` reads
them from the optimized HLO that XLA wrote when run with
``XLA_FLAGS="--xla_dump_to=folder --xla_dump_hlo_as_text --xla_dump_hlo_module_re=..."``
(so nothing compiles twice).

Each kernel's HLO op is mapped to its JAX source path (the ``op_name`` in the compiled HLO's metadata),
so fusions read as "moe/..." (the model's named scopes) rather than "fusion.123"; ops the dump does
not name show as "?". Works on any backend that records device events (GPU); elsewhere the table is
empty. With XLA's command buffers (CUDA graphs, on by default) a whole step is one event; add
``--xla_gpu_enable_command_buffer=`` to XLA_FLAGS to see its kernels (the step then runs slower).
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
import time
from typing import Any, Callable

import jax
from jax.profiler import ProfileData

_OP_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]+)\"", re.M)
_SKIP_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source code", "TraceMe")


def dumped_source_paths(folder: str, module: str) -> dict[str, str]:
    """HLO instruction name -> JAX op_name, from the optimized HLO text of the newest dumped module
    whose name contains ``module``."""
    files = sorted(glob.glob(f"{folder}/**/*{module}*after_optimizations.txt", recursive=True))
    if not files:
        return {}
    with open(files[-1]) as f:
        return dict(_OP_NAME.findall(f.read()))


def short_path(op_name: str, depth: int = 4) -> str:
    """'jit(f)/moe/jit(g)/grouped_mx_matmul/while/body' -> the first `depth` parts without the jit
    wrappers ('moe/grouped_mx_matmul/while/body'); the model's named scopes come first."""
    parts = [p for p in op_name.split("/") if not p.startswith(("jit(", "pjit(", "checkpoint"))]
    return "/".join(parts[:depth])


def _device_events(xspace_path: str):
    """(kernel or HLO op name, duration in us) for every event on a device's stream lines."""
    for plane in ProfileData.from_file(xspace_path).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if line.name.startswith(_SKIP_LINES):
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                yield str(stats.get("hlo_op", ev.name)), ev.duration_ns / 1e3


def kernel_table(run_once: Callable[[], Any], paths: dict[str, str], calls: int = 5, top: int = 25) -> str:
    """Call ``run_once`` ``calls`` times under the profiler; return a text table of device
    microseconds per call by HLO op and by source path."""
    jax.block_until_ready(run_once())
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        t = time.perf_counter()
        for _ in range(calls):
            out = run_once()
        jax.block_until_ready(out)
        wall = (time.perf_counter() - t) / calls * 1e6
    files = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    by_op, by_path = collections.Counter(), collections.Counter()
    count = collections.Counter()
    for name, us in _device_events(files[0]) if files else ():
        by_op[name] += us / calls
        count[name] += 1 / calls
        by_path[short_path(paths.get(name, name), depth=2)] += us / calls
    total = sum(by_op.values())
    lines = [f"device busy {total:,.0f} us per call over {sum(count.values()):.0f} kernels; wall {wall:,.0f} us per call"]
    lines.append(f"{'us/call':>9} {'n/call':>6}  op -> source")
    for name, us in by_op.most_common(top):
        lines.append(f"{us:9.1f} {count[name]:6.1f}  {name} -> {short_path(paths.get(name, '?'))}")
    lines.append(f"{'us/call':>9}  by source path")
    for path, us in by_path.most_common(top):
        lines.append(f"{us:9.1f}  {path}")
    return "\n".join(lines)
