"""The shape counting of compiled_shapes/simulate.py: hand-counted cases, and the same shapes as
the generation loop compiles on two fixtures."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compiled_shapes import simulate as sim  # noqa: E402

R = sim.Request


def _shapes(mode, prompt, cache, requests, batch=1):
    return sim.run(mode, sim.policy(prompt, cache), batch, requests).shapes


def test_powers_of_two_as_implemented():
    # 45 tokens: 32, 8, 4, 1, then 3 more tokens; buffer 45 + 4 + 32 -> 128 rows.
    shapes = _shapes("append", "pow2", "capacity64", [R(45, 4, 4)])
    assert shapes == {(1, 32, 128, True), (1, 8, 128, True), (1, 4, 128, True), (1, 1, 128, True)}
    trace = sim.run("append", sim.policy(), 1, [R(45, 4, 4)])
    assert trace.steps == 7 and trace.tokens == 45 + 3


def test_other_prompt_policies():
    # one step feeds the whole prompt, in a buffer of its own rows; its padding is the only
    # one, so the buffer then holds max(45 + 4, 45) -> 64 rows
    assert _shapes("append", "exact", "capacity64", [R(45, 4, 2)]) == {
        (1, 45, 45, True),
        (1, 1, 64, True),
    }
    assert _shapes("in_place", "multiple:16", "capacity64", [R(45, 4, 2)]) == {
        (1, 48, 48, True),  # then max(49, 48) -> 64
        (1, 1, 64, True),
    }
    # a first step of 64 and a longest row of 61 + 4: 65 -> 128 rows
    trace = sim.run("in_place", sim.policy("multiple:16", "capacity64"), 1, [R(61, 4, 2)])
    assert trace.shapes == {(1, 64, 64, True), (1, 1, 128, True)}
    assert trace.copies == {(1, 64, 128)}
    assert {s[1] for s in _shapes("append", "pow2min:16", "capacity64", [R(45, 4, 2)])} == {
        32,
        16,  # the last 13 tokens, padded to 16
        1,
    }
    assert {s[1] for s in _shapes("append", "nextpow2", "capacity64", [R(45, 4, 2)])} == {64, 1}


def test_cache_policies():
    assert {s[2] for s in _shapes("append", "pow2", "capacitypow2", [R(45, 4, 2)])} == {128}
    assert {s[2] for s in _shapes("append", "pow2", "capacitypow2", [R(100, 4, 2)])} == {256}
    assert {s[2] for s in _shapes("append", "pow2", "fixed:2048", [R(100, 4, 2)])} == {2048}
    assert {s[2] for s in _shapes("append", "pow2", "capacity256", [R(100, 4, 2)])} == {256}
    # 100 + 4 + 64 = 168 -> 192 (1.5 x 128); 45 + 4 + 32 = 81 -> 96; 200 + 4 + 128 = 332 -> 384
    assert sim.cache_rows("append", "capacitygeo", 104, 64) == 192
    assert sim.cache_rows("append", "capacitygeo", 49, 32) == 96
    assert sim.cache_rows("append", "capacitygeo", 204, 128) == 384
    assert sim.cache_rows("append", "capacitygeo", 10, 8) == 64
    assert sim.cache_rows("append", "capacitygeo", 120, 8) == 128


def test_a_growing_buffer_is_copied_when_full():
    trace = sim.run("append", sim.policy("pow2", "growing:64"), 1, [R(60, 100, 100)])
    # 60 prompt tokens (32, 16, 8, 4) fit in 64 rows; 99 decode steps after 60 to 158 tokens
    # need 64 rows (4 steps), then 128 (64 steps), then 192 (31 steps).
    assert {s[2] for s in trace.shapes} == {64, 128, 192}
    assert trace.copies == {(1, 64, 128), (1, 128, 192)}
    assert trace.decode_rows == 4 * 64 + 64 * 128 + 31 * 192


def test_grow_exact_compiles_every_length():
    shapes = _shapes("grow", "pow2", "exact", [R(45, 4, 4)])
    assert shapes == {
        (1, 32, 0, False),
        (1, 8, 32, True),
        (1, 4, 40, True),
        (1, 1, 44, True),
        (1, 1, 45, True),
        (1, 1, 46, True),
        (1, 1, 47, True),
    }


def test_grow_padded_compiles_one_decode_shape_per_capacity():
    shapes = _shapes("grow", "pow2", "padded64", [R(45, 4, 4)])
    assert shapes == {
        (1, 32, 0, False, 64),
        (1, 8, 64, True, 64),
        (1, 4, 64, True, 64),
        (1, 1, 64, True, 64),
    }
    long = _shapes("grow", "pow2", "padded64", [R(4, 444, 444)])
    assert long == {(1, 4, 0, False, 448), (1, 1, 448, True, 448)}
    assert len(_shapes("grow", "pow2", "exact", [R(4, 444, 444)])) == 444
    assert {s[4] for s in _shapes("grow", "pow2", "paddedpow2", [R(4, 300, 9)])} == {512}
    # prompts of 45 and 9 tokens in one step of 48 (each row drops its own padding), then decode
    together = _shapes("grow", "buckets", "padded64", [R(45, 4, 4), R(9, 4, 4)], batch=2)
    assert together == {(2, 48, 0, False, 64), (2, 1, 64, True, 64)}
    assert len(_shapes("grow", "pow2", "exact", [R(45, 4, 4), R(9, 4, 4)], batch=2)) > 2


def test_grow_buckets_compile_two_decode_shapes_per_bucket():
    shapes = _shapes("grow", "pow2", "bucket64", [R(4, 444, 130)])
    decode = sorted(s[2:] for s in shapes if s[1] == 1)
    # 64 -> 64 while it fills, 64 -> 128 when it is full, and so on.
    assert decode == [
        (64, True, 64),
        (64, True, 128),
        (128, True, 128),
        (128, True, 192),
        (192, True, 192),
    ]
    assert (1, 4, 0, False, 64) in shapes


def test_grow_groups_prompts_of_one_length():
    # Two groups (lengths 3 and 5) in one batch of 3; rows of one length share their steps.
    shapes = _shapes("grow", "pow2", "exact", [R(3, 2, 2), R(5, 2, 1), R(3, 2, 1)], batch=3)
    assert shapes == {
        (3, 2, 0, False),
        (3, 1, 2, True),
        (3, 1, 3, True),
        (3, 4, 0, False),
        (3, 1, 4, True),
    }


def test_shared_cache_rows_stop_at_their_own_length():
    trace = sim.run("append", sim.policy(), 2, [R(8, 16, 1), R(3, 16, 5)])
    # Steps: 8 (row 0 ends its prompt and stops; row 1 ends its prompt) in a buffer of its own
    # 8 rows, then 4 decode steps in the buffer of 64.
    assert trace.steps == 5
    assert trace.shapes == {(2, 8, 8, True), (2, 1, 64, True)}


def test_cumulative_counts_end_with_the_total():
    reqs = sim.requests(
        sim.Workload("w", "append", (40, 0.8, 1, 500), (20, 0.8, 1, 64), 64, (4,), 50, "m"), 3
    )
    counts = sim.cumulative_shapes("append", sim.policy(), 4, reqs)
    assert counts == sorted(counts) and len(counts) == 13
    assert counts[-1] == len(sim.run("append", sim.policy(), 4, reqs).shapes)
    per = {"prefill": 2.0, "decode": 1.0}
    shapes = sim.run("append", sim.policy(), 4, reqs).shapes
    assert sim.compile_seconds(shapes, per) == sum(2.0 if s[1] > 1 else 1.0 for s in shapes)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda: sim.policy("pow3"), "prompt policy"),
        (lambda: sim.policy("multiple:x"), "prompt policy"),
        (lambda: sim.policy("pow2", "fixed"), "cache policy"),
        (lambda: R(0, 4, 1), "bad request"),
        (lambda: R(4, 4, 5), "bad request"),
        (lambda: sim.run("grow", sim.policy("pow2", "capacity64"), 1, [R(3, 2, 1)]), "grow's"),
    ],
)
def test_bad_arguments_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


@pytest.mark.parametrize("prefill", ["buckets", "pow2"])
@pytest.mark.parametrize(("name", "padded"), [("llama-optimum", False), ("whisper-optimum", True)])
def test_the_simulation_matches_the_generation_loop(name, padded, prefill, tmp_path):
    """The batch case of a fixture (prompts of 5, 1, 40 and 9 tokens) in one batch: the shapes
    the loop compiled are those the simulation predicts from the tokens each row got (a padded
    grow cache too: its rows share it, each dropping its own padding)."""
    from generation_cases import case, context, encoder_inputs

    from transmuter_jax import generation

    the_case = case(name, "batch")
    prompts, max_new = the_case["prompts"], the_case["options"]["max_new_tokens"]
    given, inputs = encoder_inputs(name, the_case, list(range(len(prompts))))
    ctx = generation.compile(
        context(name, tmp_path, given=given, max_new_tokens=max_new, prefill=prefill),
        len(prompts),
    )
    generation.generate(ctx, prompts, list(range(len(prompts))), inputs)
    requests = [
        R(len(p), max_new, len(t) + int(eos))
        for p, t, eos in zip(prompts, the_case["tokens"], the_case["stopped_at_eos"], strict=True)
    ]
    cache = "padded64" if padded else "percall"  # generate() on the slots
    predicted = _shapes(ctx.mode, prefill, cache, requests, batch=len(prompts))
    assert {s[1:] for s in predicted} == ctx.compiled.steps.shapes
    assert ctx.compiled.padded == padded
