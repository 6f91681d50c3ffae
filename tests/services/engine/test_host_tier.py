"""The prefix cache's host tier on the CPU device (a second, larger pool): a 20-turn chat whose
history no longer fits the KV pool, with an unrelated request between turns pushing it out,
restores earlier turns from the host tier instead of recomputing them, and every reply is the
one an engine without the tier gives. The tier's work does not depend on the model: a tiny
random Llama (the embedded model's tokenizer and chat template) serves the chat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM

TURNS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=1)


def _chat(llm: LLM, noise: bool) -> list[tuple[str, int]]:
    """(reply, prompt tokens served from a cache) per turn; ``noise``: an unrelated prompt after
    each turn takes the whole pool, pushing the history out of it."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "Answer in one word."}]
    out = []
    for turn in range(TURNS):
        history.append({"role": "user", "content": f"C{turn}"})
        reply = llm.generate([llm.apply_chat_template(history)], GREEDY)[0]
        out.append((reply.outputs[0].text, reply.num_cached_tokens))
        history.append({"role": "assistant", "content": reply.outputs[0].text})
        if noise:
            text = f"Unrelated {turn}: rivers, mountains and lakes. " * 16
            llm.generate([llm.tokenizer.encode(text)], GREEDY)
    return out


def test_a_long_chat_comes_back_from_the_host_tier_unchanged(tiny_llama: Path) -> None:
    # the reference never evicts: its pool holds everything, so its history is always cached
    reference = LLM(str(tiny_llama), num_blocks=200, max_model_len=320)
    tiered = LLM(str(tiny_llama), num_blocks=20, max_model_len=320, kv_offloading_gib=0.05)
    expected, got = _chat(reference, noise=False), _chat(tiered, noise=True)
    assert [text for text, _ in got] == [text for text, _ in expected]
    stats = tiered.engine.stats()
    assert stats.kv_offload_restored > 0 and stats.prefix_cache_host_hits > 0
    assert stats.kv_offload_stored >= stats.kv_offload_restored
    # the pool lost the history to the noise every turn; the tier gave nearly all of it back
    late = [cached for _, cached in got[TURNS // 2 :]]
    assert all(cached >= ref - tiered.engine.kv.block_size
               for cached, (_, ref) in zip(late, expected[TURNS // 2 :], strict=True))  # fmt: skip
    tiered.engine.kv.check_invariants()
