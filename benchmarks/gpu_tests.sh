#!/usr/bin/env bash
# The tests that need a GPU, on the lent GPU machine (or any CUDA machine), with
# Transformer Engine staged as ../shared/te/README.md describes (installed in /tmp/tesite).
#   bash benchmarks/gpu_tests.sh [PYTEST FILES...]   (default: every file with gpu tests)
# Prints the versions, then runs `pytest -m gpu`; the log goes to $OUT/pytest-gpu.log
# where OUT is set (the device tool's output folder), else to ./pytest-gpu.log.
set -uo pipefail
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
log=${OUT:-.}/pytest-gpu.log
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_te_backend.py tests/test_te_tensor_parallel.py tests/test_fp8.py tests/test_gpu.py)
{
  date -u +"date %Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
  python3 -c "import transformer_engine as te; print('transformer_engine', te.__version__)" \
    || echo "transformer_engine: not importable (the TE tests will skip)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" || echo "torchao: missing"
  echo "python3 -m pytest -m gpu -p no:cacheprovider -rA -s ${files[*]}"
} 2>&1 | tee "$log"
python3 -m pytest -m gpu -p no:cacheprovider -rA -s "${files[@]}" 2>&1 | tee -a "$log"
