"""The engine: one step = schedule, execute, update.

Single-threaded by design; the gRPC servers drive it from one thread (``services.engine.driver``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kernels import ops
from protos.blocks import blocks_for
from protos.logprobs import PositionLogprobs, TokenLogprob
from protos.multimodal import ImageItem, VisionSpec
from protos.pooling_params import PoolingParams
from protos.sampling_params import InvalidRequestError, SamplingParams
from protos.token_bytes import TokenBytes
from services.config import ConfigError, EngineConfig, with_device_defaults
from services.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from services.engine.draft_proposer import DraftProposer
from services.engine.kv_handoff import FinalChunk, FinalChunkHook, LayerSink
from services.engine.loader import read_arch
from services.engine.model_runner import Launched, ModelRunner, launchable, resolve_device
from services.engine.mrope import rope_delta
from services.engine.outputs import RequestOutput
from services.engine.sampler import seed_engine
from services.engine.speculative import (
    VERIFY_ROWS,
    Acceptance,
    NgramProposer,
    PromptChunk,
    ProposalRequest,
    Proposer,
    SpecStats,
)
from services.engine.step_stats import HistogramSnapshot, TokenHistogram
from services.engine.structured import CompiledOutput, GrammarBatch, GrammarCompiler
from services.engine.vision import num_features
from services.model_files import ModelFiles, named_model_dir
from services.scheduling.kv_manager import KVCacheManager
from services.scheduling.outputs import (
    NO_TOKEN,
    PromptTokenScore,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
    StepUpdate,
)
from services.scheduling.request import FinishReason, Request
from services.scheduling.scheduler import Scheduler

log = logging.getLogger(__name__)
IMAGES_LOST = (
    "the request was preempted on a decode worker, which holds its images' KV but not the "
    "images themselves, so it cannot recompute them: send the request again"
)


# the files a transformers tokenizer is read from (one of them at least)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(hf_dir: str) -> Any:
    """The model's transformers tokenizer. AutoTokenizer is handed the directory's config.json as
    a plain PreTrainedConfig (model_type kept, which is all it reads of it): resolving the
    model's own config class would import its modelling code and torch._dynamo with it, about
    140 MB of a CPU worker's memory for nothing."""
    from transformers import AutoTokenizer, PreTrainedConfig
    from transformers.utils import logging as hf_logging

    try:
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "a model of type llama to instantiate one of type ''"
        try:
            config = PreTrainedConfig.from_pretrained(hf_dir)
        finally:
            hf_logging.set_verbosity(level)
        return AutoTokenizer.from_pretrained(hf_dir, config=config)
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        pass  # no or an unusual config.json (some transformers releases cannot build a plain
        # PreTrainedConfig from a Llama 3 one: AttributeError): the usual way below
    try:
        return AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError) as e:  # no tokenizer files, or ones transformers cannot read
        cause = " ".join(str(e).split())[:300] or type(e).__name__
        if not any((Path(hf_dir) / name).is_file() for name in TOKENIZER_FILES):
            cause = f"it holds none of {', '.join(TOKENIZER_FILES)}"
        raise ConfigError(
            f"cannot load the tokenizer of {hf_dir}: {cause} (a model directory needs its "
            "tokenizer files, as saved with the model)"
        ) from None


def _tokenizer_for(files: ModelFiles) -> Any:
    """The model's tokenizer; a random-weight named config borrows the embedded one if present."""
    if files.kind != "named":
        return load_tokenizer(str(files.hf_dir))
    from services.model_files import prepare_model

    try:
        return load_tokenizer(str(prepare_model("embedded").hf_dir))
    except Exception:  # no embedded model installed: token ids only
        return None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_reserved: int
    free_blocks: int
    total_blocks: int
    kv_cache_usage: float
    prompt_tokens: int
    generation_tokens: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    iteration_tokens: HistogramSnapshot  # tokens computed per step, since the engine started
    grammar_compile_s: HistogramSnapshot  # seconds per structured-output grammar compiled
    # the prefix cache's host tier (--kv-offloading-size): blocks stored, restored, dropped
    kv_offload_stored: int = 0
    kv_offload_restored: int = 0
    kv_offload_evicted: int = 0
    prefix_cache_host_hits: int = 0  # prompt tokens restored from the host tier
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's counters


# each mask the sampler names in ``SampledToken.masked_by``: how a refusal calls it, and its fix
_MASKS = {
    "structured_outputs": (
        "the structured output's grammar (from response_format, structured_outputs, a guided_* "
        "field or tool_choice)", "loosen the grammar",
    ),
    "allowed_token_ids": ("allowed_token_ids", "allow more tokens"),
    "bad_words": ("bad_words", "ban fewer words"),
    "min_tokens": ("min_tokens (which holds back the tokens that end the output)",
                   "lower min_tokens"),
}  # fmt: skip


def no_token_left(masked_by: Sequence[str]) -> tuple[str, str | None]:
    """The error of a request whose masks together left the sampler no token at some point of
    its output (the dynamic case ``LLMEngine._check_a_token_left`` cannot see up front: a
    grammar's next tokens, a bad word's last token after its others), and the field to change
    first (the gateway names the field that asked for a grammar). No field when no mask did
    it (a model whose logits were all -inf): no fault of the request."""
    names = [name for name in _MASKS if name in masked_by]
    if not names:
        return "no token is allowed at this point of the output: every logit was -inf", None
    what = [_MASKS[name][0] for name in names]
    leave = f"{what[0]} leaves" if len(what) == 1 else (
        f"{', '.join(what[:-1])} and {what[-1]} together leave"
    )  # fmt: skip
    fixes = " or ".join(_MASKS[name][1] for name in names)
    first = ("allowed_token_ids", "bad_words", "structured_outputs", "min_tokens")
    param = next(name for name in first if name in names)
    return f"no token is allowed at this point of the output: {leave} none; {fixes}", param


def _whole_image_tokens(config: EngineConfig) -> int:
    """The tokens of one image where a step must compute an image whole (its tokens attend to
    each other both ways: Gemma 3); 0 for any other model. Read from the model's config files
    alone, before the runner is sized by the step's token budget."""
    files, arch = read_arch(config.model)
    if arch.vision is None or not arch.vision.bidirectional:
        return 0
    model_dir = files.hf_dir or named_model_dir(files)
    spec = VisionSpec.of_model_dir(model_dir) if model_dir is not None else None
    return spec.tokens_of(spec.grid(1, 1)) if spec is not None else 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config = with_device_defaults(
            config, resolve_device(config.device).type, _whole_image_tokens(config)
        )
        self.config = config
        ops.set_row_invariant(0)  # a runner with drafts to verify turns it on (ModelRunner)
        self.runner = ModelRunner(config)
        files = self.runner.files
        self.tokenizer = _tokenizer_for(files)
        self._decoder = fast_decoder(self.tokenizer)  # the detokenizers' (twice a token)
        self._token_bytes = TokenBytes.of(self.tokenizer) if self.tokenizer is not None else None
        self.model_name = config.model.model if files.kind != "gguf" else files.name
        self.vocab_size = self.runner.arch.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.task = config.task  # generate | embed: the one kind of request this engine takes
        # how images become placeholder tokens (None: a text-only model, or a multimodal one
        # served as its language model)
        model_dir = files.hf_dir or named_model_dir(files)
        self.vision_spec = (
            VisionSpec.of_model_dir(model_dir)
            if model_dir is not None and self.runner.arch.vision is not None
            else None
        )
        vision = self.runner.arch.vision
        if vision is not None and vision.bidirectional and self.vision_spec is not None:
            # an image's tokens see each other: one step computes them all
            grid = self.vision_spec.grid(1, 1)  # Gemma 3: every image the same
            need = self.vision_spec.tokens_of(grid)
            if config.scheduler.token_budget < need:
                raise ConfigError(
                    f"{vision.model_type} computes each image's {need} tokens in one step "
                    "(they attend to each other both ways), but --max-num-batched-tokens is "
                    f"{config.scheduler.token_budget}: raise it to at least {need}"
                )
        tok_eos = getattr(self.tokenizer, "eos_token_id", None) if files.kind != "named" else None
        self.eos_token_ids = frozenset(self.runner.arch.eos_token_ids) | (
            {tok_eos} if tok_eos is not None else set()
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
            host_slots=self.runner.num_host_slots,
        )  # fmt: skip
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.grammars = GrammarBatch(
            self.vocab_size, config.scheduler.max_num_seqs, self.runner.device, self.eos_token_ids
        )
        spec = config.speculative
        self.proposer: Proposer | None = None
        if spec is not None and spec.method == "draft_model":
            self.proposer = DraftProposer(config, self.runner, self.tokenizer)
        elif spec is not None:
            self.proposer = NgramProposer(spec)
        self._acceptance: dict[str, Acceptance] = {}
        self.spec_stats = SpecStats()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        # prompt_logprobs, position by position, until the request's first token goes out
        self._prompt_lp: dict[str, list[PositionLogprobs]] = {}
        # the last step's token updates, turned into outputs (detokenized, stop strings checked)
        # while the next step's forward runs: off the path between two steps (see step())
        self._pending: list[StepUpdate] = []
        # where those outputs go at once (the serving driver streams them while the forward
        # runs); None: the step returns them (one step later than they were made)
        self.deliver_early: Callable[[list[RequestOutput]], None] | None = None
        # whether outputs may wait for the next step's forward at all: where they are made
        # while the device computes it (a GPU); on the CPU the forward has run by then, so they
        # would reach the client a whole step late
        overlaps = self.runner.reader.overlaps
        self.defer_outputs = overlaps
        # async scheduling: decode steps are queued on the device before the step
        # before them is read (see _advance); the one queued and not read yet
        wanted = config.scheduler.async_scheduling
        self.async_decode = (
            (overlaps if wanted is None else wanted)
            and self.proposer is None
            and self.task == "generate"
            and self.runner.launches_ahead
        )
        self._launched: Launched | None = None
        # a named config with random weights has no tokenizer of its own: token ids only
        self.detokenize = files.kind != "named"
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # (tokens, sequences) of the step whose tokens the last call read (benchmarks time a
        # call as that step's: under async scheduling it returns once that step is done)
        self.last_step_shape = (0, 0)
        self.step_tokens = TokenHistogram()  # tokens computed per step that ran (not idle ones)
        # a prefill worker streaming KV out as it is written (services.engine.kv_handoff)
        self.on_final_chunks: FinalChunkHook | None = None
        if config.model.seed is not None:  # last: nothing above draws from it after this
            seed_engine(config.model.seed)

    # ---- requests ----------------------------------------------------------------------------
    def device_memory(self) -> dict[str, int]:
        """:meth:`ModelRunner.device_memory`: the worker's ready file carries it."""
        return self.runner.device_memory()

    def _validate_ids(self, prompt_token_ids: list[int], param: str = "prompt") -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param
            )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._validate_ids(prompt_token_ids)
        if params.lora_name and params.lora_name not in self.lora_names():
            raise InvalidRequestError(
                f"LoRA adapter {params.lora_name!r} is not served here (serving: "
                f"{', '.join(self.lora_names()) or 'none; start with --enable-lora'})", "model"
            )  # fmt: skip
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids)):  # fmt: skip
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise InvalidRequestError(
                    f"{name} token id {outside[0]} is outside the vocabulary "
                    f"[0, {self.vocab_size})", name,
                )  # fmt: skip
        if len(prompt_token_ids) >= self.max_model_len:
            raise self.context_error(len(prompt_token_ids), params.max_tokens, "prompt")

    def _check_priority(self, priority: int) -> None:
        """A priority other than 0 needs the priority policy: first come, first served would
        quietly ignore it (vLLM refuses it too)."""
        if priority and self.config.scheduler.policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} needs a worker started with --scheduling-policy priority "
                "(this one serves first come, first served): leave priority out or 0",
                "priority",
            )

    def check_context(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse prompt + max_tokens past the context, as the gateway does (HTTP 400).

        Not part of :meth:`validate`: workers keep taking requests whose completion is cut at the
        context (finish_reason "length"); ``tandem generate`` calls this up front.
        """
        if prompt_len + max_tokens > self.max_model_len:
            raise self.context_error(prompt_len, max_tokens, "max_tokens")

    def context_error(self, prompt_len: int, max_tokens: int, param: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens "
            f"({prompt_len} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param,
        )

    def _check_task(self, task: str) -> None:
        if task == self.task:
            return
        if self.task == "generate":
            raise InvalidRequestError(
                "this model is served for generation; start it with --task embed to serve "
                "embeddings", "model"
            )  # fmt: skip
        raise InvalidRequestError(
            "this model is served for embeddings (--task embed); start it with --task generate "
            "to serve completions and chats", "model"
        )  # fmt: skip

    def _check_images(
        self, prompt: list[int], images: Sequence[ImageItem], need_data: bool = True
    ) -> int:
        """Refuse images a text-only model cannot take, image tokens without an image and (when
        the prompt is computed here: ``need_data``) an image without its bytes; returns the
        request's position offset (M-RoPE)."""
        arch = self.runner.arch
        vision = arch.vision
        if vision is None:
            if images:
                what = (
                    f"served for its language model only ({arch.language_only})"
                    if arch.language_of
                    else "a text-only model"
                )
                raise InvalidRequestError(
                    f"{self.model_name} is {what}: it takes no images; send text only, or "
                    "serve a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral 3, "
                    "Gemma 3)",
                    "messages",
                )  # fmt: skip
            return 0
        pad, spec = vision.image_token_id, self.vision_spec
        covered = sum(num_features(vision, im) for im in images)
        found = sum(1 for t in prompt if t == pad)

        def run(im: ImageItem) -> list[int]:  # the image's tokens (Mistral 3: with its breaks)
            return spec.run(im.grid) if spec is not None else [pad] * im.num_tokens

        bad = any(im.end > len(prompt) or prompt[im.offset : im.end] != run(im) for im in images)
        if need_data and any(not im.data for im in images):
            raise InvalidRequestError("an image came without its data", "images")
        if found != covered or bad:
            raise InvalidRequestError(
                f"the prompt has {found} image tokens but its images need {covered} at their "
                "offsets: expand each image's placeholder to its token count", "messages"
            )  # fmt: skip
        return rope_delta(images, vision.spatial_merge_size) if vision.mrope else 0

    def _whole_images(self, images: Sequence[ImageItem]) -> bool:
        """Whether each of these images must be computed in one prefill chunk (Gemma 3)."""
        vision = self.runner.arch.vision
        return bool(images) and vision is not None and vision.bidirectional

    def prepare_images(self, images: Sequence[ImageItem]) -> None:
        """Preprocess a request's images (InvalidRequestError for one that does not decode or
        does not match its placeholder count); thread-safe, so the serving path does it off
        the engine thread before ``add_request``."""
        vision = self.runner.vision
        if vision is not None and images:
            vision.prepare(tuple(images))

    def _request(
        self, request_id: str, prompt: list[int], params: SamplingParams, priority: int, hold: bool,
        images: Sequence[ImageItem] = (),
    ) -> Request:  # fmt: skip
        self._check_task("generate")
        self.validate(prompt, params)
        self._check_priority(priority)
        params = self._with_bad_word_ids(params)
        self._check_a_token_left(params)
        long_rope = self._long_rope_offset(prompt)
        offset = self._check_images(prompt, images) + long_rope
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            max_model_len=self.max_model_len,
            hold_blocks_on_finish=hold,
            cache_salt=self._cache_salt(params, bool(long_rope)),
            images=tuple(images),
            position_offset=offset,
            whole_images=self._whole_images(images),
        )

    def _check_a_token_left(self, params: SamplingParams) -> None:
        """Refuse ``allowed_token_ids`` that leave the sampler no token: every one banned by a
        one-token bad word, or, before ``min_tokens``, every one a token that ends the output
        (EOS unless ignore_eos, a stop_token_id), which the sampler holds back until then."""
        allowed = set(params.allowed_token_ids)
        if not allowed:
            return
        left = allowed - {ids[0] for ids in params.bad_word_ids if len(ids) == 1}
        if not left:
            raise InvalidRequestError(
                "allowed_token_ids leaves no token to sample: bad_words bans every one of them; "
                "allow more tokens or ban fewer words", "allowed_token_ids",
            )  # fmt: skip
        if params.min_tokens > 0 and left <= self._stop_ids(params):
            raise InvalidRequestError(
                f"allowed_token_ids leaves no token to sample before min_tokens "
                f"({params.min_tokens}): each allowed token ends the output (end of sequence "
                "or a stop_token_id), which is held back until min_tokens are out; allow "
                "other tokens or drop min_tokens", "allowed_token_ids",
            )  # fmt: skip

    def _with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """``bad_words`` as token sequences (the sampler's ``bad_word_ids``): each word as it
        is and after a space (where it follows another word), tokenized once per request."""
        if not params.bad_words or params.bad_word_ids:
            return params
        if self.tokenizer is None:
            raise InvalidRequestError(
                "bad_words needs the model's tokenizer, which this engine was started without",
                "bad_words",
            )
        sequences: list[tuple[int, ...]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return replace(params, bad_word_ids=tuple(sequences))

    def _long_rope_offset(self, prompt: Sequence[int]) -> int:
        """LongRoPE: the position offset into the model's long-factor table for a prompt longer
        than the original length (``LlamaForCausalLM.long_rope_offset``); 0 otherwise."""
        offset = getattr(self.runner.model, "long_rope_offset", 0)
        if not offset:
            return 0
        original = self.runner.arch.rope_scaling["original_max_position_embeddings"]
        return int(offset) if len(prompt) > original else 0

    def _cache_salt(self, params: SamplingParams, long_rope: bool) -> str:
        """A request's prefix-cache salt: its LoRA adapter's (as loaded now), LongRoPE's long
        factors for a prompt that takes them (``long_rope``: its keys are rotated otherwise)
        and its own ``cache_salt``; "" for none."""
        lora = self.runner.lora
        salt = lora.salts.get(params.lora_name, "") if lora is not None else ""
        if long_rope:
            salt = f"{salt}\0rope:long"
        if not params.cache_salt:
            return salt
        return f"{salt}\0user:{params.cache_salt}"

    def _track(self, req: Request) -> None:
        sp = req.sampling_params
        if not self.detokenize or req.pooling is not None:
            return
        self._detok[req.request_id] = IncrementalDetokenizer(
            self._decoder, req.prompt_token_ids, sp.stop, sp.include_stop_str_in_output,
            sp.skip_special_tokens, sp.min_tokens,
        )  # fmt: skip

    def compile_grammar(self, params: SamplingParams) -> CompiledOutput | None:
        """The request's grammar (None: free output). Thread-safe: callers on the serving path
        compile off the engine thread and pass the result in; InvalidRequestError if bad."""
        if params.structured is None:
            return None
        return self.grammar_compiler.compile(params.structured)

    def _constrain(
        self, request_id: str, params: SamplingParams, grammar: CompiledOutput | None,
        outputs: list[int],
    ) -> None:  # fmt: skip
        if params.structured is not None:
            if request_id in self.grammars.states:  # the scheduler would refuse it anyway
                raise ValueError(f"request id {request_id!r} is already in use")
            compiled = grammar or self.compile_grammar(params)
            assert compiled is not None
            self.grammars.add(request_id, compiled, outputs)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, prefill_only: bool = False, grammar: CompiledOutput | None = None,
        images: Sequence[ImageItem] = (), output_token_ids: Sequence[int] = (),
    ) -> None:  # fmt: skip
        """Queue a request. ``prefill_only`` keeps its blocks after the first token (see release);
        ``grammar``: ``compile_grammar(params)``, compiled here if not given; ``images``: the
        prompt's images, their placeholders already expanded (``protos.multimodal``).
        ``output_token_ids``: tokens this request already generated elsewhere (it moved here
        from a worker that died mid-stream): the prompt and they are prefilled, generation goes
        on after them as if they were this engine's own (max_tokens, min_tokens, penalties,
        seeds by output position, stop strings, a grammar), and their text is not sent again."""
        req = self._request(request_id, prompt_token_ids, params, priority, prefill_only, images)
        outputs = list(output_token_ids)
        if outputs:
            self._check_resumed(req, outputs)
            req.output_token_ids = outputs
        self.prepare_images(images)  # a no-op for images the driver prepared already
        self._constrain(request_id, params, grammar, outputs)
        try:
            self.scheduler.add(req)
        except BaseException:
            self.grammars.drop(request_id)
            raise
        self._track(req)
        det = self._detok.get(request_id)
        if det is not None and outputs:
            for t in outputs:
                det.add(t)
            det.release(False)  # their text was sent by the worker that made them
        self.prompt_tokens += len(prompt_token_ids)

    def _check_resumed(self, req: Request, outputs: list[int]) -> None:
        """What a request moved here with its earlier tokens must satisfy: ids in the
        vocabulary, and room left to generate (else it had finished where it was)."""
        self._validate_ids(outputs, "output_token_ids")
        if req.hold_blocks_on_finish:
            raise InvalidRequestError(
                "a prefill-only request has no earlier output tokens", "output_token_ids"
            )
        if req.ends_by_length(len(outputs)):
            raise InvalidRequestError(
                f"{len(outputs)} earlier output tokens leave nothing to generate under max_tokens "
                f"{req.sampling_params.max_tokens} and max_model_len {self.max_model_len}",
                "output_token_ids",
            )  # fmt: skip

    def add_embedding(
        self, request_id: str, prompt_token_ids: list[int], pooling: PoolingParams | None = None,
        priority: int = 0,
    ) -> None:  # fmt: skip
        """Queue an embedding (``--task embed``): the prompt is prefilled (chunked, from the
        prefix cache where its pooling allows) and finishes as one pooled vector
        (``RequestOutput.embedding``); its blocks are freed as it finishes."""
        self._check_task("embed")
        self._check_priority(priority)
        if pooling is None:
            pooler = self.config.pooler
            pooling = PoolingParams(pooler.pooling_type, pooler.normalize)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        self._validate_ids(prompt_token_ids, "input")
        if len(prompt_token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt_token_ids)} tokens in the input for embedding "
                "generation. Please reduce the length of the input.", "input"
            )  # fmt: skip
        req = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
            eos_token_ids=self.eos_token_ids, priority=priority,
            max_model_len=self.max_model_len, pooling=pooling,
        )  # fmt: skip
        self.scheduler.add(req)
        self.prompt_tokens += len(prompt_token_ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        dropped = [u for u in self._pending if u.request_id == request_id]
        if dropped:  # its last tokens are not streamed after the abort's end
            self._pending = [u for u in self._pending if u.request_id != request_id]
        req = self.scheduler.abort(request_id)
        self.runner.pooler.drop(request_id)
        self._forget(request_id)
        self._prompt_lp.pop(request_id, None)
        if req is None and self.scheduler.cancel_reservation(request_id):
            return None
        if req is None and dropped:  # it finished, its last output not made yet: aborted now
            u = dropped[-1]
            return RequestOutput(request_id, [], "", True, "abort", None, u.num_prompt_tokens,
                                 u.num_cached_tokens)  # fmt: skip
        if req is None:
            return None
        return RequestOutput(request_id, [], "", True, "abort", None, req.num_prompt_tokens,
                             req.num_cached_tokens)  # fmt: skip

    # ---- disaggregation ----------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> list[int] | None:
        """Decode side: hold blocks for a prompt whose KV will arrive; None if they don't fit
        (its images, if any, come with ``activate``)."""
        req = self._request(request_id, prompt_token_ids, params, priority, False)
        return self.kv.block_ids(request_id) if self.scheduler.reserve(req) else None

    def reserve_for(
        self, request_id: str, num_prompt_tokens: int, params: SamplingParams
    ) -> list[int] | None:
        """Reserve before the prompt itself is known (the ids come with ``activate``)."""
        return self.reserve(request_id, [0] * num_prompt_tokens, params)

    def activate(
        self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
        params: SamplingParams | None = None, grammar: CompiledOutput | None = None,
        images: Sequence[ImageItem] = (),
    ) -> RequestOutput | None:  # fmt: skip
        """The reserved prompt's KV has arrived; returns a final output if nothing is left to do.
        ``images``: the prompt's (their bytes may be left out): its decode positions follow them
        (M-RoPE) and its blocks are cached under their content."""
        reserved = self.scheduler.reserved.get(request_id)
        if reserved is None:
            raise KeyError(f"no reservation {request_id!r}")
        if len(prompt_token_ids) != reserved.num_prompt_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens but {reserved.num_prompt_tokens} "
                "were reserved", "prompt_token_ids",
            )  # fmt: skip
        self.validate(prompt_token_ids, params or reserved.sampling_params)
        params = self._with_bad_word_ids(params or reserved.sampling_params)
        long_rope = self._long_rope_offset(prompt_token_ids)
        offset = self._check_images(prompt_token_ids, images, need_data=False) + long_rope
        # the prefill worker's tokens advance the grammar: it goes on from where it stopped
        self._constrain(request_id, params, grammar, output_token_ids)
        reserved.prompt_token_ids = list(prompt_token_ids)
        reserved.sampling_params = params
        reserved.cache_salt = self._cache_salt(params, bool(long_rope))
        reserved.images, reserved.position_offset = tuple(images), offset
        reserved.whole_images = self._whole_images(images)
        req = self.scheduler.activate(request_id, output_token_ids)
        last = output_token_ids[-1] if output_token_ids else None
        if not req.finished and last is not None and self.grammars.ends_with(request_id, last):
            self.scheduler.finish(request_id, FinishReason.STOP)
        self._track(req)
        det = self._detok.get(request_id)
        if det is not None:
            for t in output_token_ids:
                det.add(t)
            # the prefill worker sent this text but for what may begin a stop string: that is
            # held here too (the same rule on the same tokens), to be matched or sent from here
            det.release(False)
        if req.finished:
            self._forget(request_id)
            reason = req.finish_reason.value if req.finish_reason else None
            return RequestOutput(request_id, [], "", True, reason, req.stop_reason,
                                 req.num_prompt_tokens, 0)  # fmt: skip
        return None

    def cancel_reservation(self, request_id: str) -> bool:
        return self.scheduler.cancel_reservation(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.block_ids(request_id)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute, update. On a GPU the outputs returned are those of the step
        before (its tokens detokenized and checked for stop strings while this step's forward
        ran) and, when nothing is left to run, this step's own; on the CPU, this step's. A stop
        string found that late finishes its request after one more token was computed for it,
        which nobody sees.

        Async scheduling: a decode step is launched, not read; the next one is
        scheduled and launched behind it before its tokens come back (see :meth:`_advance`),
        so the host's work between two steps overlaps the device's."""
        if self._launched is not None:
            return self._advance(self._launched)
        if self.proposer is not None:
            self._propose()
        out = self.scheduler.schedule()
        num_tokens = out.num_tokens
        self.last_step_shape = (num_tokens, len(out.requests))
        if self.proposer is not None:
            for rid in out.preempted:  # recomputed later: the draft's KV goes back too
                self.proposer.drop(rid)
        if out.empty:
            return self._emit_all(self._take_pending())
        lost = self._images_lost(out)
        if lost:
            out.requests = [r for r in out.requests if r.request_id not in lost]
            if out.empty:
                return [*lost.values(), *self._emit_all(self._take_pending())]
            num_tokens = out.num_tokens
        self.step_tokens.observe(num_tokens)
        if self.proposer is not None:  # the draft's prefill rides in the target's prefill step
            self._feed_prompts(out)
        min_stop = self._min_token_stop_ids(out.requests)
        score = self._prompt_scoring(out.requests)
        layers = self._layer_sink(out) if self.on_final_chunks is not None else None
        if self._may_launch(out, min_stop, score, layers):
            launched = self.runner.launch(out)
            self.runner.start_read(launched)
            return [*lost.values(), *self._advance(launched)]
        earlier: list[RequestOutput] = []
        pending = self._take_pending()
        if pending:  # the last step's outputs, made while this forward runs on the device
            self.runner.reader.while_waiting(lambda: self._early(pending, earlier))
        try:
            sampled = self.runner.execute(out, min_stop, self.grammars, score, layers=layers)
        except BaseException as exc:
            if layers is not None:  # the KV streaming out of this forward will never be whole
                layers.fail(f"the forward failed: {type(exc).__name__}: {exc}")
            self.runner.reader.while_waiting(None)  # not run: dropped with the step
            raise
        self.runner.reader.run_pending()  # a step that read nothing back
        if score:
            self._keep_prompt_scores(self.runner.score_prompts(out, score))
        pooled = self.runner.pool(out) if self.task == "embed" else {}
        if self.proposer is not None:
            self._record_acceptance(out, sampled)
        updates = self.scheduler.update(out, sampled)
        outputs = [*lost.values(), *earlier]
        tokens = []
        for u in updates:
            if u.token is None:  # an embedding's last chunk
                outputs.append(self._emit_embedding(u, pooled[u.request_id]))
            else:
                tokens.append(u)
        if self._may_defer(tokens):
            self._pending = tokens
        else:
            outputs.extend(self._emit_all(tokens))
        return outputs

    def _may_launch(
        self, out: SchedulerOutput, min_stop: dict[str, list[int]], score: dict[str, int],
        layers: LayerSink | None,
    ) -> bool:  # fmt: skip
        """Whether this step may run launched (its tokens read after the next step is queued):
        nothing for the sampler or a grammar to do on the host, in this step or in a later
        chunk of a prompt it holds (its last chunk may run launched ahead), no drafts, no
        embeddings, no KV streamed out as it is written. So no mask either: a launched step's
        every row has a token (``NO_TOKEN`` is the host sampler's), which the step queued
        behind it may take as its input id unseen."""
        if not self.async_decode or layers is not None or score or min_stop:
            return False
        for r in out.requests:
            sp = r.sampling_params
            if r.num_spec or r.pooling is not None or not launchable(sp):
                return False
            if not r.sample and len(r.output_token_ids) < sp.min_tokens:
                return False  # its last chunk samples with its stop tokens masked
        return not self._constrained([r.request_id for r in out.requests])

    def _may_admit(self, req: Request) -> bool:
        """Whether a waiting request may be admitted into a step scheduled ahead: its first
        chunk then runs launched (see :meth:`_may_launch`)."""
        sp = req.sampling_params
        return (
            launchable(sp)
            and len(req.output_token_ids) >= sp.min_tokens
            and (sp.prompt_logprobs is None or bool(req.output_token_ids))
            and not req.images
            and not req.hold_blocks_on_finish
            and not self._constrained([req.request_id])
        )

    def _advance(self, cur: Launched) -> list[RequestOutput]:
        """Finish the launched step ``cur``: first schedule and launch the step after it when
        the scheduler can say what runs without ``cur``'s tokens (those it decodes are input
        ids there, on the device), then read ``cur``'s tokens and update. ``cur``'s outputs are
        made while the next step runs; without one they may wait for the next call, as in
        :meth:`step`."""
        self._launched, nxt = None, None
        queued: frozenset[str] = frozenset()  # the requests of ``nxt``
        s = self.scheduler
        running = frozenset(r.request_id for r in cur.out.requests)
        earlier: list[RequestOutput] = []
        try:
            ahead = s.schedule_ahead(cur.out, self._may_admit)
            if ahead is not None:
                nxt = self.runner.launch(ahead[0], cur, ahead[1])
                queued = frozenset(r.request_id for r in nxt.out.requests)
                s.settle(running | queued)
            pending = self._take_pending()
            if pending:  # the last step's outputs, made while the device computes
                self.runner.reader.while_waiting(lambda: self._early(pending, earlier))
            ids = self.runner.finish(cur)
        except BaseException:
            self.runner.reader.while_waiting(None)
            try:  # the launched steps are dropped unread: their writes end before blocks free
                self.runner.wait_idle()
            finally:
                s.settle(frozenset())
            raise
        if nxt is not None:
            self.runner.start_read(nxt)
            self._launched = nxt
            self.step_tokens.observe(nxt.out.num_tokens)
        self.last_step_shape = (cur.out.num_tokens, len(cur.out.requests))
        sampling = [r for r in cur.out.requests if r.samples_token]
        sampled = {r.request_id: [SampledToken(t)] for r, t in zip(sampling, ids, strict=True)}
        updates = s.update(cur.out, sampled)
        if nxt is not None:
            s.register_ahead(nxt.out)
        s.settle(queued)  # what ``cur`` finished and ``nxt`` does not write: freed
        if nxt is None and self._may_defer(updates):
            self._pending = updates
        else:
            earlier.extend(self._emit_all(updates))
        return earlier

    def _may_defer(self, updates: list[StepUpdate]) -> bool:
        """Whether these tokens' outputs may wait for the next step's forward: only where they
        are made while the device computes it (a GPU; on the CPU they would reach the client a
        whole step late), not when the engine has nothing more to run (nobody would call
        again), nor under a grammar (its matcher must take the token before the next step's
        bitmask) or drafts (proposed from the outputs)."""
        return (
            bool(updates)
            and self.defer_outputs
            and self.proposer is None
            and self.scheduler.has_unfinished
            and not self._constrained([u.request_id for u in updates])
        )

    def _constrained(self, request_ids: list[str]) -> bool:
        """Whether a grammar constrains any of these requests (checked only when some request
        has one)."""
        return bool(self.grammars.states) and self.grammars.constrains(request_ids)

    def _early(self, pending: list[StepUpdate], into: list[RequestOutput]) -> None:
        outputs = self._emit_all(pending)
        if self.deliver_early is not None:
            self.deliver_early(outputs)
        else:
            into.extend(outputs)

    def _take_pending(self) -> list[StepUpdate]:
        pending, self._pending = self._pending, []
        return pending

    def _emit_all(self, updates: list[StepUpdate]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        done: set[str] = set()
        for u in updates:
            if u.request_id not in done:  # a stop string ends a kept run early
                outputs.append(self._emit(u))
                if outputs[-1].finished:
                    done.add(u.request_id)
        return outputs

    def _images_lost(self, out: SchedulerOutput) -> dict[str, RequestOutput]:
        """Requests this step would recompute image tokens of without the image's bytes (a
        decode worker gets only their KV; preempted, it cannot recompute them): each fails
        alone, with an error, instead of the step."""
        vision = self.runner.vision
        if vision is None:
            return {}
        lost: dict[str, RequestOutput] = {}
        for r in out.requests:
            lo, hi = r.start_pos, r.start_pos + r.num_new_tokens
            if any(not im.data and im.offset < hi and im.end > lo
                   and im.content_hash not in vision.cache for im in r.images):  # fmt: skip
                self.abort(r.request_id)
                lost[r.request_id] = RequestOutput(
                    r.request_id, [], "", True, "error", error=IMAGES_LOST
                )
        return lost

    def _layer_sink(self, out: SchedulerOutput) -> LayerSink | None:
        """The prefill-only requests whose last prompt chunk this step computes, handed to
        ``on_final_chunks`` before the forward; where that forward records its layers."""
        assert self.on_final_chunks is not None
        finals = []
        for sr in out.requests:
            req = self.scheduler.requests.get(sr.request_id)
            prefill_only = req is not None and req.hold_blocks_on_finish
            if prefill_only and sr.sample and not sr.output_token_ids:
                n = len(sr.prompt_token_ids)
                blocks = sr.block_ids[: blocks_for(n, self.config.cache.block_size)]
                finals.append(FinalChunk(sr.request_id, blocks, n))
        return self.on_final_chunks(finals) if finals else None

    # ---- speculative decoding ----------------------------------------------------------------
    def _spec_room(self, decodes: int) -> int:
        """Drafts a step may carry (0: none). Drafts ride in the rows a decode step has to
        spare: a step of few decodes is bound by reading the weights, so up to VERIFY_ROWS rows
        cost about what one does; past that every draft row costs, so a large batch decodes
        without drafts. The batch counts the requests about to decode too (running prompts and
        those waiting, up to max_num_seqs): drafting for the first few of a batch that is
        filling up buys a few steps and costs each of them."""
        assert self.config.speculative is not None
        s = self.scheduler
        batch = min(len(s.running) + len(s.waiting), self.config.scheduler.max_num_seqs)
        off_at = self.config.speculative.disable_by_batch_size
        if batch >= VERIFY_ROWS or (off_at is not None and decodes >= off_at):
            return 0
        return VERIFY_ROWS - decodes

    def _may_speculate(self, req: Request) -> bool:
        """Not constrained, not a prefill worker's request (it stops at its first token)."""
        return req.request_id not in self.grammars.states and not req.hold_blocks_on_finish

    def _propose(self) -> None:
        """Draft tokens for each running decode that speculation suits (see _may_speculate; past
        min_tokens, not sitting out after rejections), within max_tokens, the context and the
        request's own adaptive length (Acceptance.k)."""
        assert self.proposer is not None and self.config.speculative is not None
        for req in self.scheduler.running:  # a step that did not run last time's drafts
            req.spec_token_ids = []
        decodes = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        room = self._spec_room(len(decodes))
        if room <= 0:
            return
        k = self.config.speculative.num_speculative_tokens
        wanted = []
        for req in decodes:
            sp = req.sampling_params
            if req.num_output_tokens < sp.min_tokens or not self._may_speculate(req):
                continue
            acceptance = self._acceptance.get(req.request_id)
            if acceptance is None:
                acceptance = Acceptance(self.proposer.adaptivity, k)
                self._acceptance[req.request_id] = acceptance
            if not acceptance.wants_proposal():
                continue
            remaining = min(sp.max_tokens - req.num_output_tokens,
                            self.max_model_len - req.num_tokens)  # fmt: skip
            limit = min(remaining - 1, acceptance.k)
            wanted.append(ProposalRequest(req.request_id, req.prompt_token_ids,
                                          req.output_token_ids, limit, remaining))  # fmt: skip
        drafts = self.proposer.propose_batch(wanted, room)
        for req in decodes:
            req.spec_token_ids = drafts.get(req.request_id, [])

    def _feed_prompts(self, out: SchedulerOutput) -> None:
        """Hand the proposer this step's prompt chunks of requests that may propose later."""
        assert self.proposer is not None
        decodes = sum(1 for r in out.requests if r.num_new_tokens == 1 + r.num_spec)
        if self._spec_room(decodes) <= 0:
            return
        chunks = []
        for sr in out.requests:
            req = self.scheduler.requests.get(sr.request_id)
            if req is None or sr.num_new_tokens == 1 + sr.num_spec or sr.pooling is not None:
                continue  # a decode (or a one-token chunk: the catch-up takes it)
            if req.sampling_params.max_tokens > 1 and self._may_speculate(req):
                chunks.append(PromptChunk(sr.request_id, req.prompt_token_ids,
                                          req.output_token_ids, sr.context_len))  # fmt: skip
        if chunks:
            self.proposer.prefill(chunks)

    def _record_acceptance(
        self, out: SchedulerOutput, sampled: dict[str, list[SampledToken]]
    ) -> None:
        for sr in out.requests:
            tokens = sampled.get(sr.request_id)
            if sr.num_spec and tokens:
                kept = len(tokens) - 1
                self.spec_stats.record(sr.num_spec, kept)
                acceptance = self._acceptance.get(sr.request_id)
                if acceptance is not None:
                    acceptance.record(sr.num_spec, kept)

    def _forget(self, request_id: str) -> None:
        """Drops the host-side state of a request that ended: its detokenizer, grammar matcher
        and draft proposer's tables (its prompt logprobs, read into its last output, are
        popped where that output is made)."""
        self._detok.pop(request_id, None)
        self.grammars.drop(request_id)
        if self.proposer is not None:
            self.proposer.drop(request_id)
            self._acceptance.pop(request_id, None)

    def _min_token_stop_ids(self, requests: list) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r in requests:
            sp = r.sampling_params
            if r.sample and len(r.output_token_ids) < sp.min_tokens and not self._grammar_done(r):
                out[r.request_id] = sorted(self._stop_ids(sp))
        return out

    def _stop_ids(self, sp: SamplingParams) -> set[int]:
        """The tokens that end an output (its stop_token_ids, EOS unless ignore_eos): what the
        sampler holds back before min_tokens."""
        return set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))

    @staticmethod
    def _prompt_scoring(requests: list[ScheduledRequest]) -> dict[str, int]:
        """Requests asking for prompt logprobs whose chunk this step holds prompt tokens."""
        return {
            r.request_id: r.sampling_params.prompt_logprobs
            for r in requests
            if r.sampling_params.prompt_logprobs is not None
            and r.start_pos < len(r.prompt_token_ids) - 1
            and not r.output_token_ids  # sent with the first token: a recompute sends none
        }

    def _keep_prompt_scores(self, scores: dict[str, list[PromptTokenScore]]) -> None:
        for rid, entries in scores.items():
            kept = self._prompt_lp.setdefault(rid, [])
            for s in entries:
                if s.position == len(kept) + 1:  # a recompute after preemption repeats positions
                    chosen = self._token_logprob(s.token_id, s.logprob, s.rank)
                    top = tuple(
                        self._token_logprob(t, lp, j + 1) for j, (t, lp) in enumerate(s.top)
                    )
                    kept.append(PositionLogprobs(chosen, top))

    def _grammar_done(self, r: ScheduledRequest) -> bool:
        """The grammar could end here: min_tokens yields to it."""
        return self.grammars.completed(r.request_id)

    def _emit(self, u: StepUpdate) -> RequestOutput:
        assert u.token is not None
        if u.token.token_id == NO_TOKEN:
            return self._emit_no_token(u)
        self.generation_tokens += 1
        det = self._detok.get(u.request_id)
        finished, reason, stop_reason = u.finished, u.finish_reason, u.stop_reason
        if not finished and u.request_id in self.grammars.states:  # constrained
            if self.grammars.ends_with(u.request_id, u.token.token_id):
                self.scheduler.finish(u.request_id, FinishReason.STOP)  # under ignore_eos too
                finished, reason, stop_reason = True, "stop", None  # its end: an EOS token
            else:  # the matcher takes it during the next step's forward
                self.grammars.push(u.request_id, u.token.token_id)
        # a token that ends the output (EOS, a stop_token_id, a grammar's end) is in its token
        # ids but not in its text, unless include_stop_str_in_output (as vLLM); stop_reason is
        # the stop_token_id, None for EOS (a matched stop string, found below, is a str)
        stop_token = finished and reason == "stop" and not isinstance(stop_reason, str)
        if det is not None and not (stop_token and not det.include_stop):
            matched = det.add(u.token.token_id)
            if matched is not None and not finished:
                self.scheduler.finish(u.request_id, FinishReason.STOP, matched)
                finished, reason, stop_reason = True, "stop", matched
            elif matched is not None:
                reason, stop_reason = "stop", matched
        text = det.release(finished) if det is not None else ""
        if finished:
            self._forget(u.request_id)
        return RequestOutput(
            request_id=u.request_id,
            token_ids=[u.token.token_id],
            text=text,
            finished=finished,
            finish_reason=reason,
            stop_reason=stop_reason,
            num_prompt_tokens=u.num_prompt_tokens,
            num_cached_tokens=u.num_cached_tokens,
            logprobs=self._logprobs(u),
            queue_s=u.queue_s,
            prompt_logprobs=self._prompt_lp.pop(u.request_id, []) if self._prompt_lp else [],
        )

    def _emit_no_token(self, u: StepUpdate) -> RequestOutput:
        """The request's masks left the sampler no token (``NO_TOKEN``): it ends there with an
        error naming the fields that did it, the request's own fault (its blocks went back in
        ``Scheduler.update``)."""
        assert u.token is not None
        rid = u.request_id
        self._forget(rid)
        self._prompt_lp.pop(rid, None)
        error, param = no_token_left(u.token.masked_by)
        return RequestOutput(
            rid, [], "", True, "error", None, u.num_prompt_tokens, u.num_cached_tokens,
            error=error, error_param=param, queue_s=u.queue_s,
        )  # fmt: skip

    @staticmethod
    def _emit_embedding(u: StepUpdate, vector: list[float]) -> RequestOutput:
        return RequestOutput(
            request_id=u.request_id, token_ids=[], text="", finished=True, finish_reason="stop",
            num_prompt_tokens=u.num_prompt_tokens, num_cached_tokens=u.num_cached_tokens,
            queue_s=u.queue_s, embedding=vector,
        )  # fmt: skip

    def _logprobs(self, u: StepUpdate) -> list[PositionLogprobs]:
        tok = u.token
        if tok is None or tok.logprob is None:
            return []
        chosen = self._token_logprob(tok.token_id, tok.logprob)
        top = tuple(self._token_logprob(t, lp) for t, lp in tok.top_logprobs)
        return [PositionLogprobs(chosen, top)]

    def _token_logprob(self, token_id: int, logprob: float, rank: int = 0) -> TokenLogprob:
        """A token, its text decoded alone and its raw bytes (no tokenizer: empty text)."""
        if self._token_bytes is None:
            return TokenLogprob(token_id, logprob, "", rank=rank)
        text = self.tokenizer.decode([token_id])
        return TokenLogprob(token_id, logprob, text, self._token_bytes(token_id, text), rank)

    # ---- LoRA adapters (--enable-lora) ---------------------------------------------------------
    def lora_names(self) -> list[str]:
        lora = self.runner.lora
        return lora.names() if lora is not None else []

    def lora_paths(self) -> list[str]:
        """The directory each of :meth:`lora_names` was loaded from, in that order."""
        lora = self.runner.lora
        return [lora.adapters[name].path for name in lora.names()] if lora is not None else []

    def load_lora(self, name: str, path: str) -> list[str]:
        """Register an adapter at runtime; ConfigError if it cannot be served (or the name is
        taken). The adapters served after it."""
        if self.runner.lora is None:
            raise ConfigError("this worker serves no LoRA adapters: start it with --enable-lora")
        self.runner.lora.add(name, path)
        return self.lora_names()

    def unload_lora(self, name: str) -> list[str]:
        """Unregister an adapter no request runs under; KeyError if it is not served."""
        if name not in self.lora_names():
            raise KeyError(name)
        s = self.scheduler
        queued = [*s.requests.values(), *s.reserved.values(), *s.held.values()]
        if any(r.sampling_params.lora_name == name for r in queued):
            raise ConfigError(f"LoRA adapter {name!r} has requests in flight: unload it later")
        assert self.runner.lora is not None
        self.runner.lora.remove(name)
        return self.lora_names()

    def close(self, graceful: bool = True) -> None:
        """Stop the other tensor-parallel ranks (``--tensor-parallel-size`` > 1): told to, or
        (not ``graceful``) killed."""
        self.runner.close(graceful)

    @property
    def has_unfinished(self) -> bool:
        # a launched step whose requests all finished is still read (its blocks then freed)
        return self.scheduler.has_unfinished or bool(self._pending) or self._launched is not None

    def stats(self) -> EngineStats:
        s, host = self.scheduler, self.kv.host
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_reserved=len(s.reserved),
            free_blocks=self.kv.num_free_blocks,
            total_blocks=self.kv.num_blocks,
            kv_cache_usage=self.kv.usage,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=self.kv.pool.queries,
            prefix_cache_hits=self.kv.pool.hits,
            iteration_tokens=self.step_tokens.snapshot(),
            grammar_compile_s=self.grammar_compiler.compile_seconds.snapshot(),
            kv_offload_stored=host.stored if host is not None else 0,
            kv_offload_restored=host.restored if host is not None else 0,
            kv_offload_evicted=host.evicted if host is not None else 0,
            prefix_cache_host_hits=self.kv.host_hits,
            spec=replace(
                self.spec_stats, accepted_per_position=list(self.spec_stats.accepted_per_position)
            ),
        )
