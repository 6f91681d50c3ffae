"""``tandem generate``: offline generation in this process."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from protos.sampling_params import InvalidRequestError, SamplingParams
from services.config import ConfigError, LoRAConfig
from services.model_files import base_model_names


def _load_prompts(args: argparse.Namespace) -> list[Any]:
    if args.prompt:
        if args.chat:
            return [{"messages": [{"role": "user", "content": p}]} for p in args.prompt]
        return list(args.prompt)
    prompts: list[Any] = []
    try:
        with open(args.prompts_file, encoding="utf-8") as fh:
            lines = list(fh)
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"--prompts-file {args.prompts_file}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if line.strip():
            prompts.append(_prompt_line(f"{args.prompts_file}:{n}", line))
    if not prompts:
        raise InvalidRequestError(
            f"--prompts-file {args.prompts_file} holds no prompt (one JSON object a line)"
        )
    return prompts


def _prompt_line(where: str, line: str) -> Any:
    """One line of --prompts-file: ``{"prompt": TEXT}`` or ``{"messages": [...]}``, nothing
    else (a key this does not read, such as a sampling option, is refused, not ignored)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where}: not JSON ({exc.msg})") from exc
    shape = 'expected {"prompt": "..."} or {"messages": [...]}'
    if not isinstance(obj, dict) or len(obj.keys() & {"prompt", "messages"}) != 1:
        raise InvalidRequestError(f"{where}: {shape}")
    unknown = sorted(obj.keys() - {"prompt", "messages"})
    if unknown:
        raise InvalidRequestError(
            f"{where}: key(s) not supported: {', '.join(unknown)} ({shape}; sampling options "
            "and --lora-name are flags of tandem generate, the same for every line)"
        )
    if "messages" in obj:
        if not isinstance(obj["messages"], list) or not obj["messages"]:
            raise InvalidRequestError(f'{where}: "messages" must be a non-empty list')
        # checked as the gateway checks a chat request's (roles, fields, text parts), and as
        # chat templates read them
        from gateway.core.errors import APIError
        from gateway.flows.protocol import parse_messages

        try:
            return {"messages": parse_messages(obj["messages"])}
        except APIError as e:
            raise InvalidRequestError(f"{where}: {e.message}") from None
    if not isinstance(obj["prompt"], str):
        raise InvalidRequestError(f'{where}: "prompt" must be a string')
    return obj["prompt"]


def main(args: argparse.Namespace) -> int:
    try:  # the request and the prompts are checked before torch is imported (~2 s)
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.sampling_seed, max_tokens=args.max_tokens,
            lora_name=getattr(args, "lora_name", None) or "",
        )  # fmt: skip
        prompts = _load_prompts(args)
        lora = LoRAConfig.from_args(args)
        if lora is not None:  # as tandem up checks them
            lora.check_names(*base_model_names(args.model, args.served_model_name))
    except (InvalidRequestError, ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from services.engine.llm import LLM, config_from_args
    from services.engine.tp_ranks import RankFailedError

    try:
        config = config_from_args(args)
        with LLM(config=config) as llm:
            ids = [llm.encode(p) for p in prompts]
            for prompt_ids in ids:  # the gateway's 400 for the same request; no truncation
                llm.engine.check_context(len(prompt_ids), params.max_tokens)
            results = llm.generate(ids, params)
    except (InvalidRequestError, ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RankFailedError as exc:  # a tensor-parallel rank died: its rank and cause, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for res in results:
        out = res.outputs[0]
        if args.json:
            print(json.dumps({
                "prompt_token_ids": res.prompt_token_ids, "token_ids": out.token_ids,
                "text": out.text, "finish_reason": out.finish_reason,
            }))  # fmt: skip
        else:
            print(out.text)
    return 0
