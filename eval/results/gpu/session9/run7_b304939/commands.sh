python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit
export FLASHINFER_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws; mkdir -p /tmp/fiws && tar xzf .ficache/ficache.tgz -C /tmp/fiws
S=$(date +%s)
B="python3 -m flexicache.cli bench --device cuda --layers 32 --cases memory --memory-contexts 32768 --memory-batch 8"
timeout 100 $B --memory-systems dynamic --out $OUT/mem_dynamic_one_forward > $OUT/mem_dynamic.txt 2>&1; grep -o '"system.\{0,400\}' $OUT/mem_dynamic.txt | grep -o '"system": "[a-z0-9-]*"\|"prefill_chunk": [0-9a-z]*\|"prefill_ms": [0-9.]*\|"peak[a-z_]*": [0-9.]*'
echo "dynamic at $(( $(date +%s) - S )) s"
timeout 120 $B --memory-systems flexicache-1024 --prefill-chunk 4096 --out $OUT/mem_flexicache_chunked > $OUT/mem_flexicache.txt 2>&1; grep -o '"system.\{0,600\}' $OUT/mem_flexicache.txt | grep -o '"system": "[a-z0-9-]*"\|"prefill_chunk": [0-9a-z]*\|"prefill_ms": [0-9.]*\|"peak[a-z_]*": [0-9.]*'
echo "end at $(( $(date +%s) - S )) s"
