"""The engine's side of streaming a prompt's KV out while prefill still writes it.

A prefill worker ships each prompt's KV to a decode worker. Rather than wait for the first token,
it asks the engine (``LLMEngine.on_final_chunks``) to be told, on the engine thread, just before
the forward of a step that computes the last prompt chunk of prefill-only requests: it gets
each one's blocks (:class:`FinalChunk`) and answers with a :class:`LayerSink` (a
``kvtransfer.LayerReady``), which that forward tells each layer's index right after the layer's
KV write (``AttentionMetadata.on_kv_written``), or ``fail(reason)`` if the forward raises.

Why that is enough: the earlier chunks' KV was written by earlier steps, so once layer i of the
final chunk is written, layer i of every block of the prompt is. A step that holds the final
chunks of several requests tells one sink (it may be shared: waiting on it consumes nothing).
The engine always computes at least the prompt's last token (a prefix-cache hit leaves it), so
every prefill-only request has such a forward; the runner keeps it out of a CUDA graph, which
would not run the per-layer callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class LayerSink(Protocol):
    """Told as a forward writes each layer's KV (layers in order, 0 first); thread-safe."""

    def record(self, layer: int) -> None:
        """Layers 0..``layer`` are written (on CUDA: enqueued on the current stream)."""

    def fail(self, reason: str) -> None:
        """The forward failed: no more layers will be recorded."""


@dataclass(frozen=True)
class FinalChunk:
    """A prefill-only request whose last prompt chunk is computed by the step about to run."""

    request_id: str
    block_ids: list[int]  # the blocks of its whole prompt, in order
    num_prompt_tokens: int


# called on the engine thread before the step's forward; returns where that forward records
# its layers (None: nowhere). It must be quick and must not raise.
FinalChunkHook = Callable[[list[FinalChunk]], LayerSink | None]
