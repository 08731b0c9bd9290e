# kda_v3/lanes_bwd.py: lanes.py's lane-level model (ldmatrix x4 / .trans and mma.m16n8k16 emulated
# for 32 lanes as cuda_common.cuh documents them) applied to the backward state-gradient step of
# kernels/cuda/kda/chunk_mma_bwd.cu (kda3_state_bwd_k, WPB = 2, block 1, both warps; the hi parts
# only: the lo parts take the same addresses plus a constant offset). The kernel's index
# expressions are transcribed and compared with the same step as whole matrices with the same bf16
# roundings: dΔ = K^e dS + Pᵀ dO, dS' = diag(e^γ) dS + Q⁺ᵀ dO + (−W)ᵀ dΔ. Errors at fp32 rounding
# (~1e-7 relative) mean the index expressions agree with the algebra; a layout mistake gives O(1).
# Then kda/chunk_simt.cu's smm16_tc (pass 3's products on tensor cores, kda_bwd_tile = auto) the same way.
# usage: python3 tools/kda_v3/lanes_bwd.py   (numpy; a few seconds)
import numpy as np
rng=np.random.default_rng(5)
from lanemodel import (bfbits, bits2f, pack, ldsm_x4, mma, adr_b_nk, adr_b_kn, acc_to_a, draw_record, record_offsets,
                       put_record, state_frags, scale_frags, frags_matrix)
K=V=128; LD=K+8; LDP=24; WPB=2; LDO=16*WPB+4
Wn,Qp,Ke,P=draw_record(rng,K)
dO=rng.standard_normal((16,V)).astype(np.float32); eg=rng.random(K).astype(np.float32)
dS=rng.standard_normal((K,V)).astype(np.float32)
bq=lambda x: bits2f(bfbits(x)).astype(np.float64)
SW,SQ,SE,SP=record_offsets(LD)
sm=np.zeros(SP+16*LDP,np.uint16)
put_record(sm,LD,LDP,Wn,Qp,Ke,P)
jb=16*WPB*1  # blockIdx.x = 1
sO=np.zeros(16*LDO,np.float32)
for r in range(16): sO[r*LDO:r*LDO+16*WPB]=dO[r,jb:jb+16*WPB]
err=[]
for w in range(WPB):
    jw=16*w; j0=jb+jw
    st=state_frags(dS,j0)
    # dOᵀ A fragments: r = 0..3, l = 2t + 8 (r >> 1), j = jw + g + 8 (r & 1)
    oh=[]
    for l in range(32):
        g,t=l>>2,l&3; a=[]
        for r in range(4):
            ll=2*t+8*(r>>1); j=jw+g+8*(r&1)
            a.append(pack(sO[ll*LDO+j], sO[(ll+1)*LDO+j]))
        oh.append(a)
    z=lambda: [[0.0]*4 for _ in range(32)]
    dl=[z(),z()]; dx=[z(),z()]
    for kd in range(8):
        A=[acc_to_a(st[l][2*kd],st[l][2*kd+1]) for l in range(32)]
        b=ldsm_x4(sm,adr_b_nk(SE,LD,16*kd,0))
        acc=dx if kd&1 else dl
        acc[0]=mma(acc[0],A,[x[0:2] for x in b]); acc[1]=mma(acc[1],A,[x[2:4] for x in b])
    bp=ldsm_x4(sm,adr_b_kn(SP,LDP,0,0),trans=True)
    dx[0]=mma(dx[0],oh,[x[0:2] for x in bp]); dx[1]=mma(dx[1],oh,[x[2:4] for x in bp])
    Dg=np.zeros((16,16))  # dΔ[r][j - j0] as the kernel stores dD
    for l in range(32):
        g,t=l>>2,l&3
        for ns in range(2):
            for c in range(4):
                dl[ns][l][c]=np.float32(dl[ns][l][c]+dx[ns][l][c])
                Dg[8*ns+2*t+(c&1), g+8*(c>>1)]=dl[ns][l][c]
    da=[acc_to_a(dl[0][l],dl[1][l]) for l in range(32)]
    scale_frags(st,eg)
    for pp in range(8):
        b=ldsm_x4(sm,adr_b_kn(SQ,LD,0,16*pp),trans=True); bw=ldsm_x4(sm,adr_b_kn(SW,LD,0,16*pp),trans=True)
        c0=mma([st[l][2*pp] for l in range(32)],oh,[x[0:2] for x in b]); c1=mma([st[l][2*pp+1] for l in range(32)],oh,[x[2:4] for x in b])
        c0=mma(c0,da,[x[0:2] for x in bw]); c1=mma(c1,da,[x[2:4] for x in bw])
        for l in range(32): st[l][2*pp]=c0[l]; st[l][2*pp+1]=c1[l]
    S2g=frags_matrix(st,K)
    # matrix level, same roundings
    Sb=bq(dS[:,j0:j0+16]); Ob=bq(dO[:,j0:j0+16])
    D=bq(Ke)@Sb+bq(P).T@Ob; Db=bq(D)
    S2=eg[:,None]*dS[:,j0:j0+16]+bq(Qp).T@Ob+bq(Wn).T@Db
    err.append((float(np.abs(Dg-D).max()/np.abs(D).max()), float(np.abs(S2g-S2).max()/np.abs(S2).max())))
print("backward state step, warp errors (dΔ, dS'):", err)
assert all(e < 1e-5 for p in err for e in p), "layout mismatch"

# ---- kda/chunk_simt.cu's smm16_tc (kda_bwd_tile = auto): fragments gathered from fp32 arrays with any
# strides (transcribed; hi parts), C = alpha A B + beta C for M = 16; A and B read transposed here.
def smm16_tc(N,Kd,alpha,A,sam,sak,B,sbk,sbn,beta,C,ldc,nw=8):
    for w in range(nw):
        for nt in range(w,N//8,nw):
            n0=8*nt; c=[[0.0]*4 for _ in range(32)]
            for k0 in range(0,Kd,16):
                Af=[];Bf=[]
                for l in range(32):
                    g,t=l>>2,l&3; a=[]; b=[]
                    for r in range(4):
                        m=g+8*(r&1); kk=k0+2*t+8*(r>>1); a.append(pack(A[m*sam+kk*sak],A[m*sam+(kk+1)*sak]))
                    for r in range(2):
                        kk=k0+2*t+8*r; b.append(pack(B[kk*sbk+(n0+g)*sbn],B[(kk+1)*sbk+(n0+g)*sbn]))
                    Af.append(a); Bf.append(b)
                c=mma(c,Af,Bf)
            for l in range(32):
                g,t=l>>2,l&3
                for r in range(4):
                    o=(g+8*(r>>1))*ldc+n0+2*t+(r&1); v=alpha*c[l][r]
                    C[o]=v if beta==0 else v+beta*C[o]
N,Kd=48,32; LA=Kd+3; LB=16+5
Am=rng.standard_normal((16,Kd)).astype(np.float32); Bm=rng.standard_normal((Kd,N)).astype(np.float32)
Ct=rng.standard_normal((16,N)).astype(np.float32)
Aflat=np.zeros(Kd*LA,np.float32)   # A stored transposed: A(m, k) at k LA + m
for m in range(16):
    for k in range(Kd): Aflat[k*LA+m]=Am[m,k]
Bflat=np.zeros(N*(Kd+1),np.float32)  # B stored n-major: B(k, n) at n (Kd + 1) + k
for k in range(Kd):
    for n in range(N): Bflat[n*(Kd+1)+k]=Bm[k,n]
Cf=np.zeros(16*LB*4,np.float32); ldc=N+3
for m in range(16): Cf[m*ldc:m*ldc+N]=Ct[m]
smm16_tc(N,Kd,-1.0,Aflat,1,LA,Bflat,1,Kd+1,1.0,Cf,ldc)
Cg=np.array([Cf[m*ldc:m*ldc+N] for m in range(16)])
ref=Ct-bq(Am)@bq(Bm)
e=float(np.abs(Cg-ref).max()/np.abs(ref).max())
print("smm16_tc (transposed A, n-major B, beta 1) error:", e)
assert e < 1e-5, "smm16_tc layout mismatch"
