#!/usr/bin/env bash
# Runs ddp_run.py N times under torchrun (2 processes) and counts the runs whose stderr says
# "terminate called without an active exception". Example, the rows of docs/design/hooks.md:
#   FRAMEWORK=accelerate HC=1 bash benchmarks/experiments/exit_abort/count.sh 30
#   FRAMEWORK=accelerate HC=0 ...; FRAMEWORK=accelerate HC=1 DESTROY=1 ...
#   FRAMEWORK=torch HC=0 ...; FRAMEWORK=torch HC=0 DESTROY=1 ...
n=${1:-30}; python=${PYTHON:-python}; here=$(dirname "$0"); aborted=0; log=$(mktemp)
for _ in $(seq "$n"); do
  "$python" -m torch.distributed.run --nproc_per_node 2 --master_port $((30000 + RANDOM % 20000)) \
    "$here/ddp_run.py" > "$log" 2>&1
  grep -q "terminate called without an active exception" "$log" && aborted=$((aborted + 1))
done
rm -f "$log"
echo "FRAMEWORK=${FRAMEWORK:-torch} HC=${HC:-0} DESTROY=${DESTROY:-0}: $aborted of $n runs aborted at exit"
