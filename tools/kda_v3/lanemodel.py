# kda_v3/lanemodel.py: the lane-level model lanes.py and lanes_bwd.py check the tensor-core KDA
# kernels' fragment code with: bf16 packing, ldmatrix x4 (.trans) and mma.m16n8k16 emulated for 32
# lanes as cuda_common.cuh documents them, the fragment address helpers (adr_a, adr_b_nk, adr_b_kn)
# and acc_to_a (two accumulator n-tiles as one A fragment). Imported by those scripts.
import numpy as np
def bfbits(x):
    u=np.asarray(x,np.float32).view(np.uint32).astype(np.uint64)
    return (((u+0x7FFF+((u>>16)&1))>>16)&0xFFFF).astype(np.uint16)
def bits2f(b): return (np.asarray(b,np.uint32)<<16).view(np.float32)
def pack(lo,hi): return (int(bfbits(lo)), int(bfbits(hi)))  # (low half, high half) as a pair
# smem: flat uint16 array; address = element index
def ldsm_x4(sm, addr, trans=False):
    # addr[l] = element index of row l%8 of matrix l//8 (8 consecutive b16)
    out=[[None]*4 for _ in range(32)]
    for mi in range(4):
        rows=[sm[addr[mi*8+r]:addr[mi*8+r]+8] for r in range(8)]
        M=np.array(rows)  # 8x8
        for lane in range(32):
            g,t=lane>>2,lane&3
            if not trans: out[lane][mi]=(M[g,2*t],M[g,2*t+1])
            else: out[lane][mi]=(M[2*t,g],M[2*t+1,g])
    return out
def mma(C,A,B):
    # C[lane] list of 4 floats; A[lane] 4 pairs; B[lane] 2 pairs. Build full matrices, multiply, scatter.
    Am=np.zeros((16,16)); Bm=np.zeros((16,8)); Cm=np.zeros((16,8))
    for lane in range(32):
        g,t=lane>>2,lane&3
        a=A[lane]
        for (r,c0),p in zip([(g,2*t),(g+8,2*t),(g,2*t+8),(g+8,2*t+8)],a):
            Am[r,c0]=bits2f(p[0]); Am[r,c0+1]=bits2f(p[1])
        b=B[lane]
        for k0,p in zip([2*t,2*t+8],b):
            Bm[k0,g]=bits2f(p[0]); Bm[k0+1,g]=bits2f(p[1])
        c=C[lane]; Cm[g,2*t]=c[0];Cm[g,2*t+1]=c[1];Cm[g+8,2*t]=c[2];Cm[g+8,2*t+1]=c[3]
    D=(Cm+Am@Bm).astype(np.float32)
    return [[D[l>>2,2*(l&3)],D[l>>2,2*(l&3)+1],D[(l>>2)+8,2*(l&3)],D[(l>>2)+8,2*(l&3)+1]] for l in range(32)]
def adr_a(base,ld,k0): return [base+(l&15)*ld+k0+((l>>4)<<3) for l in range(32)]
def adr_b_nk(base,ld,k0,n0): return [base+(n0+(l&7)+((l>>4)<<3))*ld+k0+(((l>>3)&1)<<3) for l in range(32)]
def adr_b_kn(base,ld,k0,n0): return [base+(k0+(l&7)+(((l>>3)&1)<<3))*ld+n0+((l>>4)<<3) for l in range(32)]

def acc_to_a(c0,c1): return [pack(c0[0],c0[1]),pack(c0[2],c0[3]),pack(c1[0],c1[1]),pack(c1[2],c1[3])]
