# Sourced by the device scripts: a bundle made with `bundle.sh --compact` carries its binaries xz-compressed (to fit
# a study's corpus and a kernel check into one 64 MiB carry); this restores them in place before first use.
#   unpack_bundle DIR
unpack_bundle() {
  local dir=${1:?bundle folder} f bin
  for f in "$dir"/*.xz; do
    [ -e "$f" ] || continue
    bin=${f%.xz}
    [ -x "$bin" ] && continue
    python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as a, open(sys.argv[2], "wb") as b: shutil.copyfileobj(a, b)' "$f" "$bin" \
      && chmod +x "$bin" || { echo "error: cannot unpack $f" >&2; return 1; }
  done
}
