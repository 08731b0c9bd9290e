"""torch._grouped_mm at the shapes and row counts of `mtrl bench ops --device cuda --only moe`.

The grouped-experts rows of that benchmark (kernels/lab/bench_cuda.cu bench_moe_grouped): 64
experts, 16, 128, 1024 and 8192 rows per expert, balanced and skewed (expert e gets
floor(R (e + 1) / (E (E + 1) / 2)) rows, the last expert the remainder: the same offsets as the
benchmark, so at 16 rows the first experts get none), one grouped GEMM X [R][K] x W[e] -> [R][N],
bf16, at small's shape (K = d = 1024, N = I = 512) and the anchor's (K = 2048, N = 1024). Times
with CUDA events (median of repeats after warm-up) and prints one TFLOP/s line per case, for the
weights as (E, K, N) contiguous (anchors_gpu.py's layout) and as (E, N, K) transposed (a Linear
layout, as mtrl stores them); the JSON (--json) keeps the faster of the two under the key the
benchmark's --anchors lines read: grouped_mm_E{E}_K{K}_N{N}_rows{rows}_{balanced|skewed}_tflops.
Merge it into the anchors file given to `mtrl bench ops --anchors` (or pass it alone).
"""
import argparse, json


def offsets(E, rows, skewed):
    R = E * rows
    ends, s = [], 0
    for e in range(E):
        s += int(R * (e + 1) / (E * (E + 1) / 2.0)) if skewed else rows
        ends.append(s)
    ends[-1] = R
    return ends


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--json', default='anchors_grouped_mm.json')
    ap.add_argument('--rows', default='16,128,1024,8192')
    ap.add_argument('--shapes', default='1024x512,2048x1024', help='KxN list (K = model width)')
    ap.add_argument('--experts', type=int, default=64)
    ap.add_argument('--reps', type=int, default=10)
    a = ap.parse_args()
    import torch
    assert hasattr(torch, '_grouped_mm'), 'this torch has no torch._grouped_mm'

    def bench(fn, warm=3, rep=a.reps):
        for _ in range(warm): fn()
        torch.cuda.synchronize(); ts = []
        for _ in range(rep):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
        return sorted(ts)[len(ts) // 2]

    E = a.experts
    res = {'device': torch.cuda.get_device_name(), 'torch': torch.__version__}
    print(f"torch._grouped_mm on {res['device']}, torch {res['torch']}, bf16, median of {a.reps}", flush=True)
    for shape in a.shapes.split(','):
        K, N = map(int, shape.split('x'))
        rmax = max(map(int, a.rows.split(',')))
        X = torch.randn(E * rmax, K, device='cuda', dtype=torch.bfloat16)
        W_kn = torch.randn(E, K, N, device='cuda', dtype=torch.bfloat16) * 0.05
        W_nk = torch.randn(E, N, K, device='cuda', dtype=torch.bfloat16) * 0.05
        for rows in map(int, a.rows.split(',')):
            for skewed in (False, True):
                R = E * rows
                offs = torch.tensor(offsets(E, rows, skewed), device='cuda', dtype=torch.int32)
                x = X[:R]
                flop = 2.0 * R * K * N
                best = 0.0
                for lay, W in (('(E,K,N)', W_kn), ('(E,N,K)^T', W_nk.transpose(-2, -1))):
                    try:
                        ms = bench(lambda: torch._grouped_mm(x, W, offs=offs))
                    except Exception as ex:  # a layout or group size this torch refuses
                        print(f'  {lay}: failed: {ex}', flush=True); continue
                    tf = flop / ms / 1e9
                    best = max(best, tf)
                    kind = 'skewed' if skewed else 'balanced'
                    print(f'torch._grouped_mm E={E} {rows}/exp {kind:8s} {K}->{N} W {lay:10s} '
                          f'{ms:9.3f} ms {tf:8.1f} TFLOP/s', flush=True)
                key = f"grouped_mm_E{E}_K{K}_N{N}_rows{rows}_{'skewed' if skewed else 'balanced'}_tflops"
                if best > 0: res[key] = best
        del X, W_kn, W_nk
        torch.cuda.empty_cache()
    json.dump(res, open(a.json, 'w'), indent=1)
    print(f'wrote {a.json}', flush=True)


if __name__ == '__main__':
    main()
