"""Localise run-to-run differences at the first decode step: record every FlashInfer decode call's inputs/outputs."""
import sys, json, os
sys.path.insert(0, "eval")
import torch
from gpu_repeatability import tiny_model, make_cache
from flexicache.backends.flashinfer import FlashInferBackend
from flexicache.backends import _shared_flashinfer

calls = []
original = FlashInferBackend.run_prepared
def recording(planned, query, pool_k, pool_v, out=None):
    result = original(planned, query, pool_k, pool_v, out=out)
    total = int(planned.indptr[-1])
    idx = planned.indices[:total].long()
    calls.append(dict(q=query.clone(), indptr=planned.indptr.clone(), idx=idx.clone(), lens=planned.last_page_len.clone(),
                      k=pool_k[idx].clone(), v=pool_v[idx].clone(), out=result.clone()))
    return result
FlashInferBackend.run_prepared = staticmethod(recording)

device = torch.device("cuda", 0)
model = tiny_model(device)
ids = torch.randint(0, 512, (2, 400), device=device, generator=torch.Generator(device=device).manual_seed(1))
def generate(name, new_tokens):
    calls.clear()
    cache = make_cache(name, model, device)
    if name == "flexicache-eager":
        _shared_flashinfer(device).use_tensor_cores = TC
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    torch.cuda.synchronize()
    return torch.stack(out.logits).float(), list(calls)

report = {}
for TC in (True, False):
    for name in ("flexicache-eager",):
        tag = f"{name}-tc{TC}"
        diffs = []
        for repeat in range(int(os.environ.get("REPEATS", 60))):
            (la, ca), (lb, cb) = generate(name, 3), generate(name, 3)
            if torch.equal(la, lb):
                continue
            first = None
            for n, (a, b) in enumerate(zip(ca, cb)):
                bad = [key for key in a if a[key].shape != b[key].shape or not torch.equal(a[key], b[key])]
                if bad:
                    first = (n, bad)
                    info = {"call": n, "fields": bad}
                    if "out" in bad and a["out"].shape == b["out"].shape:
                        d = (a["out"].float() - b["out"].float()).abs()
                        info["out_max"] = float(d.max()); info["rows_differing"] = (d.flatten(1).amax(1) > 0).nonzero().view(-1).tolist()[:20]
                    if "k" in bad and a["k"].shape == b["k"].shape:
                        d = (a["k"] != b["k"]).flatten(1).any(1).nonzero().view(-1)
                        info["k_pages_differing"] = d.tolist()[:20]
                        info["idx_of_those"] = a["idx"][d].tolist()[:20]
                    if "idx" in bad and a["idx"].shape == b["idx"].shape:
                        d = (a["idx"] != b["idx"]).nonzero().view(-1)
                        info["idx_positions"] = d.tolist()[:20]; info["a"] = a["idx"][d].tolist()[:20]; info["b"] = b["idx"][d].tolist()[:20]
                    break
            step = int((la != lb).flatten(1).any(1).nonzero()[0])
            diffs.append({"repeat": repeat, "logit_step": step, "calls": len(ca), "first_call_diff": info if first else None})
            print(tag, diffs[-1], flush=True)
        report[tag] = diffs
        print(tag, "differing repeats:", len(diffs), flush=True)
json.dump(report, open(os.environ.get("OUT", ".") + "/diag.json", "w"), indent=1)
