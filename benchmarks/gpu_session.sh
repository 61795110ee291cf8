#!/usr/bin/env bash
# The GPU session, from a bare copy of this tree (no install): README's "GPU session" section has the
# device-tool commands. Results go to $OUT (default gpu-results/), two files per part.
#
#   bash benchmarks/gpu_session.sh env cuda-tests      # parts, in order; `--help` lists them
#   bash benchmarks/gpu_session.sh rehearse            # every part at toy sizes on a CPU (CI runs this)
#
# Wheels carried in .whl/ (the GPU machine reaches no registry) are installed first; a wheel that
# does not install stops the run here, before any part, with pip's reason.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d /tmp/lowmem-wheels.XXXXXX)
  if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl; then
    echo "gpu_session: the wheels in .whl/ did not install (above: pip's reason). Download them again with" \
         "README's command (GPU session) and carry .whl" >&2
    exit 3
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# This tree first: lowmem_grpo (and its kernels/) imports from it.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" benchmarks/gpu_session.py "$@"
