import json,glob,collections,re,sys
D=collections.defaultdict(dict)  # (preset,variant,d,r) -> {(n,causal): (fwd,bwd)}
for f in glob.glob('json/*.json'):
    m=re.match(r'json/(sage|fpa)-(.*)-d(\d+)-r(\d)\.json',f); p,v,d,r=m.groups()
    for x in json.load(open(f))['results']:
        D[(p,v,int(d))].setdefault((x['n'],x['causal']),[]).append((x['fwd_ms'],x['bwd_ms']))
def med(l,i): return sum(a[i] for a in l)/len(l)
for p in ['sage','fpa']:
  for d in [64,128]:
    vs=sorted(v for (pp,v,dd) in D if pp==p and dd==d)
    for part,i in [('fwd',0),('bwd',1)]:
      rel=[v for v in vs if (v.startswith('f_') if i==0 else v.startswith('bp')) or v=='def']
      print(f"\n{p} d{d} {part}: ms of def, then % vs def (r1/r2)")
      print("N causal | def | "+" | ".join(rel[1:] if rel[0]=='def' else rel))
      for key in sorted(D[(p,'def',d)]):
        base=D[(p,'def',d)][key]
        row=[f"{key[0]} {'c' if key[1] else 'f'}", f"{med(base,i):.4f} ({(base[0][i]/base[1][i]-1)*100:+.1f})"]
        for v in rel:
            if v=='def': continue
            x=D[(p,v,d)][key]
            row.append("/".join(f"{(x[k][i]/base[k][i]-1)*100:+.1f}" for k in range(2)))
        print(" | ".join(row))
