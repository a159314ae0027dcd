"""Gemma 2 and 3 with their sliding-window layers on a KV pool of their own (blocks released
as the window slides), token for token against transformers in float32: chunked prefill and
decode past the window, a prefix-cache hit, preemption by either pool; every block of both
pools free afterwards."""

from __future__ import annotations

import gc
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.engine.test_engine import GREEDY, hf_greedy, random_prompts, token_ids
from tests.support.engines import add_tiny_tokenizer, make_engine
from tests.support.tiny_models import tiny_model_dir
from worker.engine.core.block_manager import BlockManager
from worker.engine.core.hybrid_blocks import HybridBlockManager
from worker.engine.engine import LLMEngine
from worker.engine.kv_cache import zeroed
from worker.engine.offline import LLM

BS = 4  # the tiny configs' window is 8: two blocks, so blocks slide out every few tokens
FAMILIES = ["gemma2", "gemma3"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    dirs = {}
    for family in FAMILIES:
        dirs[family] = tiny_model_dir(family, root / family)
        add_tiny_tokenizer(dirs[family])
    return dirs


def hybrid_engine(model_dir: Path, **overrides: object) -> LLMEngine:
    engine = make_engine(
        model_dir, block_size=BS, max_num_seqs=8, max_num_batched_tokens=16, **overrides
    )
    assert isinstance(engine.block_manager, HybridBlockManager)
    assert engine.executor.num_local_blocks == engine.block_manager.local.num_blocks
    return engine


def assert_both_pools_free(engine: LLMEngine) -> None:
    hbm = engine.block_manager
    assert not engine.has_unfinished_requests()
    for pool in (hbm.full, hbm.local):
        assert pool.num_free_blocks == pool.num_blocks
        assert all(pool.get_ref_count(b) == 0 for b in range(pool.num_blocks))


@pytest.mark.parametrize("family", FAMILIES)
def test_windows_on_their_own_pool_equal_transformers(family, model_dirs):
    prompts = random_prompts(5, [1, 9, 17, 30, 40], seed=11)
    expected = hf_greedy(model_dirs[family], prompts, GREEDY.max_tokens)
    engine = hybrid_engine(model_dirs[family])
    llm = LLM(engine=engine)
    peak = {"local": 0}
    original_step = engine.step

    def step():  # the local pool never holds more than each sequence's window
        outputs = original_step()
        peak["local"] = max(peak["local"], engine.block_manager.local.num_used_blocks)
        return outputs

    engine.step = step
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    # 5 sequences up to 56 tokens: 14 blocks each in the full pool, at most 3 + a chunk's
    # 4 in the local one
    assert peak["local"] <= 5 * 3 + 4
    assert_both_pools_free(engine)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hit_over_both_pools_equals_transformers(family, model_dirs):
    prompt = random_prompts(1, [30], seed=5)
    expected = hf_greedy(model_dirs[family], prompt, GREEDY.max_tokens)
    engine = hybrid_engine(model_dirs[family])
    llm = LLM(engine=engine)
    llm.generate(prompt, replace(GREEDY, max_tokens=1))  # caches the prompt's blocks
    again = llm.generate(prompt, GREEDY)
    assert again[0].usage.cached_tokens == 28  # 7 full blocks (never the last token)
    assert token_ids(again) == expected
    assert_both_pools_free(engine)


@pytest.mark.parametrize("pool", ["full", "local"])
def test_preemption_by_either_pool_equals_transformers(pool, model_dirs):
    model_dir = model_dirs["gemma2"]
    prompts = random_prompts(5, [1, 9, 17, 30, 40], seed=11)
    longer = replace(GREEDY, max_tokens=24)
    engine = hybrid_engine(model_dir, enable_prefix_caching=False)
    hbm = engine.block_manager
    if pool == "full":  # 48 tokens: room for one long sequence at a time
        hbm.full = BlockManager(16, BS, False)
    else:  # two windows and a chunk, for five sequences
        hbm.local = BlockManager(14, BS, False, null_block=engine.executor.num_local_blocks)
    ours = token_ids(LLM(engine=engine).generate(prompts, longer))
    assert engine.scheduler.num_preemptions_total > 0
    assert ours == hf_greedy(model_dir, prompts, longer.max_tokens)
    assert_both_pools_free(engine)


def test_the_cpu_cache_starts_zeroed_and_writable() -> None:
    cache = zeroed((2, 3, 4, 5), torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (2, 3, 4, 5) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and not cache.any()
    cache[1, 2] = 1.5
    assert cache.sum().item() == 1.5 * 20


def test_the_cpu_cache_starts_on_a_huge_page_boundary_and_outlives_its_views() -> None:
    cache = zeroed((3, 1000, 64), torch.float32, torch.device("cpu"))
    assert cache.data_ptr() % (2 << 20) == 0  # the pool can lie in 2 MiB pages
    layer = cache[2]
    del cache
    gc.collect()
    layer.fill_(2.0)
    assert layer.sum().item() == 2.0 * 1000 * 64
