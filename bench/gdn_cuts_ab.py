"""A/B of how a cold prefill keeps its GDN states at cuts (runtime/model.py KeptCuts), on a 9B-shaped model with
random weights: `kept` (the runtime: the walk stores the state at each cut's chunk boundary, one packed call
walks the tails), `parts` (the recurrence cut into parts, a conv and a GDN call per part: the PyTorch path's
form) and `packed` (the form used before, re-created here for the comparison only: one GDN call over the prompt
and each prefix again, as packed sequences). Wall ms of forward_prefill_kept around a synchronisation, median of
--reps, the three in turn; and the logits' and kept states' largest relative difference from the parts.

    python3 bench/gdn_cuts_ab.py [--layers 32] [--reps 7] [--out bench/results/gdn-cuts-kept-ab-h200.json]
"""
import argparse
import json
import statistics
import time

import torch

import _import  # noqa: F401  (the repo as `qwen35_fast`)
from _import import host_cpu

from qwen35_fast import kernels
from qwen35_fast.runtime import model as model_mod
from qwen35_fast.runtime.host import upload
from qwen35_fast.runtime.model import Qwen35Model
from qwen35_fast.runtime.quant import linear

from e2e import nine_b, random_weights_

CASES = [(600, (200, 535, 595)), (1088, (1023, 1083)), (1300, (200, 1235, 1295)), (2600, (200, 2535, 2595)),
         (4096, (200, 4031, 4091)), (8192, (200, 8127, 8187))]


def packed_gdn(self, m, x, cache, i, be, cut, kc):
    """The earlier form: the prompt, then the first c tokens for each cut, walked in one packed call."""
    c = self.config
    hv = c.linear_num_value_heads
    mixed, z, ba = linear(x, m.in_proj, be).split([c.conv_dim, c.value_dim, 2 * hv], dim=-1)
    T = mixed.shape[1]
    conv0 = cache.conv[i]
    y, cache.conv[i] = kernels.causal_conv1d_prefill(mixed, m.conv_w, initial_state=conv0, backend=be)
    convs = kernels.causal_conv1d_states(mixed, conv0, kc.ends, m.conv_w.shape[1], backend=be)[:, None]
    bounds = [0, T]
    for k in kc.cuts:
        bounds.append(bounds[-1] + k)
    cu = upload(bounds, torch.int32, x.device)

    def rows(t):
        return torch.cat([t, *(t[:, :k] for k in kc.cuts)], dim=1)
    q, k, v = self._qkv_heads(rows(y))
    b, a = rows(ba).split([hv, hv], dim=-1)
    h0 = cache.ssm[i]
    if h0 is not None:
        h0 = h0.expand(1 + len(cut), *h0.shape[1:])
    o, ht = kernels.gdn_chunk_prefill(q, k, v, a, b, m.A_log, m.dt_bias, initial_state=h0, cu_seqlens=cu, backend=be)
    cache.ssm[i] = ht[:1].clone()
    for n, (_, state) in enumerate(cut):
        state.conv[i], state.ssm[i] = convs[n], ht[n + 1:n + 2]
    return self._gdn_out(m, o[:, :T], z, be)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = Qwen35Model(nine_b(a.layers), torch.bfloat16, dev)
    random_weights_(model)
    model.set_backend("auto")
    real_kept, real_plan = Qwen35Model._gdn_prefill_kept, model_mod.KeptCuts.plan
    forms = {"kept": (real_plan, real_kept),
             "parts": (lambda cuts, be, device: None, real_kept),
             "packed": (real_plan, packed_gdn)}
    rows = []
    for T, cuts in CASES:
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(dev)
        times, outs = {f: [] for f in forms}, {}
        for rep in range(a.reps + 2):
            for form, (plan, gdn) in forms.items():
                model_mod.KeptCuts.plan, Qwen35Model._gdn_prefill_kept = staticmethod(plan), gdn
                try:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    logits, kept = model.forward_prefill_kept(ids, model.new_cache(1, T), cuts)
                    torch.cuda.synchronize()
                    if rep >= 2:  # two warm-ups
                        times[form].append((time.perf_counter() - t0) * 1000)
                    outs[form] = (logits, kept)
                finally:
                    model_mod.KeptCuts.plan, Qwen35Model._gdn_prefill_kept = staticmethod(real_plan), real_kept
        row = {"T": T, "cuts": list(cuts), **{f"{f}_ms": round(statistics.median(v), 2) for f, v in times.items()}}
        want, want_kept = outs["parts"]
        for f in ("kept", "packed"):
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
