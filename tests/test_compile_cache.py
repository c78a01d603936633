"""The persistent compilation cache: a second process compiles nothing new."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "llama-genai-fp32"

WORKLOAD = """
import json, sys
from jax import monitoring
counts = {}
monitoring.register_event_listener(
    lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
import transmuter_jax as tj
from transmuter_jax import generation
from transmuter_jax.runtime import stored
starts = []
stored.compile_listeners.append(lambda event, seconds: starts.append(event == "start"))
folder = sys.argv[1]
model = tj.load(folder + "/model.onnx")
ctx = generation.compile(generation.context(folder, model, max_new_tokens=6), 2)
tokens = generation.generate(ctx, [[5, 6, 7, 8, 9], [10, 11]], [0, 1])
print(json.dumps({
    "hits": counts.get("/jax/compilation_cache/cache_hits", 0),
    "misses": counts.get("/jax/compilation_cache/cache_misses", 0),
    "tokens": tokens,
    "folder": tj.compile_cache.directory(),
    "stored": stored.counts,
    "traced": sum(starts),
}))
"""


def _run(setting: str) -> dict:
    env = dict(os.environ, TRANSMUTER_JAX_COMPILE_CACHE=setting, HF_HUB_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(FIXTURE)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing_new(tmp_path):
    folder = tmp_path / "jax-cache"
    first = _run(str(folder))
    assert first["folder"] == str(folder)
    # The step programs at least: what this package compiles inside compile_cache.scope().
    assert first["misses"] >= first["stored"]["exported"] >= 2
    second = _run(str(folder))
    assert second["misses"] == 0
    assert second["hits"] >= first["misses"]
    assert second["tokens"] == first["tokens"]


def test_a_second_process_traces_no_step(tmp_path):
    """The lowered step programs are kept on disk: a second process reads them, traces none."""
    folder = tmp_path / "jax-cache"
    first = _run(str(folder))
    assert first["stored"]["exported"] >= 2  # the prompt steps and the decode step
    assert first["stored"]["read"] == 0
    assert len(list((folder / "lowered").glob("*.jaxexport"))) == first["stored"]["exported"]
    second = _run(str(folder))
    assert second["stored"] == {"exported": 0, "read": first["stored"]["exported"]}
    assert second["traced"] == 0  # none ran as plain jit (a custom call jax.export refused)
    assert second["misses"] == 0
    assert second["tokens"] == first["tokens"]


def test_a_damaged_program_is_traced_again(tmp_path):
    folder = tmp_path / "jax-cache"
    first = _run(str(folder))
    for path in (folder / "lowered").glob("*.jaxexport"):
        path.write_bytes(b"not a program")
    second = _run(str(folder))
    assert second["stored"]["exported"] == first["stored"]["exported"]
    assert second["tokens"] == first["tokens"]


def test_the_variable_turns_it_off(tmp_path):
    out = _run("off")
    assert out["folder"] is None
    assert out["hits"] == out["misses"] == 0
    assert out["stored"] == {"exported": 0, "read": 0}


def test_a_graph_fingerprint_names_the_graph_not_the_load():
    import transmuter_jax as tj

    fixtures = pathlib.Path(__file__).parent / "fixtures"
    first = tj.load(FIXTURE / "model.onnx").fingerprint
    assert tj.load(FIXTURE / "model.onnx").fingerprint == first  # another load, same graph
    other = tj.load(fixtures / "qwen2-genai-fp32" / "model.onnx").fingerprint
    pruned = tj.load(FIXTURE / "model.onnx", outputs=["logits"]).fingerprint
    assert len({first, other, pruned}) == 3


def test_a_stored_program_key_changes_with_what_shapes_the_program(monkeypatch):
    import numpy as np

    from transmuter_jax.runtime import stored

    def key(what, args):
        return stored._key(what, *stored._abstract(args))

    args = ({"w": np.zeros((2, 3), np.float32)}, np.zeros(4, np.int32))
    base = key(("step", "graph"), args)
    assert key(("step", "graph"), args) == base
    assert key(("step", "other graph"), args) != base
    assert key(("step", "graph"), (args[0], np.zeros(5, np.int32))) != base
    assert key(("step", "graph"), (args[0], np.zeros(4, np.float32))) != base
    monkeypatch.setenv("TRANSMUTER_JAX_NBITS_INT8", "1")
    assert key(("step", "graph"), args) != base


def test_what_jax_export_cannot_store_runs_as_plain_jit(tmp_path, monkeypatch):
    import jax
    import numpy as np

    from transmuter_jax.runtime import compile_cache, stored

    monkeypatch.setattr(compile_cache, "directory", lambda: str(tmp_path))

    def host(x):  # a host callback: jax.export refuses it
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(lambda v: np.asarray(v) * 2, shape, x)

    before = dict(stored.counts)
    fn = stored.StoredJit(host, ("host callback",))
    np.testing.assert_array_equal(np.asarray(fn("sig", np.arange(3.0))), [0.0, 2.0, 4.0])
    assert stored.counts == before
    assert not list(tmp_path.glob("lowered/*"))
    plain = stored.StoredJit(lambda x: x + 1, ("plus one",))
    np.testing.assert_array_equal(np.asarray(plain("sig", np.arange(3.0))), [1.0, 2.0, 3.0])
    assert stored.counts["exported"] == before["exported"] + 1
    assert len(list(tmp_path.glob("lowered/*.jaxexport"))) == 1


def test_warm_stores_a_program_without_running_it(tmp_path, monkeypatch):
    import jax
    import numpy as np

    from transmuter_jax.runtime import compile_cache, stored

    monkeypatch.setattr(compile_cache, "directory", lambda: str(tmp_path))
    before = dict(stored.counts)
    calls = []

    def double(x):
        calls.append(1)  # traced, never run on the host
        return x * 2

    spec = jax.ShapeDtypeStruct((3,), np.float32)
    first = stored.AutoStoredJit(double, ("double",))
    first.warm(spec)
    assert stored.counts["exported"] == before["exported"] + 1
    traced = len(calls)
    np.testing.assert_array_equal(np.asarray(first(np.arange(3.0, dtype=np.float32))), [0, 2, 4])
    assert len(calls) == traced  # the call ran the warmed program
    again = stored.AutoStoredJit(double, ("double",))  # a new process: read from disk
    again.warm(spec)
    assert stored.counts["read"] == before["read"] + 1
    np.testing.assert_array_equal(np.asarray(again(np.ones(3, np.float32))), [2, 2, 2])


def test_only_this_threads_programs_inside_a_scope_are_kept(tmp_path, monkeypatch):
    import threading

    import jax
    import numpy as np

    from transmuter_jax import compile_cache

    fresh = {"configured": False, "folder": None, "cache": None}
    monkeypatch.setattr(compile_cache, "_state", fresh)
    assert compile_cache.enable(tmp_path) == str(tmp_path)

    def elsewhere():
        jax.jit(lambda x: jax.numpy.cos(x) * 5 - 1)(np.arange(11.0))

    with compile_cache.scope():
        jax.jit(lambda x: x * 7 + 2)(np.arange(13.0))  # kept
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        with compile_cache.scope():  # reentrant: nothing changes
            jax.jit(lambda x: x * 9 - 4)(np.arange(17.0))  # kept
    jax.jit(lambda x: x * 11 + 3)(np.arange(19.0))  # outside: not kept
    assert len(list(tmp_path.glob("*-cache"))) == 2
    assert jax.config.jax_compilation_cache_dir is None


def test_stored_programs_know_every_kernel():
    """jax.export is told every custom call of the kernels: a program calling one it does not
    know is not stored, and is traced and compiled again in every process."""
    from transmuter_jax.kernels import build
    from transmuter_jax.runtime import stored

    assert set(stored.CUSTOM_CALLS) == set(build.TARGETS)
