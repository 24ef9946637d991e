python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit
export FLASHINFER_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws; mkdir -p /tmp/fiws && tar xzf .ficache/ficache.tgz -C /tmp/fiws
S=$(date +%s)
timeout 170 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_gpu_flashinfer.py > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt | cut -c1-400
echo "tests at $(( $(date +%s) - S )) s"
timeout 150 python3 -m flexicache.cli bench --device cuda --layers 32 --cases decode --decode-contexts 32768 1024 --decode-batches 8 --decode-systems dynamic flexicache-1024 --decode-rounds 2 --out $OUT/decode > $OUT/decode.txt 2>&1; grep -E "step_ms_p50" $OUT/decode.txt | cut -c1-330
echo "decode at $(( $(date +%s) - S )) s"
timeout $(( 400 - $(date +%s) + S )) python3 -m flexicache.benchmarks.attention --batch 8 --context 32768 --budget 1024 --layers 16 --steps 48 > $OUT/attention16.txt 2>&1; tail -2 $OUT/attention16.txt
echo "end at $(( $(date +%s) - S )) s"
