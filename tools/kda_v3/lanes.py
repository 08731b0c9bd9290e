# kda_v3/lanes.py: a lane-level model of the fragment code of kernels/cuda/kda/chunk_mma.cu: ldmatrix
# (x4, .trans) and mma.m16n8k16 emulated for 32 lanes as cuda_common.cuh documents them, and the
# kernel's index expressions transcribed (state step for WPB = 2, block 1, both warps; the prep's
# X, P, W, U products), compared with the same products as whole matrices. Errors at fp32
# rounding (~1e-7 relative) mean the index expressions agree with the matrix algebra; a layout
# mistake gives O(1). It checks the transcription, not the hardware (the semantics of ldmatrix
# and mma are the ones attn/causal_mma.cu relies on).
# usage: python3 tools/kda_v3/lanes.py   (numpy; about a minute)
# Lane-level emulation of kda3 fragment code (ldmatrix / mma.m16n8k16 / pack_bf16 per cuda_common.cuh).
import numpy as np
rng=np.random.default_rng(3)
from lanemodel import (bfbits, bits2f, pack, ldsm_x4, mma, adr_a, adr_b_nk, adr_b_kn, draw_record, record_offsets,
                       put_record, state_frags, scale_frags, frags_matrix)
K=V=128; LD=K+8; LDP=24; WPB=2; LDU=16*WPB+8
# one stage: matrices
Wn,Qp,Ke,P=draw_record(rng,K)
U=rng.standard_normal((16,V)).astype(np.float32); eg=rng.random(K).astype(np.float32)
S=rng.standard_normal((K,V)).astype(np.float32)
bq=lambda x: bits2f(bfbits(x)).astype(np.float64)
# smem layout like StCfg (element units of b16)
SW,SQ,SE,SP=record_offsets(LD); SU_=SP+16*LDP  # (eg kept separately)
sm=np.zeros(SU_+16*LDU,np.uint16)
put_record(sm,LD,LDP,Wn,Qp,Ke,P)
jb=16*WPB*1  # blockIdx.x = 1
for r in range(16): sm[SU_+r*LDU:SU_+r*LDU+16*WPB]=bfbits(U[r,jb:jb+16*WPB])
err=[]
for w in range(WPB):
    jw=16*w; j0=jb+jw
    st=state_frags(S,j0)
    sa=[[ [pack(st[l][2*kd][0],st[l][2*kd][1]),pack(st[l][2*kd][2],st[l][2*kd][3]),pack(st[l][2*kd+1][0],st[l][2*kd+1][1]),pack(st[l][2*kd+1][2],st[l][2*kd+1][3])] for l in range(32)] for kd in range(8)]
    dl=[[[0.0]*4 for _ in range(32)] for _ in range(2)]
    for l in range(32):
        g,t=l>>2,l&3
        for ns in range(2):
            for c in range(4):
                dl[ns][l][c]=float(bits2f(sm[SU_+(8*ns+2*t+(c&1))*LDU+jw+g+8*(c>>1)]))
    oa=[[[0.0]*4 for _ in range(32)] for _ in range(2)]
    for kd in range(8):
        b=ldsm_x4(sm,adr_b_nk(SW,LD,16*kd,0))
        dl[0]=mma(dl[0],sa[kd],[x[0:2] for x in b]); dl[1]=mma(dl[1],sa[kd],[x[2:4] for x in b])
        bqf=ldsm_x4(sm,adr_b_nk(SQ,LD,16*kd,0))
        oa[0]=mma(oa[0],sa[kd],[x[0:2] for x in bqf]); oa[1]=mma(oa[1],sa[kd],[x[2:4] for x in bqf])
    da=[[pack(dl[0][l][0],dl[0][l][1]),pack(dl[0][l][2],dl[0][l][3]),pack(dl[1][l][0],dl[1][l][1]),pack(dl[1][l][2],dl[1][l][3])] for l in range(32)]
    bp=ldsm_x4(sm,adr_b_nk(SP,LDP,0,0))
    oa[0]=mma(oa[0],da,[x[0:2] for x in bp]); oa[1]=mma(oa[1],da,[x[2:4] for x in bp])
    scale_frags(st,eg)
    for pp in range(8):
        b=ldsm_x4(sm,adr_b_kn(SE,LD,0,16*pp),trans=True)
        A=da
        c0=mma([st[l][2*pp] for l in range(32)],A,[x[0:2] for x in b]); c1=mma([st[l][2*pp+1] for l in range(32)],A,[x[2:4] for x in b])
        for l in range(32): st[l][2*pp]=c0[l]; st[l][2*pp+1]=c1[l]
    # reference (matrix level, same roundings)
    Sb=bq(S[:,j0:j0+16]); D=bq(U[:,j0:j0+16])+bq(Wn)@Sb; Db=bq(D)
    O=bq(Qp)@Sb+bq(P)@Db; S2=eg[:,None]*S[:,j0:j0+16]+bq(Ke).T@Db
    Og=np.zeros((16,16)); S2g=frags_matrix(st,K)
    for l in range(32):
        g,t=l>>2,l&3
        for ns in range(2):
            for c in range(4): Og[8*ns+2*t+(c&1), g+8*(c>>1)]=oa[ns][l][c]
    err.append((np.abs(Og-O).max()/np.abs(O).max(), np.abs(S2g-S2).max()/np.abs(S2).max()))
print("state step warp errors (O, S'):", err)

# ---- prep mma parts: X, P, W, U
Kp=rng.standard_normal((16,K)); Qh=rng.standard_normal((16,K)); Km=rng.standard_normal((16,K)); BK=rng.standard_normal((16,K)); BV=rng.standard_normal((16,V))
Tm=np.tril(rng.standard_normal((16,16)))
sm=np.zeros(5*16*LD,np.uint16); bufs={}
for i,(nm,Mx) in enumerate([("Kp",Kp),("Qh",Qh),("Km",Km),("BK",BK),("BV",BV)]):
    bufs[nm]=i*16*LD
    for r in range(16): sm[i*16*LD+r*LD:i*16*LD+r*LD+K]=bfbits(Mx[r].astype(np.float32))
x=[[[0.0]*4 for _ in range(32)] for _ in range(2)]; p=[[[0.0]*4 for _ in range(32)] for _ in range(2)]
for kd in range(8):
    a=ldsm_x4(sm,adr_a(bufs["Kp"],LD,16*kd)); aq=ldsm_x4(sm,adr_a(bufs["Qh"],LD,16*kd)); b=ldsm_x4(sm,adr_b_nk(bufs["Km"],LD,16*kd,0))
    x[0]=mma(x[0],a,[y[0:2] for y in b]); x[1]=mma(x[1],a,[y[2:4] for y in b]); p[0]=mma(p[0],aq,[y[0:2] for y in b]); p[1]=mma(p[1],aq,[y[2:4] for y in b])
Xg=np.zeros((16,16)); Pg=np.zeros((16,16))
for l in range(32):
    g,t=l>>2,l&3
    for nt2 in range(2):
        for hf in range(2):
            i=g+8*hf; j=8*nt2+2*t
            Xg[i,j]=x[nt2][l][2*hf]; Xg[i,j+1]=x[nt2][l][2*hf+1]; Pg[i,j]=p[nt2][l][2*hf]; Pg[i,j+1]=p[nt2][l][2*hf+1]
print("X err", np.abs(Xg-bq(Kp)@bq(Km).T).max(), "P err", np.abs(Pg-bq(Qh)@bq(Km).T).max())
sT=Tm.astype(np.float32).reshape(-1)
def Tv(i,j): return Tm[i,j]
ta=[]
for l in range(32):
    g,t=l>>2,l&3
    ta.append([pack(Tv(g,2*t),Tv(g,2*t+1)),pack(Tv(g+8,2*t),Tv(g+8,2*t+1)),pack(Tv(g,2*t+8),Tv(g,2*t+9)),pack(Tv(g+8,2*t+8),Tv(g+8,2*t+9))])
Wg=np.zeros((16,K)); Ug=np.zeros((16,V))
for pp in range(8):
    b=ldsm_x4(sm,adr_b_kn(bufs["BK"],LD,0,16*pp),trans=True); bu=ldsm_x4(sm,adr_b_kn(bufs["BV"],LD,0,16*pp),trans=True)
    z=lambda: [[0.0]*4 for _ in range(32)]
    w0=mma(z(),ta,[y[0:2] for y in b]); w1=mma(z(),ta,[y[2:4] for y in b]); u0=mma(z(),ta,[y[0:2] for y in bu]); u1=mma(z(),ta,[y[2:4] for y in bu])
    for l in range(32):
        g,t=l>>2,l&3; c0=16*pp+2*t; c1=c0+8
        Wg[g,c0:c0+2]=w0[l][0:2]; Wg[g+8,c0:c0+2]=w0[l][2:4]; Wg[g,c1:c1+2]=w1[l][0:2]; Wg[g+8,c1:c1+2]=w1[l][2:4]
        Ug[g,c0:c0+2]=u0[l][0:2]; Ug[g+8,c0:c0+2]=u0[l][2:4]; Ug[g,c1:c1+2]=u1[l][0:2]; Ug[g+8,c1:c1+2]=u1[l][2:4]
print("W err", np.abs(Wg-bq(Tm)@bq(BK)).max(), "U err", np.abs(Ug-bq(Tm)@bq(BV)).max())
