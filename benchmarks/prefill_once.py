"""One kernel call to profile with Nsight Compute, twice (the first call compiles).

Default: a tensor-core prefill at 1 x 4096 (32 / 8 heads, d=128, fp16, shuffled block
tables)::

    ncu --clock-control none -k regex:prefill --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python -m benchmarks.prefill_once

``decode SEQS CONTEXT``: one fp16 decode step of the benchmark's decode table instead
(``-k regex:decode``); ``decode SEQS CONTEXT sdpa``: the peer's call on the same data in a
contiguous cache (torch SDPA), for a side-by-side profile. Needs a GPU and torch; it prints
nothing (the profiler measures).
"""
from __future__ import annotations

import sys

import gpu_kernels

from engine.config import FlagParser

from .kernels import contiguous, decode_case, prefill_case


def parse(argv=None) -> list[str]:
    parser = FlagParser(prog="python -m benchmarks.prefill_once",
                        description=__doc__.splitlines()[0],
                        epilog="default: one tensor-core prefill at 1 x 4096, fp16")
    parser.add_argument("call", nargs="*", metavar="decode SEQS CONTEXT [sdpa]",
                        help="one fp16 decode step of SEQS sequences of CONTEXT keys instead (sdpa: the peer's)")
    call = parser.parse_args(argv).call
    if call and (call[0] != "decode" or len(call) not in (3, 4) or not all(c.isdigit() for c in call[1:3])
                 or call[3:] not in ([], ["sdpa"])):
        parser.error(f"{' '.join(call)!r}: expected nothing (a prefill) or 'decode SEQS CONTEXT [sdpa]', "
                     "e.g. decode 16 8192 sdpa")
    return call


def main(argv=None):
    argv = parse(sys.argv[1:] if argv is None else argv)
    import torch
    if argv and argv[0] == "decode":
        seqs, ctx = int(argv[1]), int(argv[2])
        q, kc, vc, bt, lens = decode_case(torch, seqs, ctx)
        out = torch.empty_like(q)
        call = lambda: gpu_kernels.paged_decode(q, kc, vc, bt, lens, 128 ** -0.5, out=out)  # noqa
        if argv[3:] == ["sdpa"]:
            import torch.nn.functional as F
            k4, v4, q4 = contiguous(torch, kc, bt), contiguous(torch, vc, bt), q.unsqueeze(2)
            call = lambda: F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)  # noqa
    else:
        q, kc, vc, bt, qsl, lens = prefill_case(torch, 1, 4096, torch.float16)
        out = torch.empty_like(q)
        call = lambda: gpu_kernels.paged_prefill(q, kc, vc, bt, qsl, lens, 128 ** -0.5,  # noqa
                                                 out=out)
    for _ in range(2):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
