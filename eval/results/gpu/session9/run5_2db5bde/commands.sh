python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit
export FLASHINFER_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws; mkdir -p /tmp/fiws && tar xzf .ficache/ficache.tgz -C /tmp/fiws
S=$(date +%s)
cp -r src /tmp/oldsrc && cp .gpu_scripts/old/*.py /tmp/oldsrc/flexicache/backends/
T="python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_gpu_flashinfer.py"
for i in 1 2 3; do PYTHONPATH=/tmp/site:/tmp/oldsrc timeout 60 $T -k at_scale -x 2>&1 | grep -E "passed|failed|AssertionError" | head -3 | cut -c1-300; done
echo "old done at $(( $(date +%s) - S )) s"
for i in 1 2 3; do timeout 60 $T -k at_scale 2>&1 | tail -1; done
echo "new stress at $(( $(date +%s) - S )) s"
REPEATS=150 TC=1 timeout 100 python3 .gpu_scripts/diag3.py 2>&1 | grep "runs with wrong" 
echo "diag at $(( $(date +%s) - S )) s"
timeout 100 python3 eval/gpu_repeatability.py --out $OUT/repeat.json > $OUT/repeat.txt 2>&1; grep -v Warn $OUT/repeat.txt | tail -8
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 100 python3 eval/gpu_repeatability.py --out $OUT/repeat_cublas.json > $OUT/repeat_cublas.txt 2>&1; grep -v Warn $OUT/repeat_cublas.txt | tail -8
echo "repeat at $(( $(date +%s) - S )) s"
timeout 170 $T > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt | cut -c1-400
echo "tests at $(( $(date +%s) - S )) s"
timeout $(( 560 - $(date +%s) + S )) python3 -m flexicache.benchmarks.attention --batch 8 --context 32768 --budget 1024 --layers 16 --steps 48 > $OUT/attention.txt 2>&1; tail -12 $OUT/attention.txt
echo "end at $(( $(date +%s) - S )) s"
