"""What a KV checksum costs on a GPU: kvtransfer.wire.checksum_tensor over a Llama-3.1-8B KV of
1024 and 4096 tokens (32 layers x 2 x 8 heads x 128 x bf16 = 128 KiB per token), median of 20,
per end (the sender and the receiver each run it once per transfer)."""

import json
import statistics
import sys

import torch

from kvtransfer.wire import checksum_tensor

rows = []
for tokens in (1024, 4096):
    data = torch.randint(0, 256, (tokens * 32 * 2 * 8 * 128 * 2,), dtype=torch.uint8, device="cuda")
    for _ in range(3):
        checksum_tensor(data)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        checksum_tensor(data)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    rows.append(
        {
            "tokens": tokens,
            "bytes": data.numel(),
            "checksum_ms": ms,
            "gb_per_s": data.numel() / ms / 1e6,
            "device": torch.cuda.get_device_name(),
        }
    )
json.dump(rows, sys.stdout, indent=1)
print()
