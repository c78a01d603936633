"""The onnxruntime-genai model builder's command line, written once.

Standard library only: the fixture factory, benchmarks/make_model.py and default/export.py run
in other environments and load this file by its path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def command(
    hf: str | os.PathLike,
    out: str | os.PathLike,
    precision: str,
    cache: str | os.PathLike,
    extra_options: Sequence[str] = ("hf_token=false",),
) -> list[str]:
    """The builder's CPU export of the transformers folder ``hf`` into ``out`` at ``precision``
    ("fp32", "int4", ...), with this interpreter, ``cache`` its download/cache folder."""
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    cmd += ["-p", precision, "-e", "cpu", "-c", str(cache)]
    if extra_options:
        cmd += ["--extra_options", *extra_options]
    return cmd
