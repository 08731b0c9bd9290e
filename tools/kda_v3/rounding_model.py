# kda_v3/rounding_model.py: a numpy model of the KDA forward v3 (kernels/cuda/kda/chunk_mma.cu) at the
# matrix level, with bf16 rounding at the kernel's points (operands of every mma, T, the state and
# Δ as operands), against an fp64 recurrence. Gives the error level the v3 test tolerance rests on.
# usage: python3 tools/kda_v3/rounding_model.py   (numpy; a few minutes)
import numpy as np, sys
rng = np.random.default_rng(1)
def bf(x):
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)
f32 = np.float32
def inputs(T, H, K, V, bound):
    q = rng.standard_normal((T,H,K)); k = rng.standard_normal((T,H,K))
    q = q/np.sqrt((q*q).sum(-1,keepdims=True)+1e-6)/np.sqrt(K); k = k/np.sqrt((k*k).sum(-1,keepdims=True)+1e-6)
    v = rng.standard_normal((T,H,V))
    s = 1/(1+np.exp(-2*rng.standard_normal((T,H,K))))
    g = np.full((T,H,K), -5+1e-3) if bound else -5*s
    beta = 1/(1+np.exp(-rng.standard_normal((T,H))))
    S0 = 0.5*rng.standard_normal((H,K,V))
    return [a.astype(np.float32).astype(np.float64) for a in (q,k,v,g,beta,S0)]
def ref(q,k,v,g,beta,S0):
    T,H,K = q.shape; V = v.shape[2]
    S = S0.copy(); o = np.zeros((T,H,V)); St=[]
    for t in range(T):
        if t % 16 == 0: St.append(S.copy())
        for h in range(H):
            Sh = np.exp(g[t,h])[:,None]*S[h]
            r = v[t,h] - Sh.T@k[t,h]
            S[h] = Sh + beta[t,h]*np.outer(k[t,h], r)
            o[t,h] = S[h].T@q[t,h]
    return o, S, np.array(St)
def v3(q,k,v,g,beta,S0):
    T,H,K = q.shape; V = v.shape[2]; nt=(T+15)//16
    o = np.zeros((T,H,V)); Sf = np.zeros((H,K,V)); St = np.zeros((nt,H,K,V))
    for h in range(H):
        S = S0[h].astype(f32)
        for n in range(nt):
            t0=16*n; cr=min(16,T-t0)
            def pad(a, cols):
                z = np.zeros((16,)+a.shape[2:], f32); z[:cr]=a[t0:t0+cr,h]; return z
            qq=pad(q,0); kk=pad(k,0); vv=pad(v,0); gg=pad(g,0); bb=np.zeros(16,f32); bb[:cr]=beta[t0:t0+cr,h]
            G = np.cumsum(gg,0,dtype=f32); m=min(8,cr-1); Gm=G[m]; gam=G[15]
            e=lambda x: np.exp(x.astype(np.float64)).astype(f32)
            Kp=bf(kk*e(G-Gm)); Qh=bf(qq*e(G-Gm)); Km=bf(kk*e(Gm-G)); BK=bf(bb[:,None]*(kk*e(G))); BV=bf(bb[:,None]*vv)
            Qp=bf(qq*e(G)); Ke=bf(kk*e(gam-G)); eg=e(gam)
            X=(Kp.astype(np.float64)@Km.T.astype(np.float64)).astype(f32); Pm=(Qh.astype(np.float64)@Km.T.astype(np.float64)).astype(f32)
            i,j=np.indices((16,16))
            M=np.where(j<i, bb[:,None]*X, 0).astype(f32); P=bf(np.where(j<=i,Pm,0))
            Tm=np.linalg.inv(np.eye(16)+M.astype(np.float64)).astype(f32)
            Tb=bf(Tm)
            Wn=bf(-(Tb.astype(np.float64)@BK)); U=bf(Tb.astype(np.float64)@BV)
            St[n,h]=S
            Sb=bf(S)
            D=(U.astype(np.float64) + Wn.astype(np.float64)@Sb).astype(f32)
            Db=bf(D)
            O=Qp.astype(np.float64)@Sb + P.astype(np.float64)@Db
            o[t0:t0+cr,h]=O[:cr]
            S=(eg[:,None]*S + Ke.T.astype(np.float64)@Db).astype(f32)
        Sf[h]=S
    return o,Sf,St
rel=lambda a,b: np.linalg.norm(a-b)/np.linalg.norm(b)
for (T,H,bound) in [(77,2,0),(200,2,0),(61,1,1),(300,2,0),(1000,1,0)]:
    ins=inputs(T,H,128,128,bound)
    o,S,St=ref(*ins); o3,S3,St3=v3(*ins)
    print(T,H,bound,"o %.2e Sf %.2e St %.2e"%(rel(o3,o),rel(S3,S),rel(St3,St)))
