"""Per-phase globaltimer probes of the row-draw kernel (sampler_notes.md, 2026-11-24).

Not part of the library: apply rowdraw-probes.patch to a copy of graphexec at commit
021aead in .prof/ (the probes add a [B, 16] int64 output, launch.LAST_DBG), then on the
GPU host `CFGS="0:0 1:0" bash benchmarks/probes/run2.sh` (GX_GV / GX_TL pick the gather
variant, see the patch). Prints each phase's time of one row.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), ".prof"))
import torch  # noqa: E402

import graphexec as gx  # noqa: E402
from graphexec.sampling.tensors import SamplerOutput, SamplingTensors  # noqa: E402
from graphexec.sampling.triton import launch  # noqa: E402

assert "/.prof/" in gx.__file__, gx.__file__
V = 128256
METH = {
    "no_filter": dict(temperature=0.8),
    "tktp": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "min_p": dict(temperature=0.8, min_p=0.05),
}
names = ["t0", "loaded", "pre", "r0", "r1", "r2", "r3", "draw", "end"]


def run(meth, B, label):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(B, V, device=dev, generator=g) * 3
    params = [gx.SamplingParams(seed=1000 + b, **METH[meth]) for b in range(B)]
    table = SamplingTensors.from_params(params, V, dev)
    out = SamplerOutput.allocate(B, dev, None)
    slot = torch.arange(B, device=dev)
    pos = torch.arange(B, device=dev) + 7
    var = gx.choose_variant(params)
    t = time.time()
    gx.sample_step(logits, slot, pos, table, out, None, var, "triton")
    torch.cuda.synchronize()
    first = time.time() - t
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ts = []
    for _ in range(30):
        flush.zero_()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        gx.sample_step(logits, slot, pos, table, out, None, var, "triton")
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000)
    d = launch.LAST_DBG.cpu()
    t0 = d[:, 0]
    span = (d[:, 8].max() - t0.min()).item() / 1000
    per = (d[:, 8] - t0).float() / 1000
    med = statistics.median(ts)
    line = f"{label:28s} {meth:9s} B={B:3d} first {first:5.1f}s event med {med:7.1f}us"
    line += f" | row span {span:7.1f} per-row med {per.median():7.1f} max {per.max():7.1f}"
    print(line)
    r = 0 if B == 1 else int(per.argmax())
    row = d[r]
    prev = row[0]
    parts = []
    for i, nm in enumerate(names):
        if i == 0 or row[i] == 0:
            continue
        parts.append(f"{nm}+{(row[i] - prev).item() / 1000:.1f}")
        prev = row[i]
    if row[12]:
        parts.append(f"[narrowed@{(row[12] - row[2]).item() / 1000:.1f}")
        parts.append(f"passdone@{(row[13] - row[2]).item() / 1000:.1f}]")
    parts.append(
        f"rounds={row[9].item()} n={row[10].item()} served={row[11].item()} bandw={row[14].item()}"
    )
    print("    row", r, " ".join(parts))
    if B > 1 and meth != "no_filter":
        rounds = d[:, 9]
        print(
            "    rounds hist",
            torch.bincount(rounds, minlength=5).tolist(),
            "n med",
            d[:, 10].float().median().item(),
            "n max",
            d[:, 10].max().item(),
            "served",
            d[:, 11].sum().item(),
        )


label = f"GV{os.environ.get('GX_GV', '0')} TL{os.environ.get('GX_TL', '0')}"
warm = sys.argv[1:2] == ["warm"]
meths = sys.argv[2:] if len(sys.argv) > 2 else ["top_p", "tktp", "min_p"]
for meth in meths:
    for B in (1,) if warm else (1, 256):
        try:
            if warm:
                t = time.time()
                run(meth, B, label)
            else:
                run(meth, B, label)
        except Exception as e:  # noqa: BLE001
            print(label, meth, B, "ERROR", repr(e)[:600])
        sys.stdout.flush()
