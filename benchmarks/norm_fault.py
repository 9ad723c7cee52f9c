"""Find which norm launches fault: each case runs in its own process (a fault poisons the CUDA
context), prints OK or the error; with --sanitize the first faulting case reruns under
compute-sanitizer."""
import json
import os
import subprocess
import sys

CASE = r'''
import sys, json, cupy as cp, numpy as np
from nvdnn import launcher, dtypes
from nvdnn.kernels import norm
from nvdnn.kernels.pointwise import Operand
kind, dt, rows, L, arch, tile_index = json.loads(sys.argv[1])
npdt = dtypes.BY_NAME[dt].np
x = cp.asarray(np.random.default_rng(0).standard_normal((rows, L)).astype(npdt))
g = cp.ones(L, npdt)
op = lambda a: Operand(dt, a.shape, tuple(s // a.itemsize for s in a.strides), 16)
if kind in ("layer", "rms"):
    planf = norm.plan_layer_norm if kind == "layer" else norm.plan_rms_norm
    extra = {"beta": op(g)} if kind == "layer" else {}
    plan = planf(op(x), 1, gamma=op(g), save_stats=True, eps=1e-5, arch=arch, **extra)
    if tile_index:
        from nvdnn.kernels import tile_spec
        cands = norm.candidates(tile_spec(plan))
        plan = planf(op(x), 1, gamma=op(g), save_stats=True, eps=1e-5, arch=arch, tile=cands[tile_index], **extra)
    t = {"y": cp.empty_like(x), "x": x, "gamma": g, "beta": g, "mean": cp.empty(rows, cp.float32),
         "rstd": cp.empty(rows, cp.float32)}
else:
    plan = norm.plan_softmax(op(x), -1, arch=arch)
    t = {"y": cp.empty_like(x), "x": x}
launcher.run(plan, t)
cp.cuda.Device().synchronize()
print("OK", [l.spec.uri for l in plan.launches], [l.grid for l in plan.launches], plan.scratch)
'''

CASES = [(k, dt, r, L, a, 0) for k in ("layer", "rms", "softmax") for dt in ("float32", "bfloat16")
         for r, L in ((2, 40000), (256, 262144), (5, 16384)) for a in (None, "sm_90")]
CASES += [("layer", "bfloat16", 16384, 4096, "sm_90", i) for i in range(1, 11)]


def main():
    failing = []
    for case in CASES:
        done = subprocess.run([sys.executable, "-c", CASE, json.dumps(case)], capture_output=True, text=True,
                              timeout=120)
        last = (done.stdout.strip().splitlines() or [""])[-1]
        status = last if done.returncode == 0 else "FAIL " + done.stderr.strip().splitlines()[-1][:160]
        print(case, status[:300], flush=True)
        if done.returncode:
            failing.append(case)
    if failing and "--sanitize" in sys.argv:
        import glob
        import shutil
        san = shutil.which("compute-sanitizer") or next(iter(glob.glob("/usr/local/cuda*/bin/compute-sanitizer")),
                                                         "compute-sanitizer")
        cmd = [san, "--tool", "memcheck", "--show-backtrace", "no", sys.executable, "-c", CASE, json.dumps(failing[0])]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            print("\n".join((out.stdout + out.stderr).splitlines()[:60]))
        except FileNotFoundError:
            print("compute-sanitizer not found")


if __name__ == "__main__":
    main()
