import time, torch, copy
from cosmos3_gym.models.vae import Cosmos3VAE
from cosmos3_gym.envs.pusht import load_pusht_assets
a = load_pusht_assets()
base = Cosmos3VAE.from_pretrained(a.checkpoint / "vae")
opt = Cosmos3VAE(copy.deepcopy(base.vae)).optimize()
opt4 = Cosmos3VAE(copy.deepcopy(base.vae)).optimize(); opt4.decode_chunk_frames = "auto"
variants = {"base": (base, "all"), "opt": (opt, "all"), "opt_last": (opt, "last"), "opt_auto": (opt4, "all"), "opt_auto_last": (opt4, "last")}
for B in (1, 4):
    z = torch.randn(B, 16, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    ref = base.decode(z)
    times = {k: [] for k in variants}
    for r in range(3):
        for k, (v, fr) in variants.items():
            t = time.perf_counter(); out = v.decode(z, frames=fr); times[k].append(time.perf_counter() - t)
            if r == 0: print(B, k, out.shape, (out - ref[:, :, -out.shape[2]:]).abs().max().item())
    print(B, {k: round(min(t), 3) for k, t in times.items()})
