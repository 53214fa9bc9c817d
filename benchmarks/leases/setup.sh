# Sourced by the lease scripts (run from the repository root on the device machine): the
# carried wheels (.whl/: pydantic, zstandard, torchao, ...) on PYTHONPATH, $OUT made, and
# the GPUs named in $OUT/device.txt.
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
python3 -c "import pydantic, zstandard, torchao" 2>/dev/null ||
  pip install -q --no-deps --target /tmp/tesite .whl/*.whl 2>&1 | grep -v WARNING
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sort | uniq -c | tee "$OUT/device.txt"
