import json,glob,collections
def load(f): return {(x['head_dim'],x['n'],x['causal']):(x['fwd_ms'],x['bwd_ms'],x['fwdbwd_ms']) for x in json.load(open(f))['results']}
import math
for p in ['sagebwd','fpa']:
    A=[load(f'ab/f28-{p}-r{r}.json') for r in (1,2)]; B=[load(f'ab/f27-{p}-r{r}.json') for r in (1,2)]
    print(f"\n{p}: f28 vs f27, % (r1/r2) fwd | bwd | f+b")
    g=[0,0,0]
    for k in sorted(A[0]):
        row=[]
        for i in range(3):
            d=[(A[r][k][i]/B[r][k][i]-1)*100 for r in range(2)]
            g[i]+=math.log(A[0][k][i]*A[1][k][i]/(B[0][k][i]*B[1][k][i]))/2
            row.append(f"{d[0]:+.1f}/{d[1]:+.1f}")
        print(f"d{k[0]} N{k[1]} {'c' if k[2] else 'f'}: "+" | ".join(row))
    print("geo % fwd/bwd/f+b:", [round((math.exp(x/len(A[0]))-1)*100,2) for x in g])
