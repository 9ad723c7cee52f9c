"""Find which norm launches fault: each case runs in its own process (a fault poisons the CUDA
context) and prints OK or the error, and whether host memory (a canary array, the environment)
survived; with --sanitize the first faulting case reruns under compute-sanitizer.

    python benchmarks/norm_fault.py [--sanitize]
"""
import json
import subprocess
import sys

CASE = r'''
import os, sys, json, cupy as cp, numpy as np
from nvdnn import launcher, dtypes
from nvdnn.kernels import norm
from nvdnn.kernels.pointwise import Operand
kind, dt, rows, L, arch, iters = json.loads(sys.argv[1])
canary = np.arange(1 << 22, dtype=np.int64)
env = dict(os.environ)
npdt = dtypes.BY_NAME[dt].np
rng = np.random.default_rng(0)
x = cp.asarray(rng.uniform(-3, 3, (rows, L)).astype(np.float32).astype(npdt))
g = cp.ones(L, npdt)
op = lambda a: Operand(dt, a.shape, tuple(s // a.itemsize for s in a.strides), 16)
st = cp.ones(rows, cp.float32)
t = {"y": cp.empty_like(x), "x": x, "gamma": g, "beta": g, "mean": st, "rstd": st.copy(), "dy": x, "dx": cp.empty_like(x),
     "dgamma": cp.empty_like(g), "dbeta": cp.empty_like(g)}
plans = {
    "layer": lambda: norm.plan_layer_norm(op(x), 1, gamma=op(g), beta=op(g), arch=arch),
    "layer_stats": lambda: norm.plan_layer_norm(op(x), 1, gamma=op(g), beta=op(g), save_stats=True, arch=arch),
    "rms": lambda: norm.plan_rms_norm(op(x), 1, gamma=op(g), arch=arch),
    "softmax": lambda: norm.plan_softmax(op(x), -1, arch=arch),
    "layer_bwd": lambda: norm.plan_layer_norm_backward(op(x), op(x), 1, mean=op(st), rstd=op(st), gamma=op(g),
                                                       beta=op(g)),
    "softmax_bwd": lambda: norm.plan_softmax_backward(op(x), op(x), -1),
}
plan = plans[kind]()
if kind == "softmax_bwd":
    t["y"] = x
for _ in range(iters):
    launcher.run(plan, t)
cp.cuda.Device().synchronize()
intact = bool((canary == np.arange(1 << 22, dtype=np.int64)).all()) and dict(os.environ) == env
print("OK" if intact else "HOST MEMORY CHANGED", [l.spec.uri.split("/")[-1] for l in plan.launches],
      [l.grid for l in plan.launches], plan.scratch)
'''

CASES = [(k, "bfloat16", r, L, "sm_90", 20) for k in ("layer", "layer_stats", "rms", "softmax", "layer_bwd",
                                                     "softmax_bwd")
         for r, L in ((16384, 4096), (33, 4096), (65536, 128), (256, 262144))]
CASES += [(k, "float32", 2, 40000, a, 5) for k in ("layer", "rms") for a in (None, "sm_90")]


def main():
    failing = []
    for case in CASES:
        done = subprocess.run([sys.executable, "-c", CASE, json.dumps(case)], capture_output=True, text=True,
                              timeout=120)
        lines = done.stdout.strip().splitlines() or [""]
        status = lines[-1] if done.returncode == 0 else "FAIL " + (done.stderr.strip().splitlines() or [""])[-1]
        print(case, status[:240], flush=True)
        if done.returncode or not status.startswith("OK"):
            failing.append(case)
    if failing and "--sanitize" in sys.argv:
        import glob
        import shutil
        san = shutil.which("compute-sanitizer") or next(iter(glob.glob("/usr/local/cuda*/bin/compute-sanitizer")),
                                                         "compute-sanitizer")
        for case in failing[:2]:
            one = list(case[:5]) + [1]
            cmd = [san, "--tool", "memcheck", "--show-backtrace", "no", sys.executable, "-c", CASE, json.dumps(one)]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
                print("\n".join((out.stdout + out.stderr).splitlines()[:30]))
            except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
                print("compute-sanitizer:", exc)


if __name__ == "__main__":
    main()
