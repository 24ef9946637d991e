# Next session's first call: GPU tests on HEAD, then the repeatability check with and without a fixed cuBLAS workspace.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit
export FLASHINFER_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws; mkdir -p /tmp/fiws && tar xzf .ficache/ficache.tgz -C /tmp/fiws
S=$(date +%s)
timeout 200 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_gpu_flashinfer.py > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt | cut -c1-300
echo "at $(( $(date +%s) - S )) s"
timeout 150 python3 eval/gpu_repeatability.py --out $OUT/repeat.json > $OUT/repeat.txt 2>&1; cat $OUT/repeat.txt | tail -30
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 150 python3 eval/gpu_repeatability.py --out $OUT/repeat_cublas.json > $OUT/repeat_cublas.txt 2>&1; tail -30 $OUT/repeat_cublas.txt
echo "at $(( $(date +%s) - S )) s"
