"""SmolVLM-sized image and text to text: transmuter_jax against onnxruntime on the same files.

Usage: python benchmarks/vision.py [--new 32] [--splitting off,on] [--repeats 2] [--layers 30]
           [--vision-layers 12] [--markdown] [--json] [--out benchmarks/results]
           [--export-python PYTHON]

The model has the architecture of SmolVLM-256M-Instruct (``SMOLVLM_256M`` below) with random
weights (seed 0). It is exported once into the cache folder
(``$TRANSMUTER_JAX_CACHE/bench/smolvlm-256m-shape-L<layers>-V<vision layers>``, by default under
~/.cache/transmuter_jax) in the onnx-community layout, the way tests/fixtures/make_vision.py
exports its smolvlm-community fixture: ``onnx/vision_encoder.onnx`` (make_vision's vision
encoder module), ``onnx/embed_tokens.onnx`` and ``onnx/decoder_model_merged.onnx`` (make.py's
``export_torch_smolvlm``), all by ``torch.onnx.export`` (dynamo), with transformers'
``Idefics3Processor`` files and SmolLM2-135M-Instruct's tokenizer (the default model's ``hf``
folder) with SmolVLM's image tokens added. The export needs torch and transformers 4.57: it runs
in ``--export-python`` (default: the checkout's ``.venv-fixtures/bin/python``, made by
``bash tests/fixtures/make.sh --python-only``).

Then, in one process, for one real photo (tests/fixtures/vitgpt2-optimum/grace_hopper.jpg,
matplotlib's) and the question below, at batch 1, with and without image splitting
(``--splitting``): the processor makes the prompt ids and pixel values once (transmuter_jax's
Idefics3 processor, equal to transformers' in the tests); each engine then runs, on the same
three ONNX files,

- jax: the pipeline's vision encoder (``vision.image_text_to_text``), then its generation
  (embed_tokens, the image features merged into the embeddings, prefill and decode on the device
  in chunks), a first call to compile, then ``--repeats`` timed calls;
- ort: onnxruntime ``InferenceSession``s (``intra_op_num_threads`` = cores), a greedy Python step
  loop: the vision encoder, embed_tokens of the prompt, the image features put at the image token
  positions, the decoder on the whole prompt, then one token a step with the KV cache (each
  step's presents are the next step's pasts), one warm-up call, then ``--repeats`` timed calls.

Both generate exactly ``--new`` greedy tokens (the eos logits masked until then: transformers'
``min_new_tokens``). Figures (each the best of the timed calls, on its own): the vision
encoder's time, the time from the start of the vision encoder to the first new token (TTFT:
vision encoder plus prefill),
decode tokens/s after the first token, and whether the tokens agree (the count of leading tokens
that are equal). Writes ``<out>/vision-<date>.json`` with ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
PHOTO = os.path.join(FIXTURES, "vitgpt2-optimum", "grace_hopper.jpg")
QUESTION = "Can you describe this image?"
SEED = 0

# SmolVLM-256M-Instruct's architecture: the values of HuggingFaceTB/SmolVLM-256M-Instruct's
# config.json (an Idefics3ForConditionalGeneration: SmolLM2-135M's llama text model with a
# 49280-token vocabulary, SigLIP base patch16-512 as the vision model, a pixel shuffle of 4), and
# its preprocessor_config.json / processor_config.json (tiles of 512, longest edge 2048, Lanczos,
# 64 image tokens per tile).
SMOLVLM_256M = {
    "text_config": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49280,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=False,
        initializer_range=0.02,
        model_type="llama",
    ),  # fmt: skip
    "vision_config": dict(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        image_size=512,
        patch_size=16,
        layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh",
    ),  # fmt: skip
    "scale_factor": 4,
    "processor": dict(
        size={"longest_edge": 2048},
        max_image_size={"longest_edge": 512},
        resample=1,
        do_image_splitting=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ),  # fmt: skip
    "image_seq_len": 64,  # (512 / 16)^2 / 4^2
}
# SmolVLM's tokenizer has these beside SmolLM2's (Idefics3Processor adds <image>,
# <fake_token_around_image> and <end_of_utterance> itself)
EXTRA_TOKENS = ["<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def cache_folder(layers: int, vision_layers: int) -> str:
    """The model's folder in the per-user cache."""
    base = os.environ.get("TRANSMUTER_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "transmuter_jax"
    )
    return os.path.join(base, "bench", f"smolvlm-256m-shape-L{layers}-V{vision_layers}")


# ----------------------------------------------------------------------------
# The export (run with torch and transformers: --export-python)
# ----------------------------------------------------------------------------


def export(folder: str, layers: int, vision_layers: int, tokenizer_folder: str) -> None:
    """Makes the random SmolVLM-256M-shaped model and exports it into ``folder``."""
    import types

    sys.path.insert(0, FIXTURES)
    import make as mk  # tests/fixtures/make.py: export_torch_smolvlm, strip_stack_traces
    import make_vision
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlamaForCausalLM,
    )

    work = tempfile.mkdtemp(prefix="smolvlm-bench-", dir=os.path.dirname(folder))
    out = os.path.join(work, "model")
    os.makedirs(os.path.join(out, "onnx"))
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": EXTRA_TOKENS}, replace_additional_special_tokens=False
    )
    image_processor = Idefics3ImageProcessor(**SMOLVLM_256M["processor"])
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer,
        image_seq_len=SMOLVLM_256M["image_seq_len"], chat_template=make_vision.SMOL_TEMPLATE,
    )  # fmt: skip
    processor.save_pretrained(out)
    tokenizer = processor.tokenizer
    eos = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    text = dict(SMOLVLM_256M["text_config"], num_hidden_layers=layers)
    text.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    vision = dict(SMOLVLM_256M["vision_config"], num_hidden_layers=vision_layers)
    torch.manual_seed(SEED)
    config = Idefics3Config(
        text_config=text, vision_config=vision, scale_factor=SMOLVLM_256M["scale_factor"],
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos,
        architectures=["Idefics3ForConditionalGeneration"],
    )  # fmt: skip
    model = Idefics3ForConditionalGeneration(config).eval()
    for k, v in dict(eos_token_id=eos, pad_token_id=eos, bos_token_id=text["bos_token_id"]).items():
        setattr(model.generation_config, k, v)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    lm = LlamaForCausalLM(model.config.text_config).eval().float()
    lm.model.load_state_dict(model.model.text_model.state_dict())
    lm.lm_head.load_state_dict(model.lm_head.state_dict())
    print(f"  model made in {time.perf_counter() - start:.1f} s", flush=True)
    raw = os.path.join(work, "torch")
    os.makedirs(raw)
    start = time.perf_counter()
    mk.export_torch_smolvlm(types.SimpleNamespace(lm=lm), mk.Path(raw))
    onnx = os.path.join(out, "onnx")
    shutil.move(os.path.join(raw, "model.onnx"), os.path.join(onnx, "decoder_model_merged.onnx"))
    shutil.move(os.path.join(raw, "embed_tokens.onnx"), os.path.join(onnx, "embed_tokens.onnx"))
    print(f"  decoder and embed_tokens exported in {time.perf_counter() - start:.1f} s", flush=True)
    del lm
    start = time.perf_counter()
    path = os.path.join(out, "onnx", "vision_encoder.onnx")
    tile = SMOLVLM_256M["vision_config"]["image_size"]
    make_vision._export_vision_encoder(model, mk.Path(path), tile)
    mk.strip_stack_traces(mk.Path(path))
    print(f"  vision encoder exported in {time.perf_counter() - start:.1f} s", flush=True)
    with open(os.path.join(out, "bench.json"), "w") as file:
        about = {"architecture": "SmolVLM-256M-Instruct", "seed": SEED, "layers": layers,
                 "vision_layers": vision_layers, "torch": torch.__version__}  # fmt: skip
        json.dump(about, file, indent=2)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.rename(out, folder)
    shutil.rmtree(work)


def ensure_model(args: argparse.Namespace) -> str:
    """The exported model's folder, exported first when missing."""
    folder = cache_folder(args.layers, args.vision_layers)
    if os.path.exists(os.path.join(folder, "bench.json")):
        return folder
    python = args.export_python or os.path.join(ROOT, ".venv-fixtures", "bin", "python")
    if not os.path.exists(python):
        raise SystemExit(
            f"no {python}: the export needs torch and transformers 4.57 "
            "(bash tests/fixtures/make.sh --python-only, or --export-python)"
        )
    from transmuter_jax import default

    tokenizer = default.path("hf")
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    print(f"exporting the model into {folder} (once) ...", flush=True)
    command = [python, os.path.abspath(__file__), "--export-to", folder, "--tokenizer",
               tokenizer, "--layers", str(args.layers), "--vision-layers",
               str(args.vision_layers)]  # fmt: skip
    subprocess.run(command, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return folder


# ----------------------------------------------------------------------------
# The benchmark (the dev environment: transmuter_jax, onnxruntime)
# ----------------------------------------------------------------------------


def _conversation() -> list[dict]:
    content = [{"type": "image", "image": PHOTO}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": content}]


class Jax:
    """transmuter_jax: the pipeline's vision encoder and generation."""

    def __init__(self, folder: str):
        from transmuter_jax import vision

        self.pipe = vision.image_text_to_text(folder)

    def call(self, ids: list[int], pixels, mask, new: int) -> dict:
        import numpy as np

        marks, tokens = [], []

        def on_token(new):
            token = int(new[0])
            if token >= 0:  # negative: a step of the prompt
                marks.append(time.perf_counter())
                tokens.append(token)

        start = time.perf_counter()
        out = self.pipe.encoder({"pixel_values": pixels, "pixel_attention_mask": mask})
        features = np.asarray(out["image_features"], np.float32)
        features = features.reshape(-1, features.shape[-1])
        encoded = time.perf_counter()
        options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        self.pipe.generate_ids(
            [ids], inputs={"image_features": features}, on_token=on_token, **options
        )
        return _figures(start, encoded, marks, tokens)


class Ort:
    """onnxruntime: InferenceSessions of the three files and a greedy step loop."""

    def __init__(self, folder: str, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL

        def session(name):
            path = os.path.join(folder, "onnx", name)
            return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

        self.vision = session("vision_encoder.onnx")
        self.embed = session("embed_tokens.onnx")
        self.decoder = session("decoder_model_merged.onnx")
        with open(os.path.join(folder, "config.json")) as file:
            config = json.load(file)
        self.image_token = config["image_token_id"]
        with open(os.path.join(folder, "generation_config.json")) as file:
            eos = json.load(file)["eos_token_id"]
        self.eos = eos if isinstance(eos, list) else [eos]
        self.outputs = [o.name for o in self.decoder.get_outputs()]
        self.pasts = [i for i in self.decoder.get_inputs() if i.name.startswith("past_key_values")]

    def call(self, ids: list[int], pixels, mask, new: int) -> dict:
        import numpy as np

        marks, tokens = [], []
        start = time.perf_counter()
        features = self.vision.run(None, {"pixel_values": pixels, "pixel_attention_mask": mask})[0]
        features = features.reshape(-1, features.shape[-1])
        encoded = time.perf_counter()
        prompt = np.asarray([ids], np.int64)
        embeds = self.embed.run(None, {"input_ids": prompt})[0]
        embeds[prompt == self.image_token] = features  # in order, as transformers' inputs_merger
        feeds = {p.name: np.zeros((1, p.shape[1], 0, p.shape[3]), np.float32) for p in self.pasts}
        total = 0
        for _ in range(new):
            step = embeds.shape[1]
            feeds["inputs_embeds"] = embeds
            feeds["attention_mask"] = np.ones((1, total + step), np.int64)
            feeds["position_ids"] = np.arange(total, total + step, dtype=np.int64)[None]
            out = dict(zip(self.outputs, self.decoder.run(self.outputs, feeds), strict=True))
            logits = out["logits"][0, -1].copy()
            if len(tokens) + 1 < new:
                logits[self.eos] = -np.inf  # min_new_tokens
            token = int(logits.argmax())
            marks.append(time.perf_counter())
            tokens.append(token)
            for p in self.pasts:
                feeds[p.name] = out[p.name.replace("past_key_values", "present")]
            total += step
            embeds = self.embed.run(None, {"input_ids": np.asarray([[token]], np.int64)})[0]
        return _figures(start, encoded, marks, tokens)


def _figures(start: float, encoded: float, marks: list[float], tokens: list[int]) -> dict:
    decode = marks[-1] - marks[0]
    return {
        "vision_ms": (encoded - start) * 1e3,
        "prefill_ms": (marks[0] - encoded) * 1e3,
        "ttft_ms": (marks[0] - start) * 1e3,
        "decode_tokens_per_s": (len(marks) - 1) / decode if decode > 0 else None,
        "call_s": marks[-1] - start,
        "tokens": tokens,
    }


def _best(calls: list[dict]) -> dict:
    """The best figures of several calls (each its own best), the first call's tokens."""
    best = dict(calls[0])
    for key in ("vision_ms", "prefill_ms", "ttft_ms", "call_s"):
        best[key] = min(c[key] for c in calls)
    best["decode_tokens_per_s"] = max(c["decode_tokens_per_s"] for c in calls)
    return best


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens are equal."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(folder: str, args: argparse.Namespace) -> dict:
    import jax
    import numpy as np
    import onnxruntime

    import transmuter_jax as tj

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    start = time.perf_counter()
    engines = {"jax": Jax(folder)}
    load = {"jax": time.perf_counter() - start}
    start = time.perf_counter()
    engines["ort"] = Ort(folder, threads)
    load["ort"] = time.perf_counter() - start
    processor = engines["jax"].pipe.processor
    rows = []
    for split in args.splitting:
        start = time.perf_counter()
        ids, images = processor([_conversation()], do_image_splitting=split)
        processor_ms = (time.perf_counter() - start) * 1e3
        pixels = np.ascontiguousarray(images.pixel_values)
        mask = np.ascontiguousarray(images.pixel_attention_mask)
        image_tokens = ids[0].count(engines["jax"].pipe.image_token_id)
        print(f"image splitting {'on' if split else 'off'}: {pixels.shape[1]} frames, "
              f"{len(ids[0])} prompt tokens ({image_tokens} image tokens), processor "
              f"{processor_ms:.0f} ms", flush=True)  # fmt: skip
        figures = {}
        for name, engine in engines.items():
            first = engine.call(ids[0], pixels, mask, args.new)  # compiles (jax), warms (ort)
            calls = [engine.call(ids[0], pixels, mask, args.new) for _ in range(args.repeats)]
            figures[name] = dict(_best(calls), first_call_ttft_ms=first["ttft_ms"])
            f = figures[name]
            print(f"  {name}: vision {f['vision_ms']:.0f} ms, TTFT {f['ttft_ms']:.0f} ms, decode "
                  f"{f['decode_tokens_per_s']:.1f} tok/s (first call TTFT "
                  f"{f['first_call_ttft_ms']:.0f} ms)", flush=True)  # fmt: skip
        agree = _agree(figures["jax"]["tokens"], figures["ort"]["tokens"])
        print(f"  tokens agree: {agree}/{args.new}", flush=True)
        j, o = figures["jax"], figures["ort"]
        rows.append({
            "image_splitting": split, "frames": int(pixels.shape[1]), "prompt_tokens": len(ids[0]),
            "image_tokens": image_tokens, "processor_ms": processor_ms, "jax": j, "ort": o,
            "agree": agree, "ttft_ratio": j["ttft_ms"] / o["ttft_ms"],
            "vision_ratio": j["vision_ms"] / o["vision_ms"],
            "decode_ratio": j["decode_tokens_per_s"] / o["decode_tokens_per_s"],
            "load_average": os.getloadavg(),
        })  # fmt: skip
    with open(os.path.join(folder, "bench.json")) as file:
        model = json.load(file)
    return {
        "date": datetime.date.today().isoformat(),
        "model": dict(model, folder=folder),
        "photo": os.path.relpath(PHOTO, ROOT),
        "question": QUESTION,
        "new": args.new,
        "repeats": args.repeats,
        "threads": threads,
        "load_s": load,
        "load_average": os.getloadavg(),
        "machine": platform.processor() or platform.machine(),
        "versions": {
            "transmuter_jax": tj.__version__,
            "jax": jax.__version__,
            "onnxruntime": onnxruntime.__version__,
        },  # fmt: skip
        "rows": rows,
    }


def markdown(result: dict) -> str:
    """The table of a result, as in benchmarks/README.md."""
    lines = [
        "| image splitting | frames | prompt tokens | engine | vision ms | TTFT ms | decode tok/s "
        "| first call TTFT ms | agree |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for name in ("jax", "ort"):
            f = row[name]
            lines.append(
                f"| {'on' if row['image_splitting'] else 'off'} | {row['frames']} | "
                f"{row['prompt_tokens']} | {name} | {f['vision_ms']:.0f} | {f['ttft_ms']:.0f} | "
                f"{f['decode_tokens_per_s']:.1f} | {f['first_call_ttft_ms']:.0f} | "
                f"{row['agree']}/{result['new']} |"
            )
    lines += ["", "| image splitting | jax / ort vision | jax / ort TTFT | jax / ort decode |",
              "|---|---:|---:|---:|"]  # fmt: skip
    for row in result["rows"]:
        lines.append(
            f"| {'on' if row['image_splitting'] else 'off'} | {row['vision_ratio']:.2f} | "
            f"{row['ttft_ratio']:.2f} | {row['decode_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=32, help="new tokens per call (32)")
    parser.add_argument("--splitting", default="off,on", help="image splitting: off, on or both")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per engine (2)")
    parser.add_argument("--layers", type=int, default=30, help="text decoder layers (30)")
    parser.add_argument("--vision-layers", type=int, default=12, help="vision layers (12)")
    parser.add_argument("--export-python", help="a Python with torch and transformers 4.57")
    parser.add_argument("--json", action="store_true", help="write <out>/vision-<date>.json")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--export-to", help=argparse.SUPPRESS)  # the export step's own run
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.export_to:
        export(args.export_to, args.layers, args.vision_layers, args.tokenizer)
        return 0
    choices = {"off": False, "on": True}
    try:
        args.splitting = [choices[s.strip()] for s in args.splitting.split(",")]
    except KeyError:
        parser.error(f"--splitting takes off, on or off,on, not {args.splitting!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = ensure_model(args)
    result = run(folder, args)
    if args.markdown:
        print(markdown(result))
    if args.json:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"vision-{result['date']}.json")
        with open(path, "w") as file:
            json.dump(result, file, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
