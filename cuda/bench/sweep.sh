#!/usr/bin/env bash
# The statistics pass under several launch geometries, timed side by side on one GPU.
#
#   cuda/bench/sweep.sh build DIR [ARCH]   # anywhere with nvcc (no GPU needed): one binary per geometry
#   cuda/bench/sweep.sh run DIR [ROUNDS]   # on the GPU: TIME and CHECK lines, then a table of GB/s
#
# A geometry is CHUNK_LOG2-THREADS-UNROLL: every block takes 1 << CHUNK_LOG2 elements (kChunk and
# kMaxChunk both set to it), kThreads threads per block, kUnroll 16-byte vectors in flight per
# thread. Each binary is built from a copy of the kernel source with those constants edited (the
# kernel's code otherwise); `shipped` is the source as it is. Environment: SRC (the kernel source,
# default cuda/kernels/stats_kernel.cu; e.g. an older commit's copy), NAME (a prefix for the
# labels of this build, so two sources can share DIR), GEOMETRIES, SHIPPED=0 (no `shipped`
# binary), BASE (run: the label whose CHECK lines every other binary must match; default the
# first binary's).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="${SRC:-$here/../kernels/stats_kernel.cu}"
GEOMETRIES="${GEOMETRIES-14-512-4 16-512-4 16-256-8 15-512-4 13-256-4}"
case "${1:-}" in
  build)
    mkdir -p "$2"; out="$(cd "$2" && pwd)"; arch="${3:-sm_90}"
    labels=(); [ "${SHIPPED:-1}" = 1 ] && labels+=(shipped)
    for g in $GEOMETRIES; do labels+=("$g"); done
    for g in "${labels[@]}"; do
      label="${NAME:+$NAME-}$g"
      if [ "$g" = shipped ]; then
        cp "$src" "$out/stats_$label.cu"
      else
        IFS=- read -r chunk threads unroll <<<"$g"
        sed -e "s/^constexpr int kThreads = [0-9]*;/constexpr int kThreads = $threads;/" \
            -e "s/^constexpr int64_t kChunk = 1 << [0-9]*;/constexpr int64_t kChunk = 1 << $chunk;/" \
            -e "s/^constexpr int64_t kMaxChunk = 1 << [0-9]*;/constexpr int64_t kMaxChunk = 1 << $chunk;/" \
            -e "s/^constexpr int kUnroll = [0-9]*;/constexpr int kUnroll = $unroll;/" "$src" >"$out/stats_$label.cu"
        for want in "kThreads = $threads;" "kChunk = 1 << $chunk;" "kUnroll = $unroll;"; do
          grep -q "$want" "$out/stats_$label.cu" || { echo "sweep: could not set $want in a copy of $src" >&2; exit 1; }
        done
      fi
      nvcc -O3 -std=c++17 --fmad=false -arch="$arch" -I "$here/../include" \
        -DSTATS_SOURCE="\"$out/stats_$label.cu\"" -DVARIANT="\"$label\"" "$here/stats_geometry.cu" -o "$out/stats_$label" &
    done
    wait
    ls "$out"/stats_* | grep -v '\.cu$' ;;
  run)
    out="$2"; rounds="${3:-30}"; first=roofline
    for b in "$out"/stats_*; do
      case "$b" in *.cu) continue ;; esac
      "$b" "$rounds" $first || echo "FAILED $(basename "$b") rc=$?"  # one variant's failure keeps the others
      first=
    done | tee "$out/sweep.txt"
    python3 "$here/sweep_table.py" "$out/sweep.txt" ${BASE:+--base "$BASE"} ;;
  *) sed -n '2,15p' "$0"; exit 2 ;;
esac
