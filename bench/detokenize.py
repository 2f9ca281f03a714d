"""The cost of turning a completion's tokens into text, per token, as completions grow long.

Each served choice detokenizes on the engine's event loop, token by token (stop strings and
streaming need the text as it grows): :class:`megafleet_engine.openai.choices.ChoiceState`.
It used to decode every token so far at every step (time quadratic in the completion's length);
it now decodes a window of the last few tokens. This measures, in one run on one machine, both
ways over the same tokens: ``window`` is ``ChoiceState.feed`` itself; ``whole`` is the former
algorithm (decode all tokens, strip an unfinished character, hold back text for stop strings,
compare with the text emitted so far), kept here as the peer. The tokenizer is the tiny models'
byte-level BPE (one token per byte of text, Rust ``tokenizers`` like every Hugging Face fast
tokenizer); the text mixes ASCII with 2-, 3- and 4-byte characters.

    .venv/bin/python bench/detokenize.py --out bench/results/detokenize-<machine>-<date>.json

Figures: microseconds per token (median of ``--repeats`` runs) at each completion length, the
whole completion's time, and ``whole / window``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megafleet_engine.backends import base
from megafleet_engine.models import tiny
from megafleet_engine.openai import choices

TEXT = "The answer is 42, é, €, 😀. " * 1000


def window(tokenizer: Any, ids: list[int]) -> str:
    spec = choices.SequenceSpec(0, (1,), base.SamplingParams(max_tokens=len(ids)), ("</answer>",))
    state = choices.ChoiceState(spec)
    for position, token in enumerate(ids, start=1):
        state.feed(base.TokenStep("r", token, None, (), "length" if position == len(ids) else None), tokenizer)
    return state.text


def whole(tokenizer: Any, ids: list[int]) -> str:
    """The former per-token work: decode everything, then the same stop and hold-back logic."""
    stops = ("</answer>",)
    text = ""
    for end in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:end], skip_special_tokens=True)
        found = [p for p in (decoded.find(stop, len(text)) for stop in stops) if p >= 0]
        if found:
            return text + decoded[len(text) : min(found)]
        if end == len(ids):
            return decoded
        visible = decoded.rstrip("\ufffd")
        new_text = visible[: max(len(text), len(visible) - (len(stops[0]) - 1))]
        text += new_text[len(text) :] if new_text.startswith(text) else ""
    return text


def timed(run: Callable[[], str], repeats: int) -> tuple[float, str]:
    seconds = []
    out = ""
    for _ in range(repeats):
        started = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lengths", default="256,1024,4096,8192", help="completion lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="JSON result file")
    args = parser.parse_args(argv)
    tokenizer = tiny.build_tokenizer()
    every = tokenizer.encode(TEXT)
    rows = []
    for length in (int(value) for value in args.lengths.split(",")):
        ids = every[:length]
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        print(f"{length} tokens: timing window ...", flush=True)
        window_s, window_text = timed(lambda ids=ids: window(tokenizer, ids), args.repeats)
        print(f"{length} tokens: timing whole ...", flush=True)
        whole_s, whole_text = timed(lambda ids=ids: whole(tokenizer, ids), args.repeats)
        row = {
            "tokens": length,
            "window_us_per_token": round(window_s / length * 1e6, 2),
            "whole_us_per_token": round(whole_s / length * 1e6, 2),
            "window_completion_ms": round(window_s * 1e3, 2),
            "whole_completion_ms": round(whole_s * 1e3, 2),
            "whole_over_window": round(whole_s / window_s, 2),
            "same_text": window_text == whole_text == expected,
        }
        rows.append(row)
        print(
            f"  window {row['window_us_per_token']} us/token, whole {row['whole_us_per_token']} us/token "
            f"({row['whole_over_window']}x), same text: {row['same_text']}",
            flush=True,
        )
    result = {
        "benchmark": "detokenize",
        "date": datetime.date.today().isoformat(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "tokenizer": "tiny byte-level BPE (megafleet_engine.models.tiny.build_tokenizer), tokenizers Rust decode",
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(row["same_text"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
