"""Encode + decode time of the hot messages (a StepPlan for 256 decoding requests
should take well under 100 µs). Usage: python benchmarks/proto_codec.py"""

from __future__ import annotations

import os
import sys
import timeit

import msgspec
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from proto.arrays import pack_i32  # noqa: E402
from proto.messages import PageAppend, PlanMsg, ResultMsg, StepPlan, StepResult  # noqa: E402


def main() -> None:
    enc = msgspec.msgpack.Encoder()
    dec_plan, dec_res = msgspec.msgpack.Decoder(PlanMsg), msgspec.msgpack.Decoder(ResultMsg)
    slots = np.arange(1, 257)
    # A typical decode step: every row decodes, one in four crosses a page boundary (MTP, T=4).
    plan = StepPlan(step_id=12345, decode_slots=pack_i32(slots),
                    pages=[PageAppend(int(s), 7, pack_i32([1000 + int(s)])) for s in slots[::4]])
    res = StepResult(12345, pack_i32(slots), pack_i32(np.zeros((256, 4))), pack_i32(np.ones(256)))
    n = 2000
    for name, msg, dec in (("StepPlan 256 decode rows", plan, dec_plan), ("StepResult 256 rows x 4", res, dec_res)):
        t = timeit.timeit(lambda: dec.decode(enc.encode(msg)), number=n) / n
        print(f"{name}: encode+decode {t * 1e6:.1f} us, {len(enc.encode(msg))} bytes")


if __name__ == "__main__":
    main()
