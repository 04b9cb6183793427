#!/usr/bin/env bash
# One lent GPU's checks, as one command (the device tool runs it from the repository root).
#
# Run there, with a timeout_s of 540 (gpu_check stops starting cases after 420 s, BUDGET_S), carrying .whl:
#   bash bench/gpu_session.sh
# The device image lacks msgspec (the typed messages that memory/ and experts/ import): fetch its wheel here
# first (the device tool's README, "Notes"; `echo /.whl/ >> .git/info/exclude`), for CPython 3.12:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl msgspec==0.23.0
# and the script installs every wheel in .whl into /tmp/site. The grammar library, the tokenizer and the
# HTTP stack are not needed by any case (the sampler imports xgrammar at its first constrained row).
# The real-dimension cases read DeepSeek-V4-Flash's config.json from tests/data, which is part of the
# repository the device machine receives; DSV4_REAL_CONFIG_DIR, when set, names another folder.
# What it needs there is what the device image holds (torch, triton, numpy, tqdm); nothing is
# installed: the repository and kernels/ go on PYTHONPATH. Results land in $OUT (or /tmp): the table
# and notes in gpu_check.log, the numbers in gpu_check.json, for bench/RESULTS.md.
# Speculative decoding (issue 19): gpu_cases/spec_decode.py always times the verify sampler; with
# DSV4_REAL_CHECKPOINT_DIR naming the real checkpoint (and the server's dependencies installed) it also serves
# it with --speculative-tokens 0, 1 and 2 (extra server flags in DSV4_SPEC_SERVE_ARGS, e.g. an expert-slot
# cache) and notes tok/s and acceptance; without one it notes that it skipped them.
# gpu_cases/spec_graphs.py captures the speculative steps' graphs (verify per (bucket, n), the MTP chain) on a random
# 2-layer model with its MTP block and checks each replay against the same buffers run eagerly.
# gpu_cases/multi_gpu.py (issue 21) splits a tiny model over 2 (and 4) GPUs over NCCL against one rank when the
# machine has them (a note says so on one GPU); on a lent multi-GPU kind the same command runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp}"
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "could not install the carried wheels"; exit 2; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
export DSV4_REAL_CONFIG_DIR="${DSV4_REAL_CONFIG_DIR:-$PWD/tests/data/DeepSeek-V4-Flash}"
[ -f "$DSV4_REAL_CONFIG_DIR/config.json" ] || { echo "no $DSV4_REAL_CONFIG_DIR/config.json"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu_check.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu_check.log"
python3 bench/gpu_check.py --budget-s "${BUDGET_S:-420}" --json "$out/gpu_check.json" 2>&1 | tee -a "$out/gpu_check.log"
