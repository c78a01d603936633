"""One of two processes that generate together over a mesh spanning both (jax.distributed).

Run by tests/test_sharding.py: ``python distributed_child.py PROCESS_ID PORT FIXTURE MODEL
DATA`` with XLA_FLAGS=--xla_force_host_platform_device_count=4 (4 CPU devices per process,
gloo collectives). Prints one JSON line: the tokens on this process's first device alone and
the tokens over the 8-device mesh.
"""

from __future__ import annotations

import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process, port, fixture, model, data = sys.argv[1:6]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=int(process))

from generation_cases import case, context  # noqa: E402

from transmuter_jax import generation  # noqa: E402
from transmuter_jax.parallel import sharding  # noqa: E402


def main() -> None:
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    the_case = case(fixture, "batch")
    prompts = [the_case["prompts"][i % len(the_case["prompts"])][: 4 - i % 2] for i in range(4)]
    seeds = list(range(len(prompts)))
    with tempfile.TemporaryDirectory() as tmp:
        ctx = context(fixture, pathlib.Path(tmp), max_new_tokens=6, decode_steps=3)
        alone = generation.generate(generation.compile(ctx, 8), prompts, seeds)
        mesh = sharding.make_mesh(model=int(model), data=int(data))
        together = generation.generate(generation.compile(ctx, 8, mesh=mesh), prompts, seeds)
    print("RESULT " + json.dumps({"alone": alone, "together": together}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
