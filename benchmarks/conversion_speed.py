"""Converter throughput against the raw read speed of the same files, and peak memory.

    python benchmarks/conversion_speed.py --dir /tmp/k3bench [--out-dir /dev/shm/k3bench] [--preset mini]
                                 [--part-mb 128] [--inflight-mb 768] [--keep]

Writes a multi-GB synthetic K3-layout checkpoint (MXFP4 experts, several shards; streamed, never
in memory), then measures, each in a fresh subprocess (this process never imports JAX, so the
children's ``ru_maxrss``, which Linux carries over fork and exec, is their own):
- raw read: every shard read sequentially with ``readinto`` into one 64 MB buffer;
- raw copy: the same reads, each buffer written to a new file beside them (the I/O floor of any
  converter that writes what it reads; reported as a second peer);
- conversion: ``convert.convert`` of the same folder (orbax parts, no verify);
both with the source files evicted from the page cache first (``posix_fadvise DONTNEED``, "cold")
and with them cached ("warm"). Peak memory is the conversion subprocess's ``ru_maxrss``, compared
with the largest single output tensor plus 1 GB (aim) and with a subprocess that only imports and
plans (fixed overhead). Prints a table of ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Run as a script, this file's folder is sys.path[0] and its name would shadow the ``convert`` package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

_GENERATE = """
import sys, warnings
warnings.simplefilter("ignore")
from convert.synthetic import write_synthetic
write_synthetic(sys.argv[1], sys.argv[2], lazy=True, shard_bytes=int(sys.argv[3]), quiet=False)
print("{}")
"""

_READ = """
import json, os, resource, sys, time
files = sys.argv[1:]
buf = memoryview(bytearray(64 << 20))
t, n = time.perf_counter(), 0
for f in files:
    with open(f, "rb", buffering=0) as fh:
        while k := fh.readinto(buf):
            n += k
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": n,
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

_COPY = """
import json, os, sys, time
dst, files = sys.argv[1], sys.argv[2:]
buf = memoryview(bytearray(64 << 20))
t, n = time.perf_counter(), 0
for i, f in enumerate(files):
    with open(f, "rb", buffering=0) as fh, open(os.path.join(dst, str(i)), "wb", buffering=0) as out:
        while k := fh.readinto(buf):
            out.write(buf[:k])
            n += k
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": n}))
"""

_CONVERT = """
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
from convert.conversion import convert, plan
from convert.safetensors_io import open_checkpoint
src, out, part, inflight, only_plan = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
t = time.perf_counter()
largest = 0
if only_plan:
    from convert.conversion import out_bytes
    largest = max(out_bytes(j, None) for j in plan(open_checkpoint(src)).jobs)
else:
    convert(src, out, quiet=True, part_bytes=part, inflight_bytes=inflight)
print(json.dumps({"seconds": time.perf_counter() - t, "largest": largest,
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _run(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"subprocess failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (clean pages; no root needed)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/k3jax_convert_bench"))
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--part-mb", type=int, default=128)
    ap.add_argument("--inflight-mb", type=int, default=768)
    ap.add_argument("--shard-mb", type=int, default=700)
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where outputs (conversion, copy peer) go, e.g. /dev/shm to take the disk's writes out")
    ap.add_argument("--keep", action="store_true", help="keep the source afterwards")
    args = ap.parse_args()

    out_dir = args.out_dir or args.dir
    out_dir.mkdir(parents=True, exist_ok=True)
    src, out = args.dir / "released", out_dir / "k3jax"
    if not src.exists():
        t = time.perf_counter()
        _run(_GENERATE, str(src), args.preset, str(args.shard_mb << 20))
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    files = sorted(src.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    part = args.part_mb << 20
    overhead = _run(_CONVERT, str(src), str(out), str(part), str(args.inflight_mb << 20), "1")
    largest = overhead["largest"]
    rows = []
    for cache in ("cold", "warm"):
        if cache == "cold":
            _evict(files)
        else:
            _run(_READ, *map(str, files))
        read = _run(_READ, *map(str, files))
        if cache == "cold":
            _evict(files)
        copy_dir = out_dir / "copy"
        copy_dir.mkdir(exist_ok=True)
        copy = _run(_COPY, str(copy_dir), *map(str, files))
        shutil.rmtree(copy_dir)
        if cache == "cold":
            _evict(files)
        shutil.rmtree(out, ignore_errors=True)
        conv = _run(_CONVERT, str(src), str(out), str(part), str(args.inflight_mb << 20), "0")
        rows.append((cache, size / read["seconds"], size / copy["seconds"], size / conv["seconds"], conv["seconds"],
                     conv["max_rss"]))
    gb = 1e9
    shutil.rmtree(out, ignore_errors=True)
    print(f"\noutput to {out_dir}; source: {len(files)} shards, {size / gb:.2f} GB ({args.preset}); largest output tensor "
          f"{largest / gb:.2f} GB; parts of {args.part_mb} MB, {args.inflight_mb} MB in flight; import+plan RSS {overhead['max_rss'] / gb:.2f} GB")
    print("| source cache | raw read GB/s | raw copy GB/s | convert GB/s | convert / read | convert / copy "
          "| convert s | peak RSS GB | largest + 1 GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cache, r, cp, c, s, rss in rows:
        print(f"| {cache} | {r / gb:.2f} | {cp / gb:.2f} | {c / gb:.2f} | {c / r:.0%} | {c / cp:.0%} | {s:.1f} "
              f"| {rss / gb:.2f} | {(largest + 2**30) / gb:.2f} |")
    if not args.keep:
        shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
