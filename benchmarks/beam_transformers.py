"""transformers' beam search timed on the default model: run with the preparation environment.

Usage: PYTHON benchmarks/beam_transformers.py HF_FOLDER PROMPTS_JSON NUM_BEAMS NEW
Prints one JSON object: seconds of each batch's generate (warm) and the new tokens.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main(folder: str, prompts_json: str, beams: str, new: str) -> None:
    torch.set_num_threads(torch.get_num_threads())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    for batch, prompts in json.loads(prompts_json).items():
        ids = torch.tensor(prompts)
        options = dict(
            num_beams=int(beams), max_new_tokens=int(new), min_new_tokens=int(new), do_sample=False
        )
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), **options)  # warm-up
            start = time.perf_counter()
            result = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
            seconds = time.perf_counter() - start
        out[batch] = {"seconds": seconds, "tokens": result[:, ids.shape[1] :].tolist()}
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
