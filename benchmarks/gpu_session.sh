#!/usr/bin/env bash
# The GPU session, from a bare copy of this tree (no install): docs/gpu-notes.md has the
# device-tool commands. Results go to $OUT (default gpu-results/): CALL.log, CALL.jsonl, CALL-junit.xml.
#
#   bash benchmarks/gpu_session.sh first        # device call 1 (timeout_s 540); `--help` lists its steps
#   bash benchmarks/gpu_session.sh second       # device call 2 (timeout_s 360), right after the first
#   bash benchmarks/gpu_session.sh rehearse     # both calls at toy sizes on a CPU (CI runs this)
#
# Wheels carried in .whl/ (the GPU machine reaches no registry) are installed first; a wheel that
# does not install stops the run here, before any step, with pip's reason.
set -euo pipefail
cd "$(dirname "$0")/.."
# the call's start: the driver's budget counts from here (the wheels' install comes out of it)
export GPU_SESSION_STARTED="${GPU_SESSION_STARTED:-$(date +%s.%N)}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  # One folder per set of wheels (names, sizes) and Python: a later call on this machine finds them installed.
  key=$( (ls -l .whl/*.whl | awk '{print $5, $NF}'; "$python" -V) | cksum | cut -d' ' -f1)
  site=/tmp/lowmem-wheels-$key
  if [ ! -e "$site/.installed" ]; then
    rm -rf "$site"
    if ! "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
         .whl/*.whl; then
      echo "gpu_session: the wheels in .whl/ did not install (above: pip's reason). Download them again" \
           "with the command in docs/gpu-notes.md and carry .whl" >&2
      exit 3
    fi
    touch "$site/.installed"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# This tree first: lowmem_grpo (and its kernels/) imports from it.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" benchmarks/gpu_session.py "$@"
