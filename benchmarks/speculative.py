"""Speculative decoding (prompt lookup, a draft model) against plain greedy decoding, in one run.

``python benchmarks/speculative.py [--new 128] [--lookup 10] [--ngram 2] [--assistant 10]
[--repeats 2]`` runs the default model (SmolLM2-135M-Instruct, fp32) greedy on input-grounded
prompts (copy with edits, fix the spelling, reformat a list, change a line of code) and
open-ended ones, at batch 1 (each prompt alone) and at batch 8 (a mix of both kinds), plain and
with ``prompt_lookup_num_tokens``; then each prompt alone with the int4 export as the draft
model (``num_assistant_tokens``, heuristic schedule; ``--assistant 0`` skips it). It checks that
the tokens are the same, and prints one JSON object: tokens/s (the new tokens over the whole
call, prompts included, best of ``--repeats``; and decode tokens/s, the tokens after the first
over the time after it, as ``perf.py`` reports decode), the ratios of both, per call the drafted
and accepted tokens and the target steps saved, the load average (``uptime``) before and after,
and the CPU. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GROUNDED = [
    "Copy this paragraph, replacing every 'cat' with 'dog', and change nothing else:\n"
    "The cat sat on the mat in the morning. The cat looked at the window and waited for the sun."
    " When the sun came, the cat stretched, yawned and walked to the kitchen, where the cat ate.",
    "Fix the spelling mistakes in this text and write it out again:\n"
    "Yesterday I went to the libary to borow a book about the histroy of Europe. The libarian "
    "was very helpfull and showed me where the books about ancient civilisations were kept.",
    "Reformat this list as a numbered list, one item per line:\n"
    "- apples, - bananas, - carrots, - dates, - eggs, - flour, - grapes, - honey, - ice cream, "
    "- jam, - kale, - lemons",
    "Change the third line of this code so that it prints the total, and write out the whole "
    "program:\n```python\ndef total(values):\n    result = 0\n    for v in values:\n"
    "        result += v\n    return result\n\nprint(total([1, 2, 3]))\n```",
]
OPEN = [
    "Write a short story about a dragon who learns to bake bread.",
    "What are three good reasons to learn a second language?",
    "Describe the ocean to someone who has never seen it.",
    "Give me some ideas for a birthday party for a ten-year-old.",
]


def _call(runner, tokenizer, prompts, options) -> tuple[float, list]:
    start = time.perf_counter()
    out = runner.run(tokenizer, prompts, options, seed=0)
    return time.perf_counter() - start, out


def _measure(pipe, prompts, options, repeats) -> tuple[dict, list]:
    from transmuter_jax.generation import slot_loop

    runner = pipe._runner
    _call(runner, pipe.tokenizer, prompts, options)  # compile and warm up
    best, out = min((_call(runner, pipe.tokenizer, prompts, options) for _ in range(repeats)),
                    key=lambda pair: pair[0])  # fmt: skip
    tokens = sum(len(r.token_ids) for r in out)
    result = {"tokens": tokens, "seconds": round(best, 3), "tok_s": round(tokens / best, 1)}
    # the prompt and the first token alone (the same for both: drafting starts after it), so
    # that decode tokens/s (the tokens after the first over the time after it) is also known
    first = {**options, "max_new_tokens": 1}
    _call(runner, pipe.tokenizer, prompts, first)
    ttft = min(_call(runner, pipe.tokenizer, prompts, first)[0] for _ in range(repeats))
    after = max(tokens - len(prompts), 0)
    result.update(first_token_s=round(ttft, 3),
                  decode_tok_s=round(after / max(best - ttft, 1e-9), 1))  # fmt: skip
    if options.get("prompt_lookup_num_tokens") or options.get("num_assistant_tokens"):
        engine = runner.context(len(prompts), options)
        from transmuter_jax.generation.loop import new_tokens

        rows = [(p, new_tokens(engine, len(p)), 0) for p in prompts]
        _, stats = slot_loop.run(engine, rows)
        result.update(
            drafted=stats.drafted,
            accepted=stats.accepted,
            steps=stats.steps,
            steps_saved=stats.steps_saved,
            acceptance=round(stats.acceptance, 3) if stats.drafted else None,
        )
    return result, [list(r.token_ids) for r in out]


def _uptime() -> str:
    import subprocess

    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--lookup", type=int, default=10)
    parser.add_argument("--ngram", type=int, default=2)
    parser.add_argument("--assistant", type=int, default=10, help="num_assistant_tokens (0: skip)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cases", default="lookup,batch8,draft", help="which of them to run")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of each kind")
    parser.add_argument("--repo", default=None, help="a model folder (default: the default model)")
    args = parser.parse_args()

    from transmuter_jax import text

    pipe = text.generation(args.repo) if args.repo else text.generation()
    plain = {"max_new_tokens": args.new}
    spec = {**plain, "prompt_lookup_num_tokens": args.lookup, "max_matching_ngram_size": args.ngram}
    report: dict = {"new": args.new, "lookup": args.lookup, "ngram": args.ngram, "runs": {}}
    report["uptime_before"] = _uptime()
    kinds = {"grounded": GROUNDED[: args.prompts], "open": OPEN[: args.prompts]}
    cases = set(args.cases.split(","))
    same = True
    for kind, texts in kinds.items() if "lookup" in cases else ():
        for i, prompt in enumerate(texts):
            ids = [pipe.prompt_ids(prompt)]
            a, tokens_a = _measure(pipe, ids, plain, args.repeats)
            b, tokens_b = _measure(pipe, ids, spec, args.repeats)
            same &= tokens_a == tokens_b
            ratio = round(b["tok_s"] / a["tok_s"], 2)
            decode = round(b["decode_tok_s"] / a["decode_tok_s"], 2)
            report["runs"][f"{kind}-{i}"] = {"plain": a, "lookup": b, "ratio": ratio,
                                             "decode_ratio": decode}  # fmt: skip
            print(kind, i, ratio, decode, b.get("acceptance"), flush=True)
        runs = [r for k, r in report["runs"].items() if k.startswith(kind)]
        report[f"{kind}_ratio_mean"] = round(sum(r["ratio"] for r in runs) / len(runs), 2)
        decodes = [r["decode_ratio"] for r in runs]
        report[f"{kind}_decode_ratio_mean"] = round(sum(decodes) / len(decodes), 2)
    if "batch8" in cases:
        mixed = [pipe.prompt_ids(p) for p in GROUNDED + OPEN]
        a, tokens_a = _measure(pipe, mixed, plain, args.repeats)
        b, tokens_b = _measure(pipe, mixed, spec, args.repeats)
        same &= tokens_a == tokens_b
        ratio = round(b["tok_s"] / a["tok_s"], 2)
        decode = round(b["decode_tok_s"] / a["decode_tok_s"], 2)
        report["batch8_mixed"] = {"plain": a, "lookup": b, "ratio": ratio, "decode_ratio": decode}
        print("batch8", ratio, flush=True)
    if args.assistant and "draft" in cases:  # the int4 export drafting for the fp32 one
        helped = text.generation(args.repo, assistant_model="default-int4")
        assisted = {**plain, "num_assistant_tokens": args.assistant,
                    "num_assistant_tokens_schedule": "heuristic"}  # fmt: skip
        runs = {}
        for kind, texts in kinds.items():
            for i, prompt in enumerate(texts):
                ids = [pipe.prompt_ids(prompt)]
                a, tokens_a = _measure(pipe, ids, plain, args.repeats)
                b, tokens_b = _measure(helped, ids, assisted, args.repeats)
                same &= tokens_a == tokens_b
                ratio = round(b["tok_s"] / a["tok_s"], 2)
                decode = round(b["decode_tok_s"] / a["decode_tok_s"], 2)
                runs[f"{kind}-{i}"] = {"plain": a, "draft": b, "ratio": ratio,
                                       "decode_ratio": decode}  # fmt: skip
                print("draft", kind, i, ratio, b.get("acceptance"), flush=True)
        ratios = [r["ratio"] for r in runs.values()]
        drafted = sum(r["draft"]["drafted"] for r in runs.values())
        accepted = sum(r["draft"]["accepted"] for r in runs.values())
        report["draft_model"] = {
            "assistant": "default-int4",
            "num_assistant_tokens": args.assistant,
            "runs": runs,
            "ratio_mean": round(sum(ratios) / len(ratios), 2),
            "decode_ratio_mean": round(
                sum(r["decode_ratio"] for r in runs.values()) / len(runs), 2
            ),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
        }
    report["same_tokens"] = same
    report["load_average"] = os.getloadavg()
    report["uptime_after"] = _uptime()
    report["cpu"] = platform.processor() or platform.machine()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    report["avx512"] = "avx512f" in flags
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
