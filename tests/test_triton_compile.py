"""The Triton kernels compile for the GPU the benchmarks run on (sm_90, bf16), on a machine without a GPU.

Catches what Triton's interpreter (tests/test_triton_interpreted.py) accepts but its compiler rejects, e.g. a
variable whose type differs between the branches of an ``if``.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
backends = pytest.importorskip("triton.backends.compiler")

from flexicache.backends import triton_exact, triton_rerank, triton_select, triton_transfer

BF16_POINTERS = ("query_ptr", "kmin_ptr", "kmax_ptr", "keys_ptr", "values_ptr", "pool_k_ptr", "pool_v_ptr",
                 "src_k_ptr", "src_v_ptr", "dst_k_ptr", "dst_v_ptr", "host_k_ptr", "host_v_ptr")


def compile_for_hopper(kernel, constants: dict[str, object], pointer_types: dict[str, str] | None = None) -> None:
    """Compile ``kernel`` with every ``*_ptr`` typed (bf16 data, int64 indices unless overridden), scalars int32."""
    names = kernel.arg_names
    pointer_types = pointer_types or {}
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*bf16" if name in BF16_POINTERS else "*i64")
        else:
            signature[name] = pointer_types.get(name, "i32")
    try:
        source = compiler.ASTSource(fn=kernel, signature=signature,
                                    constexprs={(names.index(name),): value for name, value in constants.items()})
    except TypeError as error:  # another Triton release spells the source API differently
        pytest.skip(f"triton {triton.__version__}: ASTSource API differs ({error})")
    triton.compile(source, target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@pytest.mark.parametrize("reduce_sum", [False, True])
@pytest.mark.parametrize("stable_rerank", [False, True])
def test_score_pages_kernel_compiles(reduce_sum: bool, stable_rerank: bool) -> None:
    compile_for_hopper(triton_select._score_pages_kernel,
                       dict(PAGE_SIZE=16, GROUP=4, HEAD_DIM=128, BLOCK_P=64, REDUCE_SUM=reduce_sum,
                            STABLE_RERANK=stable_rerank),
                       {"scores_ptr": "*fp32"})


@pytest.mark.parametrize("write_table, write_flat", [(False, True), (True, False)])
@pytest.mark.parametrize("slots", [63, 143])  # K - 1 = 63 working-set slots, or 80 standby pages more
@pytest.mark.parametrize("exact", [False, True])  # exact_rescore: selection by the page masses
def test_decode_table_kernel_compiles(write_table: bool, write_flat: bool, slots: int, exact: bool) -> None:
    flat = {"flat_ptr": "*i32", "indptr_ptr": "*i32"} if write_flat else {}
    compile_for_hopper(triton_select._decode_table_kernel,
                       dict(K=64, SLOTS=slots, PAGE_SIZE=16, BLOCK_K=64, BLOCK_W=triton.next_power_of_2(slots),
                            BLOCK_S=4096, CHUNK_W=32, GROUP=4, HEAD_DIM=128, REDUCE_SUM=False, SPREAD_WEIGHTED=True,
                            WRITE_TABLE=write_table, WRITE_FLAT=write_flat, EXACT=exact, CANDIDATES=192, BLOCK_C=256),
                       {"scores_ptr": "*fp32", "selected_scores_ptr": "*fp32", "working_scores_ptr": "*fp32",
                        "query_ptr": "*fp32", "weight_high": "fp32", "weight_low": "fp32",
                        "unstable_mass_ptr": "*fp32", "stable_mass_ptr": "*fp32", **flat})


@pytest.mark.parametrize("candidates", [256, 384])  # 2K or 3K (exact_candidates) of K = 128
def test_exact_candidates_kernel_compiles(candidates: int) -> None:
    compile_for_hopper(triton_exact._candidates_kernel,
                       dict(CANDIDATES=candidates, PAGE_SIZE=8, BLOCK_C=triton.next_power_of_2(candidates),
                            BLOCK_S=8192), {"scores_ptr": "*fp32"})


@pytest.mark.parametrize("stable, count", [(False, 256), (True, 159)])
@pytest.mark.parametrize("page_size", [8, 16])
def test_page_mass_kernel_compiles(stable: bool, count: int, page_size: int) -> None:
    compile_for_hopper(triton_exact._page_mass_kernel,
                       dict(COUNT=count, PAGE_SIZE=page_size, GROUP=4, HEAD_DIM=128, BLOCK_W=64 // page_size,
                            STABLE=stable),
                       {"mass_ptr": "*fp32", "log2_scale": "fp32"})


def test_append_token_kernel_compiles() -> None:
    compile_for_hopper(triton_select._append_token_kernel, dict(PAGE_SIZE=16, HEAD_DIM=128))


FP8_HOST = "*fp8e4nv"  # a float8 host tier (host_dtype="float8_e4m3fn"), its keys centred in fp32


@pytest.mark.parametrize("page", [2048, 1536])
@pytest.mark.parametrize("centre_sign", [0, 1, -1])  # plain copy; from a centred float8 tier; to it
def test_copy_pages_kernel_compiles(page: int, centre_sign: int) -> None:
    host = {1: {"src_k_ptr": FP8_HOST, "src_v_ptr": FP8_HOST},
            -1: {"dst_k_ptr": FP8_HOST, "dst_v_ptr": FP8_HOST}}.get(centre_sign, {})
    compile_for_hopper(triton_transfer._copy_pages_kernel,
                       dict(PAGE=page, HEAD_DIM=128, BLOCK=2048, CENTRE_SIGN=centre_sign),
                       {"mask_ptr": "*i1", "centre_ptr": "*fp32", **host})


@pytest.mark.parametrize("slots_per_row", [63, 1])
@pytest.mark.parametrize("full_only", [False, True])
@pytest.mark.parametrize("centred", [False, True])
def test_retire_tails_kernel_compiles(slots_per_row: int, full_only: bool, centred: bool) -> None:
    host = {"host_k_ptr": FP8_HOST, "host_v_ptr": FP8_HOST} if centred else {}
    compile_for_hopper(triton_transfer._retire_tails_kernel,
                       dict(K=slots_per_row + 1, PAGE_SIZE=16, PAGE=2048, HEAD_DIM=128, BLOCK=2048,
                            BLOCK_K=triton.next_power_of_2(slots_per_row), FULL_ONLY=full_only, CENTRED=centred),
                       {"scores_ptr": "*fp32", "centre_ptr": "*fp32", **host})


@pytest.mark.parametrize("num_heads", [1, 6])
def test_open_pages_kernel_compiles(num_heads: int) -> None:
    compile_for_hopper(triton_transfer._open_pages_kernel,
                       dict(NUM_HEADS=num_heads, BLOCK_B=32, BLOCK_H=triton.next_power_of_2(num_heads)))


@pytest.mark.parametrize("slots, block_s", [(63, 2048), (3, 16384), (151, 4096)])
@pytest.mark.parametrize("limited", [False, True])
def test_rerank_kernel_compiles(slots: int, block_s: int, limited: bool) -> None:
    compile_for_hopper(triton_rerank._rerank_kernel,
                       dict(SLOTS=slots, BLOCK_K=triton.next_power_of_2(slots), BLOCK_S=block_s, LIMITED=limited),
                       {"scores_ptr": "*fp32", "selected_scores_ptr": "*fp32", "page_scratch_ptr": "*i32",
                        "copy_mask_ptr": "*i8", "held_ptr": "*i8"})


@pytest.mark.parametrize("head_dim", [128, 96])
@pytest.mark.parametrize("centred", [False, True])
def test_write_tokens_kernel_compiles(head_dim: int, centred: bool) -> None:
    host = {"host_k_ptr": FP8_HOST, "host_v_ptr": FP8_HOST} if centred else {}
    compile_for_hopper(triton_transfer._write_tokens_kernel,
                       dict(PAGE_SIZE=16, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim), CENTRED=centred),
                       {"centre_ptr": "*fp32", **host})
