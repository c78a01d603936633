"""Generation over a mesh of 1, 2, 4 and 8 devices: tokens/s, bytes per device, compiled shapes.

Usage: python benchmarks/sharding.py [--repo FOLDER] [--axis model|data] [--new 32]
       [--batch 8] [--devices 1,2,4,8] [--json OUT]

Each device count runs in its own process (JAX fixes the device count at import): on a CPU
host with ``--xla_force_host_platform_device_count=N`` forced host devices; on a GPU or TPU
host with the first N real devices (pass --real). The default repo is the default model's
genai fp32 export (SmolLM2-135M-Instruct). Greedy, ``--batch`` prompts of 32 random tokens.

The weights are loaded with ``mesh=``: each device receives only its shards ("after load" is
every array on the most loaded device once the model is loaded). On a CPU the forced devices
share the same cores, so the figures show correctness (the tokens equal the one-device run) and
memory per device, not speed. The CPU kernels are off (TRANSMUTER_JAX_KERNELS=0) unless set,
so that the one-device run computes as the sharded ones, which run without them anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def child(args) -> dict:
    import jax

    import transmuter_jax as tj
    from transmuter_jax import generation
    from transmuter_jax.parallel import sharding

    n = args.child
    devices = jax.devices()[:n]
    repo = args.repo
    mesh = None
    if n > 1:
        shape = {"model": n, "data": 1} if args.axis == "model" else {"model": 1, "data": n}
        mesh = sharding.make_mesh(devices, **shape)
    model = tj.load(os.path.join(repo, "model.onnx"), mesh=mesh)  # straight to the shards
    loaded = sharding.memory(jax.live_arrays())  # every array on the devices after load
    ctx = generation.context(repo, model, max_new_tokens=args.new, eos_token_id=[])
    rng = np.random.default_rng(0)
    vocab = ctx.vocab_size or 1000
    prompts = [rng.integers(0, vocab, 32).tolist() for _ in range(args.batch)]
    start = time.perf_counter()
    ready = generation.compile(ctx, args.batch, mesh=mesh)
    marks = []
    tokens = generation.generate(
        ready,
        prompts,
        list(range(args.batch)),
        on_token=lambda e: marks.append(time.perf_counter()),
    )
    cold = time.perf_counter() - start
    marks.clear()
    generation.generate(
        ready,
        prompts,
        list(range(args.batch)),
        on_token=lambda e: marks.append(time.perf_counter()),
    )
    decode = marks[-1] - marks[0]
    new = sum(len(t) for t in tokens) - args.batch  # tokens after the first of each row
    cache = ready.cache.empty(args.batch, 32 + args.new + 64)
    if ready.placement is not None:
        cache = ready.placement.place_cache(cache)
    weights = sharding.memory(ready.model.params)
    return {
        "devices": n,
        "axis": args.axis if n > 1 else None,
        "tokens_per_s": new / decode if decode > 0 else None,
        "cold_s": cold,
        "weights_bytes_per_device": weights,
        "loaded_bytes_per_device": loaded,
        "cache_bytes_per_device": sharding.memory(cache),
        "weights_bytes_total": int(sum(v.nbytes for v in ready.model.params.values())),
        "compiled_shapes": sorted(map(list, ready.compiled.steps.shapes)),
        "backend": jax.default_backend(),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=None)
    parser.add_argument("--axis", choices=("model", "data"), default="model")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--devices", default="1,2,4,8")
    parser.add_argument("--real", action="store_true", help="use real devices, not forced CPU")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repo is None:
        from transmuter_jax import default

        args.repo = default.path("genai-fp32")
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    rows = []
    for n in (int(x) for x in args.devices.split(",")):
        env = dict(os.environ)
        env.setdefault("TRANSMUTER_JAX_KERNELS", "0")  # the CPU kernels are not partitioned
        if not args.real:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
        command = [sys.executable, __file__, "--child", str(n), "--repo", args.repo]
        command += ["--axis", args.axis, "--new", str(args.new), "--batch", str(args.batch)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not line:
            sys.exit(f"{n} devices failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(line[-1][7:]))
    base = rows[0]["tokens"]
    print(f"{rows[0]['backend']}: {args.repo}, batch {args.batch}, {args.new} new tokens")
    print(
        "devices  axis   tokens/s  same  weights/device (max)  after load (max)  "
        "cache/device (max)  shapes"
    )
    for row in rows:
        row["same_tokens"] = row["tokens"] == base
        weights = max(row["weights_bytes_per_device"].values())
        loaded = max(row["loaded_bytes_per_device"].values())
        cache = max(row["cache_bytes_per_device"].values())
        speed = row["tokens_per_s"] or 0.0
        same = str(row["same_tokens"])
        print(
            f"{row['devices']:>7}  {row['axis'] or '-':5}  {speed:8.1f}  {same:5} "
            f"{weights / 2**20:14.1f} MiB  {loaded / 2**20:12.1f} MiB  "
            f"{cache / 2**20:14.1f} MiB  {len(row['compiled_shapes'])}"
        )
    if rows[0]["backend"] == "cpu":
        print("(forced host devices share this CPU's cores: correctness and memory, not speed)")
    if args.json:
        with open(args.json, "w") as file:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in rows], file, indent=1)


if __name__ == "__main__":
    main()
