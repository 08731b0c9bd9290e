# kda_v3/lanemodel.py: the lane-level model lanes.py and lanes_bwd.py check the tensor-core KDA
# kernels' fragment code with: bf16 packing, ldmatrix x4 (.trans) and mma.m16n8k16 emulated for 32
# lanes as cuda_common.cuh documents them, the fragment address helpers (adr_a, adr_b_nk, adr_b_kn)
# and acc_to_a (two accumulator n-tiles as one A fragment); the tile record both state passes read
# (draw_record, record_offsets, put_record) and a warp's state columns as accumulators and back
# (state_frags, scale_frags: diag(e^γ), frags_matrix). Imported by those scripts.
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

# ---- the tile record and the state fragments both state passes read (kda3_state_k, kda3_state_bwd_k)
def draw_record(rng,K):
    # −W, Q⁺, K^e [16][K] and P (lower triangle) [16][16], drawn in this order
    Wn=rng.standard_normal((16,K)).astype(np.float32); Qp=rng.standard_normal((16,K)).astype(np.float32)
    Ke=rng.standard_normal((16,K)).astype(np.float32); P=np.tril(rng.standard_normal((16,16))).astype(np.float32)
    return Wn,Qp,Ke,P
def record_offsets(LD):
    # element offsets (b16 units) of −W, Q⁺, K^e (16 rows of stride LD each) and P in a stage, as StCfg
    return 0,16*LD,2*16*LD,3*16*LD
def put_record(sm,LD,LDP,Wn,Qp,Ke,P):
    SW,SQ,SE,SP=record_offsets(LD); K=Wn.shape[1]
    for r in range(16):
        sm[SW+r*LD:SW+r*LD+K]=bfbits(Wn[r]); sm[SQ+r*LD:SQ+r*LD+K]=bfbits(Qp[r]); sm[SE+r*LD:SE+r*LD+K]=bfbits(Ke[r])
        sm[SP+r*LDP:SP+r*LDP+16]=bfbits(P[r])
def state_frags(S,j0):
    # a warp's 16 columns j0.. of a [K][V] state as accumulators: st[lane][n-tile][c] = S[8nd+2t+(c&1), j0+g+8(c>>1)]
    st=[[[0.0]*4 for _ in range(16)] for _ in range(32)]
    for l in range(32):
        g,t=l>>2,l&3
        for nd in range(16):
            for c in range(4): st[l][nd][c]=S[8*nd+2*t+(c&1), j0+g+8*(c>>1)]
    return st
def scale_frags(st,eg):
    # st ← diag(e^γ) st, row d = 8nd + 2t + (c&1)
    for l in range(32):
        t=l&3
        for nd in range(16):
            st[l][nd][0]*=eg[8*nd+2*t]; st[l][nd][1]*=eg[8*nd+2*t+1]; st[l][nd][2]*=eg[8*nd+2*t]; st[l][nd][3]*=eg[8*nd+2*t+1]
def frags_matrix(st,K):
    # the inverse of state_frags: [K][16]
    M=np.zeros((K,16))
    for l in range(32):
        g,t=l>>2,l&3
        for nd in range(16):
            for c in range(4): M[8*nd+2*t+(c&1), g+8*(c>>1)]=st[l][nd][c]
    return M
