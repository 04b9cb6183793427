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
# machine has them (a note says so on one GPU); on a lent multi-GPU kind the same command runs it, and then
# bench/bench_tp_engine.py --device cuda serves the split engine itself (rank r on cuda:r) against one rank.
# gpu_cases/fp4_moe.py's stream cases (issue 18) time a 2,048- and a 4,096-token prefill chunk whose experts are
# streamed from the pinned bank into device memory 16 at a time (dsv4serve/experts/prefill_stream.py) against the same
# chunk read in place over PCIe, bit for bit.
# SWEEPS=1 first times the decode GEMMs' K-loop forms and splits (bench/gpu_fp4_sweep.py, gpu_fp8_sweep.py: ~4 min)
# and records the fastest in kernels/dsv4_kernels/tuned/<GPU>.json, which the cases then run with (commit the copy
# in $OUT); PROFILE=1 ends with bench/gpu_profile.py at batch 1. The device tool returns at most 8 files from $OUT:
# this script writes at most 6 (gpu_check.log / .json, fp4_sweep.log, fp8_sweep.log, the tuning file, profile.log).
# kt-kernel (the hybrid cases) rides in .whl too: a slimmed wheel (only kt_kernel/ and kt_kernel.libs/, 13.7 MB;
# bench/slim_kt_wheel.py makes it) with gguf, safetensors and pyyaml beside it.
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
if [ "${SWEEPS:-0}" = 1 ]; then  # the decode GEMMs' launch choices, measured and recorded for this card first
  tuned=$(python3 -c "import torch; from dsv4_kernels.tuning import file_for, device_name; print(file_for(device_name(torch.device('cuda'))))")
  timeout 200 python3 bench/gpu_fp4_sweep.py --tokens 1 8 --budget-s 120 --write-tuning "$tuned" > "$out/fp4_sweep.log" 2>&1
  timeout 100 python3 bench/gpu_fp8_sweep.py --rows 1 8 --write-tuning "$tuned" > "$out/fp8_sweep.log" 2>&1
  cp "$tuned" "$out/" 2>/dev/null
fi
python3 bench/gpu_check.py --budget-s "${BUDGET_S:-420}" --json "$out/gpu_check.json" 2>&1 | tee -a "$out/gpu_check.log"
gpus=$(nvidia-smi --list-gpus | wc -l)
if [ "$gpus" -ge 2 ]; then  # issue 21: the server's engine split over ranks (needs pyzmq and safetensors there)
  if python3 -c "import zmq, safetensors, tokenizers" 2>/dev/null; then
    timeout 300 python3 bench/bench_tp_engine.py --device cuda --ranks 2 $([ "$gpus" -ge 4 ] && echo 4) \
      2>&1 | grep -v ' INFO ' | tee -a "$out/gpu_check.log"
  else
    echo "bench_tp_engine: skipped (pyzmq / safetensors / tokenizers not importable: carry their wheels in .whl)" \
      | tee -a "$out/gpu_check.log"
  fi
fi
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 90 python3 bench/gpu_profile.py --batch 1 > "$out/profile.log" 2>&1
fi
