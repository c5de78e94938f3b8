"""One tensor-core prefill at 1 x 4096 (32 / 8 heads, d=128, fp16, shuffled block tables), twice.

For Nsight Compute (the README's figures)::

    ncu --clock-control none -k regex:prefill --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python -m benchmarks.prefill_once
"""
from __future__ import annotations

import gpu_kernels

from .kernels import prefill_case


def main():
    import torch
    seqs, prompt = 1, 4096
    q, kc, vc, bt, qsl, lens = prefill_case(torch, seqs, prompt, torch.float16)
    out = torch.empty_like(q)
    for _ in range(2):                 # the first call compiles
        gpu_kernels.paged_prefill(q, kc, vc, bt, qsl, lens, 128 ** -0.5, out=out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
