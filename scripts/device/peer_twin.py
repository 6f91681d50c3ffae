"""W1's old peer (transformers on our engine's weight tensors) timed in a fresh process, our engine
loaded but never run: is the from-config peer of hf_peer as fast?"""

import argparse
import json

from services.cli import build_parser
from services.engine.bench.hf_peer import random_prompts, run_hf
from services.engine.bench.in_process import hf_twin
from services.engine.llm import config_from_args
from services.engine.llm_engine import LLMEngine

args = build_parser().parse_args(
    [
        "bench",
        "offline",
        "--model",
        "llama-3.1-8b",
        "--load-format",
        "dummy",
        "--max-model-len",
        "2048",
    ]
)
engine = LLMEngine(config_from_args(args))
engine.runner.release_kv_cache()
hf = hf_twin(engine)
prompts = random_prompts(256, 1024, engine.vocab_size)
run_hf(hf, prompts[:4], 4, 128)
s = run_hf(hf, prompts, 128, 128)
print(
    json.dumps({"peer": "hf_twin, fresh process", "bs": 128, "seconds": s, "tok_s": 256 * 1152 / s})
)
_ = argparse
