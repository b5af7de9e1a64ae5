#!/usr/bin/env bash
# The GPU check: every `-m gpu` test, then the GPU rows of the benchmarks, on a fresh CUDA machine, in < 8 minutes.
#
#     bash benchmarks/gpu_check.sh          # from the repository root (or anywhere: it goes there)
#
# It installs what the machine lacks from the wheels in `.whl/` (no network needed: fill `.whl/` beforehand, see
# benchmarks/README.md, "The GPU check"), puts this checkout first on PYTHONPATH, prints the device, runs the tests
# marked `gpu` (tests/test_host_syncs.py runs KVAttention forward + backward and add under
# torch.cuda.set_sync_debug_mode("error")), then `bench_layer.py --device cuda` (its layer, autocast and compile
# rows) and `bench_memory.py --device cuda` where that file exists. Output: the terminal and, where $OUT is set,
# $OUT/gpu_check.log (also the tests' junit XML). Exit status: that of the tests (benchmarks only report).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-}
if [ -n "$OUT_DIR" ]; then
    mkdir -p "$OUT_DIR"
    exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
fi
started=$(date +%s)
say() { echo "== [$(( $(date +%s) - started ))s] $*"; }

# 1. what kvsearch needs at run time and the image may lack (faiss-cpu above all): from .whl/, never the network
if ! "$PY" -c "import faiss, numpy, torch, safetensors, tqdm" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        say "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { say "pip could not install .whl/"; exit 2; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
        say "a runtime dependency is missing (faiss-cpu?) and .whl/ holds no wheels: see benchmarks/README.md"
        exit 2
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" - <<'PYEOF' || exit 2
import faiss, torch
import kvsearch
assert torch.cuda.is_available(), "no CUDA device: the GPU check needs one"
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, faiss {faiss.__version__}, "
      f"kvsearch at {kvsearch.__file__}")
PYEOF

# 2. every test marked gpu (the files that have one: the others need nothing of a GPU)
files=$(grep -l "pytest.mark.gpu" tests/test_*.py)
say "pytest -m gpu: $(echo $files | wc -w) files"
junit=()
[ -n "$OUT_DIR" ] && junit=(--junitxml "$OUT_DIR/gpu_tests.xml")
timeout 270 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -ra "${junit[@]}" $files
tests=$?
say "tests exit status $tests"

# 3. the GPU rows of the benchmarks (reported, not appended to RESULTS.md)
say "bench_layer.py --device cuda (layer, autocast, compile)"
timeout 150 "$PY" benchmarks/bench_layer.py --device cuda --quick --no-append --sections layer,precision \
    || say "bench_layer.py stopped (status $?)"
if [ -f benchmarks/bench_memory.py ]; then
    say "bench_memory.py --device cuda"
    timeout 90 "$PY" benchmarks/bench_memory.py --device cuda --quick --no-append || say "bench_memory.py stopped (status $?)"
fi
say "done"
exit $tests
