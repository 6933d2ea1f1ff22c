#!/usr/bin/env bash
# sage64b call 1: verify (default = ws3c at d64, ws3 without the P-hat clamp at d128), then the training
# shape (base 9b4f3b7 / ws3c / ws3 / ws3cs / ws3c1, base and ws3c twice), the d64+d128 sweep (base / new),
# cuDNN on the same shapes.
R=$OUT; mkdir -p $R/j
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
N=dev/sage64b/bin/sagebwd; NC=$PWD/dev/sage64b/cache; Z=dev/base/bin/sagebwd; ZC=$PWD/dev/base/cache
t0=$SECONDS
OUT=$R/v BIN=dev/sage64b/bin/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$NC bash scripts/gpu/verify.sh > $R/v.txt 2>&1
echo "verify rc=$? $((SECONDS-t0)) s" >> $R/s.txt
TR="-d 64 -n 1024,4096 --causal on --tokens 16384 --hidden 768"
ST="-d 64,128 -n 1024,4096,16384 --causal both"
A="--reps 12 --min-reps 3 --warmup 2 --max-time 1"
b() { local tag=$1 bin=$2 cache=$3; shift 3; SAGEBWD_CACHE_DIR=$cache $bin bench --preset sagebwd "$@" $A --json $R/j/$tag.json > $R/j/$tag.txt 2>&1; echo "$tag rc=$? $((SECONDS-t0)) s" >> $R/s.txt; }
b tr-base1 $Z $ZC $TR
b tr-ws3c1st $N $NC $TR
SAGEBWD_FORWARD_WGMMA=ws3 b tr-ws3 $N $NC $TR
SAGEBWD_FORWARD_WGMMA=ws3cs b tr-ws3cs $N $NC $TR
SAGEBWD_FORWARD_WGMMA=ws3c1 b tr-ws3c1 $N $NC $TR
b tr-base2 $Z $ZC $TR
b tr-ws3c2nd $N $NC $TR
python3 scripts/gpu/bench_sdpa.py --backends cudnn $TR --reps 12 --warmup 2 --json $R/j/tr-cudnn.json > $R/j/tr-cudnn.txt 2>&1
echo "tr-cudnn rc=$? $((SECONDS-t0)) s" >> $R/s.txt
A="--reps 6 --min-reps 3 --warmup 1 --max-time 0.6"
b st-base $Z $ZC $ST
b st-new $N $NC $ST
python3 scripts/gpu/bench_sdpa.py --backends cudnn $ST --reps 6 --warmup 1 --json $R/j/st-cudnn.json > $R/j/st-cudnn.txt 2>&1
echo "st-cudnn rc=$? $((SECONDS-t0)) s" >> $R/s.txt
cat $R/s.txt; grep -E "passed, .* failed" $R/v/log.txt; echo "nonzero mism/FAIL lines: $(grep -cE "hat mism [1-9]|scale mism [1-9]|^FAIL" $R/v/log.txt)"
python3 dev/sage64b/table.py $R/j
cd $R && tar czf all.tgz v v.txt j s.txt 2>/dev/null && rm -rf v v.txt j
