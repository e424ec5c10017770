"""How much do the vision tower's GEMMs leave on the table? Every cuBLASLt algorithm the heuristic offers for the
27 x 1152 tower's four projections (and the text model's prefill projections), each timed back to back, against
the call torch makes (F.linear / torch._addmm_activation). Also the residual add folded into the epilogue
(D = x W^T + b + C, beta 1) for proj and fc2. Development only; writes JSON.

    python3 bench/experiments/lt_gemm_probe.py --out probe.json [--algos 32]
"""
import argparse
import ctypes
import glob
import json
import os

import torch
import torch.nn.functional as F

COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
DESC_COMPUTE, DESC_SCALE, DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_PTR, DESC_BIAS_TYPE = 0, 1, 3, 4, 7, 8, 26
EPI_DEFAULT, EPI_BIAS, EPI_GELU_BIAS = 1, 4, 36
PREF_WORKSPACE = 1
CFG = {"tile": 1, "splitk": 2, "stages": 6, "cluster": 8, "id": 0}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heur(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_lt():
    import nvidia
    roots = [os.path.dirname(p) for p in nvidia.__path__]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "nvidia", "**", "libcublasLt.so*"), recursive=True)):
            return ctypes.CDLL(path)
    return ctypes.CDLL("libcublasLt.so")


LT = load_lt()
V = ctypes.c_void_p


def ok(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublas status {status}")


class Gemm:
    """y[M, N] = x[M, K] @ w[N, K]^T (+ bias) (+ GELU) (+ c), bf16 in / out, fp32 accumulate."""

    def __init__(self, handle, m, n, k, epilogue, bias, with_c):
        self.handle, self.m, self.n, self.k = handle, m, n, k
        self.desc = V()
        ok(LT.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        for attr, val in ((DESC_TRANSA, 1), (DESC_TRANSB, 0), (DESC_EPILOGUE, epilogue)):
            v = ctypes.c_int32(val)
            ok(LT.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "attr")
        if bias is not None:
            p = ctypes.c_void_p(bias.data_ptr())
            ok(LT.cublasLtMatmulDescSetAttribute(self.desc, DESC_BIAS_PTR, ctypes.byref(p), 8), "bias")
            t = ctypes.c_int32(R_16BF)
            ok(LT.cublasLtMatmulDescSetAttribute(self.desc, DESC_BIAS_TYPE, ctypes.byref(t), 4), "bias type")
        self.a, self.b, self.d = V(), V(), V()
        ok(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), R_16BF, ctypes.c_uint64(k), ctypes.c_uint64(n),
                                         ctypes.c_int64(k)), "A")
        ok(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), R_16BF, ctypes.c_uint64(k), ctypes.c_uint64(m),
                                         ctypes.c_int64(k)), "B")
        ok(LT.cublasLtMatrixLayoutCreate(ctypes.byref(self.d), R_16BF, ctypes.c_uint64(n), ctypes.c_uint64(m),
                                         ctypes.c_int64(n)), "D")
        self.beta = ctypes.c_float(1.0 if with_c else 0.0)
        self.alpha = ctypes.c_float(1.0)

    def algos(self, count, ws_bytes):
        pref = V()
        ok(LT.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        w = ctypes.c_uint64(ws_bytes)
        ok(LT.cublasLtMatmulPreferenceSetAttribute(pref, PREF_WORKSPACE, ctypes.byref(w), 8), "pref ws")
        res = (Heur * count)()
        got = ctypes.c_int(0)
        ok(LT.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, pref, count,
                                             res, ctypes.byref(got)), "heuristic")
        return [res[i] for i in range(got.value) if res[i].state == 0]

    def run(self, algo, w, x, c, y, ws, stream):
        ok(LT.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), V(w.data_ptr()), self.a,
                             V(x.data_ptr()), self.b, ctypes.byref(self.beta), V(c.data_ptr()), self.d,
                             V(y.data_ptr()), self.d, ctypes.byref(algo), V(ws.data_ptr()),
                             ctypes.c_size_t(ws.numel()), V(stream)), "matmul")


def describe(algo):
    out = {}
    for name, attr in CFG.items():
        v = ctypes.c_uint32(0)
        n = ctypes.c_size_t(0)
        LT.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4, ctypes.byref(n))
        out[name] = v.value
    return out


def ms(fn, reps=20):
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    best = 1e9
    for _ in range(3):
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / reps)
    return best


SHAPES = {  # name: (N, K, epilogue, residual in the epilogue)
    "qkv": (3456, 1152, EPI_BIAS, False), "proj": (1152, 1152, EPI_BIAS, False),
    "fc1_gelu": (4304, 1152, EPI_GELU_BIAS, False), "fc2": (1152, 4304, EPI_BIAS, False),
    "proj+res": (1152, 1152, EPI_BIAS, True), "fc2+res": (1152, 4304, EPI_BIAS, True),
    "9b_qkvz": (12288, 4096, EPI_DEFAULT, False), "9b_down": (4096, 12288, EPI_DEFAULT, False),
    "9b_gate_up": (24576, 4096, EPI_DEFAULT, False),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--algos", type=int, default=32)
    ap.add_argument("--rows", default="4096,16384,46080")
    args = ap.parse_args()
    torch.manual_seed(0)
    handle = V()
    ok(LT.cublasLtCreate(ctypes.byref(handle)), "create")
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for m in [int(r) for r in args.rows.split(",")]:
        for name, (n, k, epi, with_c) in SHAPES.items():
            if name.startswith("9b") and m != 4096:
                continue
            mm = 1088 if name.startswith("9b") else m
            x = torch.randn(mm, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if epi != EPI_DEFAULT else None
            c = torch.randn(mm, n, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(mm, n, device="cuda", dtype=torch.bfloat16)
            if epi == EPI_GELU_BIAS:
                def ref_fn():
                    return torch._addmm_activation(b, x, w.t(), use_gelu=True)
            elif with_c:
                def ref_fn():
                    return torch.add(c, F.linear(x, w, b))
            else:
                def ref_fn():
                    return F.linear(x, w, b)
            t_torch = ms(ref_fn)
            ref = ref_fn().float()
            g = Gemm(handle, mm, n, k, epi, b, with_c)
            found = []
            for i, h in enumerate(g.algos(args.algos, ws.numel())):
                try:
                    t = ms(lambda h=h: g.run(h.algo, w, x, c, y, ws, stream))
                except RuntimeError as e:
                    found.append({"i": i, "error": str(e)})
                    continue
                err = ((y.float() - ref).norm() / ref.norm()).item()
                found.append({"i": i, "ms": round(t, 4), "rel_err": err, "waves": round(h.waves, 2),
                              "ws": h.workspace, **describe(h.algo)})
            timed = [f for f in found if "ms" in f]
            best = min(timed, key=lambda f: f["ms"]) if timed else None
            flop = 2 * mm * n * k
            row = {"m": mm, "gemm": name, "n": n, "k": k, "torch_ms": round(t_torch, 4),
                   "torch_tflops": round(flop / t_torch / 1e9, 1),
                   "lt_first_ms": timed[0]["ms"] if timed else None, "lt_best": best,
                   "best_tflops": round(flop / best["ms"] / 1e9, 1) if best else None, "algos": found}
            rows.append(row)
            print(f"m {mm:6d} {name:10s} torch {t_torch:.4f} ({row['torch_tflops']} TF/s)  lt first "
                  f"{row['lt_first_ms']}  best {best and best['ms']} ({row['best_tflops']})  "
                  f"{best and {k2: best[k2] for k2 in ('i', 'tile', 'stages', 'cluster', 'splitk', 'rel_err')}}"
                  f"  algos {len(timed)}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
