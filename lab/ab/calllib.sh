# Helpers for a script run on the GPU machine that compares builds (source it: `. lab/ab/calllib.sh`), so that the
# script holds only what it runs. Builds are device bundles in dev/BUILD (`bash scripts/gpu/bundle.sh --out dev/BUILD`),
# carried to the device together (mind the carry limit: one bundle is ~16 MB).
#   R        the output folder ($OUT on the device, else /tmp/call); summary.txt in it is printed last by `finish`
#   lap MSG RC             appends "MSG rc=RC (seconds since the last lap)" to the summary
#   pack                   tars everything under $R into $R/all.tgz (the device returns few files; call it after each step)
#   ab_rounds ROUNDS "BUILDS" "DIMS" [PRESET]   sagebwd bench of each build in dev/BUILD, rounds alternated, JSON into $R/json
#   ab_caches ROUNDS BUILD "TAG=CACHE ..." DIM  the same with one binary (dev/BUILD) and several kernel caches, when the
#                          variants differ in kernels only and two bundles do not fit the 64 MiB carry: copy the
#                          baseline's cubins under the variant's cache file names (the cache is looked up by name only;
#                          `bash scripts/gpu/bundle.sh --variant dev/BUILD NAME STAGE.cu D -D...` makes such a cache)
#   verify_all BUILD       sagebwd-gpu-check of dev/BUILD: default and lean (full), 4 "SMs" (quick); verdicts to the summary
#   prof NAME BUILD REGEX BENCH-ARGS...         ncu (sections + SASS source) of the first kernel matching REGEX
#   finish                 packs and prints the summary
set -uo pipefail
R=${OUT:-/tmp/call}; mkdir -p "$R/json" "$R/log" "$R/prof"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
S=$R/summary.txt; _t0=$SECONDS
lap() { echo "$1 rc=$2 ($((SECONDS - _t0)) s)" >> "$S"; _t0=$SECONDS; }
pack() { tar czf "$R/all.tgz" -C "$R" --exclude all.tgz . 2>/dev/null; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$S" 2>/dev/null
# One timed `sagebwd bench` of binary dev/BUILD with kernel cache CACHE: JSON $R/json/<p><D>_TAG-rROUND.json (p: the
# preset's first letter, as lab/ab/ab.py reads them), its log beside it.
bench_json() {
  local tag=$1 build=$2 cache=$3 preset=$4 d=$5 r=$6 t=${4:0:1}
  SAGEBWD_CACHE_DIR=$cache timeout 60 "dev/$build/sagebwd" bench --reps 10 --min-reps 3 --warmup 2 --max-time 1 \
    --input-sets 2 --preset "$preset" -d "$d" --json "$R/json/$t${d}_$tag-r$r.json" > "$R/log/$t${d}_$tag-r$r.txt" 2>&1 \
    || echo "FAIL $tag $preset d$d round $r" >> "$S"
}
ab_rounds() {
  local rounds=$1 builds=$2 dims=$3 preset=${4:-sagebwd}
  for r in $(seq 1 "$rounds"); do
    for v in $builds; do
      for d in $dims; do bench_json "$v" "$v" "$PWD/dev/$v/cache" "$preset" "$d" "$r"; done
    done
  done
}
ab_caches() {
  local rounds=$1 build=$2 pairs=$3 d=$4
  for r in $(seq 1 "$rounds"); do
    for pair in $pairs; do bench_json "${pair%%=*}" "$build" "$PWD/${pair#*=}" sagebwd "$d" "$r"; done
  done
}
verify_all() {
  local n=dev/$1 c=$PWD/dev/$1/cache
  OUT=$R/verify BIN=$n/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$c timeout 100 bash scripts/gpu/verify.sh > "$R/verify-stdout.txt" 2>&1
  lap "verify $1" $?
  OUT=$R/lean BIN=$n/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$c SAGEBWD_BWD_GROUPS=lean timeout 100 bash scripts/gpu/verify.sh \
    > "$R/lean-stdout.txt" 2>&1
  lap "lean verify $1" $?
  OUT=$R/multi BIN=$n/sagebwd-gpu-check SAGEBWD_CACHE_DIR=$c SAGEBWD_PERSISTENT_SMS=4 SAGEBWD_BWD_PERSIST=1 timeout 50 \
    bash scripts/gpu/verify.sh --quick > "$R/multi-stdout.txt" 2>&1
  lap "verify $1 4 SMs" $?
  grep -HE "passed, .* failed|mismatch" "$R"/{verify,lean,multi}/log.txt | head -8 >> "$S"
}
prof() {
  local name=$1 build=$2 rx=$3; shift 3
  local ncu; ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  SAGEBWD_CACHE_DIR=$PWD/dev/$build/cache timeout 60 "$ncu" --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section SourceCounters --section SchedulerStats --section InstructionStats --section Occupancy --section LaunchStats \
    -k "regex:$rx" --launch-count 1 -f -o "$R/prof/$name" \
    "dev/$build/sagebwd" bench --reps 1 --min-reps 1 --warmup 0 --max-time 0 --input-sets 1 "$@" > "$R/prof/$name.log" 2>&1
  lap "ncu $name" $?
  "$ncu" -i "$R/prof/$name.ncu-rep" --page details --csv > "$R/prof/$name-details.csv" 2> "$R/prof/$name-details.err"
  "$ncu" -i "$R/prof/$name.ncu-rep" --page source --csv --print-source sass 2> "$R/prof/$name-source.err" | gzip > "$R/prof/$name-source.csv.gz"
  rm -f "$R/prof/$name.ncu-rep"
}
finish() { pack; cat "$S"; }
