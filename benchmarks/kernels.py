"""Benchmark: ``python -m benchmarks.kernels`` (GPU: ``--sweep`` variants, ``--only`` one table).

Without a GPU it compares the ``cpu`` backend with a NumPy gather + softmax
decode, measures the per-call overhead of the dispatch layer (NumPy and
Paddle arguments), and times CPU prefill: the tiled BLAS kernel
(``cpu.prefill``) and the NumPy reference, in GFLOP/s of causal (useful) FLOPs.
Results: ``benchmarks/results/kernels-cpu.json``, rendered into ``docs/benchmarks/``.

With a GPU (needs torch) it prints, for the ``cuda`` backend on torch tensors:

* the device's measured copy bandwidth (bytes read + written per second);
* decode for batch x context in {1, 16, 64} x {512, 2048, 8192}, 8 KV heads,
  32 query heads, head_dim 128, float16, block size 16, block tables in random
  order: GPU time per call with a cold L2 (a 256 MB buffer is rewritten before
  every call), effective KV bandwidth (K and V bytes read / time), and torch's
  ``scaled_dot_product_attention`` on the same sizes in a contiguous cache;
* host time per call of ``gpu_kernels.paged_decode`` / ``paged_prefill`` (Python + launch),
  beside SDPA's host time per call in the same run;
* prefill (float16 and bfloat16, causal) on tensor cores: TFLOP/s of useful FLOPs beside
  torch's SDPA on the same data in a contiguous cache, the float32 CUDA-core kernel on the
  same data, and host time per call.

GPU time is measured with CUDA events around one call queued behind a
``torch.cuda._sleep`` kernel, so host-side overhead does not count; it is
reported separately.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

import gpu_kernels
from gpu_kernels.testing import make_problem

from engine.config import FlagParser

from . import results


def _host_time(fn, reps):
    """Median wall time of one call (µs). On the GPU the calls queue behind each other, as
    in the engine (waiting for the device before each call would time a waking CPU)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


# --------------------------------------------------------------------------- CPU


def numpy_decode(q, kc, vc, bt, lens, scale, out):
    """The NumPy baseline: gather each sequence's pages, then softmax(q K^T) V per KV head."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kc.shape[1], kc.shape[2]
    group = num_heads // num_kv_heads
    for i in range(q.shape[0]):
        length = int(lens[i])
        nb = -(-length // block_size)
        k = kc[bt[i, :nb]].transpose(1, 0, 2, 3).reshape(num_kv_heads, nb * block_size, head_dim)
        v = vc[bt[i, :nb]].transpose(1, 0, 2, 3).reshape(num_kv_heads, nb * block_size, head_dim)
        k, v = k[:, :length].astype(np.float32), v[:, :length].astype(np.float32)
        s = (q[i].reshape(num_kv_heads, group, head_dim).astype(np.float32) * scale) \
            @ k.transpose(0, 2, 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        out[i] = (s @ v).reshape(num_heads, head_dim)


CPU_DECODE_CASES = [(1, 9, 3, 64, 512, "float32"), (8, 9, 3, 64, 1024, "float32"),
                    (1, 4, 1, 256, 4096, "float32"), (8, 32, 8, 128, 2048, "float32"),
                    (8, 32, 8, 128, 2048, "float16")]
CPU_PREFILL_CASES = [(1, 1400, 9, 3, 64, "float32", 0), (4, 512, 9, 3, 64, "float32", 0),
                     (1, 2048, 32, 8, 128, "float16", 0), (1, 2048, 8, 4, 256, "bfloat16", 512)]


def bench_cpu(cases=CPU_DECODE_CASES) -> list[dict]:
    """The CPU decode beside the NumPy gather + softmax, and the dispatch layer's cost per call;
    returns the figures (`benchmarks.results`)."""
    import numba
    figures = []
    print(f"CPU backend vs NumPy (numba {numba.__version__}, {numba.get_num_threads()} threads)")
    print("| batch | heads q/kv | head_dim | context | cache | cpu µs | NumPy µs | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for seqs, heads, kv_heads, head_dim, ctx, dtype in cases:
        p = make_problem(rng, context_lens=[ctx] * seqs, query_lens=[1] * seqs,
                         num_kv_heads=kv_heads, group=heads // kv_heads, head_dim=head_dim,
                         dtype=dtype, query_dtype="float32")
        out = np.zeros_like(p.query)
        reps = max(3, int(3e6 // (seqs * ctx * heads * head_dim) * 10))
        ours = _host_time(lambda: gpu_kernels.paged_decode(
            p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, out=out,
            backend="cpu"), reps)
        base = _host_time(lambda: numpy_decode(p.query, p.k_cache, p.v_cache, p.block_tables,
                                               p.context_lens, p.scale, out), reps)
        print(f"| {seqs} | {heads}/{kv_heads} | {head_dim} | {ctx} | {dtype} | {ours:.0f} | "
              f"{base:.0f} | {base / ours:.1f}x |")
        figures.append(results.figure(f"decode {seqs} x {ctx}, heads {heads}/{kv_heads}, d {head_dim}, {dtype}",
                                      "µs", round(ours, 1), round(base, 1), better="lower"))

    p = make_problem(rng, context_lens=[1], query_lens=[1], num_kv_heads=3, group=3, head_dim=64)
    out = np.zeros_like(p.query)
    from gpu_kernels.cpu import attention as cpu
    args = (p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, 0, out,
            numba.get_num_threads(), cpu.min_parallel_work)
    kernel = _host_time(lambda: cpu.paged_decode(*args), 2000)
    via_numpy = _host_time(lambda: gpu_kernels.paged_decode(
        p.query, p.k_cache, p.v_cache, p.block_tables, p.context_lens, p.scale, out=out), 2000)
    line = (f"\nper-call cost, 1-token decode: kernel call {kernel:.1f} µs, "
            f"dispatch with NumPy arrays {via_numpy:.1f} µs")
    figures += [results.figure("1-token decode: kernel call", "µs", round(kernel, 1), better="lower"),
                results.figure("1-token decode: dispatch with NumPy arrays", "µs", round(via_numpy, 1), better="lower")]
    try:
        import paddle
    except ImportError:
        print(line)
        return figures
    t = {k: paddle.to_tensor(getattr(p, k)) for k in
         ("query", "k_cache", "v_cache", "block_tables", "context_lens")}
    pout = paddle.zeros(p.query.shape, dtype="float32")
    via_paddle = _host_time(lambda: gpu_kernels.paged_decode(
        t["query"], t["k_cache"], t["v_cache"], t["block_tables"], t["context_lens"], p.scale,
        out=pout), 2000)
    print(f"{line}, with Paddle tensors {via_paddle:.1f} µs")
    figures.append(results.figure("1-token decode: dispatch with Paddle tensors", "µs", round(via_paddle, 1),
                                  better="lower"))
    return figures


def bench_cpu_prefill(cases=CPU_PREFILL_CASES) -> list[dict]:
    import numba

    from gpu_kernels import interop, reference
    from gpu_kernels.cpu import attention as cpu, prefill as cpu_prefill
    from gpu_kernels.cpu.blas import single_threaded_blas
    print("\nCPU prefill, query fp32, block size 16 (best of several calls; causal FLOPs only)")
    print("| sequences x prompt | heads q/kv | head_dim | cache | window | tiled ms | GFLOP/s "
          "| NumPy reference ms | tiled / reference |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    single_threaded_blas()
    figures = []
    for seqs, prompt, heads, kv_heads, head_dim, dtype, window in cases:
        p = make_problem(rng, context_lens=[prompt] * seqs, query_lens=[prompt] * seqs,
                         num_kv_heads=kv_heads, group=heads // kv_heads, head_dim=head_dim,
                         dtype=dtype, query_dtype="float32")
        out = np.zeros_like(p.query)
        kc, vc = (interop.host_view(c) for c in (p.k_cache, p.v_cache))
        args = (p.query, kc, vc, p.block_tables, p.query_start_loc, p.context_lens, p.scale,
                window, out, numba.get_num_threads(), cpu.min_parallel_work)
        seen = [min(j + 1, window) if window else j + 1 for j in range(prompt)]
        flops = 4 * head_dim * heads * seqs * sum(seen)
        best = lambda fn, reps: min(_host_time(fn, 1) for _ in range(reps)) / 1e3  # noqa
        tiled = best(lambda: cpu_prefill.paged_prefill(*args), 5)
        ref = best(lambda: reference.paged_prefill(
            p.query, p.k_cache, p.v_cache, p.block_tables, p.query_start_loc, p.context_lens,
            p.scale, sliding_window=window, out=out), 1)
        print(f"| {seqs} x {prompt} | {heads}/{kv_heads} | {head_dim} | {dtype} | "
              f"{window or '-'} | {tiled:.1f} | {flops / tiled / 1e6:.1f} | {ref:.0f} | "
              f"{ref / tiled:.1f}x |")
        case = f"prefill {seqs} x {prompt}, heads {heads}/{kv_heads}, d {head_dim}, {dtype}" + (
            f", window {window}" if window else "")
        figures += [results.figure(case, "ms", round(tiled, 2), round(ref, 1), better="lower"),
                    results.figure(case, "GFLOP/s", round(flops / tiled / 1e6, 1))]
    return figures


# --------------------------------------------------------------------------- GPU


class GpuTimer:
    """Cold-L2 GPU time of one call, host overhead hidden behind a sleep kernel.

    The L2 is made cold by rewriting a 256 MB buffer before each call (L2 then holds dirty
    lines of it); ``by_reading=True`` reads the buffer instead (L2 holds clean lines): a
    diagnostic of how much of a call's time is writing back what an earlier kernel left."""

    def __init__(self, torch, by_reading=False):
        self.torch = torch
        self.by_reading = by_reading
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn, reps=15):
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            if self.by_reading:
                self.flush.max()
            else:
                self.flush.zero_()
            torch.cuda._sleep(1_000_000)          # ~0.5 ms: the host queues fn meanwhile
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(self.start.elapsed_time(self.end) * 1e3)
        return statistics.median(times)


def copy_bandwidth(torch, timer):
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() / us / 1e6


def decode_case(torch, seqs, ctx, kv_heads=8, heads=32, head_dim=128, block_size=16,
                shuffled=True):
    """Random fp16 paged cache with shuffled blocks (``shuffled=False``: each sequence's blocks
    in order, a diagnostic), and a contiguous copy for the SDPA peer."""
    nb = seqs * ctx // block_size
    kc = torch.randn(nb, kv_heads, block_size, head_dim, dtype=torch.float16, device="cuda")
    vc = torch.randn_like(kc)
    order = torch.randperm(nb, device="cuda", dtype=torch.int32) if shuffled else \
        torch.arange(nb, device="cuda", dtype=torch.int32)
    tables = order.reshape(seqs, ctx // block_size)
    lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, heads, head_dim, dtype=torch.float16, device="cuda")
    return q, kc, vc, tables, lens


def contiguous(torch, cache, tables):
    """[seqs, kv_heads, ctx, head_dim] view of each sequence's pages (for the SDPA peer)."""
    pages = cache[tables.long()]                                  # [S, nb, Hkv, bs, D]
    s, nb, h, bs, d = pages.shape
    return pages.permute(0, 2, 1, 3, 4).reshape(s, h, nb * bs, d).contiguous()


def sdpa_decode(torch, q, k_cache, v_cache, tables):
    """The SDPA peer of a paged decode: a call of torch's ``scaled_dot_product_attention`` on a
    contiguous ``[seqs, kv_heads, context, head_dim]`` copy of each sequence's pages (the copy
    lives as long as the call does)."""
    import torch.nn.functional as F
    k4, v4, q4 = contiguous(torch, k_cache, tables), contiguous(torch, v_cache, tables), q.unsqueeze(2)
    return lambda: F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True)


def resources(dispatcher, threads, shared=0):
    """'regs R, local L B, B blocks/SM' of the kernel a dispatcher last compiled."""
    found = list(dispatcher.overloads.values())
    if not found:
        return "resources unknown"
    kernel = found[-1]
    parts = []
    for name, fmt in (("regs_per_thread", "regs {}"), ("local_mem_per_thread", "local {} B")):
        try:
            parts.append(fmt.format(getattr(kernel, name)))
        except Exception:                                   # noqa: BLE001 - best effort
            pass
    try:
        blocks = kernel._codelibrary.get_cufunc().kernel.occupancy.max_active_blocks_per_multiprocessor(threads, shared)
        parts.append(f"{blocks} blocks/SM ({blocks * threads // 32} warps)")
    except Exception:                                       # noqa: BLE001
        pass
    return ", ".join(parts)


DECODE_COLUMNS = ["batch", "context", "KV MB", "ours µs", "ours TB/s", "% of copy", "SDPA µs", "SDPA TB/s",
                  "ours/SDPA speed", "host µs/call", "SDPA host µs/call", "max err vs SDPA"]
PREFILL_COLUMNS = ["cache", "sequences x prompt", "ours ms", "TFLOP/s", "SDPA ms", "SDPA TFLOP/s",
                   "ours / SDPA speed", "CUDA-core kernel ms", "host µs/call", "SDPA host µs/call", "max err vs SDPA"]


def _row(cells: list[str], rows: list) -> None:
    """Print one row of a GPU table and keep it for the results file."""
    rows.append(cells)
    print("| " + " | ".join(cells) + " |", flush=True)


def bench_gpu_decode(torch, F, timer, bw, scale):
    """The decode table; returns (figures, rows) for `benchmarks.results`."""
    from gpu_kernels.cuda import backend as cuda_backend
    figures, rows = [], []
    print("decode, 32 q heads / 8 KV heads, d=128, fp16, block 16, cold L2")
    print("| " + " | ".join(DECODE_COLUMNS) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for seqs in (1, 16, 64):
        for ctx in (512, 2048, 8192):
            q, kc, vc, bt, lens = decode_case(torch, seqs, ctx)
            out = torch.empty_like(q)
            call = lambda: gpu_kernels.paged_decode(q, kc, vc, bt, lens, scale, out=out)  # noqa
            ours = timer(call)
            kv_bytes = 2 * seqs * ctx * 8 * 128 * 2
            host = _host_time(call, 200)
            torch.cuda.synchronize()
            sdpa = sdpa_decode(torch, q, kc, vc, bt)
            peer = timer(sdpa)
            peer_host = _host_time(sdpa, 200)
            torch.cuda.synchronize()
            err = (out.float() - sdpa().squeeze(2).float()).abs().max().item()
            del sdpa
            _row([f"{seqs}", f"{ctx}", f"{kv_bytes / 1e6:.0f}", f"{ours:.1f}", f"{kv_bytes / ours / 1e6:.2f}",
                  f"{100 * kv_bytes / ours / 1e6 / bw:.0f}%", f"{peer:.1f}", f"{kv_bytes / peer / 1e6:.2f}",
                  f"{peer / ours:.2f}x", f"{host:.0f}", f"{peer_host:.0f}", f"{err:.1e}"], rows)
            figures.append(results.figure(f"decode {seqs} x {ctx}", "µs", round(ours, 1), round(peer, 1),
                                          better="lower"))
            del q, kc, vc, bt, out
            torch.cuda.empty_cache()

    used = resources(cuda_backend.last_kernels["decode"], cuda_backend.last_kernels["decode_threads"])
    print(f"\ndecode kernel: {used}")
    from gpu_kernels.cuda.launch import Launcher
    print("launches: " + ("packed parameters, cuLaunchKernel" if Launcher.fast else
                          f"Numba's path ({Launcher.fallback})"))
    return figures, rows


def prefill_case(torch, seqs, prompt, dtype):
    """decode_case's paged cache in ``dtype`` with a prompt of queries per sequence."""
    q, kc, vc, bt, lens = decode_case(torch, seqs, prompt)
    q = torch.randn(seqs * prompt, 32, 128, dtype=dtype, device="cuda")
    qsl = torch.arange(0, seqs + 1, dtype=torch.int32, device="cuda") * prompt
    return q, kc.to(dtype), vc.to(dtype), bt, qsl, lens


def bench_gpu_prefill(torch, F, timer, scale, fp32_peak):
    """The prefill table; returns (figures, rows) for `benchmarks.results`."""
    from gpu_kernels.cuda import backend as cuda_backend
    figures, rows = [], []
    from gpu_kernels.cuda.launch import launcher
    from gpu_kernels.cuda.prefill_mma import default_mma_tile
    print("\nprefill, 32 q heads / 8 KV heads, d=128, causal, block 16, shuffled block tables "
          "(TFLOP/s of useful FLOPs only); tensor cores vs SDPA, and the float32 CUDA-core "
          "kernel (what float32 caches/queries use) on the same data")
    print("| " + " | ".join(PREFILL_COLUMNS) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float16, torch.bfloat16):
        for seqs, prompt in [(1, 4096), (4, 1024), (16, 512)]:
            q, kc, vc, bt, qsl, lens = prefill_case(torch, seqs, prompt, dtype)
            out = torch.empty_like(q)
            call = lambda: gpu_kernels.paged_prefill(q, kc, vc, bt, qsl, lens, scale,  # noqa
                                                     out=out)
            ms = timer(call, reps=7) / 1e3
            mma_kernel = cuda_backend.last_kernels["prefill"]
            host = _host_time(call, 200)
            torch.cuda.synchronize()
            flops = cuda_backend.prefill_flops([prompt] * seqs, [prompt] * seqs, 32, 128)
            k4, v4 = contiguous(torch, kc, bt), contiguous(torch, vc, bt)
            q4 = q.reshape(seqs, prompt, 32, 128).transpose(1, 2)
            sdpa = lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True,  # noqa
                                                          enable_gqa=True)
            peer = timer(sdpa, reps=7) / 1e3
            peer_host = _host_time(sdpa, 200)
            torch.cuda.synchronize()
            ref = sdpa().transpose(1, 2).reshape(seqs * prompt, 32, 128)
            err = (out.float() - ref.float()).abs().max().item()
            cuda_backend.prefill_mma_mode = "off"
            try:
                fp32_kernel = timer(call, reps=3) / 1e3
            finally:
                cuda_backend.prefill_mma_mode = "auto"
            name = str(dtype).replace("torch.", "")
            _row([name, f"{seqs} x {prompt}", f"{ms:.3f}", f"{flops / ms / 1e9:.0f}", f"{peer:.3f}",
                  f"{flops / peer / 1e9:.0f}", f"{peer / ms:.2f}x", f"{fp32_kernel:.2f}", f"{host:.0f}",
                  f"{peer_host:.0f}", f"{err:.1e}"], rows)
            figures += [results.figure(f"prefill {name} {seqs} x {prompt}", "ms", round(ms, 3), round(peer, 3),
                                       better="lower"),
                        results.figure(f"prefill {name} {seqs} x {prompt}", "TFLOP/s", round(flops / ms / 1e9),
                                       round(flops / peer / 1e9))]
            del q, kc, vc, bt, out, k4, v4
            torch.cuda.empty_cache()
    tile = default_mma_tile(128)
    used = resources(mma_kernel, tile.threads, launcher(mma_kernel).shared)
    print(f"\nprefill kernel (tensor cores, bf16): {tile}: {used}")
    return figures, rows


def bench_gpu(sweep, only=None, split_rule=False, decode_mma=False, decode_large=False,
              decode_versions=None, tables=None, page_layouts=False):
    import torch
    import torch.nn.functional as F
    from numba import cuda

    dev = cuda.get_current_device()
    sms, clock_khz = dev.MULTIPROCESSOR_COUNT, dev.CLOCK_RATE
    fp32_peak = sms * 128 * 2 * clock_khz * 1e3 / 1e12
    timer = GpuTimer(torch)
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, {clock_khz / 1e6:.2f} GHz, "
          f"FP32 CUDA-core peak {fp32_peak:.1f} TFLOP/s")
    bw = copy_bandwidth(torch, timer)
    print(f"measured device copy bandwidth: {bw:.2f} TB/s (read + write)\n")
    scale = 128 ** -0.5

    if page_layouts:
        from .kernel_sweep import sweep_page_layouts
        sweep_page_layouts(torch, timer, decode_case, scale)
    if tables:
        from .kernel_sweep import sweep_table_orders
        sweep_table_orders(torch, timer, scale, tables)
    if decode_versions:
        from .kernel_sweep import sweep_decode_versions
        sweep_decode_versions(torch, timer, decode_case, scale, decode_versions.split(","))
    if decode_mma:
        from .kernel_sweep import sweep_decode_mma
        sweep_decode_mma(torch, timer, decode_case, scale)
    if decode_large:
        from .kernel_sweep import sweep_decode_large
        sweep_decode_large(torch, timer, decode_case, scale)
        import functools
        print("the same with each sequence's blocks in order (block tables not shuffled)")
        sweep_decode_large(torch, timer, functools.partial(decode_case, shuffled=False), scale,
                           1, [{}], [(16, 8192), (64, 2048), (64, 8192)])
        print("the same, L2 made cold by reading 256 MB (clean lines) instead of writing them")
        sweep_decode_large(torch, GpuTimer(torch, by_reading=True), decode_case, scale, 1,
                           [{}, {"DECODE_EVICT_FIRST_L2": 4}],
                           [(16, 2048), (1, 32768), (64, 512), (16, 8192)])
    if split_rule:
        from .kernel_sweep import sweep_split_rule
        sweep_split_rule(torch, timer, decode_case, scale)
    if sweep:
        from .kernel_sweep import sweep_decode, sweep_prefill
        if only != "prefill":
            sweep_decode(torch, timer, decode_case, scale)
        if only != "decode":
            sweep_prefill(torch, timer, decode_case, scale, fp32_peak)

    device = f"{torch.cuda.get_device_name()} ({sms} SMs, {clock_khz / 1e6:.2f} GHz)"
    settings = {"device": device, "heads q/kv": "32/8", "head_dim": 128, "block size": 16,
                "block tables": "shuffled", "device copy bandwidth (read + write)": f"{bw:.2f} TB/s"}
    if only != "prefill":
        started = results.start()
        figures, rows = bench_gpu_decode(torch, F, timer, bw, scale)
        results.write_run("kernels-gpu-decode", figures, ours="gpu_kernels cuda", peer="torch SDPA", started=started,
                          title=f"CUDA paged decode beside torch SDPA ({device})",
                          settings={**settings, "cache": "float16", "L2": "cold (256 MB rewritten before each call)"},
                          tables=[{"title": "As printed (GPU time per call from CUDA events; host time: median wall "
                                            "time of a call, calls queued)", "columns": DECODE_COLUMNS, "rows": rows}])
    if only != "decode":
        started = results.start()
        figures, rows = bench_gpu_prefill(torch, F, timer, scale, fp32_peak)
        results.write_run("kernels-gpu-prefill", figures, ours="gpu_kernels cuda (tensor cores)", peer="torch SDPA",
                          started=started, title=f"CUDA paged prefill on tensor cores beside torch SDPA ({device})",
                          settings={**settings, "causal": True, "FLOPs": "useful only"},
                          tables=[{"title": "As printed (CUDA-core kernel: the float32 kernel on the same data)",
                                   "columns": PREFILL_COLUMNS, "rows": rows}])


def main(argv=None):
    parser = FlagParser(prog="python -m benchmarks.kernels",
                        description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--sweep", action="store_true", help="GPU: also time kernel variants")
    parser.add_argument("--only", choices=["decode", "prefill"], help="GPU: one table only")
    parser.add_argument("--split-rule", action="store_true",
                        help="GPU: also time decode split rules at long contexts")
    parser.add_argument("--decode-mma", action="store_true",
                        help="GPU: also time the decode stage on tensor cores vs CUDA cores")
    parser.add_argument("--decode-large", action="store_true",
                        help="GPU: also time decode variants at large KV (L2 hints, split-K)")
    parser.add_argument("--decode-versions", metavar="PKG,PKG",
                        help="GPU: also time the decode of several copies of gpu_kernels "
                             "(importable package names) on the same data")
    parser.add_argument("--tables", metavar="FILE",
                        help="GPU: also time decode through shuffled, in-order and the engine's own block "
                             "tables (FILE from python -m benchmarks.engine_tables)")
    parser.add_argument("--page-layouts", action="store_true",
                        help="GPU: also time decode by block size (16/32/64) and page order (shuffled, "
                             "shuffled within 2 MB, in order)")
    parser.add_argument("--quick", action="store_true",
                        help="CPU: the three smallest decode cases and the two smallest prefill cases")
    args = parser.parse_args(argv)
    try:
        from numba import cuda
        gpu = cuda.is_available()
        import torch
        gpu = gpu and torch.cuda.is_available()
    except ImportError:
        gpu = False
    if gpu:
        bench_gpu(args.sweep, args.only, args.split_rule, args.decode_mma, args.decode_large,
                  args.decode_versions, args.tables, args.page_layouts)
    else:
        import numba

        started = results.start()
        figures = bench_cpu(CPU_DECODE_CASES[:3] if args.quick else CPU_DECODE_CASES)
        figures += bench_cpu_prefill(CPU_PREFILL_CASES[:2] if args.quick else CPU_PREFILL_CASES)
        results.write_run("kernels-cpu", figures, ours="Numba cpu backend", peer="NumPy",
                          title="Numba CPU kernels beside NumPy (decode: gather + softmax; prefill: the reference)",
                          started=started, quick=args.quick,
                          settings={"numba threads": numba.get_num_threads(), "query": "float32",
                                    "block size": 16},
                          notes=["Decode µs: median wall time of a call. Prefill ms: best of 5 calls (the NumPy "
                                 "reference: 1 call); GFLOP/s counts causal FLOPs only."])


if __name__ == "__main__":
    main()
