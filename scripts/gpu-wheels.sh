#!/usr/bin/env bash
# Download, on a machine with a package registry, the wheels that scripts/gpu-check.sh
# installs on a GPU machine without one (docs/gpu.md). The target image ('cuda': CPython
# 3.12, torch 2.11 + CUDA 13, triton 3.6, grpcio, protobuf, numpy, cupy-cuda13x,
# cuda-toolkit, nvidia-cufile, cuda-pathfinder, packaging, ...) lacks the packages below,
# or may hold grpcio/protobuf older than the committed stubs need.
#
#   scripts/gpu-wheels.sh [DIR]        DIR: default .gpu-wheels (ignored by git)
#
# Env: PYTHON (default python3: any Python with pip; the wheels are for CPython 3.12),
#      GPU_WHEELS_MAX_MIB (default 48: the wheels plus the working tree must stay under it;
#      a lent GPU machine takes 64 MiB with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.gpu-wheels}"
max_mib="${GPU_WHEELS_MAX_MIB:-48}"
py="${PYTHON:-python3}"

# One version of each (two of one name stop the install). --no-deps: every dependency the
# image lacks is named here; the rest (numpy, packaging, cupy-cuda13x, cuda-toolkit[cufile],
# cuda-pathfinder, typing-extensions) is in the image.
grpc=1.85.3        # the version CI runs; the stubs need >= their GRPC_GENERATED_VERSION (checked below)
protobuf=7.36.2    # the version CI runs; the stubs need >= their gencode version, < next major
wheels=(
    "grpcio==$grpc"
    "grpcio-health-checking==1.85.1"
    "grpcio-reflection==1.85.1"
    "protobuf==$protobuf"
    "rocksdict==0.3.29"
    "kvikio-cu13==26.10.0"      # disk_backend = "kvikio" on CUDA 13 (the image's CUDA)
    "libkvikio-cu13==26.10.0"   # kvikio-cu13's C++ library
    "rapids-logger==0.3.0"      # libkvikio-cu13's logger
)

# The committed stubs say what they need: refuse pins below it.
stub_grpc=$(sed -n "s/^GRPC_GENERATED_VERSION = '\(.*\)'/\1/p" proto/kvcraft/v1/kvcraft_pb2_grpc.py)
stub_pb=$(sed -n 's/^# Protobuf Python Version: //p' proto/kvcraft/v1/kvcraft_pb2.py)
at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }  # $1 >= $2
at_least "$grpc" "$stub_grpc" || { echo "gpu-wheels: grpcio $grpc < $stub_grpc, what the stubs need" >&2; exit 1; }
at_least "$protobuf" "$stub_pb" || { echo "gpu-wheels: protobuf $protobuf < $stub_pb, what the stubs need" >&2; exit 1; }
[ "${protobuf%%.*}" = "${stub_pb%%.*}" ] || { echo "gpu-wheels: protobuf $protobuf: the stubs need major ${stub_pb%%.*}" >&2; exit 1; }

git check-ignore -q "$dir/x.whl" 2>/dev/null || echo "gpu-wheels: warning: $dir is not ignored by git; it would travel with every call" >&2

rm -rf "$dir"
mkdir -p "$dir"
# pip matches manylinux_2_N exactly: name every N these wheels use.
"$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$dir" "${wheels[@]}"

n=$(find "$dir" -name '*.whl' | wc -l)
[ "$n" -eq "${#wheels[@]}" ] || { echo "gpu-wheels: expected ${#wheels[@]} wheels, got $n" >&2; exit 1; }

wheel_bytes=$(find "$dir" -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')
if git rev-parse --git-dir >/dev/null 2>&1; then  # what travels without `carry`: tracked + untracked, not ignored
    tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null |
                 awk '{s += $1} END {print s + 0}')
else
    tree_bytes=0
fi
mib() { awk -v b="$1" 'BEGIN {printf "%.2f", b / 1048576}'; }

echo "packed into $dir:"
find "$dir" -name '*.whl' -printf '%s %f\n' | sort -rn | while read -r size name; do
    printf '  %8s MiB  %s\n' "$(mib "$size")" "$name"
done
total=$((wheel_bytes + tree_bytes))
printf '  %8s MiB  wheels (%d)\n  %8s MiB  working tree (tracked + untracked, not ignored)\n  %8s MiB  together, limit %s MiB\n' \
    "$(mib "$wheel_bytes")" "$n" "$(mib "$tree_bytes")" "$(mib "$total")" "$max_mib"
if [ "$total" -gt $((max_mib * 1048576)) ]; then
    echo "gpu-wheels: refusing: wheels + working tree exceed $max_mib MiB; removed $dir" >&2
    rm -rf "$dir"
    exit 1
fi
echo "on a lent GPU machine: name $dir in the call's carry; scripts/gpu-check.sh installs what the image lacks"
