"""Compile TTIR files with a pip Triton for sm_90 (no GPU needed); print registers, spills, shared memory, SASS
instruction histogram. Usage: /tmp/o_tri/bin/python o_tcompile.py WARPS STAGES file.ttir ..."""
import collections, re, subprocess, sys, os
import triton
from triton.backends.compiler import GPUTarget

warps, stages = int(sys.argv[1]), int(sys.argv[2])
bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
for path in sys.argv[3:]:
    k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    base = path.rsplit(".", 1)[0]
    for ext in ("ttgir", "llir", "ptx"):
        open(f"{base}.{ext}", "w").write(k.asm[ext])
    open(f"{base}.cubin", "wb").write(k.asm["cubin"])
    sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", f"{base}.cubin"], capture_output=True, text=True).stdout
    open(f"{base}.sass", "w").write(sass)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    hist = collections.Counter(o.split(".")[0] for o in ops)
    res = subprocess.run([f"{bindir}/cuobjdump", "--dump-resource-usage", f"{base}.cubin"], capture_output=True,
                         text=True).stdout
    usage = " ".join(re.findall(r"(REG:\d+|STACK:\d+|SHARED:\d+|LOCAL:\d+)", res))
    print(f"{os.path.basename(path)}: {usage} shared(meta) {k.metadata.shared} instrs {len(ops)}")
    print("   ", " ".join(f"{o}:{n}" for o, n in hist.most_common(28)))
