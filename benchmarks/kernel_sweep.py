"""Kernel-variant sweep for ``python -m benchmarks.kernels --sweep`` (GPU only).

Times decode and prefill variants (the tunables of ``gpu_kernels.cuda.backend``) on
the benchmark's shapes and prints each compiled kernel's registers per
thread, local memory per thread and resident blocks per multiprocessor.
"""
from __future__ import annotations

import gpu_kernels
from gpu_kernels.cuda import backend as cuda_backend

from .kernels import contiguous, resources, sdpa_decode

#: (threads, ring stages, stage bytes, register cap, blocks per SM aimed at)
DECODE_VARIANTS = [(128, 2, 4096, 128, 4), (128, 2, 4096, 128, 2), (128, 2, 4096, 128, 8),
                   (128, 3, 4096, 128, 4), (128, 4, 2048, 128, 4), (256, 2, 2048, 128, 3)]
DECODE_SHAPES = [(64, 8192), (64, 2048), (16, 8192), (16, 2048), (1, 2048), (1, 8192)]
#: tensor-core prefill tiles for head_dim 128: (warps, 16-row tiles per warp, keys, K/V stages,
#: register cap, rescale slack)
PREFILL_VARIANTS = [(4, 2, 32, 3, None, 8.0), (4, 2, 32, 2, None, 8.0), (8, 2, 32, 3, None, 8.0),
                    (8, 2, 32, 2, None, 8.0), (4, 2, 64, 2, None, 8.0)]


def _set_decode(threads, stages, stage_bytes, regs, per_sm):
    cuda_backend.DECODE_THREADS, cuda_backend.DECODE_STAGES = threads, stages
    cuda_backend.DECODE_STAGE_BYTES, cuda_backend.DECODE_MAX_REGISTERS = stage_bytes, regs
    cuda_backend.DECODE_BLOCKS_PER_SM = per_sm


def sweep_decode(torch, timer, decode_case, scale):
    defaults = (cuda_backend.DECODE_THREADS, cuda_backend.DECODE_STAGES,
                cuda_backend.DECODE_STAGE_BYTES, cuda_backend.DECODE_MAX_REGISTERS,
                cuda_backend.DECODE_BLOCKS_PER_SM)
    few = cuda_backend.DECODE_FEW_PAIRS_SHAPE
    cuda_backend.DECODE_FEW_PAIRS_SHAPE = None      # each variant's shape at every batch
    times = {v: [] for v in DECODE_VARIANTS}
    res = {}
    for seqs, ctx in DECODE_SHAPES:
        q, kc, vc, bt, lens = decode_case(torch, seqs, ctx)
        out = torch.empty_like(q)
        for v in DECODE_VARIANTS:
            _set_decode(*v)
            call = lambda: gpu_kernels.paged_decode(q, kc, vc, bt, lens, scale, out=out)  # noqa
            times[v].append(timer(call))
            if v not in res:
                res[v] = resources(cuda_backend.last_kernels["decode"], v[0])
        del q, kc, vc, bt, out
        torch.cuda.empty_cache()
    _set_decode(*defaults)
    cuda_backend.DECODE_FEW_PAIRS_SHAPE = few
    print("decode variants: µs at " + ", ".join(f"{s}x{c}" for s, c in DECODE_SHAPES))
    for v in DECODE_VARIANTS:
        kv = [2 * s * c * 8 * 128 * 2 for s, c in DECODE_SHAPES]
        cells = " ".join(f"{t:8.1f}" for t in times[v])
        print(f"  threads={v[0]} stages={v[1]} stage_bytes={v[2]} regs={v[3]} per_sm={v[4]}: "
              f"{cells} | {kv[0] / times[v][0] / 1e6:.2f} TB/s | {res[v]}", flush=True)
    print()


def sweep_prefill(torch, timer, decode_case, scale, fp32_peak):
    import torch.nn.functional as F

    from gpu_kernels.cuda.launch import launcher as get_launcher
    defaults = dict(cuda_backend.PREFILL_MMA_TILES)
    print("tensor-core prefill tiles (fp16): ms at 1x4096, 4x1024, 16x512 (TFLOP/s), max error "
          "vs SDPA")
    cases = []
    for seqs, prompt in [(1, 4096), (4, 1024), (16, 512)]:
        q, kc, vc, bt, lens = decode_case(torch, seqs, prompt)
        q = torch.randn(seqs * prompt, 32, 128, dtype=torch.float16, device="cuda")
        qsl = torch.arange(0, seqs + 1, dtype=torch.int32, device="cuda") * prompt
        flops = cuda_backend.prefill_flops([prompt] * seqs, [prompt] * seqs, 32, 128)
        q4 = q.reshape(seqs, prompt, 32, 128).transpose(1, 2)
        ref = F.scaled_dot_product_attention(q4, contiguous(torch, kc, bt),
                                             contiguous(torch, vc, bt), is_causal=True,
                                             enable_gqa=True)
        ref = ref.transpose(1, 2).reshape(seqs * prompt, 32, 128).float()
        cases.append((q, kc, vc, bt, qsl, lens, torch.empty_like(q), flops, ref))
    for tile in PREFILL_VARIANTS:
        cuda_backend.PREFILL_MMA_TILES[128] = tile
        threads = 32 * tile[0]
        cells, err = [], 0.0
        try:
            for q, kc, vc, bt, qsl, lens, out, flops, ref in cases:
                call = lambda: gpu_kernels.paged_prefill(q, kc, vc, bt, qsl, lens, scale,  # noqa
                                                         out=out)
                out.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                err = max(err, (out.float() - ref).abs().max().item())
                ms = timer(call, reps=5) / 1e3
                cells.append(f"{ms:.3f} ({flops / ms / 1e9:.0f})")
            kernel = cuda_backend.last_kernels["prefill"]
            info = resources(kernel, threads, get_launcher(kernel).shared)
        except Exception as exc:                            # noqa: BLE001 - report, go on
            info = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
        print(f"  {tile}: {' '.join(cells)} err {err:.1e} "
              f"| {info}", flush=True)
    cuda_backend.PREFILL_MMA_TILES.clear()
    cuda_backend.PREFILL_MMA_TILES.update(defaults)
    print()


#: decode split rule: (DECODE_MERGE_SPLITS, DECODE_MIN_CHUNK, DECODE_LONG_SHARE); min chunk 0:
#: no rule; (32, 256, 1.0): the rule before the long-split share
SPLIT_RULES = [(32, 0, 1.0), (32, 256, 1.0), (16, 256, 1.0), (16, 256, 0.5), (16, 128, 0.5),
               (16, 256, 0.25)]
SPLIT_SHAPES = [(1, 512), (1, 2048), (1, 8192), (1, 16384), (1, 32768), (4, 8192), (4, 32768)]


def sweep_split_rule(torch, timer, decode_case, scale):
    """Decode µs per split rule at few sequences and long contexts, SDPA beside (same run)."""
    names = ("DECODE_MERGE_SPLITS", "DECODE_MIN_CHUNK", "DECODE_LONG_SHARE")
    defaults = [getattr(cuda_backend, n) for n in names]
    print("decode split rule (merge splits, min chunk, long share): µs per call; SDPA µs; "
          "default's / SDPA, best's / SDPA")
    try:
        for seqs, ctx in SPLIT_SHAPES:
            q, kc, vc, bt, lens = decode_case(torch, seqs, ctx)
            out = torch.empty_like(q)
            call = lambda: gpu_kernels.paged_decode(q, kc, vc, bt, lens, scale, out=out)  # noqa
            for n, v in zip(names, defaults):
                setattr(cuda_backend, n, v)
            default = min(timer(call), timer(call))
            cells = []
            for rule in SPLIT_RULES:
                for n, v in zip(names, rule):
                    setattr(cuda_backend, n, v)
                cells.append(min(timer(call), timer(call)))
            sdpa = sdpa_decode(torch, q, kc, vc, bt)
            peer = min(timer(sdpa) for _ in range(2))
            row = " ".join(f"{r}:{t:.1f}" for r, t in zip(SPLIT_RULES, cells))
            print(f"  {seqs}x{ctx}: default {default:.1f} | {row} | SDPA {peer:.1f} | "
                  f"{peer / default:.2f}x, {peer / min(cells):.2f}x", flush=True)
            del q, kc, vc, bt, out, sdpa
            torch.cuda.empty_cache()
    finally:
        for n, v in zip(names, defaults):
            setattr(cuda_backend, n, v)
    print()


#: decode stage on tensor cores vs CUDA cores: (decode_mma_mode, blocks per SM aimed at, ring
#: stages, shape with few (sequence, head block) pairs (None: the same), evict_first up to
#: this many times the L2 size (0: never))
DECODE_MMA_VARIANTS = [("off", 4, 2, None, 0), ("auto", 4, 2, None, 0),
                       ("auto", 4, 2, (256, 3, 1), 0), ("auto", 4, 2, (256, 3, 1), 4),
                       ("auto", 4, 2, (256, 4, 1), 4)]
DECODE_MMA_SHAPES = [(1, 2048), (1, 8192), (1, 16384), (1, 32768), (4, 8192), (16, 512),
                     (16, 2048), (16, 8192), (64, 512), (64, 2048), (64, 8192)]


def sweep_decode_mma(torch, timer, decode_case, scale):
    """Decode µs per variant (tensor-core stage or not, register cap, blocks per SM, stages,
    stages with few sequences),
    SDPA beside and each variant's max error vs SDPA, same run."""
    names = ("decode_mma_mode", "DECODE_BLOCKS_PER_SM", "DECODE_STAGES",
             "DECODE_FEW_PAIRS_SHAPE", "DECODE_EVICT_FIRST_L2")
    defaults = [getattr(cuda_backend, n) for n in names]
    print("decode stage variants (mode, blocks/SM aimed at, stages, (threads, stages, blocks/SM) "
          "with few (sequence, head block) pairs, evict_first up to x L2): µs per call "
          "(x SDPA), max error vs SDPA")
    res = {}
    try:
        for seqs, ctx in DECODE_MMA_SHAPES:
            q, kc, vc, bt, lens = decode_case(torch, seqs, ctx)
            out = torch.empty_like(q)
            sdpa = sdpa_decode(torch, q, kc, vc, bt)
            peer = min(timer(sdpa), timer(sdpa))
            ref = sdpa().squeeze(2).float()
            cells = []
            for v in DECODE_MMA_VARIANTS:
                for n, x in zip(names, v):
                    setattr(cuda_backend, n, x)
                call = lambda: gpu_kernels.paged_decode(q, kc, vc, bt, lens, scale, out=out)  # noqa
                try:
                    out.fill_(float("nan"))
                    call()
                    torch.cuda.synchronize()
                except Exception as exc:                    # noqa: BLE001 - report, go on
                    cells.append(f"{v}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                err = (out.float() - ref).abs().max().item()
                t = min(timer(call), timer(call))
                cells.append(f"{v}: {t:.1f} ({peer / t:.2f}x) err {err:.1e}")
                if v not in res:
                    res[v] = resources(cuda_backend.last_kernels["decode"],
                                       cuda_backend.last_kernels["decode_threads"])
            print(f"  {seqs}x{ctx}: SDPA {peer:.1f} | " + " | ".join(cells), flush=True)
            del q, kc, vc, bt, out, sdpa
            torch.cuda.empty_cache()
    finally:
        for n, x in zip(names, defaults):
            setattr(cuda_backend, n, x)
    for v in DECODE_MMA_VARIANTS:
        print(f"  {v}: {res.get(v)}")
    print()


#: decode at large KV: each variant a dict of ``cuda_backend`` tunables (L2 qualifiers of
#: the K/V copies, split-K aim, block shape) over the defaults
DECODE_LARGE_VARIANTS = [
    {},
    {"DECODE_FEW_PAIRS_SHAPE": None},
    {"DECODE_FEW_PAIRS_SHAPE": (256, 4, 1)},
    {"DECODE_EVICT_FIRST_L2": 4},
    {"DECODE_L2_HINT": ("L2::128B",)},
]
DECODE_LARGE_SHAPES = [(16, 8192), (64, 2048), (64, 8192), (16, 2048), (1, 8192), (1, 32768),
                       (64, 512), (16, 512)]


def _label(variant):
    return ", ".join(f"{k.replace('DECODE_', '').lower()}={v}" for k, v in variant.items()) \
        or "defaults"


def sweep_decode_large(torch, timer, decode_case, scale, rounds=2,
                       variants=DECODE_LARGE_VARIANTS, shapes=DECODE_LARGE_SHAPES):
    """Decode µs per variant at large KV, SDPA timed before and after them (same run), each
    variant's max error vs SDPA; ``rounds`` passes over the variants per shape (drift)."""
    names = sorted({k for v in variants for k in v})
    defaults = {n: getattr(cuda_backend, n) for n in names}
    print("decode variants at large KV: µs per call (x SDPA) per round, max error vs SDPA")
    res = {}
    try:
        for seqs, ctx in shapes:
            q, kc, vc, bt, lens = decode_case(torch, seqs, ctx)
            out = torch.empty_like(q)
            sdpa = sdpa_decode(torch, q, kc, vc, bt)
            peer = [min(timer(sdpa), timer(sdpa))]
            ref = sdpa().squeeze(2).float()
            call = lambda: gpu_kernels.paged_decode(q, kc, vc, bt, lens, scale, out=out)  # noqa
            cells = {i: [] for i in range(len(variants))}
            errs = {}
            for _ in range(rounds):
                for i, v in enumerate(variants):
                    for n in names:
                        setattr(cuda_backend, n, v.get(n, defaults[n]))
                    try:
                        if i not in errs:
                            out.fill_(float("nan"))
                            call()
                            torch.cuda.synchronize()
                            errs[i] = (out.float() - ref).abs().max().item()
                            res.setdefault(i, resources(
                                cuda_backend.last_kernels["decode"],
                                cuda_backend.last_kernels["decode_threads"]))
                        cells[i].append(min(timer(call), timer(call)))
                    except Exception as exc:                # noqa: BLE001 - report, go on
                        errs[i] = f"FAILED {type(exc).__name__}: {str(exc)[:200]}"
            peer.append(min(timer(sdpa), timer(sdpa)))
            p = min(peer)
            print(f"  {seqs}x{ctx}: SDPA {peer[0]:.1f} / {peer[1]:.1f}", flush=True)
            for i, v in enumerate(variants):
                ts = " / ".join(f"{t:.1f} ({p / t:.3f}x)" for t in cells[i])
                e = errs.get(i)
                print(f"    {_label(v)}: {ts} err {e if isinstance(e, str) else f'{e:.1e}'}",
                      flush=True)
            del q, kc, vc, bt, out, sdpa
            torch.cuda.empty_cache()
    finally:
        for n in names:
            setattr(cuda_backend, n, defaults[n])
    for i, v in enumerate(variants):
        print(f"  {_label(v)}: {res.get(i)}")
    print()


#: decode shapes of ``sweep_decode_versions``: large K/V first, then short calls
DECODE_VERSION_SHAPES = [(16, 8192), (64, 2048), (64, 8192), (16, 2048), (1, 8192), (64, 512),
                         (1, 32768), (16, 512), (1, 2048)]


def sweep_decode_versions(torch, timer, decode_case, scale, packages, rounds=3,
                          shapes=DECODE_VERSION_SHAPES):
    """Decode µs of several versions of the kernels on the same data, SDPA before and after.

    ``packages``: importable names of copies of ``gpu_kernels`` (e.g. another commit's
    ``gpu_kernels`` copied to ``gk_main/``); ``rounds`` passes over them per shape, the order
    reversed every other pass (drift). Prints each version's max error vs SDPA and whether
    its output is bit-equal to the first version's."""
    import importlib

    mods = [importlib.import_module(p) for p in packages]
    backends = [importlib.import_module(p + ".cuda.backend") for p in packages]
    print("decode versions: µs per call per round, best (x SDPA), max error vs SDPA, "
          f"bit-equal to {packages[0]}")
    res = {}
    for seqs, ctx in shapes:
        q, kc, vc, bt, lens = decode_case(torch, seqs, ctx)
        sdpa = sdpa_decode(torch, q, kc, vc, bt)
        peer = [min(timer(sdpa), timer(sdpa))]
        ref = sdpa().squeeze(2).float()
        outs = [torch.full_like(q, float("nan")) for _ in packages]
        calls = [lambda m=m, o=o: m.paged_decode(q, kc, vc, bt, lens, scale, out=o)
                 for m, o in zip(mods, outs)]
        for k, call in enumerate(calls):
            call()
            torch.cuda.synchronize()
            threads = backends[k].last_kernels["decode_threads"]
            res.setdefault((k, threads), resources(backends[k].last_kernels["decode"], threads))
        times = [[] for _ in packages]
        for r in range(rounds):
            order = range(len(packages)) if r % 2 == 0 else reversed(range(len(packages)))
            for k in order:
                times[k].append(min(timer(calls[k]), timer(calls[k])))
        peer.append(min(timer(sdpa), timer(sdpa)))
        p = min(peer)
        print(f"  {seqs}x{ctx}: SDPA {peer[0]:.1f} / {peer[1]:.1f}", flush=True)
        for k, name in enumerate(packages):
            err = (outs[k].float() - ref).abs().max().item()
            ts = " / ".join(f"{t:.1f}" for t in times[k])
            best = min(times[k])
            print(f"    {name}: {ts} | best {best:.1f} ({p / best:.3f}x) | err {err:.1e} | "
                  f"{torch.equal(outs[k], outs[0])}", flush=True)
        del q, kc, vc, bt, sdpa, outs, calls
        torch.cuda.empty_cache()
    for (k, threads), used in sorted(res.items()):
        print(f"  {packages[k]}, {threads} threads: {used}")
    print()


def sweep_table_orders(torch, timer, scale, path, rounds=3):
    """Decode µs of the same sequences read through three kinds of block table, on one cache of
    the engine pool's size: shuffled (the benchmark's table), each sequence's blocks in order,
    and the tables the engine's scheduler and block pool handed out under traffic
    (``benchmarks.engine_tables``); SDPA on the contiguous copy before and after."""
    import numpy as np

    import gpu_kernels

    saved = np.load(path)
    print(f"decode by block-table order ({path}): µs per call, best of {rounds} rounds (x SDPA)")
    print("| batch x context | pool blocks | SDPA | shuffled | in order | engine's tables |")
    print("|---|---|---|---|---|---|")
    for key in sorted(k for k in saved.files if k.startswith("tables_")):
        shape = key.removeprefix("tables_")
        engine = saved[key]
        num_blocks = int(saved[f"blocks_{shape}"])
        seqs, per_seq = engine.shape
        ctx = per_seq * 16
        kc = torch.randn(num_blocks, 8, 16, 128, dtype=torch.float16, device="cuda")
        vc = torch.randn_like(kc)
        q = torch.randn(seqs, 32, 128, dtype=torch.float16, device="cuda")
        lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
        tables = {
            "shuffled": torch.randperm(num_blocks, device="cuda", dtype=torch.int32)[:seqs * per_seq],
            "in order": torch.arange(seqs * per_seq, device="cuda", dtype=torch.int32),
            "engine's tables": torch.from_numpy(engine.astype(np.int32)).cuda(),
        }
        tables = {k: t.reshape(seqs, per_seq).contiguous() for k, t in tables.items()}
        sdpa = sdpa_decode(torch, q, kc, vc, tables["engine's tables"])
        ref = sdpa().squeeze(2).float()
        peer = [min(timer(sdpa), timer(sdpa))]
        out = torch.empty_like(q)
        times = {k: [] for k in tables}
        for r in range(rounds):
            for name in (list(tables) if r % 2 == 0 else list(tables)[::-1]):
                bt = tables[name]
                call = lambda bt=bt: gpu_kernels.paged_decode(q, kc, vc, bt, lens, scale, out=out)  # noqa
                times[name].append(min(timer(call), timer(call)))
        gpu_kernels.paged_decode(q, kc, vc, tables["engine's tables"], lens, scale, out=out)
        err = (out.float() - ref).abs().max().item()
        peer.append(min(timer(sdpa), timer(sdpa)))
        p = min(peer)
        cells = " | ".join(f"{min(t):.1f} ({p / min(t):.3f}x)" for t in times.values())
        print(f"| {seqs} x {ctx} | {num_blocks} | {peer[0]:.1f} / {peer[1]:.1f} | {cells} |"
              f"  (engine's tables vs SDPA: max err {err:.1e})", flush=True)
        del kc, vc, q, sdpa, out, tables
        torch.cuda.empty_cache()
    print()


PAGE_LAYOUT_SHAPES = [(16, 8192), (64, 2048), (64, 8192), (16, 2048)]
PAGE_SIZES = (16, 32, 64)


def _page_order(torch, order, num_blocks, block_size):
    """Block ids for the tables: shuffled over the whole cache, shuffled only within 2 MB of K
    (the pages a sequence reads stay near each other: one GPU page of 2 MB holds them), in order."""
    if order == "in order":
        return torch.arange(num_blocks, device="cuda", dtype=torch.int32)
    if order == "shuffled":
        return torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    per_window = max(1, (2 << 20) // (8 * block_size * 128 * 2))       # blocks of 8 KV heads x d 128, fp16
    ids = torch.arange(num_blocks, device="cuda", dtype=torch.int32).reshape(-1, per_window)
    return torch.gather(ids, 1, torch.argsort(torch.rand(ids.shape, device="cuda"), dim=1)).reshape(-1)


def sweep_page_layouts(torch, timer, decode_case, scale, rounds=3):
    """Decode µs by page size (the cache's block size: 16 tokens = 4 KB per KV head, 64 = 16 KB)
    and page order (shuffled over the cache, shuffled within 2 MB, in order), SDPA on the
    contiguous copy in every round: where a paged decode's gap to a contiguous one comes from."""
    import gpu_kernels

    orders = ("shuffled", "within 2 MB", "in order")
    print(f"decode by page size and order: µs per call, best of {rounds} rounds (x SDPA)")
    print("| batch x context | block size | SDPA | " + " | ".join(orders) + " |")
    print("|---|---|---|" + "---|" * len(orders))
    for seqs, ctx in PAGE_LAYOUT_SHAPES:
        for block_size in PAGE_SIZES:
            q, kc, vc, _, lens = decode_case(torch, seqs, ctx, block_size=block_size)
            tables = {o: _page_order(torch, o, kc.shape[0], block_size).reshape(seqs, -1).contiguous()
                      for o in orders}
            out = torch.empty_like(q)
            times = {o: [] for o in orders}
            peer = []
            for r in range(rounds):
                for order in (orders if r % 2 == 0 else orders[::-1]):
                    bt = tables[order]
                    times[order].append(timer(lambda: gpu_kernels.paged_decode(q, kc, vc, bt, lens, scale, out=out)))
                sdpa = sdpa_decode(torch, q, kc, vc, tables["in order"])
                peer.append(timer(sdpa))
                del sdpa
            p = min(peer)
            cells = " | ".join(f"{min(t):.1f} ({p / min(t):.3f}x)" for t in times.values())
            print(f"| {seqs} x {ctx} | {block_size} | {p:.1f} | {cells} |", flush=True)
            del q, kc, vc, tables
            torch.cuda.empty_cache()
