"""A/B of how a cold prefill gets its GDN states at cuts (runtime/model.py cut_form), on a 9B-shaped model with
random weights: `runtime` (what cut_form picks), `kept` (the walk stores the state at each cut's chunk boundary,
one packed call walks the tails of eight layers at a time), `parts` (the recurrence cut into parts, a conv and a
GDN call per part: the PyTorch path's form) and `packed` (one GDN call over the prompt and each prefix again, as
packed sequences), each forced. Wall ms of forward_prefill_kept around a synchronisation and host ms (until it
returns), median of --reps, the forms in turn; the TMA tensor maps each call encodes (cache misses: a few µs of
driver each); and the logits' and kept states' relative difference from the parts.

    python3 bench/gdn_cuts_ab.py [--layers 32] [--reps 7] [--max-tokens N]
        [--out bench/results/gdn-cuts-kept-ab-h200.json]
"""
import argparse
import json
import statistics
import time

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast.kernels import cuda_build
from qwen35_fast.runtime import model as model_mod
from qwen35_fast.runtime.model import KeptCuts, PackedCuts, Qwen35Model

from e2e import nine_b, random_weights_

CASES = [(600, (200, 535, 595)), (1088, (1023, 1083)), (1300, (200, 1235, 1295)), (2600, (200, 2535, 2595)),
         (4096, (200, 4031, 4091)), (8192, (200, 8127, 8187))]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="only the prompts of at most this many tokens")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = Qwen35Model(nine_b(a.layers), torch.bfloat16, dev)
    random_weights_(model)
    model.set_backend("auto")
    real = model_mod.cut_form
    forms = {"runtime": real,
             "kept": lambda cuts, T, be, device: KeptCuts.plan(cuts, be, device),
             "parts": lambda cuts, T, be, device: None,
             "packed": lambda cuts, T, be, device: PackedCuts.build(cuts, T, device)}
    encodes = [0]
    encode = cuda_build.TensorMap.__init__

    def counted(self, *args, **kw):
        encodes[0] += bool(args)  # (TensorMap.zero() encodes nothing)
        encode(self, *args, **kw)

    cuda_build.TensorMap.__init__ = counted
    rows = []
    for T, cuts in [c for c in CASES if a.max_tokens is None or c[0] <= a.max_tokens]:
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(dev)
        times, host, maps, outs = {f: [] for f in forms}, {f: [] for f in forms}, {f: [] for f in forms}, {}
        for rep in range(a.reps + 2):
            for form, fn in forms.items():
                model_mod.cut_form = fn
                try:
                    torch.cuda.synchronize()
                    t0, e0 = time.perf_counter(), encodes[0]
                    logits, kept = model.forward_prefill_kept(ids, model.new_cache(1, T), cuts)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    if rep >= 2:  # two warm-ups
                        times[form].append((time.perf_counter() - t0) * 1000)
                        host[form].append((t1 - t0) * 1000)
                        maps[form].append(encodes[0] - e0)
                    outs[form] = (logits, kept)
                finally:
                    model_mod.cut_form = real
        picked = type(real(cuts, T, model.backend, dev)).__name__
        row = {"T": T, "cuts": list(cuts), "runtime_form": picked,
               **{f"{f}_ms": round(statistics.median(v), 2) for f, v in times.items()},
               **{f"{f}_host_ms": round(statistics.median(v), 2) for f, v in host.items()},
               **{f"{f}_map_encodes": max(v) for f, v in maps.items()}}
        want, want_kept = outs["parts"]
        for f in ("kept", "packed"):  # (runtime is one of them)
            got, got_kept = outs[f]
            states = [rel(x, y) for s, w in zip(got_kept, want_kept) for x, y in zip(s.ssm, w.ssm) if x is not None]
            row[f"{f}_vs_parts"] = {"logits": round(rel(got, want), 5), "states_max": round(max(states), 5)}
        print(row, flush=True)
        rows.append(row)
    result = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "device": torch.cuda.get_device_name(),
              "host_cpu": host_cpu(), "layers": a.layers, "reps": a.reps, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
