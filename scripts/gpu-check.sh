#!/usr/bin/env bash
# The GPU check kit (docs/gpu.md): one command, from the repository root, on a GPU host or
# on a lent GPU machine that got the working tree (and .gpu-wheels, scripts/gpu-wheels.sh).
#
#   scripts/gpu-check.sh
#
# Steps, each under its own time cap (timeout) and all under one budget (450 s):
#   env        nvidia-smi; Python, torch, triton, CUDA versions
#   wheels     .gpu-wheels/*.whl that this Python lacks (or holds at a version pyproject.toml
#              does not accept) installed into a temporary target; skipped without the folder
#   project    kvcraft as installed from this checkout, else this checkout installed into the
#              target (pip --no-index --no-build-isolation; linked folders if that fails)
#   imports    every package of the project and its gRPC, RocksDB and kvikio dependencies
#   then the issue's numbers first (scripts/gpu_blend.py; random-weight Llamas, 5 and 16 chunks
#   of 512 tokens + a 32-token question = 2,592 and 8,224 tokens; per case TTFT, speed-up over
#   the same run's full prefill, GPU-busy share and launches from the profiler, logit deviation):
#   blend-llama3-8b      Llama-3-8B's shape, bf16, both lengths, KV in GPU memory and streamed
#                        from pinned host memory layer by layer
#   blend-smollm2-135m   SmolLM2-135M's shape, the same
#   serve-llama3-8b      kvcraft serve as a process with gpu_budget_bytes set, this engine
#                        storing, planning and serving blended prefills with the KV from the
#                        gpu tier (CUDA IPC), 2,592 tokens: TTFT beside full prefill, answer
#   blend-smollm2-135m-fp32  fp32, 2,592 tokens: exact reuse and the GPU against the CPU
#   selftest   kvcraft selftest: round trips bit for bit per tier, GB/s into GPU memory
#   tests      the CUDA tests: tests/gpu, tests/kernels/test_gpu_kernels.py and the CUDA cases
#              of the kernel dispatch and benchmark tests
#   kernels    the Triton kernels against torch SDPA and their references (kvbench.engine.kernels)
# Without CUDA every GPU step is SKIPped with its reason and selftest runs its CPU half.
# Output: stdout; with $OUT set, also $OUT/gpu-check.log, $OUT/summary.txt and the JSON/XML
# reports (otherwise those go to a directory named at the end). Exit 1 if a step FAILed or
# hit its cap, else 0.
#
# Env: PYTHON (python3), GPU_CHECK_WHEELS (.gpu-wheels), GPU_CHECK_BUDGET_S (450),
#      GPU_CHECK_DIR (/var/tmp: selftest's payload file, the served step's data dir; O_DIRECT needs a real filesystem).
set -uo pipefail  # no -e: a failed step is recorded and the next one runs
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
case $py in */*) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac  # absolute (steps cd elsewhere), links kept (a venv)
wheels="${GPU_CHECK_WHEELS:-.gpu-wheels}"
budget="${GPU_CHECK_BUDGET_S:-450}"
start=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvcraft-gpu-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if [ -n "${OUT:-}" ]; then
    res="$OUT"
    mkdir -p "$res"
    exec > >(tee -a "$res/gpu-check.log") 2>&1
    tee_pid=$!
else
    res=$(mktemp -d "${TMPDIR:-/tmp}/kvcraft-gpu-check-results.XXXXXX")
fi
workdir="${GPU_CHECK_DIR:-/var/tmp}"
[ -d "$workdir" ] && [ -w "$workdir" ] || workdir="$tmp"

names=() statuses=() secs=() notes=()
record() { names+=("$1"); statuses+=("$2"); secs+=("$3"); notes+=("$4"); }
amend() { local i=$((${#names[@]} - 1)); statuses[i]="$1"; notes[i]="$2"; }  # the last step's verdict
skip() { echo; echo "== $1: SKIP ($2)"; record "$1" SKIP 0 "$2"; }

# step NAME CAP CMD...: run CMD under min(CAP, what is left of the budget); returns its status.
step() {
    local name=$1 cap=$2
    shift 2
    local avail=$((budget - (SECONDS - start) - 15))  # 15 s kept for the summary
    if [ "$avail" -lt 10 ]; then
        skip "$name" "the check's budget of ${budget}s is spent"
        return 125
    fi
    [ "$cap" -gt "$avail" ] && cap=$avail
    echo
    echo "== $name (cap ${cap}s): $*"
    local t0=$SECONDS rc
    timeout -k 10 "$cap" "$@"
    rc=$?
    if [ $rc -eq 0 ]; then
        record "$name" PASS $((SECONDS - t0)) ""
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        record "$name" TIMEOUT $((SECONDS - t0)) "stopped at its cap of ${cap}s"
    else
        record "$name" FAIL $((SECONDS - t0)) "exit status $rc"
    fi
    return $rc
}

# report KIND FILE: one line for the summary from a step's report; exit 1 if it shows a failure.
report() {
    timeout 30 "$py" - "$@" <<'EOF'
import json, math, sys
import xml.etree.ElementTree as ET

kind, path = sys.argv[1], sys.argv[2]
if kind == "junit":
    s = ET.parse(path).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    n, f, e, k = (int(s.get(a, 0)) for a in ("tests", "failures", "errors", "skipped"))
    print(f"{n - f - e - k} passed, {f + e} failed, {k} skipped")
    sys.exit(1 if f + e else 0)
data = json.load(open(path))
if kind == "selftest":
    st = [r["status"] for r in data["results"]]
    rates = ", ".join(f"{r['path']} {r['gbps']:.1f} GB/s" for r in data["rates"])
    print(f"{st.count('PASS')} PASS, {st.count('FAIL')} FAIL, {st.count('SKIP')} SKIP" + (f"; {rates}" if rates else ""))
elif kind == "kernels":
    # kvbench.engine.kernels measures each kernel's error against its reference but does not judge it;
    # test_gpu_kernels.py holds the tolerances. Here: finite and small, or the step fails.
    tri = [r for r in data["rows"] if r["impl"].startswith("triton")]
    bad = [r["kernel"] for r in tri if not (r["max_abs_err"] is not None and math.isfinite(r["max_abs_err"])
                                            and r["max_abs_err"] < 0.1)]
    att = [r for r in tri if r["kernel"] == "selective_attention"]
    print(f"{len(tri)} Triton rows on {data['device']}, max err {max(r['max_abs_err'] for r in tri):.1e}"
          + (f"; attention {att[0]['ms']:.3f} ms" if att else "") + (f"; WRONG: {bad}" if bad else ""))
    sys.exit(1 if bad else 0)
elif kind == "blend":  # scripts/gpu_blend.py: per run (dtype, prompt length) each case's TTFT, x full, GPU busy
    parts = []
    for run in data:
        def case(r):
            busy = r.get("gpu_busy_share")
            return (f"{r['case'].replace('full prefill', 'full')} {r['ttft_ms']:.1f} ms"
                    + (f" {r['speedup']:.2f}x" if not r["case"].startswith("full prefill") else "")
                    + (f" busy {100 * busy:.0f}%" if busy is not None else ""))
        fails = [c["check"] for c in run["checks"] if c["status"] == "FAIL"]
        parts.append(f"{run['dtype']} {run.get('prompt_tokens', '')} tokens: {', '.join(case(r) for r in run['rows'])}"
                     + (f"; FAILED: {', '.join(fails)}" if fails else ""))
    print("; ".join(parts))
EOF
}

echo "kvcraft GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -n), budget ${budget}s"

# -- env ---------------------------------------------------------------------------------
echo
echo "== env"
if command -v nvidia-smi >/dev/null; then
    timeout -k 5 20 nvidia-smi || echo "nvidia-smi: exit status $?"
else
    echo "nvidia-smi: not on PATH"
fi
step env 90 "$py" - "$tmp/cuda" <<'EOF'
import platform, sys
from importlib import metadata

print(f"python {platform.python_version()} ({sys.executable}), {platform.machine()}")
for name in ("torch", "triton", "grpcio", "protobuf", "rocksdict", "kvikio-cu13", "kvikio-cu12", "transformers"):
    try:
        print(f"  {name:<14} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name:<14} not installed")
import torch

cuda = torch.cuda.is_available()
print(f"torch CUDA build {torch.version.cuda}; CUDA available: {cuda}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
open(sys.argv[1], "w").write(torch.cuda.get_device_name(0) if cuda else "")
EOF
gpu=$(cat "$tmp/cuda" 2>/dev/null || true)
[ "${statuses[-1]}" = PASS ] && amend PASS "${gpu:-no CUDA device}"
no_gpu="torch sees no CUDA device"

# -- wheels ------------------------------------------------------------------------------
site="$tmp/site"
mkdir -p "$site"
if ! compgen -G "$wheels/*.whl" >/dev/null; then
    skip wheels "no $wheels/*.whl: using the packages this Python has"
elif step wheels 180 "$py" - "$wheels" "$site" <<'EOF'
import subprocess, sys, tomllib
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

folder, target = Path(sys.argv[1]), sys.argv[2]
wanted = {}
for dep in tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]:
    r = Requirement(dep)
    wanted[canonicalize_name(r.name)] = r.specifier
take = []
for whl in sorted(folder.glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(whl.name)
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    spec = wanted.get(name)
    if have is not None and (spec is None or spec.contains(have, prereleases=True)):
        print(f"  keep    {name} {have} (installed{'; pyproject: ' + str(spec) if spec else ''})")
    else:
        print(f"  install {name} {version} ({'not installed' if have is None else f'{have} is outside {spec}'})")
        take.append(str(whl))
if take:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", target, *take], check=True)
print(f"installed {len(take)} wheel(s) into {target}")
EOF
then
    amend PASS "$(find "$site" -maxdepth 1 -name '*.dist-info' | sed 's|.*/||; s|\.dist-info||' | tr '\n' ' ')"
fi
export PYTHONPATH="$tmp/project:$site${PYTHONPATH:+:$PYTHONPATH}"

# -- project -----------------------------------------------------------------------------
here=$(pwd -P)
from=$(cd / && timeout 60 "$py" -c "import kvbench, os; print(os.path.dirname(os.path.dirname(os.path.realpath(kvbench.__file__))))" 2>/dev/null)
if [ "$from" = "$here" ]; then
    record project PASS 0 "kvcraft installed from this checkout"
    echo; echo "== project: kvcraft installed from this checkout"
else
    echo "kvcraft ${from:+installed from $from, not this checkout}${from:-not installed}: installing this checkout"
    if step project 180 "$py" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
            --no-build-isolation --no-compile --target "$tmp/project" .; then
        amend PASS "this checkout installed into a temporary target"
    else
        # Import names differ from folder names (pyproject package-dir): link them instead.
        rm -rf "$tmp/project"
        timeout 30 "$py" - "$tmp/project" <<'EOF' && amend PASS "pip failed; this checkout linked under its import names"
import sys, tomllib
from pathlib import Path

dst = Path(sys.argv[1])
dst.mkdir(parents=True)
for name, folder in tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items():
    (dst / name).symlink_to(Path(folder).resolve())
EOF
    fi
fi

# -- imports -----------------------------------------------------------------------------
step imports 90 "$py" - "$tmp/imports" <<'EOF'
import importlib, sys
from importlib import metadata

for m in ("kvcraft.v1.kvcraft_pb2_grpc", "kvservice.server.startup", "kvservice.store", "kvservice.tiers.gpu",
          "kvclient.client", "kvclient.copy_stream", "kvkernels", "engine_adapter", "kvcli.selftest",
          "kvbench.engine.kernels", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "rocksdict"):
    importlib.import_module(m)
print("imported the project's packages and grpc health/reflection, rocksdict")
note = []
for name in ("grpcio", "protobuf", "rocksdict"):
    note.append(f"{name} {metadata.version(name)}")
try:
    import kvikio

    note.append(f"kvikio {kvikio.__version__}")
except Exception as e:  # noqa: BLE001 - selftest skips its kvikio checks then, with this reason
    print(f"kvikio does not import: {type(e).__name__}: {e}")
    note.append("kvikio does not import")
print(", ".join(note))
open(sys.argv[1], "w").write(", ".join(note))
EOF
[ -f "$tmp/imports" ] && amend "${statuses[-1]}" "$(cat "$tmp/imports")"

# -- the issue's numbers first: blended vs full prefill, the service as users run it -------
# Caps: the 8B shape draws 16 GB of random weights on the device and runs both lengths
# (measured on an H100 at 2,592 tokens: 14 s for the whole step); the service step starts
# kvcraft serve, stores 320 MiB of KV and serves 4 cases x 5 requests.
if [ -z "$gpu" ]; then
    skip blend-llama3-8b "$no_gpu"
    skip blend-smollm2-135m "$no_gpu"
    skip serve-llama3-8b "$no_gpu (scripts/gpu_blend.py --serve --device cpu runs the same on CPU)"
    skip blend-smollm2-135m-fp32 "$no_gpu"
else
    blend() {  # blend STEP CAP ARGS...: scripts/gpu_blend.py, its JSON report summarised
        local name=$1 cap=$2
        shift 2
        step "$name" "$cap" "$py" scripts/gpu_blend.py "$@" --json "$res/$name.json"
        [ -f "$res/$name.json" ] && amend "${statuses[-1]}" "$(report blend "$res/$name.json")"
    }
    blend blend-llama3-8b 150 --shape llama3-8b --dtype bf16 --chunks 5 16 --repeats 3
    blend blend-smollm2-135m 100 --shape smollm2-135m --dtype bf16 --chunks 5 16 --repeats 5
    blend serve-llama3-8b 120 --serve --shape llama3-8b --dtype bf16 --chunks 5 --repeats 3 --data-dir "$workdir"
    blend blend-smollm2-135m-fp32 90 --shape smollm2-135m --dtype fp32 --chunks 5 --repeats 3
fi

# -- selftest ----------------------------------------------------------------------------
if [ -n "$gpu" ]; then
    sizes=(--mib 256 --repeat 5)
else
    sizes=(--mib 4 --repeat 1)  # the CPU half: host + disk tiers, store, O_DIRECT
fi
step selftest 150 "$py" -m kvcli.main selftest --no-kernels "${sizes[@]}" --dir "$workdir" --json "$res/selftest.json"
rc=$?
if [ -f "$res/selftest.json" ]; then
    note=$(report selftest "$res/selftest.json")
    [ -z "$gpu" ] && note="$note; CPU half only: $no_gpu"
    amend "${statuses[-1]}" "$note"
fi

# -- CUDA tests, kernels -----------------------------------------------------------------
if [ -z "$gpu" ]; then
    skip tests "$no_gpu (CI runs the CPU halves of tests/gpu and tests/kernels)"
    skip kernels "$no_gpu (the Triton kernels run on CPU only in the interpreter, in CI)"
else
    # One process (-o addopts: the suite's own start pytest-xdist workers, which a GPU image lacks).
    step tests 240 "$py" -m pytest -o addopts="--import-mode=importlib" -p no:xdist -q -p no:cacheprovider -rs \
        --junitxml "$res/pytest.xml" \
        tests/gpu tests/kernels/test_gpu_kernels.py tests/kernels/test_kernels_dispatch.py \
        tests/kernels/test_bench_kernels.py
    rc=$?
    if [ -f "$res/pytest.xml" ] && note=$(report junit "$res/pytest.xml"); then
        [ $rc -eq 0 ] && amend PASS "$note" || amend "${statuses[-1]}" "$note"
    elif [ -f "$res/pytest.xml" ]; then
        amend FAIL "$note"
    fi

    peaks=()
    case "$gpu" in  # datasheet peaks (dense bf16): H100 SXM, H200 SXM
        *H100*) peaks=(--peak-tbps 3.35 --peak-tflops 989) ;;
        *H200*) peaks=(--peak-tbps 4.8 --peak-tflops 989) ;;
    esac
    step kernels 150 "$py" -m kvbench.engine.kernels --json "$res/kernels.json" "${peaks[@]}"
    rc=$?
    if [ -f "$res/kernels.json" ]; then
        note=$(report kernels "$res/kernels.json") && ok=$rc || ok=1
        amend "$([ "$ok" -eq 0 ] && echo PASS || { [ "${statuses[-1]}" = TIMEOUT ] && echo TIMEOUT || echo FAIL; })" "$note"
    fi
fi

# -- summary -----------------------------------------------------------------------------
passed=0 failed=0 skipped=0
for s in "${statuses[@]}"; do
    case $s in PASS) passed=$((passed + 1)) ;; SKIP) skipped=$((skipped + 1)) ;; *) failed=$((failed + 1)) ;; esac
done
{
    echo
    echo "== summary: kvcraft GPU check, ${gpu:-no CUDA device}, $((SECONDS - start)) s"
    for i in "${!names[@]}"; do
        printf '  %-7s %-24s %4ss  %s\n' "${statuses[i]}" "${names[i]}" "${secs[i]}" "${notes[i]}"
    done
    echo "  ran $((passed + failed)), passed $passed, failed or stopped $failed, skipped $skipped; reports in $res"
} | tee "$res/summary.txt"
if [ -n "${tee_pid:-}" ]; then  # let the log's writer finish before the caller collects $OUT
    exec >&- 2>&-
    wait "$tee_pid" 2>/dev/null
fi
[ "$failed" -eq 0 ]
