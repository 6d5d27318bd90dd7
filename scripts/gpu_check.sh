#!/usr/bin/env bash
# Check the template on a GPU machine in a few minutes: the CUDA-marked tests, then a one-minute
# scaling sweep (experiment=scaling) over the strategies and 1, 2, 4, ... of the GPUs present,
# ending with the scaling table. Exits non-zero if a test or a sweep job failed.
#
#   scripts/gpu_check.sh                      # extra arguments go to the sweep, e.g. logger=none
set -uo pipefail
cd "$(dirname "$0")/.."

gpus=$(python -c "import torch; print(torch.cuda.device_count())") || exit 1
if [ "$gpus" -lt 1 ]; then
  echo "gpu_check: no CUDA GPU is visible to torch" >&2
  exit 1
fi
devices=1
while [ $((devices * 2)) -le "$gpus" ]; do devices="$devices,$((devices * 2))"; done
[ "${devices##*,}" = "$gpus" ] || devices="$devices,$gpus"
python -c "import torch; print(*(torch.cuda.get_device_name(i) for i in range($gpus)), sep='\n')"

status=0
python -m pytest -q -m cuda || status=1
# A model big enough for the GPUs to have work; still about a minute for the whole sweep.
python train.py -m experiment=scaling "parallel.devices=$devices" trainer.accelerator=cuda \
  model.hidden=1024 model.depth=8 trainer.batch_size=1024 \
  "hydra.sweep.dir=outputs/multirun/gpu-check/$(date +%Y-%m-%d_%H-%M-%S)" "$@" || status=1
exit $status
