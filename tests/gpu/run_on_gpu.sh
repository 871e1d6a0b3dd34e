#!/usr/bin/env bash
# The GPU checks (tests/gpu), on a machine with an NVIDIA GPU and a python3 whose torch has
# CUDA, with nvidia-ml-py and pytest. Run from the repository root; what ran goes to $OUT
# (default ./gpu-report): the GPU, the versions, pytest's log and junit XML, the NVML reads,
# the preflight's result, an agent's /metrics and log. Wheels in .whl/ (this package and any
# dependency the machine lacks) are installed into /tmp/site first.
set -u
OUT=${OUT:-$PWD/gpu-report}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
{
  nvidia-smi
  nvidia-smi -q >"$OUT/nvidia-smi-q.txt" 2>&1
  "$PY" -c 'import torch, pynvml; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version(), "nvml", pynvml.__file__)'
} >"$OUT/gpu-info.txt" 2>&1
export TRAINGUARD_GPU_REPORT_DIR=$OUT PYTHONUNBUFFERED=1
# --confcutdir: the GPU checks need none of the other folders' fixtures (nor their imports)
"$PY" -m pytest -q -p no:cacheprovider --confcutdir tests/gpu -rA --durations 0 \
  --junitxml "$OUT/junit.xml" "${@:-tests/gpu}" 2>&1 | tee "$OUT/pytest.txt"
exit "${PIPESTATUS[0]}"
