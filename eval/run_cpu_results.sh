#!/usr/bin/env bash
# The CPU accuracy results of eval/RESULTS.md: per model, task and budget, dense | oracle pages | FlexiCache (its
# settings) | Quest's bound (spread_weight=1.0 in the model's axes), budgets at context/8 and context/16 (perplexity:
# of the final context), greedy decoding, fp32 on the CPU, one thread per process. Every folder's rows choose pages
# by box scores unless they say exact_rescore=true (eval_cpu). Every folder resumes (finished samples are skipped),
# so the script can be stopped and re-run. Usage: bash eval/run_cpu_results.sh [RESULTS_ROOT] [MODEL...]
# (models: smollm2 qwen2.5-coder gemma3; levers: each page-scoring option's effect on SmolLM2; profiles: the head
# split's; default all).
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-eval/results/cpu}
shift || true
models=("${@:-smollm2 levers profiles qwen2.5-coder gemma3}")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
stdlib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

# flexicache eval on the CPU; --exact-rescore false --standby-pages quarter --exact-candidates 2 --head-budgets
# uniform --split-score overlap: the folders' own rows choose pages by box scores, keep K // 4 pages on standby, give
# every head K pages and (without a profile) rank the heads by page overlap (rows with exact_rescore=true, K standby
# pages, spelled standby_pages=budget/8 at 8-token pages, exact_candidates=3, head_budgets=prompt and
# split_score=staleness are the library's defaults; rows without exact_candidates choose among 2K candidates, rows
# without head_budgets give every head K pages, rows without split_score rank by page overlap)
eval_cpu() {
    python -m flexicache.cli eval --device cpu --no-progress --exact-rescore false --standby-pages quarter \
        --exact-candidates 2 --head-budgets uniform --split-score overlap "$@"
}

# the same without the box-score pins: folders whose rows keep the library's exact rescoring and standby pages
eval_cpu_exact() {
    python -m flexicache.cli eval --device cpu --no-progress --exact-candidates 2 --head-budgets uniform \
        --split-score overlap "$@"
}

# eval MODEL OUT BUDGET... [SPEC...] -- ARGS: one folder at 16-token pages without standby pages (the paper's page
# size and stable heads: the oracle pages, FlexiCache and Quest's bound rows at each budget) with 8-token pages and a
# quarter of K on standby beside them at each budget, and a row per extra method SPEC (e.g. budget=256,profile=online)
eval_rows() {
    local model=$1 out=$2; shift 2
    local budgets=() quest=() defaults=() extra=()
    while [[ $1 != -- ]]; do
        if [[ $1 == *=* ]]; then extra+=("$1"); else
            budgets+=("$1"); quest+=("budget=$1,spread_weight=1.0,principal_bounds=false")
            defaults+=("budget=$1,page_size=8,standby_pages=quarter"); fi
        shift
    done
    shift
    local methods=("${defaults[@]}" "${quest[@]}" "${extra[@]}")
    echo "+ flexicache eval --model $model --budget ${budgets[*]} --oracle --method ${methods[*]} $* --out $out"
    eval_cpu --model "$model" --page-size 16 --standby-pages 0 \
        --budget "${budgets[@]}" --oracle --method "${methods[@]}" "$@" --out "$out"
}

# gemma3_exact_8k TASK OUT METHOD [ARGS...]: Gemma-3-270M's synthetic TASK at 8k, 20 samples, 8-token pages, the
# FlexiCache row METHOD (e.g. budget=1024,exact_rescore=true) beside dense
gemma3_exact_8k() {
    local task=$1 out=$2 method=$3; shift 3
    eval_cpu --model gemma3 --suite synthetic --tasks "$task" --lengths 8192 --limit 20 --max-new-tokens 24 \
        --context-length 8192 --page-size 8 --method "$method" "$@" --out "$out"
}
# Qwen2.5-Coder, one synthetic task at one length, 20 samples, 8-token pages, no profile
qwen_synthetic_online() {
    local task=$1 length=$2 out=$3 method=$4; shift 4
    eval_cpu --model qwen2.5-coder --suite synthetic --tasks "$task" --lengths "$length" --limit 20 \
        --max-new-tokens 24 --context-length "$length" --page-size 8 --profile online --method "$method" "$@" \
        --out "$out"
}

for model in ${models[@]}; do
    case $model in
        smollm2)  # 8k context window: synthetic retrieval at 4k and 8k
            eval_rows smollm2 "$root/smollm2/synthetic-4k" 512 256 budget=512,rerank_warmup=16 budget=256,rerank_warmup=16 \
                -- --suite synthetic \
                --tasks passkey niah_single_1 --lengths 4096 --limit 20 --max-new-tokens 24
            python eval/build_lcc_set.py --count 20 --min-words 800 --max-words 1600 --out "$root/lcc_stdlib_20.jsonl"
            eval_rows smollm2 "$root/smollm2/lcc-4k" 512 256 budget=512,rerank_warmup=16 budget=256,rerank_warmup=16 -- \
                --suite lcc --data "$root/lcc_stdlib_20.jsonl" \
                --context-length 4096 --max-new-tokens 24
            eval_rows smollm2 "$root/smollm2/ppl-1.5k" 192 96 budget=192,profile=online budget=96,profile=online -- \
                --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024
            eval_rows smollm2 "$root/smollm2/synthetic-8k" 1024 512 -- --suite synthetic \
                --tasks passkey niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24
            ;;
        qwen2.5-coder)  # 32k context window: 8k prompts; perplexity at 2k (one core's time)
            eval_rows qwen2.5-coder "$root/qwen2.5-coder/ppl-2k" 256 128 budget=256,profile=online \
                budget=128,profile=online budget=256,rerank_warmup=16 budget=128,rerank_warmup=16 \
                budget=256,host_dtype=float8_e4m3fn budget=256,page_size=8,rerank_interval=2 \
                budget=256,page_size=8,rerank_interval=2,profile=online \
                budget=256,page_size=8,rerank_interval=2,max_promotions=3 \
                budget=256,page_size=8,standby_pages=quarter,profile=online \
                budget=128,page_size=8,standby_pages=quarter,profile=online -- --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536
            # the library's defaults without a profile beside the oracle pages of their page size (8 tokens), twice
            # the standby pages, reranks every 8 steps, and other spread weights
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online --budget 256 128 --oracle --method budget=256,standby_pages=16 \
                budget=256,rerank_interval=8 budget=256,spread_weight=0.25 budget=256,spread_weight=0.75 \
                budget=256,spread_weight=1.0 --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 2048 --prefill 1536 --out "$root/levers/qwen2.5-coder-ppl-2k-page8"
            # the exact second stage (exact_rescore) beside the defaults without a profile
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online --budget 256 128 --method budget=256,exact_rescore=true budget=128,exact_rescore=true \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-exact"
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online --method budget=256,exact_rescore=true budget=256,exact_rescore=true,standby_pages=32 \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-replicate-exact-online"
            # is what the defaults lose at 1/8 the stable heads' staleness? their reranks every step and every 4 steps
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online --method budget=256,exact_rescore=true,rerank_interval=1 \
                budget=256,exact_rescore=true,rerank_interval=4 --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 2048 --prefill 1536 --out "$root/levers/qwen2.5-coder-ppl-2k-exact-rerank-online"
            # the same with HeadProfile.default (no --profile), the split of the qwen2.5-coder/ppl-2k rows
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 \
                --budget 256 128 --method budget=256,exact_rescore=true budget=128,exact_rescore=true \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-default-profile-exact"
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online --budget 256 128 --method budget=256,exact_rescore=true,standby_pages=32 \
                budget=128,exact_rescore=true,standby_pages=16 --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 2048 --prefill 1536 --out "$root/levers/qwen2.5-coder-ppl-2k-exact-standby"
            eval_cpu --model qwen2.5-coder --suite lcc --page-size 8 \
                --budget 320 160 --method budget=320,exact_rescore=true budget=160,exact_rescore=true \
                --data "$root/lcc_stdlib_20.jsonl" --context-length 8192 --max-new-tokens 24 \
                --out "$root/levers/qwen2.5-coder-lcc-3k-exact"
            eval_cpu --model qwen2.5-coder --suite synthetic \
                --tasks passkey niah_single_1 --lengths 8192 --limit 20 --max-new-tokens 24 --context-length 8192 \
                --page-size 8 --budget 1024 --method budget=1024,exact_rescore=true \
                --out "$root/levers/qwen2.5-coder-synthetic-8k-exact"
            # next-line completion and passkey without a profile (the library's default head split)
            eval_cpu --model qwen2.5-coder --suite lcc --page-size 8 --profile online \
                --budget 320 160 --method budget=320,exact_rescore=true budget=160,exact_rescore=true \
                --data "$root/lcc_stdlib_20.jsonl" --context-length 8192 --max-new-tokens 24 \
                --out "$root/levers/qwen2.5-coder-lcc-3k-exact-online"
            eval_cpu --model qwen2.5-coder --suite lcc --page-size 8 --profile online \
                --method budget=320,exact_rescore=true,standby_pages=40 budget=160,exact_rescore=true,standby_pages=20 \
                --data "$root/lcc_stdlib_20.jsonl" --context-length 8192 --max-new-tokens 24 \
                --out "$root/levers/qwen2.5-coder-lcc-3k-exact-standby-online"
            qwen_synthetic_online passkey 8192 "$root/levers/qwen2.5-coder-synthetic-8k-passkey-exact-online" \
                budget=1024,exact_rescore=true --budget 1024
            qwen_synthetic_online niah_single_1 8192 "$root/levers/qwen2.5-coder-synthetic-8k-niah-exact-online" \
                budget=1024,exact_rescore=true --budget 1024
            # the same with K standby pages (the defaults)
            qwen_synthetic_online passkey 8192 "$root/levers/qwen2.5-coder-synthetic-8k-passkey-exact-standby-online" \
                budget=1024,exact_rescore=true,standby_pages=128
            qwen_synthetic_online niah_single_1 8192 \
                "$root/levers/qwen2.5-coder-synthetic-8k-niah-exact-standby-online" \
                budget=1024,exact_rescore=true,standby_pages=128
            # the defaults: the prompt's split and 3K candidates
            qwen_synthetic_online passkey 8192 "$root/levers/qwen2.5-coder-synthetic-8k-passkey-candidates-online" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3
            qwen_synthetic_online niah_single_1 8192 "$root/levers/qwen2.5-coder-synthetic-8k-niah-candidates-online" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3
            # the defaults: the online split ranking heads by what staleness costs them (split_score=staleness)
            qwen_synthetic_online passkey 8192 "$root/levers/qwen2.5-coder-synthetic-8k-passkey-staleness-online" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,split_score=staleness
            qwen_synthetic_online niah_single_1 8192 "$root/levers/qwen2.5-coder-synthetic-8k-niah-staleness-online" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,split_score=staleness
            # the same at 1/16 (budget 512, K = 64 standby pages)
            eval_cpu --model qwen2.5-coder --suite synthetic \
                --tasks passkey niah_single_1 --lengths 8192 --limit 20 --max-new-tokens 24 --context-length 8192 \
                --page-size 8 --profile online --method budget=512,exact_rescore=true,standby_pages=64 \
                --out "$root/levers/qwen2.5-coder-synthetic-8k-16-exact-standby-online"
            # the same at 16k, budget 2048
            qwen_synthetic_online passkey 16384 "$root/levers/qwen2.5-coder-synthetic-16k-passkey-exact-online" \
                budget=2048,exact_rescore=true
            qwen_synthetic_online niah_single_1 16384 "$root/levers/qwen2.5-coder-synthetic-16k-niah-exact-online" \
                budget=2048,exact_rescore=true
            qwen_synthetic_online passkey 16384 \
                "$root/levers/qwen2.5-coder-synthetic-16k-passkey-exact-standby-online" \
                budget=2048,exact_rescore=true,standby_pages=256
            qwen_synthetic_online niah_single_1 16384 \
                "$root/levers/qwen2.5-coder-synthetic-16k-niah-exact-standby-online" \
                budget=2048,exact_rescore=true,standby_pages=256
            # the defaults at 16k (3K candidates, each layer's pages split across its heads at the prompt)
            qwen_synthetic_online passkey 16384 "$root/levers/qwen2.5-coder-synthetic-16k-passkey-candidates-online" \
                budget=2048,exact_rescore=true,standby_pages=256,head_budgets=prompt,exact_candidates=3
            qwen_synthetic_online niah_single_1 16384 \
                "$root/levers/qwen2.5-coder-synthetic-16k-niah-candidates-online" \
                budget=2048,exact_rescore=true,standby_pages=256,head_budgets=prompt,exact_candidates=3
            # the same with the staleness ranking (the defaults)
            qwen_synthetic_online passkey 16384 "$root/levers/qwen2.5-coder-synthetic-16k-passkey-staleness-online" \
                budget=2048,exact_rescore=true,standby_pages=256,head_budgets=prompt,exact_candidates=3,split_score=staleness
            qwen_synthetic_online niah_single_1 16384 \
                "$root/levers/qwen2.5-coder-synthetic-16k-niah-staleness-online" \
                budget=2048,exact_rescore=true,standby_pages=256,head_budgets=prompt,exact_candidates=3,split_score=staleness
            eval_cpu --model qwen2.5-coder --suite synthetic \
                --tasks passkey --lengths 8192 --limit 20 --max-new-tokens 24 --context-length 8192 \
                --page-size 8 --method budget=512,exact_rescore=true \
                --out "$root/levers/qwen2.5-coder-synthetic-8k-16-exact"
            eval_cpu --model qwen2.5-coder --suite synthetic \
                --tasks niah_single_1 --lengths 8192 --limit 20 --max-new-tokens 24 --context-length 8192 \
                --page-size 8 --method budget=512,exact_rescore=true \
                --out "$root/levers/qwen2.5-coder-synthetic-8k-niah-16-exact"
            # each request's pages split across a layer's KV heads at the prompt (head_budgets=prompt), other defaults
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-head-budgets-online"
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-replicate-head-budgets-online"
            # the defaults: exact rescoring among 3K candidates and the prompt's split (exact_candidates=3)
            eval_cpu_exact --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3 \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-candidates-online"
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3 \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-replicate-candidates-online"
            # the defaults: the online split ranking heads by what staleness costs them (split_score=staleness)
            eval_cpu_exact --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-staleness-online"
            eval_cpu_exact --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-replicate-staleness-online"
            eval_cpu_exact --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --data "$stdlib/enum.py" "$stdlib/functools.py" "$stdlib/pathlib.py" "$stdlib/tempfile.py" \
                --context-length 2048 --prefill 1536 --out "$root/levers/qwen2.5-coder-ppl-2k-four-more-files-staleness-online"
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 --profile online --budget 256 --oracle \
                --data "$stdlib/enum.py" "$stdlib/functools.py" "$stdlib/pathlib.py" "$stdlib/tempfile.py" \
                --context-length 2048 --prefill 1536 --out "$root/levers/qwen2.5-coder-ppl-2k-four-more-files-oracle"
            eval_cpu_exact --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,page_size=4,exact_rescore=true,standby_pages=64,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --data "$stdlib/enum.py" "$stdlib/functools.py" "$stdlib/pathlib.py" "$stdlib/tempfile.py" \
                --context-length 2048 --prefill 1536 --out "$root/levers/qwen2.5-coder-ppl-2k-four-more-files-page4"
            # the defaults with the float8 host tier (host_dtype=float8_e4m3fn)
            eval_cpu_exact --model qwen2.5-coder --suite ppl --page-size 8 --profile online --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,split_score=staleness,host_dtype=float8_e4m3fn \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-float8-staleness-online"
            eval_cpu_exact --model qwen2.5-coder --suite ppl --page-size 8 --profile online --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,split_score=staleness,host_dtype=float8_e4m3fn \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-replicate-float8-staleness-online"
            # half the heads unstable (unstable_fraction=0.5), the defaults otherwise
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,unstable_fraction=0.5 \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-unstable-fraction"
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,unstable_fraction=0.5 \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-replicate-unstable-fraction"
            # every head unstable (unstable_fraction=1.0), the first pair
            eval_cpu --model qwen2.5-coder --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-every-head-unstable"
            # the stable heads reranked every 8 steps, the defaults otherwise
            python -m flexicache.cli eval --device cpu --no-progress --split-score overlap --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,rerank_interval=8 \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-rerank-interval-online"
            # the same, at most K/4 pages promoted per rerank
            python -m flexicache.cli eval --device cpu --no-progress --split-score overlap --model qwen2.5-coder --suite ppl --page-size 8 \
                --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,rerank_interval=8,max_promotions=8 \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/qwen2.5-coder-ppl-2k-rerank-interval-promotions-online"
            eval_cpu --model qwen2.5-coder --suite lcc --page-size 8 --profile online \
                --method budget=320,exact_rescore=true,standby_pages=40,head_budgets=prompt,exact_candidates=3 \
                budget=160,exact_rescore=true,standby_pages=20,head_budgets=prompt,exact_candidates=3 \
                --data "$root/lcc_stdlib_20.jsonl" --context-length 8192 --max-new-tokens 24 \
                --out "$root/levers/qwen2.5-coder-lcc-3k-candidates-online"
            eval_cpu --model qwen2.5-coder --suite lcc --page-size 8 --profile online \
                --method budget=320,exact_rescore=true,standby_pages=40,head_budgets=prompt \
                budget=160,exact_rescore=true,standby_pages=20,head_budgets=prompt \
                --data "$root/lcc_stdlib_20.jsonl" --context-length 8192 --max-new-tokens 24 \
                --out "$root/levers/qwen2.5-coder-lcc-3k-head-budgets-online"
            # the defaults: the online split ranking heads by what staleness costs them (split_score=staleness)
            eval_cpu --model qwen2.5-coder --suite lcc --page-size 8 --profile online \
                --method budget=320,exact_rescore=true,standby_pages=40,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                budget=160,exact_rescore=true,standby_pages=20,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --data "$root/lcc_stdlib_20.jsonl" --context-length 8192 --max-new-tokens 24 \
                --out "$root/levers/qwen2.5-coder-lcc-3k-staleness-online"
            # 40 more completions (another seed, no record shared with the 20): both rankings at 1/8
            python eval/build_lcc_set.py --count 40 --seed 1 --min-words 800 --max-words 1600 \
                --out "$root/lcc_stdlib_seed1_40.jsonl"
            eval_cpu --model qwen2.5-coder --suite lcc --page-size 8 --profile online \
                --method budget=320,exact_rescore=true,standby_pages=40,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                budget=320,exact_rescore=true,standby_pages=40,head_budgets=prompt,exact_candidates=3,split_score=overlap \
                --data "$root/lcc_stdlib_seed1_40.jsonl" --context-length 8192 --max-new-tokens 24 \
                --out "$root/levers/qwen2.5-coder-lcc-3k-seed1-40-online"
            eval_cpu --model qwen2.5-coder --suite synthetic \
                --tasks passkey niah_single_1 --lengths 8192 --limit 20 --max-new-tokens 24 --context-length 8192 \
                --page-size 8 --profile online \
                --method budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt \
                --out "$root/levers/qwen2.5-coder-synthetic-8k-head-budgets-online"
            eval_rows qwen2.5-coder "$root/qwen2.5-coder/synthetic-8k" 1024 512 -- --suite synthetic \
                --tasks passkey niah_single_1 --lengths 8192 --limit 20 --max-new-tokens 24
            eval_rows qwen2.5-coder "$root/qwen2.5-coder/lcc-8k" 1024 512 budget=1024,rerank_warmup=16 \
                budget=512,rerank_warmup=16 -- --suite lcc \
                --data "$root/lcc_stdlib_20.jsonl" --context-length 8192 --max-new-tokens 24
            # the same files' prompts are 1.8k-3.7k tokens (mean 2.7k): budgets 320 and 160 are 1/8 and 1/16 of the mean
            eval_rows qwen2.5-coder "$root/qwen2.5-coder/lcc-3k" 320 160 -- --suite lcc \
                --data "$root/lcc_stdlib_20.jsonl" --context-length 8192 --max-new-tokens 24
            ;;
        gemma3)  # hybrid: 5 sliding-window (512) layers per global layer; the budget applies to the global layers.
            # About a minute per row and sample on one core: 1/8 in full, 1/16 with the defaults only;
            # the two tasks in two folders, so that they can run side by side on two cores (a folder stopped early:
            # --summarize-only, its n in the table). The runs with --profile online and no unstable_fraction were
            # measured while the split kept one of the three paged heads stable; the split now keeps none (fewer than
            # four paged heads), so they now give the unstable_fraction=1.0 rows.
            eval_rows gemma3 "$root/gemma3/synthetic-8k" 1024 budget=512,page_size=8,standby_pages=quarter -- \
                --suite synthetic --tasks passkey --lengths 8192 --limit 20 --max-new-tokens 24
            eval_rows gemma3 "$root/gemma3/niah-8k" 1024 budget=512,page_size=8,standby_pages=quarter -- \
                --suite synthetic --tasks niah_single_1 --lengths 8192 --limit 20 --max-new-tokens 24
            eval_rows gemma3 "$root/gemma3/ppl-2k" 256 128 budget=256,page_size=8,rerank_interval=2 \
                budget=256,page_size=8,rerank_interval=2,max_promotions=3 -- --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536
            gemma3_exact_8k passkey "$root/levers/gemma3-synthetic-8k-passkey-exact" budget=1024,exact_rescore=true
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact" budget=1024,exact_rescore=true
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact-seed1" budget=1024,exact_rescore=true --seed 1
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact-seed2" budget=1024,exact_rescore=true --seed 2
            # the same without a profile (the library's default head split)
            gemma3_exact_8k passkey "$root/levers/gemma3-synthetic-8k-passkey-exact-online" budget=1024,exact_rescore=true --profile online
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact-online" budget=1024,exact_rescore=true --profile online
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact-online-seed1" budget=1024,exact_rescore=true --profile online --seed 1
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact-online-seed2" budget=1024,exact_rescore=true --profile online --seed 2
            # the 8-token oracle pages on the first 5 needles (the exact rows' one miss is the fifth)
            eval_cpu --model gemma3 --suite synthetic \
                --tasks niah_single_1 --lengths 8192 --limit 5 --max-new-tokens 24 --context-length 8192 --page-size 8 \
                --budget 1024 --oracle --out "$root/levers/gemma3-synthetic-8k-niah-oracle8"
            eval_cpu --model gemma3 --suite synthetic \
                --tasks niah_single_1 --lengths 8192 --limit 5 --max-new-tokens 24 --context-length 8192 --page-size 8 \
                --method budget=1024,exact_rescore=true,page_size=4 --out "$root/levers/gemma3-synthetic-8k-niah-page4"
            eval_cpu --model gemma3 --suite ppl --page-size 8 \
                --budget 256 128 --method budget=256,exact_rescore=true budget=128,exact_rescore=true \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-exact"
            eval_cpu --model gemma3 --suite ppl --page-size 8 --profile online \
                --budget 256 128 --method budget=256,exact_rescore=true budget=128,exact_rescore=true \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-exact-online"
            # one global KV head of three unstable (what the split from the prompt makes), each of them in turn
            python - "$root" <<'PY'
import sys
from flexicache import HeadProfile
for layer in (5, 11, 17):
    layers = [layer]
    HeadProfile(num_layers=18, num_kv_heads=1, head_dim=256, unstable_heads=[(layer, 0)], sparse_layers=[5, 11, 17],
                calibration={"source": f"fixed: layer {layers} unstable"}).save(
        f"{sys.argv[1]}/profiles/gemma3-unstable-{layer}.json")
PY
            eval_cpu --model gemma3 --suite ppl --page-size 8 \
                --method "budget=256,exact_rescore=true,profile=$root/profiles/gemma3-unstable-5.json" \
                "budget=256,exact_rescore=true,profile=$root/profiles/gemma3-unstable-11.json" \
                "budget=256,exact_rescore=true,profile=$root/profiles/gemma3-unstable-17.json" \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-single-unstable-head"
            eval_cpu --model gemma3 --suite ppl --page-size 8 \
                --budget 256 128 --method budget=256,exact_rescore=true,standby_pages=32 \
                budget=128,exact_rescore=true,standby_pages=16 --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 2048 --prefill 1536 --out "$root/levers/gemma3-ppl-2k-exact-standby"
            eval_cpu --model gemma3 --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32 budget=128,exact_rescore=true,standby_pages=16 \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-exact-standby-online"
            # passkey and needle without a profile, K standby pages (the defaults)
            gemma3_exact_8k passkey "$root/levers/gemma3-synthetic-8k-passkey-exact-standby-online" \
                budget=1024,exact_rescore=true,standby_pages=128 --profile online
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact-standby-online" \
                budget=1024,exact_rescore=true,standby_pages=128 --profile online
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact-standby-online-seed1" \
                budget=1024,exact_rescore=true,standby_pages=128 --profile online --seed 1
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-exact-standby-online-seed2" \
                budget=1024,exact_rescore=true,standby_pages=128 --profile online --seed 2
            # the defaults: exact rescoring among 3K candidates (one KV head per paged layer: head_budgets keeps K)
            eval_cpu --model gemma3 --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3 \
                budget=128,exact_rescore=true,standby_pages=16,head_budgets=prompt,exact_candidates=3 \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-candidates-online"
            eval_cpu --model gemma3 --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3 \
                budget=128,exact_rescore=true,standby_pages=16,head_budgets=prompt,exact_candidates=3 \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-replicate-candidates-online"
            # every paged head unstable (unstable_fraction=1.0; what the defaults do with fewer than four paged heads),
            # and on the second pair the 8-token oracle pages
            eval_cpu --model gemma3 --suite ppl --page-size 8 --profile online \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                budget=128,exact_rescore=true,standby_pages=16,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-every-head-unstable"
            # the defaults and the 8-token oracle pages on four more files
            eval_cpu --model gemma3 --suite ppl --page-size 8 --profile online --budget 256 --oracle \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --data "$stdlib/enum.py" "$stdlib/functools.py" "$stdlib/pathlib.py" "$stdlib/tempfile.py" \
                --context-length 2048 --prefill 1536 --out "$root/levers/gemma3-ppl-2k-four-more-files-online"
            eval_cpu --model gemma3 --suite ppl --page-size 8 --profile online --budget 256 128 --oracle \
                --method budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-replicate-oracle"
            eval_cpu --model gemma3 --suite ppl --page-size 8 --profile online \
                --method budget=128,exact_rescore=true,standby_pages=16,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 2048 --prefill 1536 \
                --out "$root/levers/gemma3-ppl-2k-replicate-every-head-unstable-16"
            gemma3_exact_8k passkey "$root/levers/gemma3-synthetic-8k-passkey-candidates-online" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3 --profile online
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-candidates-online" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3 --profile online
            gemma3_exact_8k passkey "$root/levers/gemma3-synthetic-8k-passkey-every-head-unstable" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                --profile online
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-every-head-unstable" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                --profile online
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-every-head-unstable-seed1" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                --profile online --seed 1
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-every-head-unstable-seed2" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                --profile online --seed 2
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-candidates-online-seed1" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3 --profile online \
                --seed 1
            gemma3_exact_8k niah_single_1 "$root/levers/gemma3-synthetic-8k-niah-candidates-online-seed2" \
                budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3 --profile online \
                --seed 2
            ;;
        levers)  # SmolLM2, one budget: each option of the page selection (and the float8 host tier) on its own and
            # combined; perplexity also with the oracle among the top 2K pages by the box scores (the ceiling of an
            # exact second stage), and with 8-token pages against the rerank interval
            levers=(spread_weight=1.0,principal_bounds=false principal_bounds=false spread_weight=1.0 page_size=8
                    group_reduce=sum rerank_interval=1 rerank_warmup=16 host_dtype=float8_e4m3fn)
            echo "+ levers: ppl"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 192 \
                --page-size 16 --standby-pages 0 --oracle --oracle-candidates 2 \
                --method "${levers[@]/#/budget=192,}" budget=192,spread_weight=0.0 \
                budget=192,spread_weight=0.25 budget=192,spread_weight=0.75 --out "$root/levers/ppl-1.5k"
            echo "+ levers: ppl with 8-token pages (the page size is the folder's: its oracle rows use it too)"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 192 \
                --page-size 8 --standby-pages 0 --oracle --oracle-candidates 2 4 --method budget=192,rerank_interval=1 \
                budget=192,rerank_interval=4 budget=192,rerank_interval=2 budget=192,rerank_warmup=16 \
                budget=192,rerank_interval=2,host_dtype=float8_e4m3fn budget=192,rerank_interval=1,max_promotions=2 \
                budget=192,rerank_interval=1,max_promotions=4 budget=192,rerank_interval=2,max_promotions=2 \
                budget=192,rerank_interval=2,max_promotions=4 budget=192,standby_pages=quarter budget=192,standby_pages=12 \
                --out "$root/levers/ppl-1.5k-page8"
            echo "+ levers: ppl, the exact second stage (exact_rescore) beside the defaults"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 192 96 \
                --method budget=192,exact_rescore=true budget=96,exact_rescore=true --out "$root/levers/ppl-1.5k-exact"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 48 \
                --oracle --method budget=48,exact_rescore=true --out "$root/levers/ppl-1.5k-32-exact"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 48 \
                --method budget=48,exact_rescore=true,standby_pages=6 budget=48,exact_rescore=true,standby_pages=12 \
                budget=48,exact_rescore=true,rerank_interval=1 budget=48,exact_rescore=true,page_size=4 \
                --out "$root/levers/ppl-1.5k-32-levers"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --page-size 4 \
                --budget 48 --oracle --method budget=48,exact_rescore=true --out "$root/levers/ppl-1.5k-32-page4"
            echo "+ levers: 4-token pages at 1/8 with the other defaults, no profile (their own oracle pages beside)"
            eval_cpu --model smollm2 --suite ppl --page-size 4 --profile online \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 192 \
                --oracle --method budget=192,exact_rescore=true,standby_pages=48 \
                --out "$root/levers/ppl-1.5k-page4-exact-standby-online"
            eval_cpu --model smollm2 --suite ppl --page-size 4 --profile online \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --budget 192 \
                --oracle --method budget=192,exact_rescore=true,standby_pages=48 \
                --out "$root/levers/ppl-1.5k-replicate-page4-exact-standby-online"
            echo "+ levers: the defaults at 1/16 without a profile, both pairs of files"
            eval_cpu --model smollm2 --suite ppl --page-size 8 --profile online \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 \
                --method budget=96,exact_rescore=true,standby_pages=12 --out "$root/levers/ppl-1.5k-16-exact-standby-online"
            eval_cpu --model smollm2 --suite ppl --page-size 8 --profile online \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 \
                --method budget=96,exact_rescore=true,standby_pages=12 \
                --out "$root/levers/ppl-1.5k-replicate-16-exact-standby-online"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --budget 192 \
                --method budget=192,exact_rescore=true --out "$root/levers/ppl-1.5k-replicate-exact"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 192 \
                --profile online --method budget=192,exact_rescore=true budget=96,exact_rescore=true \
                budget=192,exact_rescore=true,standby_pages=24 --out "$root/levers/ppl-1.5k-exact-online"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --budget 192 \
                --profile online --method budget=192,exact_rescore=true budget=192,exact_rescore=true,standby_pages=24 \
                --out "$root/levers/ppl-1.5k-replicate-exact-online"
            echo "+ levers: ppl, the exact second stage with more standby pages (the stable heads choose among more)"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 192 \
                --method budget=192,exact_rescore=true,standby_pages=12 budget=192,exact_rescore=true,standby_pages=24 \
                budget=192,exact_rescore=true,rerank_interval=8 --out "$root/levers/ppl-1.5k-exact-standby"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --budget 192 \
                --method budget=192,exact_rescore=true,standby_pages=24 --out "$root/levers/ppl-1.5k-replicate-exact-standby"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 96 \
                --method budget=96,exact_rescore=true,standby_pages=12 --out "$root/levers/ppl-1.5k-16-exact-standby"
            echo "+ levers: a long generation (1k tokens prefilled, 2k decoded) without a profile, against the paper's setting"
            eval_cpu --model smollm2 --suite ppl --page-size 8 --profile online \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 3072 --prefill 1024 --budget 384 256 \
                --oracle --method budget=384,exact_rescore=true budget=256,exact_rescore=true \
                budget=256,page_size=16,standby_pages=0,spread_weight=1.0,principal_bounds=false \
                --out "$root/levers/ppl-3k-decode-2k-exact-online"
            eval_cpu --model smollm2 --suite ppl --page-size 8 --profile online \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 3072 --prefill 1024 \
                --method budget=384,exact_rescore=true,standby_pages=48 budget=256,exact_rescore=true,standby_pages=32 \
                --out "$root/levers/ppl-3k-decode-2k-exact-standby-online"
            echo "+ levers: passkey and needle at 4k, the exact second stage beside the defaults"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks niah_single_1 passkey --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 \
                --page-size 8 --budget 512 256 --method budget=512,exact_rescore=true budget=256,exact_rescore=true \
                --out "$root/levers/synthetic-4k-exact"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks niah_single_1 passkey --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 \
                --page-size 8 --budget 512 256 --method budget=512,exact_rescore=true budget=256,exact_rescore=true \
                --out "$root/levers/synthetic-4k-exact-online"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks niah_single_1 passkey --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 \
                --page-size 8 --budget 512 --method budget=512,exact_rescore=true,standby_pages=64 \
                --out "$root/levers/synthetic-4k-exact-standby"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks niah_single_1 passkey --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 \
                --page-size 8 --method budget=512,exact_rescore=true,standby_pages=64 \
                budget=256,exact_rescore=true,standby_pages=32 --out "$root/levers/synthetic-4k-exact-standby-online"
            echo "+ levers: passkey and needle at 4k, budget 128 (context/budget = 32), the exact second stage"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks passkey niah_single_1 --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 \
                --page-size 8 --budget 128 --oracle --method budget=128,exact_rescore=true \
                --out "$root/levers/synthetic-4k-32-exact"
            echo "+ levers: passkey and needle at 7.7k, budget 1024 (1/7.5) and 512 (1/15), the exact second stage"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks passkey --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 --budget 1024 \
                --method budget=1024,exact_rescore=true --out "$root/levers/synthetic-8k-passkey-exact"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 --budget 1024 \
                --method budget=1024,exact_rescore=true --out "$root/levers/synthetic-8k-niah_single_1-exact"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks passkey --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 \
                --method budget=512,exact_rescore=true --out "$root/levers/synthetic-8k-passkey-16-exact"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 \
                --method budget=512,exact_rescore=true --out "$root/levers/synthetic-8k-niah_single_1-16-exact"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks passkey niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 --budget 1024 \
                --method budget=1024,exact_rescore=true --out "$root/levers/synthetic-8k-exact-online"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks passkey niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 \
                --method budget=1024,exact_rescore=true,standby_pages=128 \
                --out "$root/levers/synthetic-8k-exact-standby-online"
            # the defaults: the prompt's split and 3K candidates
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks passkey niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 \
                --method budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/synthetic-8k-candidates-online"
            echo "+ levers: the main settings on two other files (a replicate of the perplexity rows above)"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --budget 192 \
                --page-size 16 --standby-pages 0 --oracle --method budget=192,page_size=8 \
                budget=192,page_size=8,rerank_interval=2 budget=192,page_size=8,standby_pages=quarter \
                budget=192,page_size=8,rerank_interval=2,max_promotions=2 --out "$root/levers/ppl-1.5k-replicate"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --budget 192 \
                --page-size 8 --standby-pages 0 --oracle --method budget=192,rerank_interval=1 \
                --out "$root/levers/ppl-1.5k-replicate-page8"
            echo "+ levers: each request's pages split across a layer's KV heads at the prompt (head_budgets=prompt)"
            echo "  with the other defaults, no profile"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 192 \
                --profile online --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt \
                --out "$root/levers/ppl-1.5k-head-budgets-online"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --budget 192 \
                --profile online --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt \
                --out "$root/levers/ppl-1.5k-replicate-head-budgets-online"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks niah_single_1 passkey --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 \
                --page-size 8 --method budget=512,exact_rescore=true,standby_pages=64,head_budgets=prompt \
                budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt \
                --out "$root/levers/synthetic-4k-head-budgets-online"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks passkey niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 \
                --method budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt \
                --out "$root/levers/synthetic-8k-head-budgets-online"
            eval_cpu --model smollm2 --suite ppl --page-size 8 --profile online \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 3072 --prefill 1024 \
                --method budget=384,exact_rescore=true,standby_pages=48,head_budgets=prompt \
                budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt \
                --out "$root/levers/ppl-3k-decode-2k-head-budgets-online"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 \
                --method budget=48,exact_rescore=true,standby_pages=6,head_budgets=prompt \
                budget=48,page_size=4,exact_rescore=true,standby_pages=12,head_budgets=prompt \
                --out "$root/levers/ppl-1.5k-32-head-budgets"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 \
                --method budget=48,exact_rescore=true,standby_pages=6,head_budgets=prompt,exact_candidates=3 \
                budget=48,page_size=4,exact_rescore=true,standby_pages=12,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/ppl-1.5k-32-candidates"
            echo "+ levers: an unstable head's exact-rescoring candidates 3K (exact_candidates=3),"
            echo "  with head_budgets=prompt (the defaults) and without, no profile"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3 \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/ppl-1.5k-candidates-online"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3 \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/ppl-1.5k-replicate-candidates-online"
            echo "+ levers: the online split ranking heads by what staleness costs them (split_score=staleness,"
            echo "  the defaults), no profile"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/ppl-1.5k-staleness-online"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/ppl-1.5k-replicate-staleness-online"
            echo "+ levers: the defaults on four more files, their oracle pages (K per head) and three levers"
            more_files=("$stdlib/enum.py" "$stdlib/functools.py" "$stdlib/pathlib.py" "$stdlib/tempfile.py")
            defaults=budget=192,exact_rescore=true,head_budgets=prompt,exact_candidates=3,split_score=staleness
            eval_cpu --model smollm2 --suite ppl --data "${more_files[@]}" --context-length 1536 --prefill 1024 \
                --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/ppl-1.5k-four-more-files-staleness-online"
            eval_cpu --model smollm2 --suite ppl --data "${more_files[@]}" --context-length 1536 --prefill 1024 \
                --page-size 8 --profile online --budget 192 --oracle --out "$root/levers/ppl-1.5k-four-more-files-oracle"
            eval_cpu --model smollm2 --suite ppl --data "${more_files[@]}" --context-length 1536 --prefill 1024 \
                --profile online --method $defaults,standby_pages=24,rerank_interval=8 \
                $defaults,standby_pages=24,unstable_fraction=0.5 $defaults,standby_pages=48 \
                --out "$root/levers/ppl-1.5k-four-more-files-levers"
            echo "+ levers: the defaults with 4-token pages (K = 48 of them, K on standby) on all eight files"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/typing.py" "$stdlib/argparse.py" "$stdlib/dataclasses.py" \
                "$stdlib/inspect.py" "${more_files[@]}" --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,page_size=4,exact_rescore=true,standby_pages=48,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/ppl-1.5k-eight-files-page4-staleness-online"
            echo "+ levers: the defaults with the float8 host tier (host_dtype=float8_e4m3fn)"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 1536 --prefill 1024 --profile online --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,split_score=staleness,host_dtype=float8_e4m3fn \
                --out "$root/levers/ppl-1.5k-float8-staleness-online"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" \
                --context-length 1536 --prefill 1024 --profile online --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,split_score=staleness,host_dtype=float8_e4m3fn \
                --out "$root/levers/ppl-1.5k-replicate-float8-staleness-online"
            echo "+ levers: the share of heads the online split makes unstable (unstable_fraction), the defaults"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,unstable_fraction=0.5 \
                budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt,exact_candidates=3,unstable_fraction=0.5 \
                --out "$root/levers/ppl-1.5k-unstable-fraction"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,unstable_fraction=0.5 \
                budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,unstable_fraction=1.0 \
                budget=96,exact_rescore=true,standby_pages=12,head_budgets=prompt,exact_candidates=3,unstable_fraction=0.5 \
                --out "$root/levers/ppl-1.5k-replicate-unstable-fraction"
            echo "+ levers: the stable heads' reranks every 8 and 4 steps, and every step for the first 64, the defaults"
            python -m flexicache.cli eval --device cpu --no-progress --split-score overlap --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --profile online \
                --page-size 8 --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,rerank_interval=8 \
                budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,rerank_interval=4 \
                budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,rerank_warmup=64 \
                --out "$root/levers/ppl-1.5k-rerank-interval-online"
            python -m flexicache.cli eval --device cpu --no-progress --split-score overlap --model smollm2 --suite ppl \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --profile online \
                --page-size 8 --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,rerank_interval=8 \
                budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,rerank_interval=4 \
                --out "$root/levers/ppl-1.5k-replicate-rerank-interval-online"
            echo "+ levers: the stable heads' reranks every 8 steps with at most K/4 pages promoted each, the defaults"
            python -m flexicache.cli eval --device cpu --no-progress --split-score overlap --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --profile online \
                --page-size 8 --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,rerank_interval=8,max_promotions=6 \
                --out "$root/levers/ppl-1.5k-rerank-interval-promotions-online"
            python -m flexicache.cli eval --device cpu --no-progress --split-score overlap --model smollm2 --suite ppl \
                --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" --context-length 1536 --prefill 1024 --profile online \
                --page-size 8 --method budget=192,exact_rescore=true,standby_pages=24,head_budgets=prompt,exact_candidates=3,rerank_interval=8,max_promotions=6 \
                --out "$root/levers/ppl-1.5k-replicate-rerank-interval-promotions-online"
            echo "+ levers: 2K standby pages per stable head (standby_pages=48 at budget 192), the defaults otherwise"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=48,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/ppl-1.5k-standby-2k-online"
            eval_cpu --model smollm2 --suite ppl --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=48,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/ppl-1.5k-replicate-standby-2k-online"
            eval_cpu_exact --model smollm2 --suite ppl --data "$stdlib/typing.py" "$stdlib/argparse.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,exact_candidates=3 \
                --out "$root/levers/ppl-1.5k-candidates-uniform-online"
            eval_cpu_exact --model smollm2 --suite ppl --data "$stdlib/dataclasses.py" "$stdlib/inspect.py" \
                --context-length 1536 --prefill 1024 --profile online \
                --method budget=192,exact_rescore=true,standby_pages=24,exact_candidates=3 \
                --out "$root/levers/ppl-1.5k-replicate-candidates-uniform-online"
            eval_cpu --model smollm2 --suite ppl --page-size 8 --profile online \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 3072 --prefill 1024 \
                --method budget=384,exact_rescore=true,standby_pages=48,head_budgets=prompt,exact_candidates=3 \
                budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/ppl-3k-decode-2k-candidates-online"
            eval_cpu --model smollm2 --suite ppl --page-size 8 --profile online \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 3072 --prefill 1024 \
                --method budget=384,exact_rescore=true,standby_pages=48,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/ppl-3k-decode-2k-staleness-online"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks niah_single_1 passkey --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 \
                --page-size 8 \
                --method budget=512,exact_rescore=true,standby_pages=64,head_budgets=prompt,exact_candidates=3 \
                budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/synthetic-4k-candidates-online"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks niah_single_1 passkey --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 \
                --page-size 8 \
                --method budget=512,exact_rescore=true,standby_pages=64,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                budget=256,exact_rescore=true,standby_pages=32,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/synthetic-4k-staleness-online"
            echo "+ levers: the defaults with 4-token pages (K = 128, K on standby), passkey and needle at 4k"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks passkey --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 --page-size 8 \
                --method budget=512,page_size=4,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/synthetic-4k-passkey-page4-staleness-online"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks niah_single_1 --lengths 4096 --limit 20 --max-new-tokens 24 --context-length 4096 --page-size 8 \
                --method budget=512,page_size=4,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/synthetic-4k-niah_single_1-page4-staleness-online"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks passkey niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 \
                --method budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3 \
                --out "$root/levers/synthetic-8k-candidates-online"
            # the defaults: the online split ranking heads by what staleness costs them (split_score=staleness)
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks passkey --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 \
                --method budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/synthetic-8k-passkey-staleness-online"
            eval_cpu --model smollm2 --suite synthetic --profile online \
                --tasks niah_single_1 --lengths 7680 --limit 20 --max-new-tokens 24 --page-size 8 \
                --method budget=1024,exact_rescore=true,standby_pages=128,head_budgets=prompt,exact_candidates=3,split_score=staleness \
                --out "$root/levers/synthetic-8k-niah-staleness-online"
            echo "+ levers: niah_single_1 4k"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks niah_single_1 --lengths 4096 --limit 10 --max-new-tokens 24 --budget 256 --oracle \
                --page-size 16 --standby-pages 0 --method "${levers[@]/#/budget=256,}" --out "$root/levers/niah-4k"
            ;;
        profiles)  # SmolLM2, one budget: which heads are unstable (shipped profile, online estimate, fixed splits)
            python - <<'PY'
from flexicache import HeadProfile
shipped = HeadProfile.from_pretrained("smollm2-135m-instruct")
shape = dict(num_layers=shipped.num_layers, num_kv_heads=shipped.num_kv_heads, head_dim=shipped.head_dim,
             model=shipped.model)
every = [(layer, head) for layer in range(shipped.num_layers) for head in range(shipped.num_kv_heads)]
for name, heads, source in (("all-stable", [], "every head stable (reranked every 16 steps)"),
                            ("all-unstable", every, "every head unstable (reranked every step, all pages on device)")):
    HeadProfile(unstable_heads=heads, calibration={"source": source}, **shape).save(
        f"eval/results/cpu/profiles/{name}.json")
PY
            splits=(profile=default profile=online profile=$root/profiles/all-stable.json
                    profile=$root/profiles/all-unstable.json)
            echo "+ profiles: ppl"
            eval_cpu --model smollm2 --suite ppl \
                --data "$stdlib/typing.py" "$stdlib/argparse.py" --context-length 1536 --prefill 1024 --budget 192 \
                --page-size 16 --standby-pages 0 --method "${splits[@]/#/budget=192,}" --out "$root/profiles/ppl-1.5k"
            echo "+ profiles: niah_single_1 4k"
            eval_cpu --model smollm2 --suite synthetic \
                --tasks niah_single_1 --lengths 4096 --limit 10 --max-new-tokens 24 --budget 256 \
                --page-size 16 --standby-pages 0 --method "${splits[@]/#/budget=256,}" --out "$root/profiles/niah-4k"
            ;;
        *) echo "unknown model $model (smollm2, levers, profiles, qwen2.5-coder, gemma3)" >&2; exit 2 ;;
    esac
done
