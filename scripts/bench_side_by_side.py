"""Two scripts/bench_engine.py outputs side by side: the 4-bit run's TTFA and RTF at each batch
and its peak GPU memory, then the float run's batch-1 numbers and the ratios (scripts/gpu_check.sh,
step bench_int4, against bench_graphs).

    python scripts/bench_side_by_side.py BF16_OUTPUT INT4_OUTPUT

Prints `int4 ttfa_ms_b1=.. ttfa_ms_b2=.. rtf_b1=.. rtf_b2=.. cuda_peak_gib=..` (the batches the
run has), then `bf16 ...` and `int4_vs_bf16 ttfa_ratio_b1=.. rtf_ratio_b1=.. peak_ratio=..` when
the float output is there. Exit status 1 when the 4-bit output has no stream rows.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

ROW = re.compile(r"^stream 1 s x(\d+)\s+(.*)$", re.M)
PEAK = re.compile(r"cuda_peak_allocated_gib=([\d.]+)")


def parse(text: str) -> tuple[dict[int, tuple[float, float]], float]:
    """{batch: (ttfa_ms, rtf)} of the 1 s stream rows, and the peak allocated GiB (nan if absent)."""

    def num(value: str) -> float:
        return math.nan if value == "-" else float(value)

    rows = {}
    for match in ROW.finditer(text):
        cols = match.group(2).split()  # pre thinker talker MTP codec TTFT TTFA max MTP/frm c2w/frm RTF audio
        if len(cols) >= 12:
            rows[int(match.group(1))] = (num(cols[6]), num(cols[10]))
    peak = PEAK.search(text)
    return rows, float(peak.group(1)) if peak else math.nan


def read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    int4, int4_peak = parse(read(argv[1]))
    if not int4:
        print(f"no stream rows in {argv[1]}")
        return 1
    print(
        "int4 "
        + " ".join(f"ttfa_ms_b{b}={t:.1f}" for b, (t, _) in sorted(int4.items()))
        + " "
        + " ".join(f"rtf_b{b}={r:.2f}" for b, (_, r) in sorted(int4.items()))
        + f" cuda_peak_gib={int4_peak:.1f}"
    )
    bf16, bf16_peak = parse(read(argv[0]))
    if 1 not in bf16 or 1 not in int4:
        print(f"bf16: no batch-1 row in {argv[0]} to compare with")
        return 0
    (t4, r4), (t16, r16) = int4[1], bf16[1]
    print(f"bf16 ttfa_ms_b1={t16:.1f} rtf_b1={r16:.2f} cuda_peak_gib={bf16_peak:.1f}")
    print(
        f"int4_vs_bf16 ttfa_ratio_b1={t4 / t16:.2f} rtf_ratio_b1={r4 / r16:.2f} peak_ratio={int4_peak / bf16_peak:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
