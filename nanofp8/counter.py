"""
The byte counter of every collective in nanofp8 (dist.py, zero.py, parallel.py): what each rank
hands to collectives and what it puts on the wire, by operation and by dtype.

COMM is the module-level counter (read and reset it with comm_stats()):
    bytes_in    the bytes this rank hands to collectives: payload + scales (+ padding);
    bytes_sent  the bytes this rank puts on the wire under the bandwidth-optimal algorithm:
                all_to_all (W-1)/W of its input (the part addressed to others), all_gather
                (W-1) x its input (a ring forwards every other rank's piece once), all_reduce
                2(W-1)/W, reduce_scatter (W-1)/W, broadcast: the root sends its input once.
                This is the number to compare: an FP8 all-reduce sends 0.5x the bytes of a
                BF16 all-reduce, plus 4 bytes per scale (and the padding of the last chunk).
    by_dtype    bytes_sent split by what the bytes are: "float8_e4m3fn" / "float8_e5m2"
                payloads, their "float32" scales, "bfloat16" / "float32" baselines. Tests read
                it to check that a precision level sends exactly what its name says.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class CommCounter:
    calls: int = 0
    bytes_in: int = 0  # handed to collectives by this rank (payload + scales + padding)
    bytes_sent: int = 0  # put on the wire by this rank (bandwidth-optimal algorithm)
    by_op: dict = field(default_factory=dict)  # op name -> {"calls", "bytes_in", "bytes_sent"}
    by_dtype: dict = field(default_factory=dict)  # dtype name -> bytes_sent

    def add(self, op, bytes_in, bytes_sent, dtype=torch.float32, scale_bytes=0):
        """Count one collective. dtype: what its payload is; scale_bytes: how many of bytes_in
        are fp32 scales riding along (an FP8 buffer), counted as float32."""
        bytes_sent = int(round(bytes_sent))
        scales = int(round(bytes_sent * scale_bytes / bytes_in)) if bytes_in else 0
        for name, n in ((str(dtype).split(".")[-1], bytes_sent - scales), ("float32", scales)):
            if n:
                self.by_dtype[name] = self.by_dtype.get(name, 0) + n
        self.calls += 1
        self.bytes_in += bytes_in
        self.bytes_sent += bytes_sent
        entry = self.by_op.setdefault(op, {"calls": 0, "bytes_in": 0, "bytes_sent": 0})
        entry["calls"] += 1
        entry["bytes_in"] += bytes_in
        entry["bytes_sent"] += bytes_sent

    def reset(self):
        self.calls = self.bytes_in = self.bytes_sent = 0
        self.by_op, self.by_dtype = {}, {}


COMM = CommCounter()


def comm_stats(reset=False):
    """A snapshot of COMM as a dict (calls, bytes_in, bytes_sent, by_op); reset=True zeroes it."""
    snap = {"calls": COMM.calls, "bytes_in": COMM.bytes_in, "bytes_sent": COMM.bytes_sent,
            "by_op": {k: dict(v) for k, v in COMM.by_op.items()}, "by_dtype": dict(COMM.by_dtype)}
    if reset:
        COMM.reset()
    return snap
