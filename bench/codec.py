"""Encode/decode throughput of the binary event format against stdlib JSON.

Same events (synthetic episodes, realistic sizes), same process, interleaved
rounds; the figure is the ratio of medians, so machine noise mostly cancels.
"""

from __future__ import annotations

import json
import statistics
import time

import msgspec

from schemas.codec import decode_event, encode_event, to_json
from streams.synth import generate_episodes

__all__ = ["bench_codec"]


def _rate(fn, items, rounds: int) -> list[float]:
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for x in items:
            fn(x)
        rates.append(len(items) / (time.perf_counter() - t0))
    return rates


def bench_codec(n_episodes: int = 300, rounds: int = 5) -> dict[str, float]:
    """Events/s of decode and encode, binary vs stdlib ``json``, on the same events."""
    events = [ev for ep in generate_episodes(n_episodes, seed=1) for ev in ep]
    frames = [encode_event(ev) for ev in events]
    json_docs = [to_json(ev).decode() for ev in events]
    builtins = [msgspec.to_builtins(ev, enc_hook=lambda a: a.tolist()) for ev in events]
    dec_bin, dec_json, enc_bin, enc_json = [], [], [], []
    for _ in range(rounds):  # interleave so both see the same machine state
        dec_bin += _rate(decode_event, frames, 1)
        dec_json += _rate(json.loads, json_docs, 1)
        enc_bin += _rate(encode_event, events, 1)
        enc_json += _rate(json.dumps, builtins, 1)
    med = statistics.median
    return {
        "decode_events_per_s": round(med(dec_bin)),
        "json_decode_events_per_s": round(med(dec_json)),
        "decode_vs_json": round(med(dec_bin) / med(dec_json), 2),
        "encode_events_per_s": round(med(enc_bin)),
        "json_encode_events_per_s": round(med(enc_json)),
        "encode_vs_json": round(med(enc_bin) / med(enc_json), 2),
        "event_bytes_binary_avg": round(sum(map(len, frames)) / len(frames)),
        "event_bytes_json_avg": round(sum(map(len, json_docs)) / len(json_docs)),
    }


if __name__ == "__main__":
    print(json.dumps(bench_codec(), indent=1))
