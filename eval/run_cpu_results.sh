#!/usr/bin/env bash
# The CPU results of eval/RESULTS.md: SmolLM2-135M-Instruct (GGUF, fp32), 2 cores, one thread per process.
# Every budget is at most 1/8 of the context. Usage: bash eval/run_cpu_results.sh [RESULTS_ROOT]
# Re-running resumes (finished samples are skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-results/cpu}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
run() { echo "+ flexicache eval $*"; python -m flexicache.cli eval --model smollm2 --device cpu --no-progress "$@"; }

run --suite synthetic --tasks passkey --lengths 2048 --limit 3 --budget 256 --out "$root/passkey-2k"
run --suite ppl --data "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')/argparse.py" \
    --context-length 1024 --prefill 128 --budget 128 --out "$root/ppl-1k"
run --suite synthetic --tasks niah_single_1 vt --lengths 2048 --limit 2 --max-new-tokens 24 --budget 256 \
    --out "$root/ruler-2k"
python eval/build_lcc_set.py --count 4 --min-words 800 --max-words 1600 --out "$root/lcc_stdlib_4.jsonl"
run --suite lcc --data "$root/lcc_stdlib_4.jsonl" --context-length 4096 --max-new-tokens 24 --budget 256 \
    --out "$root/lcc"
run --suite synthetic --tasks passkey --lengths 4096 --limit 3 --budget 512 --out "$root/passkey-4k"
run --suite leval --context-length 2048 --limit 1 --max-new-tokens 128 --budget 256 --out "$root/longgen-2k"
