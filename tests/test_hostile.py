"""Hostile inputs, each in the form of a probe of issue 14, with the exact outcome each must get.

The probes that a process's state could hide (the program store, the compilation cache, import
side effects) run in a fresh process each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import transmuter_jax as tj
from transmuter_jax import hub
from transmuter_jax.testing import example_inputs
from transmuter_jax.text import chat

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
LLAMA = FIXTURES / "llama-genai-fp32"
VOCAB = 512  # vocab_size of LLAMA's config.json


def _python(code: str, tmp_path: Path, timeout: int = 300, **env: str) -> dict:
    """Runs ``code`` in a fresh process; returns the JSON object of its last line."""
    environment = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), **env)
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", textwrap.dedent(code), str(tmp_path)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["stderr"] = out.stderr
    return result


def _model(nodes, inputs, outputs, inits=(), opset=21) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _embedding(vocab: int = 10) -> onnx.ModelProto:
    """y = table[input_ids] * 2, with ``input_ids`` (batch, seq) and ``past`` (batch, 1, past, 2),
    ``attention_mask`` (batch, total) summed into ``m``."""
    table = np.arange(vocab * 4, dtype=np.float32).reshape(vocab, 4)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["e"], name="embed"),
        helper.make_node("Add", ["e", "e"], ["y"], name="twice"),
        helper.make_node("ReduceSum", ["attention_mask"], ["m"], keepdims=0, name="mask_sum"),
        helper.make_node("Identity", ["past_key_values.0.key"], ["present"], name="keep"),
    ]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
        helper.make_tensor_value_info(
            "past_key_values.0.key", TensorProto.FLOAT, ["batch", 1, "past", 2]
        ),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4]),
        helper.make_tensor_value_info("m", TensorProto.INT64, []),
        helper.make_tensor_value_info("present", TensorProto.FLOAT, ["batch", 1, "past", 2]),
    ]
    return _model(nodes, inputs, outputs, [numpy_helper.from_array(table, "table")])


def _shaped() -> onnx.ModelProto:
    """y = reshape(x, (batch, -1)) @ W, plus or minus one by the flag (an If); z = y * 2."""
    w = np.arange(60, dtype=np.float32).reshape(12, 5) / 60
    branch = {
        name: helper.make_graph(
            [helper.make_node(op, ["y0", "one"], [name])],
            name,
            [],
            [helper.make_empty_tensor_value_info(name)],
        )
        for name, op in (("then", "Add"), ("else", "Sub"))
    }
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"]),
        helper.make_node("Concat", ["b", "minus_one"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["x2"]),
        helper.make_node("MatMul", ["x2", "W"], ["y0"]),
        helper.make_node(
            "If", ["flag"], ["y"], then_branch=branch["then"], else_branch=branch["else"]
        ),
        helper.make_node("Add", ["y", "y"], ["z"]),
    ]
    inits = [
        numpy_helper.from_array(w, "W"),
        numpy_helper.from_array(np.ones(5, np.float32), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4]),
        helper.make_tensor_value_info("flag", TensorProto.BOOL, [1]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5]),
        helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 5]),
    ]
    return _model(nodes, inputs, outputs, inits)


def _feed(batch=2, seq=3, past=1, total=None, past_batch=None, ids=None) -> dict:
    total = seq + past if total is None else total
    return {
        "input_ids": np.zeros((batch, seq), np.int64) if ids is None else np.asarray(ids),
        "attention_mask": np.ones((batch, total), np.int64),
        "past_key_values.0.key": np.zeros((past_batch or batch, 1, past, 2), np.float32),
    }


@pytest.fixture
def embedding(tmp_path) -> tj.Model:
    path = tmp_path / "embedding.onnx"
    onnx.save(_embedding(), path)
    return tj.load(path)


# Probe 5: token ids outside the vocabulary.


@pytest.mark.parametrize("bad", [VOCAB, -600])
@pytest.mark.parametrize(
    "file",
    [LLAMA / "model.onnx", FIXTURES / "marian-optimum" / "decoder_model_merged.onnx"],
    ids=["genai", "merged decoder (embedding inside If)"],
)
def test_token_ids_outside_the_vocabulary_are_refused(bad, file):
    model = tj.load(file)
    inputs = example_inputs(model, batch=1, length=3)
    inputs["input_ids"] = np.array([[1, bad, 2]], np.int64)
    with pytest.raises(
        tj.InputError, match=rf"'input_ids'.* holds {bad}, outside the {VOCAB} rows"
    ):
        model(inputs)


def test_token_ids_inside_the_vocabulary_run(embedding):
    out = embedding(_feed(ids=[[0, 9, 3], [1, 2, 3]]))
    np.testing.assert_array_equal(np.asarray(out["y"])[0, 1], np.arange(36, 40) * 2)


# Probe 7: genai_config.json naming a decoder outside the folder.


@pytest.mark.parametrize(
    "decoder", ["../../outside/model.onnx", "/etc/model.onnx", "a/../../x.onnx"]
)
def test_genai_config_naming_a_file_outside_the_folder_is_refused(tmp_path, decoder):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "genai_config.json").write_text(
        json.dumps({"model": {"decoder": {"filename": decoder}}})
    )
    (root / "model.onnx").write_text("x")
    with pytest.raises(tj.ModelFileError, match="outside the model's folder; refusing to load it"):
        hub.files(root)


# Probes 8 and 9: a script that runs two stored programs and prints their values, warnings
# and the store's counts.

STORE = """
import json, sys, warnings
import numpy as np
import transmuter_jax as tj
from transmuter_jax.runtime import compile_cache, stored
compile_cache.enable(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = stored.StoredJit(lambda x: x + 1, ("plus one",))("s", np.arange(3.0))
    b = stored.StoredJit(lambda x: x * 2, ("twice",))("s", np.arange(4.0))
print(json.dumps({
    "values": [np.asarray(a).tolist(), np.asarray(b).tolist()],
    "warnings": [str(w.message) for w in caught],
    "counts": stored.counts,
}))
"""
VALUES = [[1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]]  # STORE's values


# Probe 8: the program store without flatbuffers says so, once.


def test_the_store_without_flatbuffers_warns_once_and_runs(tmp_path):
    without = 'import sys; sys.modules["flatbuffers"] = None  # as if it were not installed'
    out = _python(without + STORE, tmp_path)
    assert out["values"] == VALUES
    assert len(out["warnings"]) == 1
    assert "needs the package flatbuffers" in out["warnings"][0]
    assert out["counts"] == {"exported": 0, "read": 0}
    assert not list(tmp_path.glob("lowered/*"))


# Probe 9: a stored program (or a compiled one) under the wrong key.


def test_a_stored_program_under_the_wrong_key_is_traced_again_and_replaced(tmp_path):
    first = _python(STORE, tmp_path)
    assert first["counts"] == {"exported": 2, "read": 0}
    files = sorted((tmp_path / "lowered").glob("*.jaxexport"))
    assert len(files) == 2
    contents = [f.read_bytes() for f in files]
    files[0].write_bytes(contents[1])  # each a valid program, under the other's name
    files[1].write_bytes(contents[0])
    second = _python(STORE, tmp_path)
    assert second["values"] == first["values"] == VALUES
    assert second["counts"] == {"exported": 2, "read": 0}
    problems = [w for w in second["warnings"] if "does not match its key" in w]
    assert len(problems) == 1 and "stored program" in problems[0]
    assert sorted(f.read_bytes() for f in files) == sorted(contents)  # replaced by the right ones
    assert files[0].read_bytes() == contents[0]
    third = _python(STORE, tmp_path)
    assert third["counts"] == {"exported": 0, "read": 2}
    assert not [w for w in third["warnings"] if "does not match" in w]


COMPILED = """
import json, sys, warnings
import numpy as np
import transmuter_jax as tj
from jax import monitoring
counts = {}
monitoring.register_event_listener(
    lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
tj.compile_cache.enable(sys.argv[1])
model = tj.load(sys.argv[1] + "/../embedding.onnx")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ys = [np.asarray(model({
        "input_ids": np.ones((1, n), np.int64),
        "attention_mask": np.ones((1, n), np.int64),
        "past_key_values.0.key": np.zeros((1, 1, 0, 2), np.float32),
    })["y"]).sum().item() for n in (2, 3)]
print(json.dumps({
    "ys": ys,
    "warnings": [str(w.message) for w in caught],
    "hits": counts.get("/jax/compilation_cache/cache_hits", 0),
    "misses": counts.get("/jax/compilation_cache/cache_misses", 0),
}))
"""


def test_a_compiled_program_under_the_wrong_key_is_compiled_again_and_replaced(tmp_path):
    onnx.save(_embedding(), tmp_path / "embedding.onnx")
    cache = tmp_path / "cache"
    first = _python(COMPILED, cache)
    assert first["misses"] == 2
    files = sorted(cache.glob("*-cache"))
    assert len(files) == 2
    contents = [f.read_bytes() for f in files]
    files[0].write_bytes(contents[1])
    files[1].write_bytes(contents[0][:-100])  # truncated
    second = _python(COMPILED, cache)
    assert second["ys"] == first["ys"] == [88.0, 132.0]  # 2 * (4 + 5 + 6 + 7) per token
    assert (second["hits"], second["misses"]) == (0, 2)
    problems = [w for w in second["warnings"] if "does not match its key" in w]
    assert len(problems) == 1 and "compiled program" in problems[0]
    third = _python(COMPILED, cache)
    assert (third["hits"], third["misses"]) == (2, 0)


# Probe 10: hostile chat templates.

MESSAGES = [{"role": "user", "content": "hi"}]


def _render(template: str) -> str:
    return chat.render(template, MESSAGES, add_generation_prompt=False, special_tokens={})


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{{ 'a' * 3000000000 }}", "builds a string or list (with *) of 3,000,000,000 items"),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "ran more than 1,000,000 loop iterations and calls",
        ),
        ("{{ 10 ** 100000000 }}", "an integer of more than 65,536 bits"),
        ("{{ 'a'|center(3000000000) }}", "builds a string of 3,000,000,000 items"),
        ("{{ 'a'.ljust(3000000000) }}", "builds a string of 3,000,000,000 items"),
        ("{{ '%3000000000d' % 1 }}", "formats a value to a width of 10,000,000 or more"),
        ("{{ '{:>3000000000}'.format(1) }}", "formats a value to a width of 10,000,000 or more"),
        (
            "{% set ns = namespace(s='a') %}{% for i in range(60) %}"
            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "builds a string (with ~) of 16,777,216 items",
        ),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
            "{% set ns.s = ns.s|replace('a', 'aa') %}{% endfor %}",
            "more than the limit of 10,000,000",
        ),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError (too deep"),
        ("{{ messages|tojson(indent=9999999) }}", "calls tojson with an argument of more than"),
        ("{{ ('\t' * 1000000).expandtabs(1000) }}", "a string (with expandtabs) of 1,001,000,000"),
        (
            "{% set big = 'a' * 9000000 %}{% set ns = namespace(l=[]) %}{% for i in range(5) %}"
            "{% set ns.l = ns.l + [big] %}{% endfor %}{{ ns.l|join }}",
            "builds a string (with join) of 45,000,000 items",
        ),
    ],
)
def test_a_hostile_chat_template_fails_fast_with_a_clear_error(template, words):
    with pytest.raises(chat.ChatTemplateLimitError) as error:
        _render(template)
    assert "chat template exceeds a limit of a render: " in str(error.value)
    assert words in str(error.value)


def test_a_chat_template_that_runs_too_long_is_stopped(monkeypatch):
    monkeypatch.setattr(chat, "TIME_LIMIT", 0.2)
    monkeypatch.setattr(chat, "MAX_STEPS", 10**12)
    template = "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}"
    with pytest.raises(chat.ChatTemplateLimitError, match=r"it took more than 0\.2 s"):
        _render(template + "{{ f(40) }}")


def test_a_long_message_renders():
    content = "<think>" + "word " * 1_000_000 + "</think>answer"  # 5 MB
    template = (
        "{% for m in messages %}{% if m.content.startswith('<think>') %}"
        "{{ m.content.split('</think>')[-1]|trim }}|{{ m.content|replace('word', 'w')|length }}"
        "|{{ (m.content ~ m.role)|length }}|{{ m.content|tojson|length }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": content}]
    text = chat.render(template, messages, add_generation_prompt=False, special_tokens={})
    size = len(content)
    assert text == f"answer|{size - 3_000_000}|{size + 4}|{size + 2}"


def test_ordinary_templates_still_render():
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %}!{% endif %}"
        "{% endfor %}{{ (['ab'] * 3)|join(',') }} {{ '%05d' % 3 }} {{ '{:>4}'.format(1) }}"
        "{{ 'x' ~ 'y' }}{{ [1] + [2] }}{{ 2 ** 10 }}{{ 'a' * 3 }}"
    )
    assert _render(template) == "user: hi!ab,ab,ab 00003    1xy[1, 2]1024aaa"


# Probe 11: importing the package changes no global JAX configuration, and loading a model does
# not collect the caller's programs.

IMPORT = """
import json, sys, warnings
import jax, numpy as np
before = {k: repr(v) for k, v in jax.config.values.items()}
import transmuter_jax as tj
after_import = {k: repr(v) for k, v in jax.config.values.items()}
model = tj.load(sys.argv[1] + "/embedding.onnx")
model({
    "input_ids": np.ones((1, 2), np.int64),
    "attention_mask": np.ones((1, 2), np.int64),
    "past_key_values.0.key": np.zeros((1, 1, 0, 2), np.float32),
})
jax.jit(lambda x: jax.numpy.sin(x) * 3)(np.arange(7.0))  # the caller's own program
after_load = {k: repr(v) for k, v in jax.config.values.items()}
print(json.dumps({
    "import": {k: [before[k], after_import[k]] for k in before if before[k] != after_import[k]},
    "load": {k: [before[k], after_load[k]] for k in before if before[k] != after_load[k]},
    "folder": tj.compile_cache.directory(),
}))
"""


def test_import_changes_no_jax_config_and_the_callers_programs_stay_out(tmp_path):
    onnx.save(_embedding(), tmp_path / "embedding.onnx")
    cache = tmp_path / "cache"
    out = _python(IMPORT, tmp_path, TRANSMUTER_JAX_COMPILE_CACHE=str(cache))
    assert out["import"] == {}
    assert out["load"] == {}
    assert out["folder"] == str(cache)
    entries = sorted(p.name for p in cache.glob("*-cache"))
    assert len(entries) == 1 and entries[0].startswith("tj1-jit_trace-")  # the model's only


def test_a_cache_folder_the_caller_set_is_kept(tmp_path):
    onnx.save(_embedding(), tmp_path / "embedding.onnx")
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    code = f"import jax; jax.config.update('jax_compilation_cache_dir', {str(theirs)!r})\n"
    out = _python(code + IMPORT, tmp_path, TRANSMUTER_JAX_COMPILE_CACHE=str(mine))
    assert out["folder"] == str(theirs)
    assert not list(mine.glob("*-cache"))


# Probe 12: errors that name what is wrong.


def test_a_node_input_that_no_node_produces_is_named(tmp_path):
    model = _embedding()
    model.graph.node[1].input[1] = "ghost"
    onnx.save(model, tmp_path / "m.onnx")
    words = r"node 'twice' \(Add\) of .* reads 'ghost', which no input, initializer or earlier"
    with pytest.raises(tj.ModelFileError, match=words):
        tj.load(tmp_path / "m.onnx")


def _external(tmp_path, **fields: str) -> Path:
    table = numpy_helper.from_array(np.ones((10, 4), np.float32), "table")
    (tmp_path / "w.bin").write_bytes(np.ones((10, 4), np.float32).tobytes())
    table.ClearField("raw_data")
    table.data_location = TensorProto.EXTERNAL
    for key, value in {"location": "w.bin", **fields}.items():
        entry = table.external_data.add()
        entry.key, entry.value = key, value
    model = _embedding()
    model.graph.ClearField("initializer")
    model.graph.initializer.append(table)
    onnx.save(model, tmp_path / "m.onnx")
    return tmp_path / "m.onnx"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"offset": "-8"}, "has offset '-8'; it must be a non-negative integer"),
        ({"offset": "eight"}, "has offset 'eight'; it must be a non-negative integer"),
        ({"length": "-1"}, "has length '-1'; it must be a non-negative integer"),
    ],
)
def test_a_bad_external_data_offset_is_named(tmp_path, fields, words):
    with pytest.raises(tj.ModelFileError, match=words):
        tj.load(_external(tmp_path, **fields))


def test_dims_whose_product_wraps_are_refused(tmp_path):
    path = _external(tmp_path)
    model = onnx.load(path, load_external_data=False)
    del model.graph.initializer[0].dims[:]
    model.graph.initializer[0].dims.extend([2**32, 2**32])  # 2**64 elements wrap to 0 in int64
    onnx.save(model, path)
    with pytest.raises(tj.ModelFileError, match=r"dims \[4294967296, 4294967296\], which give no"):
        tj.load(path)


@pytest.mark.parametrize("content", ["{not json", '"a string"', "[1, 2]"])
def test_malformed_json_config_names_the_file(tmp_path, content):
    (tmp_path / "generation_config.json").write_text(content)
    words = r"generation_config\.json.*(not valid JSON|must hold a JSON object)"
    with pytest.raises(tj.ModelFileError, match=words):
        hub.read_json(tmp_path, "generation_config.json")


def test_a_batch_mismatch_between_input_ids_and_the_past_is_named(embedding):
    with pytest.raises(
        tj.InputError, match=r"'past_key_values.0.key' .* has batch 3, but 'input_ids' has batch 2"
    ):
        embedding(_feed(batch=2, past_batch=3))


def test_an_empty_onnx_file_is_refused(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(tj.ModelFileError, match=r"is empty \(0 bytes\)"):
        tj.load(tmp_path / "model.onnx")


def test_all_missing_inputs_are_named_at_once(embedding):
    with pytest.raises(
        tj.InputError, match=r"missing inputs 'attention_mask', 'past_key_values.0.key' of"
    ):
        embedding({"input_ids": np.zeros((1, 1), np.int64)})


# Probe 13: what must be refused.


def test_an_attention_mask_longer_than_the_sequence_and_the_past_is_refused(embedding):
    embedding(_feed(seq=3, past=2, total=5))
    with pytest.raises(tj.InputError, match=r"has 6 columns, more than the sequence \(3\) plus"):
        embedding(_feed(seq=3, past=2, total=6))


def test_an_opset_newer_than_any_implementation_warns(tmp_path):
    model = _embedding()
    model.opset_import[0].version = 99
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.warns(RuntimeWarning, match="imports opset 99 of ai.onnx, newer than any"):
        tj.load(tmp_path / "m.onnx")


# Property: a mutated small model loads and runs, or raises one of this package's errors.

_OPS = ["Add", "Relu", "Nonexistent", "Reshape", "MatMul", "Gather", "Identity"]


def _mutate(model: onnx.ModelProto, kind: str, a: int, b: int) -> bytes:
    graph = model.graph
    nodes = graph.node
    if kind == "drop node":
        del nodes[a % len(nodes)]
    elif kind == "rename input":
        node = nodes[a % len(nodes)]
        names = [n for n in node.input] + ["ghost", "table", "input_ids", ""]
        node.input[b % len(node.input)] = names[(a + b) % len(names)]
    elif kind == "op type":
        nodes[a % len(nodes)].op_type = _OPS[b % len(_OPS)]
    elif kind == "opset":
        model.opset_import[0].version = [1, 6, 11, 13, 21, 99][b % 6]
    elif kind == "dims":
        table = graph.initializer[0]
        del table.dims[:]
        table.dims.extend([[10, 4], [4, 10], [40], [-1, 4], [2**40, 2**40], [0, 4]][b % 6])
    elif kind == "attribute":
        node = nodes[a % len(nodes)]
        node.attribute.append(helper.make_attribute("axis", b - 3))
    data = model.SerializeToString()
    if kind == "truncate":
        data = data[: a % len(data)]
    elif kind == "flip byte":
        data = bytearray(data)
        data[a % len(data)] ^= 1 + b % 255
        data = bytes(data)
    return data


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    kind=st.sampled_from(
        [
            "drop node",
            "rename input",
            "op type",
            "opset",
            "dims",
            "attribute",
            "truncate",
            "flip byte",
        ]
    ),
    base=st.sampled_from([_embedding, _shaped]),
    a=st.integers(0, 10_000),
    b=st.integers(0, 10_000),
)
def test_a_mutated_model_gives_a_result_or_this_packages_error(tmp_path, kind, base, a, b):
    path = tmp_path / "mutated.onnx"
    path.write_bytes(_mutate(base(), kind, a, b))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = tj.load(path)
            feed = {
                **_feed(batch=1, seq=2, past=1),
                "x": np.ones((1, 3, 4), np.float32),
                "flag": np.array([True]),
            }
            feed = {i.name: feed.get(i.name, np.zeros(1, np.float32)) for i in model.inputs}
            out = model(feed)
        except tj.TransmuterError:
            return
    assert set(out) == {o.name for o in model.outputs}


def test_a_tokenizer_folder_whose_config_is_a_json_string_is_named(tmp_path):
    import shutil

    from transmuter_jax.text.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(FIXTURES / "llama-optimum" / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)  # the class then comes from config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text('"just a string"')
    with pytest.raises(tj.ModelFileError, match="config.json.? must hold a JSON object"):
        Tokenizer.from_folder(tmp_path)


# -- generation options, property-based -------------------------------------------------------

_OPTION_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-5, 600), max_size=3),
    st.lists(st.lists(st.integers(-5, 600), max_size=3), max_size=2),
)
_OPTION_NAMES = st.sampled_from(
    sorted(__import__("transmuter_jax.generation.options", fromlist=["NAMES"]).NAMES)
    + ["temprature", "diversity_penalty", "guidance_scale", "stop_strings"]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_OPTION_NAMES, _OPTION_VALUES, max_size=4))
def test_any_generation_options_give_options_or_a_generation_error(options):
    from transmuter_jax.generation import GenerationError
    from transmuter_jax.generation.options import merge

    try:
        merged = merge({}, {}, options)
        merged.check_supported(VOCAB)
    except GenerationError:
        return
    except (TypeError, ValueError) as error:  # a value of the wrong kind
        assert not isinstance(error, GenerationError)
        pytest.fail(f"{options!r} raised {type(error).__name__}: {error}")
    hash(merged)  # frozen and hashable: it keys compiled programs


@pytest.fixture(scope="module")
def small_context():
    from transmuter_jax import generation

    model = tj.load(LLAMA / "model.onnx")
    return lambda **options: generation.compile(
        generation.context(LLAMA, model, max_new_tokens=3, **options), 2
    )


_RUN_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "do_sample": st.booleans(),
        "temperature": st.floats(0.05, 5.0),
        "top_k": st.integers(0, 600),
        "top_p": st.floats(0.01, 1.0),
        "min_p": st.floats(0.0, 1.0),
        "repetition_penalty": st.floats(0.1, 5.0),
        "no_repeat_ngram_size": st.integers(0, 4),
        "min_new_tokens": st.integers(0, 5),
        "eos_token_id": st.lists(st.integers(0, VOCAB - 1), max_size=2),
        "suppress_tokens": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "decode_steps": st.integers(1, 4),
        "token_logprobs": st.booleans(),
    },
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_RUN_OPTIONS, st.integers(-(2**70), 2**70))
def test_generation_under_any_valid_options_gives_tokens_in_the_vocabulary(
    small_context, options, seed
):
    from transmuter_jax.generation import GenerationError

    try:
        ctx = small_context(**options)
    except GenerationError:
        return
    out = generate_rows(ctx, seed)
    for row in out:
        for item in row:
            token, logprob = item if isinstance(item, tuple) else (item, 0.0)
            assert 0 <= token < VOCAB
            assert not np.isnan(logprob)


def generate_rows(ctx, seed):
    from transmuter_jax import generation

    return generation.generate(ctx, [[5, 6, 7], [9]], [seed, seed + 1])


def test_an_oversized_max_new_tokens_runs_in_bounded_memory():
    """The probe `generate MODEL hi --max-new-tokens 100000000` under a 4 GiB address-space
    limit: the pipeline clamps to the positions left instead of sizing a huge cache."""
    import json
    import os
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    command = [sys.executable, "-m", "transmuter_jax", "generate", str(FIXTURES / "llama-optimum")]
    command += ["hi", "--max-new-tokens", "100000000", "--json", "--no-chat-template"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        command, capture_output=True, text=True, preexec_fn=limit, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["finish_reason"] == "length"
    assert 200 < len(record["token_ids"]) < 256  # the 256 positions less the prompt
    assert all(np.isfinite(record["logprobs"]))


# -- round 2: model folders are untrusted input ------------------------------------------------


def _special(tmp_path: Path, kind: str, name: str) -> Path:
    """``name`` in ``tmp_path`` as a hostile file of ``kind``."""
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "link outside":
        outside = tmp_path.parent / f"outside-{name}"
        outside.write_text('{"secret": 1}')
        path.symlink_to(outside)
    elif kind == "folder":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as stream:
            stream.truncate(hub.MAX_TOKENIZER_BYTES + 1)  # sparse: no disk used
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    return path


_SPECIAL = {
    "fifo": "is a FIFO, not a regular file",
    "device": "outside the model's folder",
    "link outside": "outside the model's folder; refusing to read it",
    "folder": "is a folder, not a regular file",
    "huge": "more than the limit of",
    "deep": "nested too deep",
}


@pytest.mark.parametrize("kind", sorted(_SPECIAL))
@pytest.mark.parametrize(
    "name", ["config.json", "generation_config.json", "preprocessor_config.json"]
)
def test_a_hostile_config_file_is_refused_by_name_without_reading_it(tmp_path, kind, name):
    folder = tmp_path / "model"
    folder.mkdir()
    _special(folder, kind, name)
    with pytest.raises(tj.ModelFileError, match=_SPECIAL[kind]) as error:
        hub.read_json(folder, name)
    assert name in str(error.value)
    assert "secret" not in str(error.value)


@pytest.mark.parametrize("kind", sorted(_SPECIAL))
@pytest.mark.parametrize(
    "name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"]
)
def test_a_hostile_tokenizer_file_is_refused_by_name(tmp_path, kind, name):
    import shutil

    from transmuter_jax.text.tokenizer import Tokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(FIXTURES / "llama-optimum" / file, folder / file)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)  # then config.json is read too
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / name).unlink(missing_ok=True)
    _special(folder, kind, name)
    if kind == "deep" and name == "tokenizer.json":
        with pytest.raises(tj.ModelFileError, match="cannot load"):
            Tokenizer.from_folder(folder)
        return
    with pytest.raises(tj.ModelFileError, match=_SPECIAL[kind]):
        Tokenizer.from_folder(folder)


def test_a_hub_cache_snapshot_whose_files_link_to_its_blobs_is_read(tmp_path):
    snapshot = tmp_path / "models--org--name" / "snapshots" / ("0" * 40)
    blobs = tmp_path / "models--org--name" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "abc").write_text('{"max_new_tokens": 4}')
    (snapshot / "generation_config.json").symlink_to("../../blobs/abc")
    assert hub.read_json(snapshot, "generation_config.json") == {"max_new_tokens": 4}


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"hop_length": 0}, "hop_length is 0; it must be from 1 to"),
        ({"hop_length": 2.5}, "hop_length is 2.5; it must be a whole number"),
        ({"n_samples": 0}, "n_samples is 0; it must be from 1"),
        ({"n_samples": 10**12}, "n_samples is 1000000000000; it must be from 1"),
        ({"chunk_length": -3}, "chunk_length is -3"),
        ({"sampling_rate": 1}, "sampling_rate is 1; it must be from 1,000 to 384,000"),
        ({"sampling_rate": "16k"}, "sampling_rate is '16k'; it must be a whole number"),
        ({"feature_size": 10**9}, "feature_size is 1000000000"),
        ({"n_fft": 1}, "n_fft is 1"),
        ({"nb_max_frames": float("nan")}, "nb_max_frames is nan"),
        ({"padding_value": float("inf")}, "padding_value is inf; it must be a finite number"),
        (
            {"n_samples": 200, "hop_length": 100, "n_fft": 400},
            r"n_fft \(400\) needs more than 200 samples",
        ),
    ],
)
def test_degenerate_feature_extractor_values_are_refused_by_name(config, words):
    from transmuter_jax.audio.features import FeatureExtractor

    with pytest.raises(tj.ModelFileError, match=r"preprocessor_config\.json: " + words):
        FeatureExtractor.from_config(config)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"size": 0}, r"size\['height'\] is 0; it must be from 1 to 8192"),
        ({"size": {"height": 10**9, "width": 3}}, r"size\['height'\] is 1000000000"),
        ({"size": {"height": 4, "width": -1}}, r"size\['width'\] is -1"),
        ({"image_std": [0.5, 0, 0.5]}, "image_std is .*a standard deviation of 0"),
        ({"image_std": 0}, "image_std is 0"),
        ({"image_mean": [float("nan")] * 3}, "image_mean is .*it must be finite"),
        ({"image_mean": "grey"}, "image_mean is 'grey'; it must be a number or a list"),
        ({"rescale_factor": float("inf")}, "rescale_factor is inf; it must be finite"),
        ({"resample": 9}, "resample is 9; it must be one of"),
        (
            {"do_center_crop": True, "crop_size": {"height": 0, "width": 2}},
            r"crop_size\['height'\] is 0",
        ),
    ],
)
@pytest.mark.parametrize("kind", ["ViTImageProcessor", "DeiTImageProcessor"])
def test_degenerate_image_processor_values_are_refused_by_name(config, words, kind):
    from transmuter_jax.vision import processing

    if "crop_size" in config and kind == "ViTImageProcessor":
        processing.PROCESSORS[kind](config)  # ViT does not crop: it reads no crop_size
        return
    with pytest.raises(ValueError, match=f"{kind}: " + words):
        processing.PROCESSORS[kind](config)
    if "crop_size" not in config:  # a call's options are checked the same way
        with pytest.raises(ValueError, match=f"{kind}: " + words):
            processing.PROCESSORS[kind]({}).settings(config)


@pytest.mark.parametrize(
    ("file", "words"),
    [
        ({"max_new_tokens": "ten"}, "max_new_tokens must be an integer, got 'ten'"),
        ({"max_length": 3.5}, "max_length must be an integer, got 3.5"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_p": float("inf")}, "top_p must be a finite number"),
        ({"do_sample": "yes"}, "do_sample must be a bool"),
        ({"eos_token_id": "2"}, "eos_token_id must be a token id"),
        ({"num_beams": [4]}, "num_beams must be an integer"),
    ],
)
def test_generation_config_values_of_the_wrong_type_are_refused_naming_the_file(file, words):
    from transmuter_jax.generation import GenerationError
    from transmuter_jax.generation.options import merge

    with pytest.raises(GenerationError, match=r"generation_config\.json: " + words):
        merge({}, file, {})


# -- round 2: options and arguments ------------------------------------------------------------


def test_numpy_scalars_count_as_the_python_numbers_they_hold():
    from transmuter_jax.generation.options import merge

    plain = merge({}, {"top_k": 40}, {"max_new_tokens": 7, "temperature": 0.5, "do_sample": True})
    numpy = merge(
        {},
        {"top_k": np.int32(40)},
        {
            "max_new_tokens": np.int64(7),
            "temperature": np.float32(0.5),
            "do_sample": np.bool_(True),
        },
    )
    assert numpy == plain and hash(numpy) == hash(plain)
    assert numpy.program_key == plain.program_key  # the same compiled programs
    assert type(numpy.max_new_tokens) is int and type(numpy.temperature) is float
    zero_d = merge({}, {}, {"max_new_tokens": np.array(7), "eos_token_id": [np.int64(2)]})
    assert zero_d.max_new_tokens == 7 and zero_d.eos_token_id == (2,)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"max_new_tokens": 3.0}, "max_new_tokens must be an integer, got 3.0"),
        ({"max_new_tokens": float("inf")}, "max_new_tokens must be an integer"),
        ({"temperature": float("inf"), "do_sample": True}, "temperature must be a finite"),
        ({"top_p": float("nan"), "do_sample": True}, "top_p must be a finite number"),
        ({"num_return_sequences": 10**9, "do_sample": True}, "more than the limit of 1024"),
        ({"top_logprobs": 10**6}, "top_logprobs is 1000000, more than the limit of 1024"),
        ({"num_beams": 5000}, "num_beams is 5000, more than the limit of 1024"),
    ],
)
def test_limits_of_the_wrong_type_non_finite_or_huge_are_refused_by_name(options, words):
    from transmuter_jax.generation import GenerationError
    from transmuter_jax.generation.options import merge

    with pytest.raises(GenerationError, match=words):
        merge({}, {}, options)


# -- round 2: audio ----------------------------------------------------------------------------


def _wav(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    """A PCM16 wav file of [frames * channels] interleaved samples, its header written by hand
    (so that any rate can be told)."""
    import struct

    data = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", 36 + len(data), b"WAVE", b"fmt ", 16, 1, channels, rate,
        rate * channels * 2, channels * 2, 16, b"data", len(data),
    )  # fmt: skip
    return header + data


_TONE = np.sin(np.arange(16000) / 7.0).astype(np.float32) * 0.5


@pytest.mark.parametrize(
    ("audio", "rate", "words"),
    [
        (np.zeros(0, np.float32), 16000, "empty"),
        (np.array([np.nan, 0.1], np.float32), 16000, "NaN or infinite"),
        (np.array([np.inf, 0.1]), 16000, "NaN or infinite"),
        (np.array([1e300, 0.1]), 16000, "beyond float32's range"),
        (_TONE, 0, "sampling_rate is 0 Hz, outside 100 to 1,000,000 Hz"),
        (_TONE, 10**12, "sampling_rate is 1,000,000,000,000 Hz, outside"),
        (_TONE, float("nan"), "sampling_rate is a whole number of Hz, got nan"),
        (_TONE, 16000.5, "sampling_rate is a whole number of Hz"),
        (_TONE, "16000", "sampling_rate is a number of Hz, got '16000'"),
        (
            np.full(3 * 10**6, 0.1, np.float32),
            100,
            "lasts 8.3 h at 100 Hz, longer than the limit of 6 h",
        ),
        (b"this is not audio at all, just text\n" * 20, None, "cannot read the audio bytes"),
        (_wav(_TONE, 16000)[:30], None, "cannot read the audio bytes"),
        (_wav(_TONE, 1), None, "the file's sampling rate is 1 Hz, outside"),
        (_wav(_TONE[:100], 2_000_000_000), None, "the file.s sampling rate is 2,000,000,000 Hz"),
    ],
    ids=lambda v: str(v)[:30] if not isinstance(v, np.ndarray) else f"array{v.shape}",
)
def test_hostile_audio_is_refused_by_name(audio, rate, words):
    from transmuter_jax.audio.load import AudioError, load

    with pytest.raises(AudioError, match=words):
        load(audio, 16000, rate)


def test_odd_but_valid_audio_gives_the_right_samples():
    from transmuter_jax.audio.load import load

    one = load(np.array([0.25], np.float32), 16000, 16000)
    np.testing.assert_array_equal(one, [0.25])
    eight = np.repeat(_TONE[:, None], 8, axis=1)  # [frames, 8 channels]
    np.testing.assert_allclose(load(_wav(eight.reshape(-1), 16000, 8), 16000), _TONE, atol=1e-4)
    truncated = _wav(_TONE, 16000)[:-1001]  # half a sample cut off the end of the data
    got = load(truncated, 16000)
    assert 0 < len(got) < len(_TONE)
    np.testing.assert_allclose(got, _TONE[: len(got)], atol=1e-4)
    low = load(_wav(_TONE[:8000], 8000), 16000)  # resampled up, to twice the samples
    assert len(low) == 16000 and np.isfinite(low).all()


@pytest.mark.parametrize(
    ("chunk", "stride", "words"),
    [
        (-1.0, None, "chunk_length_s is a positive number of seconds, got -1"),
        (float("nan"), None, "chunk_length_s is a finite number of seconds, got nan"),
        (float("inf"), None, "chunk_length_s is a finite number of seconds, got inf"),
        (1e-9, None, "chunk_length_s=1e-09 is shorter than the least of 0.1 s"),
        (0.05, None, "chunk_length_s=0.05 is shorter than the least of 0.1 s"),
        (10.0, float("inf"), "stride_length_s is finite seconds, got inf"),
        (10.0, (1.0, float("nan")), "stride_length_s is finite seconds"),
        (10.0, -1.0, "stride_length_s is not negative"),
        (10.0, 5.0, "stride_length_s=5.0 is too large for chunk_length_s=10.0"),
        (10.0, 4.96, "advances 0.08 s a chunk, less than the least of 0.1 s"),
        (10.0, (1.0,), r"stride_length_s is seconds or \(left, right\)"),
        (10.0, "2", r"stride_length_s is seconds or \(left, right\)"),
        (True, None, "chunk_length_s is a number of seconds, got True"),
    ],
)
def test_chunk_and_stride_lengths_are_refused_by_name(chunk, stride, words):
    from transmuter_jax.audio import chunks

    if words is None:
        return
    with pytest.raises(ValueError, match=words):
        chunks.lengths(chunk, stride, 16000, 30 * 16000)


def test_numpy_chunk_lengths_count_as_numbers():
    from transmuter_jax.audio import chunks

    want = chunks.lengths(10.0, (1.0, 2.0), 16000, 480000)
    assert chunks.lengths(np.float32(10.0), (np.float64(1.0), np.int64(2)), 16000, 480000) == want


# -- round 2: images ---------------------------------------------------------------------------


def _image_bytes(image, format="PNG", **save) -> bytes:
    import io

    stream = io.BytesIO()
    image.save(stream, format=format, **save)
    return stream.getvalue()


def _reference_rgb(data: bytes) -> np.ndarray:
    """transformers' load_image of ``data``: EXIF orientation, then convert("RGB")."""
    import io

    from PIL import Image, ImageOps

    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))


def _odd_images() -> dict[str, bytes]:
    from PIL import Image

    gradient = np.arange(48, dtype=np.uint8).reshape(4, 4, 3) * 5
    rgb = Image.fromarray(gradient)
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    palette.info["transparency"] = 0
    frames = [Image.new("RGB", (3, 2), c) for c in ((255, 0, 0), (0, 255, 0))]
    animated = _image_bytes(frames[0], "GIF", save_all=True, append_images=frames[1:])
    sixteen = Image.fromarray(np.arange(12, dtype=np.uint16).reshape(3, 4) * 5000)
    return {
        "1x1": _image_bytes(Image.new("RGB", (1, 1), (9, 8, 7))),
        "cmyk": _image_bytes(rgb.convert("CMYK"), "JPEG"),
        "16-bit": _image_bytes(sixteen.convert("I;16")),
        "palette with transparency": _image_bytes(palette),
        "animated": animated,
    }


@pytest.mark.parametrize("kind", ["1x1", "cmyk", "16-bit", "palette with transparency", "animated"])
def test_odd_images_load_as_transformers_loads_them(kind):
    from transmuter_jax import vision

    data = _odd_images()[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow's own notes on palettes
        want = _reference_rgb(data)
        got = np.asarray(vision.load_image(data))
    assert got.dtype == np.uint8 and got.shape == want.shape and got.shape[-1] == 3
    np.testing.assert_array_equal(got, want)


def test_a_decompression_bomb_is_refused_with_pillows_limit_kept(tmp_path):
    from PIL import Image

    from transmuter_jax import vision

    limit = Image.MAX_IMAGE_PIXELS
    side = int((2 * limit) ** 0.5) + 100  # past twice the limit: Pillow's error, not a warning
    path = tmp_path / "bomb.png"
    Image.new("1", (side, side)).save(path)  # a few kB on disk
    assert path.stat().st_size < 1 << 20
    with pytest.raises(vision.ImageError, match=r"more pixels than Pillow's limit of [\d,]+"):
        vision.load_image(path)
    with pytest.raises(vision.ImageError, match="decompression bomb"):
        vision.load_image(path.read_bytes())
    assert Image.MAX_IMAGE_PIXELS == limit


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:9/cat.png", "https://example.com/a.jpg", "file:///etc/passwd", "s3://b/k"],
)
def test_an_image_url_is_refused_by_name_and_never_fetched(url, monkeypatch):
    import socket
    import urllib.request

    from transmuter_jax import vision

    def no_network(*args, **kwargs):
        raise AssertionError("the network was used")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    with pytest.raises(vision.ImageError, match="is a URL; images are never fetched"):
        vision.load_image(url)


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "/etc/hostname", "/proc/self/environ", "/dev/zero"]
)
def test_a_system_file_given_as_an_image_is_refused_without_its_content(path):
    from transmuter_jax import vision

    if not os.path.exists(path):
        pytest.skip(f"{path} is not on this system")
    with pytest.raises(vision.ImageError) as error:
        vision.load_image(path)
    message = str(error.value)
    assert repr(path) in message
    if os.path.isfile(path) and os.access(path, os.R_OK):
        content = Path(path).read_bytes()[:4000].decode("latin-1")
        for line in content.replace("\0", "\n").splitlines():
            if len(line) > 6:
                assert line not in message


@pytest.mark.parametrize("cut", [10, 40, 200])
def test_a_text_file_or_a_truncated_image_is_refused_by_name(tmp_path, cut):
    from PIL import Image

    from transmuter_jax import vision

    noise = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    data = _image_bytes(Image.fromarray(noise))
    (tmp_path / "cut.png").write_bytes(data[:cut])
    (tmp_path / "notes.txt").write_text("not an image\n" * 100)
    for name in ("cut.png", "notes.txt"):
        with pytest.raises(vision.ImageError, match=rf"'.*{name}' is not a readable image file"):
            vision.load_image(tmp_path / name)


# -- round 2: text -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["a\ud800b", "\udcff", "ok \udfff"])
def test_a_lone_surrogate_is_refused_with_a_clear_message(text):
    from transmuter_jax.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(FIXTURES / "llama-optimum")
    index = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    words = rf"is not valid Unicode text: it holds a lone surrogate U\+{ord(text[index]):04X} at"
    with pytest.raises(ValueError, match="text " + words):
        tokenizer.encode(text)
    with pytest.raises(ValueError, match=r"texts\[1\] " + words):
        tokenizer.encode_batch(["fine", text])


def _cli(args: list, stdin: bytes = b"") -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "transmuter_jax", *args],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


def test_non_utf8_standard_input_and_arguments_get_one_clear_error_line():
    model = str(FIXTURES / "llama-optimum")
    done = _cli(["generate", model, "-", "--max-new-tokens", "2"], b"caf\xe9 \xff\xfe")
    err = done.stderr.decode()
    assert done.returncode in (1, 2), err
    assert err.strip().splitlines() == [
        "transmuter-jax: error: standard input is not UTF-8 text: byte 0xe9 at offset 3 "
        "(invalid continuation byte); give UTF-8 text"
    ]
    done = _cli(["generate", model, b"caf\xe9", "--max-new-tokens", "2"])
    err = done.stderr.decode()
    assert done.returncode in (1, 2), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("transmuter-jax: error: ") and "lone surrogate U+DCE9" in err


# -- round 2: seeds and mesh arguments ---------------------------------------------------------


@pytest.fixture(scope="module")
def llama_pipe():
    from transmuter_jax import text

    return text.generation(FIXTURES / "llama-optimum")


_SAMPLE = {"do_sample": True, "max_new_tokens": 3, "top_k": 0}


@pytest.mark.parametrize("seed", [3.7, 3.0, float("nan"), "5", True, [1], np.float32(2)])
def test_a_seed_of_the_wrong_type_is_refused_by_name_never_truncated(llama_pipe, seed):
    from transmuter_jax.generation import GenerationError

    with pytest.raises(GenerationError, match=r"seed must be an integer, got "):
        llama_pipe.generate(["hi"], seed=seed, **_SAMPLE)


def test_numpy_and_huge_seeds_are_seeds(llama_pipe):
    plain = llama_pipe.generate(["hi"], seed=5, **_SAMPLE)[0].token_ids
    assert llama_pipe.generate(["hi"], seed=np.int64(5), **_SAMPLE)[0].token_ids == plain
    assert llama_pipe.generate(["hi"], seed=np.array(5), **_SAMPLE)[0].token_ids == plain
    for seed in (2**64 + 5, -(2**70), 2**200):
        first = llama_pipe.generate(["hi"], seed=seed, **_SAMPLE)[0].token_ids
        assert first == llama_pipe.generate(["hi"], seed=seed, **_SAMPLE)[0].token_ids
        assert len(first) == 3 and all(0 <= t < VOCAB for t in first)


@pytest.mark.parametrize(
    ("arguments", "error", "words"),
    [
        ({"mesh": "cpu"}, TypeError, "mesh= must be a jax.sharding.Mesh, not str"),
        ({"mesh": 4}, TypeError, "mesh= must be a jax.sharding.Mesh, not int"),
        ({"devices": "cpu"}, TypeError, "devices= must be a sequence of jax devices, not str"),
        ({"devices": 8}, TypeError, "devices= must be a sequence of jax devices, not int"),
        ({"devices": []}, ValueError, "devices= is empty"),
        ({"devices": ["cpu:0"]}, TypeError, r"devices\[0\] must be a jax device"),
    ],
)
def test_mesh_and_device_arguments_that_are_not_are_refused_by_name(arguments, error, words):
    from transmuter_jax import text

    with pytest.raises(error, match=words):
        text.generation(FIXTURES / "llama-optimum", **arguments)


# -- round 2: stop strings ---------------------------------------------------------------------


def test_thousands_of_stop_strings_and_a_huge_one_give_the_right_tokens(llama_pipe):
    base = llama_pipe.generate(["hi"], max_new_tokens=12)[0]
    target = "valley"  # in the fixture's greedy text
    assert target in base.text
    alone = llama_pipe.generate(["hi"], max_new_tokens=12, stop_strings=[target])[0]
    assert alone.finish_reason == "stop" and len(alone.token_ids) < len(base.token_ids)
    many = [f"zq{i}xv" for i in range(3000)]
    for strings in (many, [*many, target], ["Q" * 100_000], ["Q" * 100_000, target]):
        got = llama_pipe.generate(["hi"], max_new_tokens=12, stop_strings=strings)[0]
        want = alone if target in strings else base
        assert got.token_ids == want.token_ids
        streamed = "".join(llama_pipe.stream("hi", max_new_tokens=12, stop_strings=strings))
        assert streamed == want.text


def _held_back(before: str, pieces: list[str], stop: tuple[str, ...]) -> str:
    """What a stream shows of ``pieces``, by brute force: generation ends where a stop string
    first ends in them (it may start in ``before``); the text ends before the first stop string
    in what was generated up to there."""
    text = before + "".join(pieces)
    found = [(i, i + len(s)) for s in stop for i in range(len(text))
             if text.startswith(s, i) and i + len(s) > len(before)]  # fmt: skip
    if not found:
        return text[len(before) :]
    end = min(e for _, e in found)
    start = min(i for i, e in found if e <= end)
    return text[len(before) : max(len(before), start)]


def test_the_stream_hold_back_shows_what_a_brute_force_search_shows():
    from transmuter_jax.tasks.runner import _Hold

    rng = np.random.default_rng(0)
    for _ in range(400):
        word = lambda n: "".join(rng.choice(list("ab"), n))  # noqa: E731
        stop = tuple(word(int(rng.integers(1, 6))) for _ in range(int(rng.integers(1, 4))))
        before = word(int(rng.integers(0, 4)))
        pieces = [word(int(rng.integers(0, 4))) for _ in range(int(rng.integers(1, 6)))]
        hold = _Hold(stop, before)
        shown = "".join(hold.push(p) for p in pieces) + ("" if hold.over else hold.pending)
        assert shown == _held_back(before, pieces, stop), (stop, before, pieces)


def test_a_long_stop_string_costs_no_more_than_a_short_one():
    """Work counted, not time: the matcher reads each character once per stop string."""
    from transmuter_jax.tasks import runner

    counts = {}
    for length in (3, 100_000):
        # a stop string that the pieces keep starting and never end
        hold = runner._Hold(("Q" * length + "!",), "Q" * min(length - 1, 50))
        calls = [0]
        step = hold._step

        def counted(char, _step=step, _calls=calls):
            _calls[0] += 1
            return _step(char)

        hold._step = counted
        assert "".join(hold.push("Q" * 5 + " hello") for _ in range(50))
        counts[length] = calls[0]
    assert counts[100_000] == counts[3] == 50 * 11


# -- round 2: streams and threads --------------------------------------------------------------

_STREAM = {"max_new_tokens": 40, "do_sample": True, "top_k": 0}


def test_two_threads_streaming_one_pipeline_each_equal_their_solo_run(llama_pipe):
    import threading

    solo = {s: "".join(llama_pipe.stream("hi there", seed=s, **_STREAM)) for s in (1, 2, 3)}
    got: dict = {}

    def run(seed):
        got[seed] = "".join(llama_pipe.stream("hi there", seed=seed, **_STREAM))

    threads = [threading.Thread(target=run, args=(s,)) for s in solo]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert got == solo


def test_a_stream_closed_from_another_thread_ends_and_stops_generating(llama_pipe):
    import threading

    options = {"max_new_tokens": 200, "min_new_tokens": 200}
    whole = "".join(llama_pipe.stream("hi", **options))
    stream = llama_pipe.stream("hi", **options)
    read = [next(stream)]
    errors = []

    def reader():
        try:
            read.extend(stream)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    thread = threading.Thread(target=reader)
    thread.start()
    stream.close()  # from this thread, while the reader may be waiting in another
    thread.join(120)
    assert not thread.is_alive() and errors == []
    assert whole.startswith("".join(read))
    assert list(stream) == []  # closed stays closed
    assert llama_pipe.generate(["hi"], **options)[0].text == whole  # the pipeline still works


def test_an_exception_inside_on_token_reaches_the_caller_and_the_context_stays_usable():
    from transmuter_jax import generation

    model = tj.load(LLAMA / "model.onnx")
    ctx = generation.compile(generation.context(LLAMA, model, max_new_tokens=4), 1)
    want = generation.generate(ctx, [[5, 6]], [1])

    class Mine(Exception):
        pass

    def on_token(event):
        raise Mine("from on_token")

    with pytest.raises(Mine, match="from on_token"):
        generation.generate(ctx, [[5, 6]], [1], None, on_token)
    assert generation.generate(ctx, [[5, 6]], [1]) == want


# -- round 2: the command line -----------------------------------------------------------------

_LM = str(FIXTURES / "llama-optimum")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["generate", _LM, "hi", "--max-new-tokens", "0"], "--max-new-tokens: 0 is out of range"),
        (["generate", _LM, "hi", "--max-new-tokens", "-3"], "it must be at least 1"),
        (["generate", _LM, "hi", "--max-new-tokens", "2.5"], "'2.5' is not a whole number"),
        (["generate", _LM, "hi", "--temperature", "nan"], "--temperature: nan is out of range"),
        (["generate", _LM, "hi", "--temperature", "-1"], "it must be finite, at least 0"),
        (["generate", _LM, "hi", "--top-p", "2"], "--top-p: 2 is out of range"),
        (["generate", _LM, "hi", "--top-p", "0"], "above 0 and at most 1"),
        (["generate", _LM, "hi", "--top-k", "-1"], "--top-k: -1 is out of range"),
        (["generate", _LM, "hi", "--num-beams", "0"], "--num-beams: 0 is out of range"),
        (["generate", _LM, "hi", "--num-return-sequences", "99999"], "from 1 to 1024"),
        (["generate", _LM, "hi", "--repetition-penalty", "0"], "--repetition-penalty: 0 is out"),
        (["generate", _LM, "hi", "--top-logprobs", "5000"], "--top-logprobs: 5000 is out"),
        (["generate", _LM, "hi", "--stop", ""], "--stop: an empty string matches everywhere"),
        (["generate", _LM, "hi", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["generate", _LM + "/tokenizer.json", "hi"], "is a file, not a model folder"),
    ],
)
def test_bad_command_lines_get_one_error_line(args, words):
    done = _cli(args)
    err = done.stderr.decode()
    assert done.returncode in (1, 2), err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("transmuter-jax: error: "), err
    assert words in lines[0]


def test_a_megabyte_prompt_gets_a_result_or_one_error_line():
    done = _cli(
        ["generate", _LM, "-", "--max-new-tokens", "2", "--no-chat-template"], b"w " * 500_000
    )
    err = done.stderr.decode()
    if done.returncode == 0:
        return
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning")]
    assert done.returncode in (1, 2) and "Traceback" not in err, err
    assert lines[-1].startswith("transmuter-jax: error: "), err


# -- round 2: two layouts at once --------------------------------------------------------------


def _copy(source: Path, folder: Path, names=None) -> None:
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and (names is None or path.name in names):
            shutil.copy(path, folder / path.name)


_TWO_LAYOUTS = {
    # optimum at the top and transformers.js under onnx/ (both fp32)
    "optimum+transformers.js": [("llama-optimum", ""), ("llama-optimum", "onnx")],
    # the genai builder's folder at the top and an optimum decoder beside it
    "genai+optimum": [("llama-genai-fp32", ""), ("marian-optimum", "")],
    # genai at the top and transformers.js under onnx/
    "genai+transformers.js": [("llama-genai-fp32", ""), ("llama-optimum", "onnx")],
    # an fp32 genai subfolder beside an optimum decoder at the top
    "optimum+genai subfolder": [("llama-optimum", ""), ("qwen2-genai-fp32", "cpu-fp32")],
}


def _two_layouts(tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / "model"
    for fixture, sub in _TWO_LAYOUTS[kind]:
        names = None
        if fixture == "marian-optimum":
            names = {"decoder_model_merged.onnx", "encoder_model.onnx"}
        elif sub == "onnx":
            names = {"model.onnx"}
        _copy(FIXTURES / fixture, folder / sub if sub else folder, names)
    return folder


@pytest.mark.parametrize("kind", sorted(_TWO_LAYOUTS))
def test_a_folder_of_two_layouts_is_refused_naming_both_and_the_way_out(tmp_path, kind):
    folder = _two_layouts(tmp_path, kind)
    with pytest.raises(tj.ModelFileError, match="several layouts at once") as error:
        hub.files(folder)
    message = str(error.value)
    assert "pass file= (--file)" in message
    families = {"optimum": "optimum ", "genai": "genai ", "transformers.js": "transformers.js "}
    for family in kind.replace(" subfolder", "").split("+"):
        assert families[family] in message, message
    done = _cli(["generate", str(folder), "hi", "--max-new-tokens", "2"])
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr.decode()
    assert lines[0].startswith("transmuter-jax: error: ") and "several layouts" in lines[0]


def test_naming_the_decoder_of_a_two_layout_folder_gives_that_model(tmp_path):
    from transmuter_jax import text

    folder = _two_layouts(tmp_path, "optimum+transformers.js")
    reference = text.generation(FIXTURES / "llama-optimum", max_new_tokens=4)
    expected = reference("Hello there", chat=False)
    for file in ("model.onnx", "onnx/model.onnx"):
        pipe = text.generation(folder, file=file, max_new_tokens=4)
        assert pipe("Hello there", chat=False) == expected
    assert hub.files(folder, dtype="fp32", file="onnx/model.onnx").family == "transformers.js"


def test_one_layout_beside_other_dtypes_is_not_two_layouts(tmp_path):
    """Variants of other dtypes are no second layout: the request picks one of them."""
    folder = _two_layouts(tmp_path, "optimum+genai subfolder")
    (folder / "cpu-fp32").rename(folder / "cpu-int4")  # the subfolder's name tells its precision
    assert hub.files(folder).family == "optimum"
    assert hub.files(folder, dtype="int4").family == "genai"


# -- round 2: vocab_size 0 ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -5, "512", 2.5, True, 1 << 40, [512]])
@pytest.mark.parametrize("nested", [False, True])
def test_a_vocab_size_that_is_no_vocabulary_is_refused_by_name(value, nested):
    config = {"text_config": {"vocab_size": value}} if nested else {"vocab_size": value}
    where = "text_config.vocab_size" if nested else "vocab_size"
    with pytest.raises(tj.ModelFileError, match=rf"has {where} .*whole number from 1 to"):
        hub.vocab_size(config)
    assert hub.vocab_size({"vocab_size": None}) is None and hub.vocab_size({}) is None


def _vocab_zero_folder(tmp_path: Path, symbolic: bool) -> Path:
    """llama-optimum with config.json's vocab_size 0; with ``symbolic``, the logits' last axis
    unnamed in the graph, so only the config could tell the vocabulary."""
    folder = tmp_path / "model"
    _copy(FIXTURES / "llama-optimum", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 0}))
    if symbolic:
        model = onnx.load(str(folder / "model.onnx"))
        logits = next(o for o in model.graph.output if o.name == "logits")
        logits.type.tensor_type.shape.dim[2].dim_param = "vocab"  # clears dim_value
        onnx.save(model, str(folder / "model.onnx"))
    return folder


def test_vocab_size_0_is_refused_where_the_config_must_tell_the_vocabulary(tmp_path):
    from transmuter_jax import text

    folder = _vocab_zero_folder(tmp_path, symbolic=True)
    with pytest.raises(tj.ModelFileError, match="has vocab_size 0; it must be a whole number"):
        text.generation(folder, max_new_tokens=2)("Hello", chat=False)
    done = _cli(["generate", str(folder), "Hello", "--max-new-tokens", "2"])
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr.decode()
    assert "vocab_size 0" in lines[0] and lines[0].startswith("transmuter-jax: error: ")


def test_vocab_size_0_beside_a_graph_that_tells_the_vocabulary_gives_the_right_tokens(tmp_path):
    from transmuter_jax import text

    folder = _vocab_zero_folder(tmp_path, symbolic=False)
    expected = text.generation(FIXTURES / "llama-optimum", max_new_tokens=4).generate(
        ["Hello there"], chat=False
    )
    got = text.generation(folder, max_new_tokens=4).generate(["Hello there"], chat=False)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]


# -- round 2: hours of audio in bounded memory -------------------------------------------------

_MEMORY_CHILD = """
import importlib, json, resource, sys
import numpy as np

def data_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024

load = importlib.import_module("transmuter_jax.audio.load")
speech = importlib.import_module("transmuter_jax.audio.speech_to_text")
args = json.loads(sys.argv[1])
pipe = None
if args.get("model"):
    pipe = speech.speech_to_text(args["model"], num_beams=1, max_new_tokens=2)
    warm = np.sin(np.arange(16000 * 40) / 9.0).astype(np.float32) * 0.1
    pipe.generate([warm], sampling_rate=16000)  # the programs compiled before the limit
budget = args["budget_mb"] << 20
if args.get("samples_s"):  # the caller's array is allocated before the limit
    given = (np.random.default_rng(0).standard_normal(int(args["samples_s"] * 16000)) * 0.05)
    given = given.astype(np.float32)
resource.setrlimit(resource.RLIMIT_DATA, (data_bytes() + budget, resource.RLIM_INFINITY))
try:
    if pipe is None:
        out = {"samples": int(len(load.load(args["path"], 16000)))}
    else:
        options = {k: args[k] for k in ("chunk_length_s",) if k in args}
        result = pipe.generate([given], sampling_rate=16000, **options)[0]
        out = {"tokens": len(result.token_ids)}
except MemoryError:
    out = {"memory_error": True}
except Exception as error:  # noqa: BLE001
    out = {"error": f"{type(error).__name__}: {error}"}
print(json.dumps(out))
"""


def _memory_child(tmp_path: Path, **args) -> dict:
    code = _MEMORY_CHILD.replace("sys.argv[1]", repr(json.dumps(args)))
    return _python(code, tmp_path, timeout=1800)


def _long_wav(path: Path, minutes: float, rate: int = 48000, channels: int = 2) -> int:
    """Writes ``minutes`` of quiet noise as a 16-bit wav; returns its frames."""
    import soundfile

    rng = np.random.default_rng(3)
    frames = int(minutes * 60 * rate)
    with soundfile.SoundFile(path, "w", rate, channels, "PCM_16") as sound:
        for start in range(0, frames, rate * 10):
            n = min(rate * 10, frames - start)
            sound.write((rng.standard_normal((n, channels)) * 0.05).astype(np.float32))
    return frames


def test_a_long_file_loads_in_memory_for_its_samples_at_the_models_rate(tmp_path):
    """6 minutes at 48 kHz in stereo (69 MB of 16-bit samples, 138 MB as float32 at its rate
    and channels) load as 16 kHz mono (23 MB) within 40 MB: read, mixed and resampled a block
    at a time."""
    pytest.importorskip("soundfile")
    frames = _long_wav(tmp_path / "long.wav", 6)
    out = _memory_child(tmp_path, path=str(tmp_path / "long.wav"), budget_mb=40)
    assert out.get("samples") == frames // 3, out


@pytest.mark.slow
def test_hours_of_audio_load_in_memory_for_their_samples_at_the_models_rate(tmp_path):
    pytest.importorskip("soundfile")
    frames = _long_wav(tmp_path / "long.wav", 120, rate=44100)
    out = _memory_child(tmp_path, path=str(tmp_path / "long.wav"), budget_mb=500)  # 460 MB
    assert abs(out.get("samples", 0) - frames * 16000 / 44100) < 2, out


def test_chunks_of_long_audio_are_decoded_in_bounded_groups_with_the_same_tokens(monkeypatch):
    """A long input's chunks are encoded and decoded a group at a time (so memory holds one
    group's features, encoder outputs and cache), and give the tokens of one batch."""
    import importlib

    from transmuter_jax import audio

    module = importlib.import_module("transmuter_jax.audio.speech_to_text")
    pipe = audio.speech_to_text(FIXTURES / "whisper-speech-optimum", num_beams=1, max_new_tokens=3)
    long = np.sin(np.arange(16000 * 150) / 5.0).astype(np.float32) * 0.2
    long *= np.random.default_rng(4).random(len(long)).astype(np.float32)
    whole = pipe.generate([long, long[: 16000 * 5]], sampling_rate=16000, seed=3)
    sizes = []
    features = type(pipe.features).__call__

    def spy(self, batch):
        sizes.append(len(batch))
        return features(self, batch)

    monkeypatch.setattr(module, "ROW_GROUP", 3)
    monkeypatch.setattr(type(pipe.features), "__call__", spy)
    grouped = pipe.generate([long, long[: 16000 * 5]], sampling_rate=16000, seed=3)
    assert max(sizes) == 3 and sum(sizes) > 3
    assert [r.token_ids for r in grouped] == [r.token_ids for r in whole]
    assert [r.text for r in grouped] == [r.text for r in whole]


@pytest.mark.slow
@pytest.mark.parametrize(("seconds", "chunk_length_s"), [(3600, None), (1800, 10.0)])
def test_hours_of_audio_transcribe_in_bounded_memory(tmp_path, seconds, chunk_length_s):
    """An hour (180 chunks of 30 s), or half an hour in 270 chunks of 10 s, within 700 MB beyond
    the caller's samples: their copy at the model's rate (230 MB an hour) and the features,
    encoder outputs and cache of one group of chunks at a time."""
    args = {} if chunk_length_s is None else {"chunk_length_s": chunk_length_s}
    out = _memory_child(
        tmp_path, model=str(FIXTURES / "whisper-speech-optimum"), samples_s=seconds,
        budget_mb=700, **args,
    )  # fmt: skip
    assert out.get("tokens", 0) > 0, out


def test_hours_of_audio_without_chunking_are_refused_by_name():
    """chunk_length_s=0 asks for no chunking, which audio longer than the 30 s window cannot
    have (transformers' sequential long-form decoding is not supported): a clear error."""
    from transmuter_jax import audio

    pipe = audio.speech_to_text(FIXTURES / "whisper-speech-optimum", num_beams=1)
    hours = np.full(16000 * 3600 * 2, 0.01, np.float32)
    with pytest.raises(ValueError, match="7200 s is longer than the 30 s window and chunk_len"):
        pipe.generate([hours], sampling_rate=16000, chunk_length_s=0)


# -- round 2: Idefics3 and Qwen2-VL preprocessor values ----------------------------------------


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"size": {"longest_edge": 0}}, r"size\['longest_edge'\] is 0; it must be from 1 to 8,192"),
        ({"size": {"longest_edge": 10**9}}, r"size\['longest_edge'\] is 1000000000"),
        ({"size": {"height": 4}}, r"size\['width'\] is None; it must be a whole number"),
        ({"size": {"shortest_edge": 4}}, r"size is .*it must be \{'longest_edge': N\} or"),
        ({"size": 364}, r"size is 364; it must be"),
        ({"max_image_size": {"longest_edge": 0}}, r"max_image_size\['longest_edge'\] is 0"),
        (
            {"max_image_size": {"longest_edge": 2.5}},
            r"max_image_size\['longest_edge'\] is 2.5; it must be a whole number",
        ),
        (
            {"max_image_size": {"longest_edge": float("inf")}},
            r"max_image_size\['longest_edge'\] is inf; it must be a whole",
        ),
        ({"max_image_size": {}}, r"max_image_size is \{\}; it must be \{'longest_edge': N\}$"),
        ({"image_std": [0.5, 0.0, 0.5]}, "image_std is .*a standard deviation of 0"),
        ({"image_mean": [float("nan")] * 3}, "image_mean is .*it must be finite"),
        ({"rescale_factor": "1/255"}, "rescale_factor is '1/255'; it must be a number"),
        ({"resample": 42}, "resample is 42; it must be one of"),
    ],
)
def test_degenerate_idefics3_processor_values_are_refused_by_name(config, words):
    from transmuter_jax.vision.idefics3 import Idefics3ImageProcessor

    with pytest.raises(ValueError, match="Idefics3ImageProcessor: " + words):
        Idefics3ImageProcessor(config)
    with pytest.raises(ValueError, match="Idefics3ImageProcessor: " + words):
        Idefics3ImageProcessor({}).settings(config)  # a call's options too


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"patch_size": 0}, "patch_size is 0; it must be from 1 to 8,192"),
        ({"patch_size": 10**6}, "patch_size is 1000000; it must be from 1"),
        ({"merge_size": 0}, "merge_size is 0; it must be from 1"),
        ({"patch_size": 1024, "merge_size": 16}, "merge_size is 16; it must be from 1 to 8$"),
        ({"temporal_patch_size": -2}, "temporal_patch_size is -2"),
        ({"min_pixels": 0}, "min_pixels is 0; it must be from 1 to 67,108,864"),
        ({"min_pixels": 10**12}, "min_pixels is 1000000000000"),
        ({"max_pixels": 10**12}, "max_pixels is 1000000000000"),
        ({"max_pixels": float("nan")}, "max_pixels is nan; it must be a whole number"),
        ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels is 5,000, more than max_pixels"),
        ({"image_std": 0}, "image_std is 0; a standard deviation of 0"),
        ({"rescale_factor": float("inf")}, "rescale_factor is inf; it must be finite"),
    ],
)
def test_degenerate_qwen2vl_processor_values_are_refused_by_name(config, words):
    from transmuter_jax.vision.qwen2vl import Qwen2VLImageProcessor

    with pytest.raises(ValueError, match="Qwen2VLImageProcessor: " + words):
        Qwen2VLImageProcessor(config)
    with pytest.raises(ValueError, match="Qwen2VLImageProcessor: " + words):
        Qwen2VLImageProcessor({}).settings(config)


@pytest.mark.parametrize(
    ("files", "words"),
    [
        ({"processor_config.json": {"image_seq_len": 0}}, "image_seq_len is 0; it must be from"),
        ({"processor_config.json": {"image_seq_len": 10**9}}, "image_seq_len is 1000000000"),
        ({"processor_config.json": {"image_seq_len": "64"}}, "image_seq_len is '64'"),
        ({"config.json": {"vision_config": {"patch_size": 0}}}, "config.json: patch_size is 0"),
        ({"config.json": {"scale_factor": 0}}, "config.json: scale_factor is 0"),
        ({"config.json": {"vision_config": {"image_size": -1}}}, "image_size is -1"),
    ],
)
def test_degenerate_idefics3_prompt_values_are_refused_by_name(tmp_path, files, words):
    from transmuter_jax.vision.idefics3 import Idefics3Processor

    source = FIXTURES / "smolvlm-community"
    _copy(source, tmp_path, {"preprocessor_config.json", "config.json"})
    (tmp_path / "processor_config.json").write_text("{}")
    for name, change in files.items():
        current = json.loads((tmp_path / name).read_text())
        for key, value in change.items():
            if isinstance(value, dict):
                current[key] = {**current.get(key, {}), **value}
            else:
                current[key] = value
        (tmp_path / name).write_text(json.dumps(current))
    with pytest.raises(ValueError, match=words):
        Idefics3Processor(tmp_path, tokenizer=None)


def test_a_qwen2vl_config_with_a_merge_size_of_0_is_refused_by_name():
    from transmuter_jax.vision.qwen2vl import RopeConfig

    config = json.loads((FIXTURES / "qwen2vl-community" / "config.json").read_text())
    config["vision_config"]["spatial_merge_size"] = 0
    with pytest.raises(ValueError, match="config.json: vision_config.spatial_merge_size is 0"):
        RopeConfig.from_config(config)


# -- round 2: streaming equals generate ---------------------------------------------------------


@pytest.fixture(scope="module")
def speech_pipe():
    from transmuter_jax import audio

    return audio.speech_to_text(FIXTURES / "whisper-speech-optimum", max_new_tokens=10)


def _noise(seconds: float, seed: int = 1) -> np.ndarray:
    n = int(seconds * 16000)
    tone = np.sin(np.arange(n) / 5.0).astype(np.float32) * 0.3
    return tone * np.random.default_rng(seed).random(n).astype(np.float32)


@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("seconds", [8, 70])  # one window, and chunks merged
def test_a_stream_with_timestamps_joins_to_the_text_of_generate(speech_pipe, num_beams, seconds):
    x = _noise(seconds)
    options = dict(return_timestamps=True, num_beams=num_beams, sampling_rate=16000, seed=2)
    expected = speech_pipe.generate([x], **options)[0]
    pieces = list(speech_pipe.stream(x, **options))
    assert "".join(pieces) == expected.text
    if num_beams > 1 or seconds > 30:  # final only when the search (or the merge) ends
        assert len(pieces) <= 1


def _joined(pieces: list, n: int) -> list[str]:
    """The text of each of the n sequences of a stream's (j, piece) pairs."""
    assert all(isinstance(p, tuple) and 0 <= p[0] < n and isinstance(p[1], str) for p in pieces)
    return ["".join(piece for j, piece in pieces if j == i) for i in range(n)]


@pytest.mark.parametrize(
    "options",
    [
        dict(num_return_sequences=3, do_sample=True, seed=5),
        dict(num_return_sequences=2, num_beams=3),
        dict(num_return_sequences=3, do_sample=True, seed=7, stop=["e", "an"]),
        dict(num_return_sequences=2, num_beams=2, do_sample=True, seed=3),
    ],
    ids=["sampled", "beams", "sampled-stop", "beam-sampled"],
)
def test_a_stream_of_several_sequences_joins_to_each_sequence_of_generate(options):
    from transmuter_jax import text

    pipe = text.generation(FIXTURES / "llama-optimum", max_new_tokens=12)
    n = options["num_return_sequences"]
    want = [r.text for r in pipe.generate(["Hello"], chat=False, **options)[0]]
    pieces = list(pipe.stream("Hello", chat=False, **options))
    assert _joined(pieces, n) == want and any(want)
    if options.get("num_beams", 1) > 1:  # final when the search ends: one piece per sequence
        assert [j for j, _ in pieces] == [j for j, t in enumerate(want) if t]
    else:
        assert len(pieces) > n  # pieces as tokens come


def test_a_speech_stream_of_several_sequences_joins_to_each_sequence(speech_pipe):
    options = dict(num_return_sequences=2, do_sample=True, seed=1, num_beams=1)
    x = _noise(3)
    want = [r.text for r in speech_pipe.generate([x], sampling_rate=16000, **options)[0]]
    pieces = list(speech_pipe.stream(x, sampling_rate=16000, **options))
    assert _joined(pieces, 2) == want and any(want)


def test_a_stream_of_one_sequence_gives_plain_pieces_and_the_cli_gives_several(speech_pipe):
    from transmuter_jax import text

    pipe = text.generation(FIXTURES / "llama-optimum", max_new_tokens=3)
    options = dict(num_return_sequences=2, do_sample=True, seed=1)
    assert all(isinstance(p, str) for p in pipe.stream("Hello", chat=False, seed=1))
    # the command line gives the n sequences without streaming
    done = _cli(["generate", str(FIXTURES / "llama-optimum"), "Hello", "--no-chat-template",
                 "--max-new-tokens", "3", "--num-return-sequences", "2", "--sample", "--seed",
                 "1"])  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    texts = [r.text for r in pipe.generate(["Hello"], chat=False, **options)[0]]
    assert done.stdout.decode().count("\n") >= 2 and all(t in done.stdout.decode() for t in texts)


def test_transcribe_with_several_sequences_prints_each_or_refuses_by_name(speech_pipe, capsys):
    """--json: one object per sequence with its index; plain: '[j] text' lines; --srt and
    --timestamps (one transcript per file) are refused naming the flag."""
    from transmuter_jax import cli

    wav = str(FIXTURES / "whisper-speech-optimum" / "stereo-44k.wav")
    base = ["transcribe", str(FIXTURES / "whisper-speech-optimum"), wav, "--num-beams", "1"]
    base += ["--num-return-sequences", "2", "--sample", "--seed", "1", "--max-new-tokens", "4"]
    options = dict(num_return_sequences=2, do_sample=True, num_beams=1, max_new_tokens=4)
    want = speech_pipe.generate([wav], seed=1, **options)[0]
    assert cli.main([*base, "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["index"], r["text"], r["token_ids"]) for r in records] == [
        (j, w.text, w.token_ids) for j, w in enumerate(want)
    ]
    assert cli.main(base) == 0
    assert capsys.readouterr().out.splitlines() == [f"[{j}] {w.text}" for j, w in enumerate(want)]
    for flag in ("--srt", "--timestamps"):
        assert cli.main([*base, flag]) == 1
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        why = f"{flag} shows one transcript per file, not --num-return-sequences 2: add --json"
        assert err == [f"transmuter-jax: error: {why} for the chunks of each sequence"]
