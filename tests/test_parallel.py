"""Multi-device and tensor-parallel support (flexicache.parallel, issue 8).

CPU: profile slicing and TP detection (unit), per-device bookkeeping, accelerate-dispatched models (disk and CPU
offload through accelerate's hooks), and real tensor parallelism with ``tp_plan="auto"`` over two gloo ranks
(``torchrun``; tests/tp_worker.py is one rank). GPU (skipped without CUDA): layers split over GPUs and the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import accelerate
import pytest
import torch
from conftest import checked, greedy, left_pad, mixed_profile, random_prompt, tiny_config, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

from flexicache import FlexiCache, HeadProfile
from flexicache.parallel import (
    BYTE_KEYS,
    kv_bytes_by_device,
    local_view,
    shard_config,
    shard_profile,
    tensor_parallel_shard,
)
from flexicache.profile import model_shape
from flexicache.sequence import SequenceState

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


def profile_4_heads() -> HeadProfile:
    return HeadProfile(
        num_layers=3, num_kv_heads=4, head_dim=8, unstable_heads=[(0, 0), (0, 3), (1, 1), (1, 2), (2, 2)],
        model="tiny", scores=[[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8], [0.9, 1.0, 1.1, 1.2]],
        calibration={"source": "test"}, model_info={"model_type": "llama"},
    )


# ------------------------------------------------------------------------------------------- profile slicing


def test_shard_profile_maps_model_heads_to_local_heads():
    profile = profile_4_heads()
    rank0, rank1 = (shard_profile(profile, rank, 2) for rank in (0, 1))
    assert rank0.num_kv_heads == rank1.num_kv_heads == 2
    assert rank0.unstable_heads == [(0, 0), (1, 1)]  # model heads 0 and 1
    assert rank1.unstable_heads == [(0, 1), (1, 0), (2, 0)]  # model heads 3, 2, 2
    assert rank1.scores == [[0.3, 0.4], [0.7, 0.8], [1.1, 1.2]]
    assert rank1.model_info == {"model_type": "llama", "tensor_parallel": {"rank": 1, "world_size": 2,
                                                                           "first_kv_head": 2}}
    assert (rank1.num_layers, rank1.head_dim, rank1.model, rank1.calibration) == (3, 8, "tiny", {"source": "test"})
    # every unstable head lands on exactly one rank, at its local index
    for world_size in (1, 2, 4):
        local = [shard_profile(profile, rank, world_size) for rank in range(world_size)]
        back = {(layer, rank * (4 // world_size) + head)
                for rank, shard in enumerate(local) for layer, head in shard.unstable_heads}
        assert sorted(back) == profile.unstable_heads
    assert profile.model_info == {"model_type": "llama"}  # the full profile is left as it was


def test_shard_profile_rejects_uneven_splits_and_bad_ranks():
    profile = profile_4_heads()
    with pytest.raises(ValueError, match="4 KV heads cannot be split evenly over 3"):
        shard_profile(profile, 0, 3)
    for rank, world_size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="rank must be in"):
            shard_profile(profile, rank, world_size)


def test_shard_config_divides_heads_and_keeps_head_dim():
    config = tiny_config(group=3, num_kv_heads=4, num_layers=2, head_dim=8)
    config.head_dim = None  # derived from hidden_size / num_attention_heads: must survive the split
    local = shard_config(config, 2)
    assert model_shape(local) == (2, 2, 8) and local.num_attention_heads == 6
    assert model_shape(config) == (2, 4, 8) and config.num_attention_heads == 12  # untouched
    with pytest.raises(ValueError, match="cannot be split evenly"):
        shard_config(config, 3)


# ------------------------------------------------------------------------------------------------ TP detection


class FakeMesh:
    """A 1-D tensor-parallel mesh as far as tensor_parallel_shard looks at it."""

    ndim = 1

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def get_local_rank(self) -> int:
        return self.rank


class FakeMeshND:
    """An n-D device mesh with a "tp" dimension (transformers before the mesh manager)."""

    ndim = 3

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __getitem__(self, name: str) -> FakeMesh:
        assert name == "tp"
        return FakeMesh(self.rank)


LLAMA_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
              "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}


def fake_tp(model, rank: int, world_size: int, plan=None, manager: bool = True):
    """``model`` marked the way transformers marks a model it loaded with ``tp_plan="auto"``."""
    model._tp_size = world_size
    model._tp_plan = LLAMA_PLAN if plan is None else plan
    if manager:
        model._mesh_manager = SimpleNamespace(get_mesh=lambda dims: FakeMesh(rank) if dims == "tp" else None)
    else:
        model._device_mesh = FakeMeshND(rank)
    return model


def test_tensor_parallel_shard_detection():
    config = tiny_config(num_kv_heads=4)
    assert tensor_parallel_shard(tiny_model(config)) is None
    assert tensor_parallel_shard(fake_tp(tiny_model(config), 1, 2)) == (1, 2)
    assert tensor_parallel_shard(fake_tp(tiny_model(config), 3, 4, manager=False)) == (3, 4)
    assert tensor_parallel_shard(fake_tp(tiny_model(config), 0, 1)) is None  # tp_size 1: nothing split
    # plans that leave every KV head on every rank
    mlp_only = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    gathered = {**LLAMA_PLAN, "model.layers.*.self_attn.k_proj": "colwise_gather_output"}
    for plan in (mlp_only, gathered, {}):
        assert tensor_parallel_shard(fake_tp(tiny_model(config), 1, 2, plan=plan)) is None


def test_local_view_slices_config_and_profile_under_tp(tmp_path):
    config = tiny_config(group=2, num_kv_heads=4, num_layers=3, head_dim=8)
    profile = profile_4_heads()
    plain = tiny_model(config)
    plain_config, plain_profile = local_view(plain, profile)
    assert plain_config is plain.config and plain_profile is profile  # no TP: the model's own, untouched
    model = fake_tp(tiny_model(config), 1, 2)
    local_config, local_profile = local_view(model, profile)
    assert model_shape(local_config) == (3, 2, 8) and local_profile == shard_profile(profile, 1, 2)
    profile.save(tmp_path / "profile.json")
    assert local_view(model, tmp_path / "profile.json")[1] == local_profile  # a path is loaded first
    default = local_view(model, "default")[1]  # the default profile of the full model, sliced
    assert default.unstable_heads == shard_profile(HeadProfile.default(config), 1, 2).unstable_heads
    for online in (None, "online"):  # estimated from the prompt, over this rank's heads
        online_config, online_profile = local_view(model, online)
        assert model_shape(online_config) == (3, 2, 8) and online_profile == online
    with pytest.raises(ValueError, match="made for a model with 3 layers, 2 KV heads"):
        local_view(model, shard_profile(profile, 0, 2))  # an already sliced profile is not the model's

    # The cache built from the local view takes this rank's [B, 2, T, D] keys; one built from the full config does
    # not, and says so.
    keys = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    local_cache = FlexiCache(local_config, profile=local_profile)
    local_cache.update(keys, keys, 0)
    local_cache.reset()  # drops the staged chunk that no attention function took
    with pytest.raises(ValueError, match="received 2 KV heads but the HeadProfile/config has 4"):
        FlexiCache(config, profile=profile).update(keys, keys, 0)


# ------------------------------------------------------------------------------------ per-device bookkeeping


def test_kv_bytes_by_device_sums_layer_stats():
    config = tiny_config(num_kv_heads=2, num_layers=3)
    model = tiny_model(config)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=32, page_size=8)
    assert kv_bytes_by_device(cache) == {}  # nothing stored yet
    ids = random_prompt(45, seed=1).view(1, -1)
    greedy(model, ids, cache, max_new_tokens=6)
    stats = cache.stats()
    assert kv_bytes_by_device(cache) == {"cpu": {key: stats[key] for key in BYTE_KEYS}}
    assert stats["host_kv_bytes"] > 0 and stats["device_kv_bytes"] > 0


def test_sequence_state_keeps_validity_on_cpu_and_plans_on_the_asking_device():
    """``meta`` stands in for a second device: a layer there gets every plan tensor there, and the validity that
    layers on any device index their tensors with stays on the CPU."""
    meta, cpu = torch.device("meta"), torch.device("cpu")
    state = SequenceState(page_size=4)
    first = state.plan_chunk(0, torch.tensor([[False, True, True], [True, True, True]]), 2, 3, cpu)
    other = state.plan_chunk(0, None, 2, 3, meta)  # the same chunk, asked by a layer on the other device
    names = ("batch", "chunk_pos", "page", "offset", "new_page_batch", "new_page_index", "before", "after")
    assert all(getattr(first, name).device == cpu and getattr(other, name).device == meta for name in names)
    assert other.after_host is first.after_host
    decode = state.plan_chunk(1, None, 2, 1, meta)  # next chunk, planned first on the other device
    assert all(getattr(decode, name).device == meta for name in names)
    assert state.logical_valid().device == cpu
    assert state.logical_valid().tolist() == [[False, True, True, True], [True] * 4]

    state = SequenceState(page_size=4)
    state.plan_chunk(0, None, 2, 3, meta)  # the first layer lives on the other device
    assert state.logical_valid().device == cpu and bool(state.logical_valid().all())


# -------------------------------------------------------------------------------- accelerate-dispatched models


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where accelerate runs ``module``: the execution device of the first hook in it, else its weights' device."""
    for submodule in module.modules():
        device = getattr(getattr(submodule, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(module.parameters()).device


def assert_storage_on_layer_devices(model, cache: FlexiCache) -> None:
    """Every layer's pages, metadata, tables and backend live on its decoder layer's device; its host tier on the
    CPU."""
    for decoder_layer, layer in zip(model.model.layers, cache.layers):
        assert layer.device == execution_device(decoder_layer), layer.layer_idx
        storage = layer.storage
        tensors = [storage.pool.k, storage.pool.v, storage.meta.kmin, storage.meta.kmax, storage.write_slots,
                   storage.unstable_index, storage.stable_index]
        if storage.resident is not None:
            tensors.append(storage.resident.table)
        if storage.offloaded is not None:
            tensors += [storage.offloaded.selected, storage.offloaded.selected_scores]
            assert storage.offloaded.host.k.device.type == "cpu"
        assert {tensor.device for tensor in tensors} == {layer.device}, layer.layer_idx
        assert layer.backend is cache.backends[layer.device]
    devices = {str(layer.device) for layer in cache.layers}
    assert set(kv_bytes_by_device(cache)) == devices


def disk_offloaded(model, tmp_path: Path):
    """``model`` reloaded with ``from_pretrained(device_map=...)``: layers 1 and 3 offloaded to disk (weights on the
    meta device, loaded by accelerate's hooks at every forward)."""
    model.save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{index}": "disk" if index % 2 else "cpu"
                       for index in range(model.config.num_hidden_layers)})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map, dtype=torch.float64,
                                                  offload_folder=tmp_path / "offload")
    assert loaded.model.layers[1].self_attn.k_proj.weight.device.type == "meta"
    loaded.generation_config.pad_token_id, loaded.generation_config.eos_token_id = 0, None
    return loaded


def cpu_offloaded(model, tmp_path: Path):
    """``model`` under ``accelerate.cpu_offload``: every weight on the meta device, streamed in by hooks."""
    return accelerate.cpu_offload(model, execution_device="cpu")


@pytest.mark.parametrize("dispatch", [disk_offloaded, cpu_offloaded])
def test_dispatched_model_matches_dynamic_cache_and_keeps_storage_per_layer(dispatch, tmp_path):
    config = tiny_config(num_kv_heads=2, group=2, num_layers=4)
    ids, mask = left_pad([random_prompt(40, seed=1), random_prompt(29, seed=2)])
    plain = tiny_model(config, seed=1)
    sparse_plain = greedy(plain, ids, FlexiCache.from_model(plain, profile=mixed_profile(config), token_budget=32,
                                                            page_size=8, rerank_interval=4), mask, 12)
    model = dispatch(tiny_model(config, seed=1), tmp_path)
    reference = greedy(model, ids, DynamicCache(config=model.config), mask, 12)
    settings = {"profile": mixed_profile(config), "page_size": 8, "rerank_interval": 4}
    cache = checked(FlexiCache.from_model(model, token_budget=64, **settings))  # 40 + 12 tokens <= 64
    assert torch.equal(greedy(model, ids, cache, mask, 12), reference)
    assert_storage_on_layer_devices(model, cache)
    assert kv_bytes_by_device(cache) == {"cpu": {key: cache.stats()[key] for key in BYTE_KEYS}}
    # A sparse budget: the hooks change nothing, the tokens are those of the plain model.
    sparse = FlexiCache.from_model(model, token_budget=32, **settings)
    assert torch.equal(greedy(model, ids, sparse, mask, 12), sparse_plain)
    assert sparse.stats()["promoted_pages"] > 0


# ---------------------------------------------------------------------------------------- tensor parallelism


def tensor_parallel_unavailable() -> str | None:
    """Why tensor parallelism over CPU processes cannot run here, or ``None``."""
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if not dist.is_gloo_available():
        return "this torch build has no gloo backend, which tensor parallelism on the CPU needs"
    return None


def run_tensor_parallel(tmp_path: Path, *, gpus: bool, head_dim: int, dtype: str, initializer_range: float) -> tuple:
    """A tiny model saved and generated by 2 ``torchrun`` ranks of tests/tp_worker.py (gloo on the CPU, NCCL with one
    GPU per rank); returns ``(model, ids, mask, profile, [rank 0 result, rank 1 result])``."""
    config = tiny_config(group=2, num_kv_heads=4, num_layers=3, vocab_size=128, head_dim=head_dim,
                         initializer_range=initializer_range)
    model = tiny_model(config, seed=3)
    ids, mask = left_pad([random_prompt(70, 1, vocab_size=128), random_prompt(55, 2, vocab_size=128)])
    profile = HeadProfile(num_layers=3, num_kv_heads=4, head_dim=head_dim,
                          unstable_heads=[(0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2)])
    return model, ids, mask, profile, run_tensor_parallel_ranks(tmp_path, model, ids, mask, profile, gpus, dtype)


def run_tensor_parallel_ranks(tmp_path: Path, model, ids: torch.Tensor, mask: torch.Tensor, profile: HeadProfile,
                              gpus: bool, dtype: str) -> list[dict]:
    """``model`` saved and generated on ``ids``/``mask`` with the full model's ``profile`` by 2 ``torchrun`` ranks of
    tests/tp_worker.py; returns each rank's result."""
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "inputs.json").write_text(json.dumps({"input_ids": ids.tolist(), "attention_mask": mask.tolist()}))
    profile.save(tmp_path / "profile.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(SRC)]))}
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(TESTS / "tp_worker.py"), str(tmp_path / "model"), str(tmp_path), "--new-tokens", "24",
               "--page-size", "8", "--small-budget", "32", "--dtype", dtype]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


LOCAL_UNSTABLE = {0: [[0, 1], [1], []], 1: [[0, 1], [0], []]}  # model heads (1, 1) -> rank 0, (1, 2) -> rank 1


def assert_rank_holds_its_shard(rank: int, result: dict, device: str) -> None:
    """Each run of a rank keeps 2 of the 4 KV heads, the profile sliced to them, storage on the rank's device."""
    assert result["shard"] == [rank, 2]
    full, small = result["full_budget"], result["small_budget"]
    for run in (full, small, result["small_budget_from_model"]):
        assert run["kv_heads"] == run["stored_kv_heads"] == [2, 2, 2]
        assert run["unstable_heads"] == LOCAL_UNSTABLE[rank]
        assert set(run["bytes_by_device"]) == {device}
    assert small["reranks_stable"] > 0
    assert small["bytes_by_device"][device]["device_kv_bytes"] < full["bytes_by_device"][device]["device_kv_bytes"]
    assert small["bytes_by_device"][device]["host_kv_bytes"] > 0


@pytest.mark.skipif(tensor_parallel_unavailable() is not None, reason=str(tensor_parallel_unavailable()))
def test_tensor_parallel_generation_on_two_cpu_ranks(tmp_path):
    """tp_plan="auto" over 2 gloo ranks: FlexiCache equals DynamicCache when the budget covers the context; with a
    small budget each rank keeps only its own KV heads, and the tokens equal a single-process FlexiCache with the full
    profile (each head's selection is independent of the other heads)."""
    model, ids, mask, profile, ranks = run_tensor_parallel(tmp_path, gpus=False, head_dim=8, dtype="float64",
                                                           initializer_range=0.2)
    single = FlexiCache.from_model(model, profile=profile, token_budget=32, page_size=8, rerank_interval=4)
    single_tokens = greedy(model, ids, single, mask, 24).tolist()
    for rank, result in enumerate(ranks):
        assert_rank_holds_its_shard(rank, result, "cpu")
        full, small = result["full_budget"], result["small_budget"]
        assert full["tokens"] == result["full_budget_reference"]["tokens"] == result["dense"] == ranks[0]["dense"]
        assert full["max_logit_difference"] <= 1e-10
        assert small["tokens"] == result["small_budget_from_model"]["tokens"] == single_tokens
        assert 2 * small["dense_kv_bytes"] == single.stats()["dense_kv_bytes"]  # each rank holds half of the heads


def nccl_unavailable() -> str | None:
    """Why tensor parallelism with one GPU per rank cannot run here, or ``None``."""
    import torch.distributed as dist

    if torch.cuda.device_count() < 2:
        return "needs two GPUs"
    if not (dist.is_available() and dist.is_nccl_available()):
        return "this torch build has no NCCL backend"
    if importlib.util.find_spec("flashinfer") is None:
        return "needs FlashInfer (the test checks its decode on every rank)"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(nccl_unavailable() is not None, reason=str(nccl_unavailable()))
def test_tensor_parallel_generation_on_two_gpus(tmp_path):
    """tp_plan="auto" over 2 NCCL ranks, one GPU each, bf16 with FlashInfer: each rank's cache holds its KV heads
    on its GPU; at a budget covering the context the logits follow DynamicCache's under the same TP (bf16 kernels
    differ, so up to the first differing token); whole-step CUDA graphs (which record the all-reduces) give the
    tokens of the layer-by-layer path."""
    _, _, _, _, ranks = run_tensor_parallel(tmp_path, gpus=True, head_dim=128, dtype="bfloat16",
                                            initializer_range=0.02)
    for rank, result in enumerate(ranks):
        assert_rank_holds_its_shard(rank, result, f"cuda:{rank}")
        full, small, graphed = result["full_budget"], result["small_budget"], result["small_budget_from_model"]
        assert result["dense"] == ranks[0]["dense"]
        assert full["tokens"] == ranks[0]["full_budget"]["tokens"]
        reference = result["full_budget_reference"]
        assert full["relative_logit_error"] <= 2e-2, (full["relative_logit_error"], reference["relative_logit_error"])
        assert full["backend"] == small["backend"] == graphed["backend"] == "flashinfer"
        assert graphed["step_graph_replays"] > 0
        assert graphed["tokens"] == small["tokens"] == ranks[0]["small_budget"]["tokens"]


# ---------------------------------------------------------------------------------------------------- GPUs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layers_split_over_gpus_and_cpu():
    """Layers round-robin over every GPU and the CPU (CPU layers compute on the CPU): same tokens as DynamicCache
    under the same placement, storage on each layer's device, and exact read-back / batch selection across devices."""
    config = tiny_config(num_kv_heads=2, group=2, num_layers=6, head_dim=16)
    model = tiny_model(config, seed=4, dtype=torch.float32)
    places = list(range(torch.cuda.device_count())) + ["cpu"]
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 0, "lm_head": 0}
    device_map.update({f"model.layers.{index}": places[index % len(places)] for index in range(6)})
    model = accelerate.dispatch_model(model, device_map, main_device="cpu", skip_keys=model._skip_keys_device_placement)
    ids, mask = left_pad([random_prompt(150, seed=1), random_prompt(119, seed=2)])
    ids, mask = ids.cuda(), mask.cuda()
    dense = DynamicCache(config=model.config)
    reference = greedy(model, ids, dense, mask, 20)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=176, page_size=16)
    assert torch.equal(greedy(model, ids, cache, mask, 20), reference)
    assert_storage_on_layer_devices(model, cache)
    assert {str(layer.device) for layer in cache.layers} == {str(torch.device("cuda", p)) if p != "cpu" else "cpu"
                                                              for p in places}
    real = cache.sequence.logical_valid()[:, : ids.shape[1]]
    for flexi_layer, dense_layer in zip(cache.layers, dense.layers):
        keys, values = flexi_layer.read_logical()
        selector = real[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3]).to(keys.device)
        length = ids.shape[1]
        assert torch.equal(keys[:, :, :length][selector], dense_layer.keys[:, :, :length][selector])
        assert torch.equal(values[:, :, :length][selector], dense_layer.values[:, :, :length][selector])
    second = [layer.read_logical()[0][1:] for layer in cache.layers]
    cache.batch_select_indices(torch.tensor([1]))
    for layer, keys in zip(cache.layers, second):
        assert torch.equal(layer.read_logical()[0], keys)
    sparse = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=32, page_size=16)
    greedy(model, ids, sparse, mask, 20)
    assert sparse.stats()["promoted_pages"] > 0
    assert_storage_on_layer_devices(model, sparse)
