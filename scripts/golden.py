"""Golden runs: a digest of the model and optimizer state after 6 steps of the tiny model, for every
precision level, recipe and layout. A refactor that should change no math runs this before and
after, on the same machine, and compares:

    python scripts/golden.py --json /tmp/before.json          (on the old tree)
    python scripts/golden.py --json /tmp/after.json --against /tmp/before.json

The digests depend on the CPU's kernels (AVX2 or AVX-512 sum in different orders), so they are
compared between two trees on one machine, never stored. `--only O2,O3-dp2` runs some runs.
"""

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["config/shakespeare_char_fp8.py", "dataset=shakespeare_char", "n_layer=2", "n_head=2", "n_embd=32",
        "block_size=32", "batch_size=4", "gradient_accumulation_steps=2", "eval_iters=2", "log_interval=1",
        "device=cpu", "compile=False", "learning_rate=3e-3", "warmup_iters=2", "min_lr=3e-4", "max_iters=6",
        "eval_interval=6"]

RUNS = {  # name: (ranks, train.py keys)
    "bf16": (1, ["precision=bf16"]),
    "O1": (1, ["precision=O1"]),
    "O1-delayed": (1, ["precision=O1", "fp8_recipe=delayed"]),
    "O1-rowwise": (1, ["precision=O1", "fp8_recipe=rowwise"]),
    "O1-blockwise": (1, ["precision=O1", "fp8_recipe=blockwise"]),
    "O1-mxfp8": (1, ["precision=O1", "fp8_recipe=mxfp8"]),
    "O2": (1, ["precision=O2"]),
    "O2-vfp8": (1, ["precision=O2", "o2_v_format=fp8"]),
    "O2-accfp8": (1, ["precision=O2", "o2_grad_accum=fp8"]),
    "O2-rowwise": (1, ["precision=O2", "fp8_recipe=rowwise"]),
    "O1-dp2": (2, ["precision=O1"]),
    "O2-dp2": (2, ["precision=O2"]),
    "O3-dp2": (2, ["precision=O3"]),
    "O3-dp2-vfp8": (2, ["precision=O3", "o2_v_format=fp8"]),
    "O1-tp2-sp": (2, ["precision=O1", "tensor_parallel=2", "sequence_parallel=True"]),
    "O1-torch-dp2": (2, ["precision=O1", "engine=torch"]),
}


def digest(obj, h):
    """Feed every tensor (its dtype, shape and bytes) and every plain value of a nested state into h,
    in a fixed order; wall-clock values are left out."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            if str(k) in ("time", "saved_at", "wall_s", "elapsed_s", "host", "git"):
                continue
            h.update(str(k).encode())
            digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            digest(v, h)
    elif isinstance(obj, (int, float, str, bool, type(None))):
        h.update(repr(obj).encode())


def state_digests(out_dir):
    """{file: sha256} of the newest checkpoint set's model and optimizer state."""
    newest = sorted(d for d in os.listdir(out_dir) if d.startswith("ckpt-"))[-1]
    found = {}
    for root, _, files in os.walk(os.path.join(out_dir, newest)):
        for f in sorted(files):
            path = os.path.join(root, f)
            h = hashlib.sha256()
            if f.endswith(".pt"):
                ckpt = torch.load(path, map_location="cpu", weights_only=False)
                digest({k: v for k, v in ckpt.items() if k in ("model", "optimizer", "fp8_ranks")}, h)
            elif f.endswith(".distcp"):
                h.update(open(path, "rb").read())
            else:
                continue
            found[os.path.relpath(path, out_dir).split("/", 1)[1]] = h.hexdigest()[:16]
    return found


def run_one(name, ranks, keys, work):
    out_dir = os.path.join(work, name)
    args = [*TINY, *keys, f"out_dir={out_dir}"]
    if ranks == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr)[-800:]}
    losses = re.findall(r"\biter \d+: loss ([^,\s]+)", r.stdout)
    return {"losses": losses, "state": state_digests(out_dir)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the digests here")
    p.add_argument("--against", help="compare with this earlier --json; exit 1 on any difference")
    p.add_argument("--only", help="comma-separated run names (default: all)")
    a = p.parse_args()
    names = a.only.split(",") if a.only else list(RUNS)
    found = {}
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            found[name] = run_one(name, *RUNS[name], work)
            print(name, "error" if "error" in found[name] else found[name]["state"], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(found, f, indent=1)
    if a.against:
        before = json.load(open(a.against))
        differ = [n for n in names if n in before and found[n] != before[n]]
        for n in differ:
            print(f"DIFFERS: {n}\n  before {before[n]}\n  after  {found[n]}")
        print("golden runs: " + (f"{len(differ)} differ: {differ}" if differ else "all identical"))
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
