#!/usr/bin/env bash
# Check the template on a GPU machine in a few minutes, in this order (cheapest first):
#   1. the default run (`python train.py`) on the GPU;
#   2. the CUDA-marked tests: every strategy that fits on the GPUs present, a kill-and-resume;
#   3. the GPU benchmark: template vs a plain loop on the same GPU, and the per-step overhead;
#      gpt2_124m against a nanoGPT-style loop (tokens/s, MFU);
#      with 2 GPUs or more, tp 2 against ddp 2 and the pipeline schedules' idle time (pp);
#   4. a one-minute scaling sweep (experiment=scaling) over the strategies and 1, 2, 4, ... of the
#      GPUs present, ending with the scaling table;
#   5. the full test suite (CPU tests are pinned to the CPU and must pass on a GPU box too).
# Exits non-zero if any part failed; each part runs anyway.
#
#   scripts/gpu_check.sh                      # extra arguments go to the sweep, e.g. logger=none
#   GPU_CHECK_SKIP_SUITE=1 scripts/gpu_check.sh   # without part 5
#
# It runs on the machine's own torch (2.11 or later): the other requirements may come from a
# folder on PYTHONPATH, as they do on a machine without network (scripts/gpu_wheels.sh makes
# the wheels; docs/gpus.md says how). PYTHON names the interpreter (default: python, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-$(command -v python || command -v python3)}
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())") || exit 1
if [ "$gpus" -lt 1 ]; then
  echo "gpu_check: no CUDA GPU is visible to torch" >&2
  exit 1
fi
devices=1
while [ $((devices * 2)) -le "$gpus" ]; do devices="$devices,$((devices * 2))"; done
[ "${devices##*,}" = "$gpus" ] || devices="$devices,$gpus"
"$python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'from', torch.__file__)
for i in range(torch.cuda.device_count()): print(f'cuda:{i}', torch.cuda.get_device_name(i))"
# W&B is a runtime dependency; a box without it still checks everything else.
logger=()
"$python" -c "import wandb" 2>/dev/null || { echo "wandb is not installed: logger=none"; logger=(logger=none); }

failed=()
part() {  # part NAME COMMAND...: run one part, time it, remember failures
  local name=$1 start=$SECONDS
  shift
  echo; echo "=== gpu_check: $name"
  "$@" || failed+=("$name")
  echo "=== gpu_check: $name took $((SECONDS - start)) s"
}
stamp=$(date +%Y-%m-%d_%H-%M-%S)
part "default run" "$python" train.py "${logger[@]}" "hydra.run.dir=outputs/gpu-check/$stamp/default"
part "cuda tests" "$python" -m pytest -q -m cuda -p no:cacheprovider
part "benchmark" "$python" scripts/benchmark.py --device cuda --only single --only overhead --rounds 3
# gpt2_124m, bf16, compiled: the template against a nanoGPT-style loop, with tokens/s and MFU.
# One round: each side compiles (about a minute) before its 100 timed steps.
part "gpt2 benchmark" "$python" scripts/benchmark.py --device cuda --only gpt2 --rounds 1 --steps 120
# tensor parallel against ddp, and the pipeline schedules' idle time against their bubble: 2 GPUs.
if [ "$gpus" -ge 2 ]; then
  part "tp and pp benchmark" "$python" scripts/benchmark.py --device cuda --only tp --only pp --rounds 3
fi
# A model big enough for the GPUs to have work; still about a minute for the whole sweep.
part "scaling sweep" "$python" train.py -m experiment=scaling "parallel.devices=$devices" \
  trainer.accelerator=cuda model.hidden=1024 model.depth=8 trainer.batch_size=1024 \
  "hydra.sweep.dir=outputs/gpu-check/$stamp/sweep" "${logger[@]}" "$@"
# Three test files at a time suit 2 cores (pyproject.toml); a GPU machine's cores take more.
workers=$(( $(nproc) / 2 > 3 ? $(nproc) / 2 : 3 ))
[ -n "${GPU_CHECK_SKIP_SUITE:-}" ] ||
  part "full test suite" "$python" -m pytest -q -p no:cacheprovider -n "$workers"

echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all parts passed"
