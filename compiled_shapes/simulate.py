"""Counts the compiled step shapes of a workload under a shape policy, without running a model.

The step loop of :mod:`transmuter_jax.generation.loop` is replayed on token counts only: each
batch of requests runs its prompt in steps (the prompt policy), then one token per step, on a
cache whose rows the cache policy sets. Each distinct (batch, step tokens, cache rows, branch,
rows after the step) is one compiled program. ``policy("pow2", "capacity64")`` in append or
in_place, ``policy("pow2", "exact")`` and ``policy("pow2", "padded64")`` in grow are what the
package implements; the others are alternatives to compare.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

MODES = ("in_place", "append", "grow")


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt: its tokens, the most new tokens, and the selections it gets before it stops
    (the new tokens, plus one when it stops at eos), at most ``max_new``."""

    prompt: int
    max_new: int
    steps: int

    def __post_init__(self) -> None:
        if self.prompt < 1 or not 1 <= self.steps <= max(self.max_new, 1):
            raise ValueError(f"bad request {self}")


@dataclasses.dataclass(frozen=True)
class Policy:
    """How step tokens and cache rows are chosen.

    Attributes:
        prompt: "pow2" (the largest power of two at most what is left: 45 = 32+8+4+1, as
            implemented), "exact" (the whole prompt in one step), "multiple:K" (one step padded to
            a multiple of K), "pow2min:M" (powers of two, the last part under M padded to M) or
            "nextpow2" (one step padded to the next power of two) or "buckets" (one step
            padded to a multiple of 16 up to 64 tokens, then of 64, at most 512 a step: the
            implemented ``prefill="buckets"``, ``generation.cache.prompt_bucket``).
        cache: append / in_place: "capacity64" (the longest row plus the first step, rounded up to
            64; when the first step feeds every prompt whole, the longer of the longest row and that
            step, rounded up to 64: as implemented), "capacity256" (rounded up to 256),
            "capacitypow2" (rounded up to a power of two, at least 64), "capacitygeo" (rounded up to
            2^k or 1.5 x 2^k, at least 64), "growing:K" (the buffer starts small and is copied into
            one K rows larger when a step needs room), "fixed:N" (always N rows) or "windows" (as
            implemented since generate() runs on the slots: a first step that feeds every prompt
            whole runs in its own rows, else in the prefill windows 64, 256, 1024, ...; each
            decode step reads the smallest of 64, 128, 256, ... rows that holds the longest row's
            tokens and the step, at most the capacity: the slots of a server) or "percall" (as
            implemented for generate(), which runs on the slots with a capacity of its own: the
            longest row or what the prompt steps write, rounded up to 64; prompts as "windows";
            every decode step reads the capacity). grow: "exact"
            (the exact length, as implemented without padding), "padded64" (padded: the longest row
            rounded up to 64, as implemented), "paddedpow2" (rounded up to a power of two, at least
            64), "bucket64" (the cache grows in steps of 64 rows as it fills: each step's capacity
            is its valid tokens rounded up to 64) or "fixed:N".
    """

    prompt: str = "pow2"
    cache: str = "capacity64"

    @property
    def name(self) -> str:
        return f"{self.prompt} / {self.cache}"


def policy(prompt: str = "pow2", cache: str = "capacity64") -> Policy:
    """A checked :class:`Policy`."""
    kind, _, arg = prompt.partition(":")
    if kind not in ("pow2", "exact", "multiple", "pow2min", "nextpow2", "buckets") or (
        kind in ("multiple", "pow2min") and not arg.isdigit()
    ):
        raise ValueError(f"unknown prompt policy {prompt!r}")
    kind, _, arg = cache.partition(":")
    known = (
        "capacity64",
        "capacity256",
        "capacitypow2",
        "capacitygeo",
        "windows",
        "percall",
        "growing",
        "fixed",
        "exact",
        "padded64",
        "paddedpow2",
        "bucket64",
    )
    if kind not in known or (kind in ("fixed", "growing")) != arg.isdigit():
        raise ValueError(f"unknown cache policy {cache!r}")
    return Policy(prompt, cache)


def chunk(remaining: int) -> int:
    """The largest power of two at most ``remaining`` (as generation's steps)."""
    return 1 << (max(remaining, 1).bit_length() - 1)


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def next_pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def step_tokens(prompt_policy: str, remaining: int) -> int:
    """Tokens of the next prompt step when the longest remaining prompt part is ``remaining``."""
    kind, _, arg = prompt_policy.partition(":")
    if kind == "pow2":
        return chunk(remaining)
    if kind == "exact":
        return remaining
    if kind == "multiple":
        return round_up(remaining, int(arg))
    if kind == "pow2min":
        return chunk(remaining) if remaining >= int(arg) else int(arg)
    if kind == "nextpow2":
        return next_pow2(remaining)
    if kind == "buckets":
        return min(round_up(remaining, 16) if remaining <= 64 else round_up(remaining, 64), 512)
    raise ValueError(prompt_policy)


def padding_allowed(mode: str, cache_policy: str) -> bool:
    """Whether a step may feed padding tokens after a row's prompt (not in grow at exact
    lengths: every token fed is cached and attended; a padded grow cache drops each row's)."""
    return mode != "grow" or cache_policy != "exact"


def cache_rows(mode: str, cache_policy: str, longest: int, first: int, prompt: int = 0) -> int:
    """Rows of the cache buffer of a batch (0: grow, the exact length); ``prompt``: the longest
    prompt (a first step that feeds every prompt whole needs no room past the longest row)."""
    kind, _, arg = cache_policy.partition(":")
    if mode == "grow":
        if kind in ("exact", "bucket64"):
            return 0
        if kind == "padded64":
            return round_up(longest, 64)
        if kind == "paddedpow2":
            return next_pow2(longest, 64)
        if kind == "fixed":
            if int(arg) < longest:
                raise ValueError(f"{longest} rows do not fit in {cache_policy!r}")
            return int(arg)
        raise ValueError(f"cache policy {cache_policy!r} is not one of grow's")
    need = longest + first
    if kind in ("capacity64", "windows", "percall"):
        return round_up(max(longest, first) if first >= prompt else need, 64)
    if kind == "capacity256":
        return round_up(need, 256)
    if kind == "capacitypow2":
        return next_pow2(need, 64)
    if kind == "capacitygeo":
        power = next_pow2(need, 64)
        return power * 3 // 4 if power * 3 // 4 >= max(need, 64) else power
    if kind == "growing":
        return 0
    if kind == "fixed":
        if int(arg) < need:
            raise ValueError(f"{need} rows do not fit in {cache_policy!r}")
        return int(arg)
    raise ValueError(f"cache policy {cache_policy!r} is not one of {mode}'s")


@dataclasses.dataclass
class Trace:
    """The steps a workload ran: the compiled shapes and the tokens each step computed."""

    shapes: set[tuple] = dataclasses.field(default_factory=set)
    steps: int = 0  # steps run
    tokens: int = 0  # token positions computed (batch x step tokens), padding included
    attended: int = 0  # (token, cache row) pairs of attention, padding included
    real_attended: int = 0  # the same without padding rows of the cache
    decode_rows: int = 0  # cache rows read by the rows of one-token steps (batch x rows)
    copies: set[tuple] = dataclasses.field(default_factory=set)  # (batch, rows, new rows)
    window: int = 0  # "windows": the rows the last step ran in


def _prompt_steps(policy: Policy, mode: str, left: int) -> list[int]:
    """Step tokens of one group's prompt of ``left`` tokens (in grow, every row's)."""
    steps = []
    while left > 0:
        size = step_tokens(policy.prompt, left)
        if not padding_allowed(mode, policy.cache):
            size = min(size, chunk(left)) if policy.prompt != "exact" else left
        steps.append(size)
        left -= min(size, left)
    return steps


def run_batch(mode: str, policy: Policy, batch: int, requests: Sequence[Request], trace: Trace):
    """Replays one call of generate with ``requests`` (at most ``batch``) into ``trace``."""
    if len(requests) > batch:
        raise ValueError(f"{len(requests)} requests for batch {batch}")
    if mode == "grow" and policy.cache != "exact":
        _run_grow_shared(policy, batch, list(requests), trace)
        return
    if mode == "grow":
        groups: dict[int, list[Request]] = {}
        for r in requests:
            groups.setdefault(r.prompt, []).append(r)
        for _, group in sorted(groups.items()):
            _run_grow_group(policy, batch, group, trace)
        return
    _run_shared(mode, policy, batch, list(requests), trace)


def _run_shared(mode: str, policy: Policy, batch: int, requests: list[Request], trace: Trace):
    """in_place / append: every row in one cache buffer; rows feed their prompts together."""
    trace.window = 0  # a call's slots start afresh
    fed = [0] * len(requests)
    selections = [0] * len(requests)
    longest = max(r.prompt + r.max_new for r in requests)
    first = step_tokens(policy.prompt, max(r.prompt for r in requests))
    kind, _, arg = policy.cache.partition(":")
    prompt = max(r.prompt for r in requests)
    rows = 0 if kind == "growing" else cache_rows(mode, policy.cache, longest, first, prompt)
    # a first step that feeds every prompt whole runs in its own rows, which are then copied
    # into the buffer
    if kind == "percall":  # the slots' capacity of a call: no chunk of room past a row
        rows = round_up(max(longest, sum(_prompt_steps(policy, mode, prompt))), 64)
    alone = first if kind in ("capacity64", "windows", "percall") and prompt <= first < rows else 0
    if kind in ("windows", "percall") and not alone:  # the prompts' steps: a prefill window
        written = sum(_prompt_steps(policy, mode, prompt))
        alone = next((w for w in (64, 256, 1024, 4096) if w >= written and w < rows), 0)
    while any(s < r.steps for s, r in zip(selections, requests, strict=True)):
        remaining = [
            r.prompt - f if s < r.steps else 0
            for f, s, r in zip(fed, selections, requests, strict=True)
        ]
        size = step_tokens(policy.prompt, max(remaining)) if max(remaining) > 0 else 1
        valid = [f + max(s - 1, 0) for f, s in zip(fed, selections, strict=True)]
        if kind == "growing":  # room for this step: the buffer is copied into a larger one
            need = round_up(max(valid) + size, int(arg))
            if need > rows:
                if rows:
                    trace.copies.add((batch, rows, need))
                rows = need
        prompting = max(remaining) > 0
        if kind in ("windows", "percall"):  # the prompts' rows, then the decode window
            window = next_pow2(max(valid) + size, 64) if kind == "windows" else rows
            here = (alone or rows) if prompting else min(window, rows)
            before = trace.window
            if before and here != before:
                trace.copies.add((batch, before, here))
            trace.window = here
        else:
            here = alone if alone and trace.steps == 0 else rows
            if here != rows and any(r.steps > 1 for r in requests):
                trace.copies.add((batch, here, rows))
        trace.shapes.add((batch, size, here, True))
        trace.steps += 1
        trace.tokens += batch * size
        trace.attended += batch * size * (here + size)
        if size == 1:
            trace.decode_rows += batch * (here if kind == "windows" else rows)
        for i, r in enumerate(requests):
            if selections[i] >= r.steps:
                continue
            trace.real_attended += size * (valid[i] + size)
            if remaining[i] > 0:
                fed[i] += min(size, remaining[i])
                if fed[i] < r.prompt:
                    continue
            selections[i] += 1


def _run_grow_shared(policy: Policy, batch: int, requests: list[Request], trace: Trace):
    """grow on a padded cache: every row in one cache whose valid rows come last (a step's
    padding after a row's tokens is dropped); rows feed their prompts together."""
    n = len(requests)
    fed, selections, valid = [0] * n, [0] * n, [0] * n
    capacity = cache_rows("grow", policy.cache, max(r.prompt + r.max_new for r in requests), 0)
    buckets = policy.cache == "bucket64"
    rows = 0  # the cache's rows before the step: none before the first
    while any(s < r.steps for s, r in zip(selections, requests, strict=True)):
        remaining = [
            r.prompt - f if s < r.steps else 0
            for f, s, r in zip(fed, selections, requests, strict=True)
        ]
        size = step_tokens(policy.prompt, max(remaining)) if max(remaining) > 0 else 1
        if not padding_allowed("grow", policy.cache):
            size = min(size, chunk(max(remaining))) if max(remaining) > 0 else 1
        after = round_up(max(valid) + size, 64) if buckets else capacity
        trace.shapes.add((batch, size, rows, rows > 0, after))
        trace.steps += 1
        trace.tokens += batch * size
        trace.attended += batch * size * (rows + size)
        if size == 1:
            trace.decode_rows += batch * rows
        for i, r in enumerate(requests):
            if selections[i] >= r.steps:
                continue
            trace.real_attended += size * (valid[i] + size)
            real = min(size, remaining[i]) if remaining[i] > 0 else 1
            valid[i] += real
            if remaining[i] > 0:
                fed[i] += real
                if fed[i] < r.prompt:
                    continue
            selections[i] += 1
        rows = after


def _run_grow_group(policy: Policy, batch: int, group: list[Request], trace: Trace):
    """grow at exact lengths: rows of one prompt length share a cache of their exact length."""
    prompt = group[0].prompt
    longest = max(r.prompt + r.max_new for r in group)
    capacity = cache_rows("grow", policy.cache, longest, 0)
    buckets = policy.cache == "bucket64"
    length = rows = 0
    steps = _prompt_steps(policy, "grow", prompt) + [1] * (max(r.steps for r in group) - 1)
    for size in steps:
        if buckets:  # the rows now, and after the step: the valid tokens rounded up to 64
            after: tuple[int, ...] = (round_up(length + size, 64),)
        else:
            rows = 0 if length == 0 else (capacity or length)
            after = (capacity,) if capacity else ()
        trace.shapes.add((batch, size, rows, length > 0, *after))
        trace.steps += 1
        trace.tokens += batch * size
        trace.attended += batch * size * (rows + size)
        trace.real_attended += len(group) * size * (length + size)
        if size == 1:
            trace.decode_rows += batch * rows
        length += size
        if buckets:
            rows = after[0]


def run(
    mode: str, policy: Policy, batch: int, requests: Iterable[Request], trace: Trace | None = None
) -> Trace:
    """Replays ``requests`` in consecutive batches of ``batch``."""
    trace = trace or Trace()
    pending: list[Request] = []
    for r in requests:
        pending.append(r)
        if len(pending) == batch:
            run_batch(mode, policy, batch, pending, trace)
            pending = []
    if pending:
        run_batch(mode, policy, batch, pending, trace)
    return trace


@dataclasses.dataclass(frozen=True)
class Workload:
    """A distribution of requests.

    Attributes:
        name: a label.
        mode: the cache mode of the decoder it runs on.
        prompt: (median, sigma, low, high) of a log-normal prompt length, clipped to [low, high].
        new: (median, sigma, low, high) of the selections before eos, clipped, then at most
            ``max_new``.
        max_new: max_new_tokens.
        batches: the batch sizes to simulate.
        requests: how many requests.
        model: the key of the measured compile times to use.
    """

    name: str
    mode: str
    prompt: tuple[float, float, int, int]
    new: tuple[float, float, int, int]
    max_new: int
    batches: tuple[int, ...]
    requests: int
    model: str


def _lognormal(rng: np.random.Generator, spec: tuple[float, float, int, int], n: int) -> np.ndarray:
    median, sigma, low, high = spec
    if sigma == 0:
        return np.full(n, int(median))
    values = np.exp(rng.normal(math.log(median), sigma, n))
    return np.clip(np.rint(values), low, high).astype(int)


def requests(workload: Workload, seed: int = 0) -> list[Request]:
    """The workload's requests, drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    prompts = _lognormal(rng, workload.prompt, workload.requests)
    steps = np.minimum(_lognormal(rng, workload.new, workload.requests), workload.max_new)
    return [
        Request(int(p), workload.max_new, max(int(s), 1))
        for p, s in zip(prompts, steps, strict=True)
    ]


def cumulative_shapes(mode: str, policy: Policy, batch: int, reqs: Sequence[Request]) -> list[int]:
    """Distinct shapes compiled after each batch of requests."""
    trace, counts = Trace(), []
    for start in range(0, len(reqs), batch):
        run_batch(mode, policy, batch, reqs[start : start + batch], trace)
        counts.append(len(trace.shapes))
    return counts


def compile_seconds(shapes: Iterable[tuple], per_shape: dict[str, float]) -> float:
    """Estimated compile time: ``per_shape["prefill"]`` for a step of more than one token,
    ``per_shape["decode"]`` for one token."""
    return sum(per_shape["prefill" if s[1] > 1 else "decode"] for s in shapes)
