#!/usr/bin/env python3
"""Issue 25's anchors on one NVIDIA GPU, for `mtrl bench ops --anchors FILE` in the same call.

Measured with CUDA events (median of repeats after warm-up), B = 1, bf16:
  * fla: flash-linear-attention `chunk_kda` (Triton; FLA_FLASH_KDA=0), the lower-bounded gate
    (safe_gate, lower_bound = -5; l2norm, gate and beta-sigmoid in the kernel), K = V = 128:
    forward at H = 16 for --kda-T and at --kda-wide-H for --kda-wide-T; forward+backward at
    H = 16 for --kda-fwdbwd-T (a shape that does not fit is recorded as out of memory);
  * FlashKDA (CUTLASS, forward only) on the same inputs at the same forward shapes, and the
    relative difference of its output from fla's;
  * torch SDPA causal, cuDNN and FA2 backends, forward and forward+backward, H = 16, for the MHA
    shape (Dk = Dv = 128) and the naive MLA shape (Dk = 192, Dv = 128, at --naive-H heads). A
    backend that refuses a shape is recorded as such ("<key>_native_error"), then timed with V
    zero-padded to Dk ("<key>_padded": true); FLOPs are always the unpadded shape's.

FLOP convention (the same as kernels/lab/bench_cuda.cu): causal forward T^2 H (Dk + Dv),
forward+backward 3.5x that. Keys, as `mtrl bench ops --anchors` reads them:
  kda_H{H}_T{T}_fwd_ms, kda_H{H}_T{T}_fwdbwd_ms, kda_H{H}_T{T}_fwdbwd_peak_gib  (fla)
  flashkda_H{H}_T{T}_fwd_ms, flashkda_vs_fla_H{H}_T{T}_rel                       (FlashKDA)
  sdpa_{cudnn,fa2}_T{T}_{fwd,fwdbwd}_tflops                                      (MHA, H = 16)
  sdpa_{cudnn,fa2}_naive_H{H}_T{T}_{fwd,fwdbwd}_tflops                           (naive MLA)
and for a measurement that failed, "<key>_error" (text) or "<key>_oom" (true).

The JSON file is read first if it exists and updated (and rewritten after every shape), so the
parts may run in separate processes (--parts) into one file. Sources: FLA_PATH (the directory that
holds the `fla` package), FKDA_PATH (FlashKDA built in place: holds flash_kda and flash_kda_C).
"""
import argparse
import json
import os
import sys
import time


def ints(s):
    return [int(x) for x in s.split(',') if x.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--json', default='anchors25.json', help='file to update (default anchors25.json)')
    ap.add_argument('--parts', default='sdpa,fla,flashkda', help='comma list of: sdpa, fla, flashkda')
    ap.add_argument('--kda-T', default='8192,65536,262144,1048576', help='H = 16 forward lengths')
    ap.add_argument('--kda-fwdbwd-T', default='8192,65536,262144,1048576', help='H = 16 fwd+bwd lengths (fla)')
    ap.add_argument('--kda-wide-H', default='64,96', help='heads of the wide forward rows')
    ap.add_argument('--kda-wide-T', default='8192', help='lengths of the wide forward rows')
    ap.add_argument('--attn-T', default='8192,32768,131072')
    ap.add_argument('--attn-shapes', default='mha,naive')
    ap.add_argument('--naive-H', default='16', help='heads of the naive MLA shape (comma list)')
    ap.add_argument('--reps', type=int, default=10, help='forward repeats (fwd+bwd: half, at least 3)')
    ap.add_argument('--fla-path', default=os.environ.get('FLA_PATH', ''))
    ap.add_argument('--fkda-path', default=os.environ.get('FKDA_PATH', ''))
    a = ap.parse_args()

    import torch
    import torch.nn.functional as F

    res = {}
    if os.path.exists(a.json):
        try:
            res = json.load(open(a.json))
        except Exception as e:  # a file cut by a timeout: start again
            print(f'{a.json}: unreadable ({e!r}); starting a new one', flush=True)
    res['device'] = torch.cuda.get_device_name()
    res['torch'] = torch.__version__
    parts = set(filter(None, a.parts.split(',')))

    def save():
        tmp = a.json + '.tmp'
        with open(tmp, 'w') as f:
            json.dump(res, f, indent=1, sort_keys=True)
        os.replace(tmp, a.json)

    def bench(fn, warm=3, rep=10):
        for _ in range(warm):
            fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(rep):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        return ts[len(ts) // 2]

    def fail(key, e):
        if isinstance(e, torch.OutOfMemoryError):
            res[key + '_oom'] = True
            msg = 'out of memory'
        else:
            res[key + '_error'] = (type(e).__name__ + ': ' + str(e)).replace('\n', ' ')[:300]
            msg = res[key + '_error']
        res.pop(key, None)
        print(f'  {key}: {msg}', flush=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def ok(key, val):
        res[key] = val
        for suf in ('_error', '_oom'):
            res.pop(key + suf, None)

    reps, reps_b = max(1, a.reps), max(3, a.reps // 2)

    # ---- SDPA (runs first in tools/gpu_issue25.sh, beside FlashKDA's build) ---------------------
    if 'sdpa' in parts:
        from torch.nn.attention import sdpa_kernel, SDPBackend
        shapes = []
        if 'mha' in a.attn_shapes:
            shapes.append(('', 16, 128, 128))
        if 'naive' in a.attn_shapes:
            shapes += [('_naive_H%d' % h, h, 192, 128) for h in ints(a.naive_H)]
        for T in ints(a.attn_T):
            for tag, H, Dk, Dv in shapes:
                torch.cuda.empty_cache()
                mk = lambda d: torch.randn(1, H, T, d, device='cuda', dtype=torch.bfloat16, requires_grad=True)
                q, k, v = mk(Dk), mk(Dk), mk(Dv)
                do = torch.randn(1, H, T, Dv, device='cuda', dtype=torch.bfloat16)
                fl = float(T) * T * H * (Dk + Dv)
                vpad = dopad = None
                for name, be in (('cudnn', SDPBackend.CUDNN_ATTENTION), ('fa2', SDPBackend.FLASH_ATTENTION)):
                    base = f'sdpa_{name}{tag}_T{T}'
                    def timed(kind, padded):
                        vv, dd = (vpad, dopad) if padded else (v, do)
                        def f():
                            with torch.no_grad():
                                F.scaled_dot_product_attention(q, k, vv, is_causal=True)
                        def fb():
                            o = F.scaled_dot_product_attention(q, k, vv, is_causal=True)
                            torch.autograd.grad(o, (q, k, vv), dd)
                        with sdpa_kernel(be):
                            return bench(f, 3, reps) if kind == 'fwd' else bench(fb, 2, reps_b)
                    for kind, cnt in (('fwd', 1.0), ('fwdbwd', 3.5)):
                        key = f'{base}_{kind}_tflops'
                        for suf in ('_native_error', '_padded'):
                            res.pop(key + suf, None)
                        padded = False
                        try:
                            ms = timed(kind, False)
                        except Exception as e:
                            if Dv == Dk:
                                fail(key, e)
                                continue
                            res[key + '_native_error'] = (type(e).__name__ + ': ' + str(e)).replace('\n', ' ')[:300]
                            print(f'  {key}: Dk != Dv refused: {res[key + "_native_error"]} (next: V padded to Dk)', flush=True)
                            torch.cuda.synchronize()
                            torch.cuda.empty_cache()
                            if vpad is None:
                                vpad = F.pad(v.detach(), (0, Dk - Dv)).requires_grad_(True)
                                dopad = F.pad(do, (0, Dk - Dv))
                            padded = True
                            try:
                                ms = timed(kind, True)
                            except Exception as e2:
                                fail(key, e2)
                                continue
                        ok(key, cnt * fl / ms / 1e9)
                        res[key[:-len('_tflops')] + '_ms'] = ms
                        if padded:
                            res[key + '_padded'] = True
                        print(f'SDPA {name} H{H} Dk{Dk} Dv{Dv} T{T} {kind}: {ms:.3f} ms = {res[key]:.0f} TFLOP/s'
                              f'{" (V padded to Dk)" if padded else ""}', flush=True)
                        save()
                del q, k, v, do, vpad, dopad
        save()

    # ---- fla chunk_kda and FlashKDA (same inputs) ----------------------------------------------
    if 'fla' in parts or 'flashkda' in parts:
        os.environ.setdefault('FLA_FLASH_KDA', '0')  # fla's own Triton kernels, not its FlashKDA dispatch
        def load(path, name, what):  # the module from the carried source tree, its COMMIT file recorded
            if path:
                sys.path.insert(0, path)
            try:
                import importlib
                mod = importlib.import_module(name)
            except Exception as e:
                res[what + '_error'] = 'import failed: ' + repr(e)[:300]
                print(f'{name} import failed:', res[what + '_error'], flush=True)
                return None
            res.pop(what + '_error', None)
            try:
                res[what + '_commit'] = open(os.path.join(path, 'COMMIT')).read().strip()
            except OSError:
                pass
            return mod
        kda_mod = load(a.fla_path, 'fla.ops.kda', 'fla') if 'fla' in parts else None
        chunk_kda = kda_mod.chunk_kda if kda_mod is not None else None
        fk = load(a.fkda_path, 'flash_kda', 'flashkda') if 'flashkda' in parts else None
        K = 128
        shapes = [(T, 16) for T in ints(a.kda_T)] + [(T, H) for H in ints(a.kda_wide_H) for T in ints(a.kda_wide_T)]
        fb_T = set(ints(a.kda_fwdbwd_T))
        # 8K first: fla's Triton autotuning is paid on the smallest shape
        for T, H in sorted(shapes, key=lambda s: (s[1] != 16, s[0])):
            torch.cuda.empty_cache()
            t0 = time.time()
            dev = 'cuda'
            q = F.normalize(torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16).float(), dim=-1).bfloat16()
            k = F.normalize(torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16).float(), dim=-1).bfloat16()
            v = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16)
            g = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16)
            beta = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16)
            A_log = torch.rand(H, device=dev)
            dt_bias = torch.rand(H, K, device=dev)
            scale = K ** -0.5
            kw = dict(A_log=A_log, dt_bias=dt_bias.flatten(), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, scale=scale)
            sh = f'H{H}_T{T}'
            o_fla = o_fk = None
            if chunk_kda is not None:
                key = f'kda_{sh}_fwd_ms'
                def fla_fwd():
                    with torch.inference_mode():
                        return chunk_kda(q, k, v, g, beta, **kw)
                try:
                    ok(key, bench(fla_fwd, 3, reps))
                    print(f'fla chunk_kda {sh} fwd: {res[key]:.3f} ms = {T / res[key] / 1e3:.1f} Mtok/s', flush=True)
                    if fk is not None:
                        o_fla = fla_fwd()[0]
                except Exception as e:
                    fail(key, e)
                save()
            if fk is not None:
                key = f'flashkda_{sh}_fwd_ms'
                out = torch.zeros_like(v)
                try:
                    ok(key, bench(lambda: fk.fwd(q, k, v, g, beta, scale, out, A_log=A_log, dt_bias=dt_bias,
                                                 lower_bound=-5.0), 3, reps))
                    print(f'FlashKDA {sh} fwd: {res[key]:.3f} ms = {T / res[key] / 1e3:.1f} Mtok/s', flush=True)
                    o_fk = out
                except Exception as e:
                    fail(key, e)
                if o_fla is not None and o_fk is not None:
                    rel = float((o_fk.float() - o_fla.float()).norm() / o_fla.float().norm())
                    res[f'flashkda_vs_fla_{sh}_rel'] = rel
                    print(f'  FlashKDA vs fla output: {rel:.2e} relative', flush=True)
                del out
                save()
            elif 'flashkda' in parts:
                res[f'flashkda_{sh}_fwd_ms_error'] = res.get('flashkda_error', 'not built')
            o_fla = o_fk = None
            del q, k, v, g, beta
            if chunk_kda is not None and H == 16 and T in fb_T:
                torch.cuda.empty_cache()
                key = f'kda_{sh}_fwdbwd_ms'
                try:
                    mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16).requires_grad_(True)
                    q, k, v, g = mk(1, T, H, K), mk(1, T, H, K), mk(1, T, H, K), mk(1, T, H, K)
                    beta = mk(1, T, H)
                    kwb = dict(kw, A_log=torch.zeros(H, device=dev), dt_bias=torch.zeros(H * K, device=dev))
                    do = torch.randn(1, T, H, K, device=dev, dtype=torch.bfloat16)
                    def fb():
                        o, _ = chunk_kda(q, k, v, g, beta, **kwb)
                        torch.autograd.grad(o, (q, k, v, g, beta), do)
                    torch.cuda.reset_peak_memory_stats()
                    ms = bench(fb, 2, reps_b)
                    ok(key, ms)
                    res[f'kda_{sh}_fwdbwd_peak_gib'] = torch.cuda.max_memory_allocated() / 2**30
                    print(f'fla chunk_kda {sh} fwd+bwd: {ms:.3f} ms = {T / ms / 1e3:.2f} Mtok/s, '
                          f'peak {res[f"kda_{sh}_fwdbwd_peak_gib"]:.1f} GiB', flush=True)
                except Exception as e:
                    res[f'kda_{sh}_fwdbwd_peak_gib_at_failure'] = torch.cuda.max_memory_allocated() / 2**30
                    fail(key, e)
                q = k = v = g = beta = do = None
                save()
            print(f'  ({sh}: {time.time() - t0:.0f} s with compilation and autotuning)', flush=True)
    save()
    print(f'wrote {a.json}: {len(res)} keys', flush=True)


if __name__ == '__main__':
    main()
