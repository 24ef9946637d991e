"""Integrity of the stable heads' device pages against the host tier after identical generations (eager)."""
import sys, json, os
sys.path.insert(0, "eval")
import torch
from gpu_repeatability import tiny_model, make_cache
from flexicache.backends import _shared_flashinfer

device = torch.device("cuda", 0)
model = tiny_model(device)
ids = torch.randint(0, 512, (2, 400), device=device, generator=torch.Generator(device=device).manual_seed(1))

def check(cache, after_tokens):
    problems = []
    for n, layer in enumerate(cache.layers):
        o = layer.offloaded
        if o is None:
            continue
        K = o.k
        B, H, P, ps, D = o.host.k.shape
        hostk = o.host.k.to(device)
        flat_host = hostk.reshape(-1, D)
        poolk = layer.pool.k
        flat_pool = poolk[: layer.pool.used].reshape(-1, D)
        sel = o.selected.cpu()
        for r in range(sel.shape[0]):
            b, h = divmod(r, H)
            for j in range(K - 1):
                p = int(sel[r, j])
                if p < 0:
                    continue
                slot = o.base + r * K + j
                bad = (poolk[slot] != hostk[b, h, p]).any(-1).nonzero().view(-1).tolist()
                if bad:
                    tok = poolk[slot, bad[0]]
                    in_host = (flat_host == tok).all(-1).nonzero().view(-1).tolist()[:4]
                    in_pool = (flat_pool == tok).all(-1).nonzero().view(-1).tolist()[:4]
                    problems.append(dict(layer=n, row=r, pos=j, page=p, slot=slot, bad_tokens=bad,
                                         wrong_is_zero=bool((tok == 0).all()),
                                         wrong_found_in_host_flat=[(i // ps // P, i // ps % P, i % ps) for i in in_host],
                                         wrong_found_in_pool=[(i // ps, i % ps) for i in in_pool]))
    return problems

def generate(new_tokens):
    cache = make_cache("flexicache-eager", model, device)
    _shared_flashinfer(device).use_tensor_cores = os.environ.get("TC", "1") == "1"
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    torch.cuda.synchronize()
    return cache

for new_tokens in (1, 2):
    bad_runs = 0
    for repeat in range(int(os.environ.get("REPEATS", 100))):
        problems = check(generate(new_tokens), None)
        if problems:
            bad_runs += 1
            print("new_tokens", new_tokens, "repeat", repeat, json.dumps(problems)[:1500], flush=True)
    print("new_tokens", new_tokens, "runs with wrong stable pages:", bad_runs, flush=True)
