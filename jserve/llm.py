"""`LLM`: the offline Python API in the shape vLLM users know (generate, chat)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Mapping, Sequence, Union

from jserve.core.lora_slots import LoRARequest
from jserve.core.request import RequestOutput, SamplingParams

PromptType = Union[str, Sequence[int], Mapping[str, Any]]


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> Path:
    """Turn on JAX's persistent compilation cache (default: ~/.cache/jserve/jax)."""
    import jax

    path = Path(directory or os.environ.get("JSERVE_COMPILATION_CACHE")
                or Path.home() / ".cache" / "jserve" / "jax")
    path.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir not in (None, str(path)):
        # JAX opens its cache once, at the first compilation: another folder needs it reopened
        # (a private function; without it the first folder stays in use).
        from jserve.runtime import lazy_buckets

        lazy_buckets.stop_all()  # a lazy buckets' thread must not read the cache while it is reopened
        try:
            from jax._src import compilation_cache

            compilation_cache.reset_cache()
        except (ImportError, AttributeError):
            pass
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Entries faster to compile than this are not kept; a compile artifact keeps all
    # (`jserve.engine.compile_cache` sets JSERVE_CACHE_MIN_COMPILE_SECONDS=0).
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("JSERVE_CACHE_MIN_COMPILE_SECONDS", 0.2)))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class LLM:
    """A model loaded for offline generation on the continuous-batching engine.

    Args:
      model: a jserve checkpoint folder, a Hugging Face folder, a `.gguf` file, a converted
        model's name, a named model (`jserve.model.named`: "gemma3-270m", ...; None for the
        default SmolLM2-135M-Instruct), or a Hugging Face Hub id ("org/name", "org/name:file.gguf"),
        converted on first use (`jserve.model.checkpoint.resolve_model`).
      dtype: weight (and KV cache) dtype: "auto" (None, the default: the checkpoint's own; a
        float32 one as bfloat16 on a TPU or GPU), "float32" / "float", "bfloat16", "float16" /
        "half" (served as bfloat16); `jserve.model.dtype`. A checkpoint stored in another dtype
        is cast while restoring; dummy weights (`load_format="dummy"`) are bfloat16 under auto. On
        an NVIDIA GPU the paged-attention kernel needs a bfloat16 KV cache (this, or `kv_cache_dtype`).
      revision, download_dir, gguf_file: a Hub model's branch, tag or commit (default main), the
        Hugging Face cache to download into (default HF_HUB_CACHE), and the GGUF file of a GGUF
        repo (or of a local folder) to serve.
      tokenizer: a tokenizer to use instead of the model's own: a folder, checkpoint, `.gguf`
        file or Hub id.
      shardings: optional weight shardings, passed to `checkpoint.load_checkpoint` (without a mesh).
      quantization (a setting): "int8", "int4" or "fp8" quantizes a float checkpoint's weights at
        load (`jserve.model.quant`), "gguf" serves a .gguf file's own quantized weights; a
        quantized checkpoint needs none. A quantized model is served only if its quality report
        passes the gate (`jserve.engine.quality_gate`; settings quality_gate, quality_max_kl,
        quality_min_top1); `self.quantization` holds the record and report.
      compilation_cache: directory for JAX's persistent compilation cache; False turns it off.
      chat_template: a chat template (jinja2 text) that replaces the tokenizer's own, for `chat`
        (and for the server, which renders with this tokenizer); a base model has none.
      **settings: the engine's settings by name, as `jserve.engine.config.EngineConfig` lists and
        documents them (max_model_len, max_num_seqs, max_num_batched_tokens, page_size, backend,
        mesh, kv_cache_dtype, num_scheduler_steps, warmup, ...); an unknown name is a ValueError.
        With `mesh` ("dp=2,tp=4", a dict, or a `jax.sharding.Mesh` with axes 'dp'/'tp', see
        `jserve.runtime.sharding`) weights restore straight into their shardings.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str | None = None,
                 revision: str | None = None, download_dir: str | os.PathLike | None = None,
                 gguf_file: str | None = None, tokenizer: str | os.PathLike | None = None,
                 shardings: Any = None, compilation_cache: str | os.PathLike | bool | None = None,
                 chat_template: str | None = None, **settings: Any):
        from jserve.engine.build import build_engine, resolve_max_model_len
        from jserve.engine.config import EngineConfig
        from jserve.model.checkpoint import load_tokenizer, model_files, read_quantization, resolve_model, served_dtype
        from jserve.model.dtype import check_dtype
        from jserve.model.pooling import declared_pooling
        from jserve.text.chat_template import compile_chat_template

        engine_config = EngineConfig.from_settings(**settings)  # bad settings are named before loading
        if chat_template is not None:
            compile_chat_template(chat_template)  # a malformed one fails before loading too
        if compilation_cache is not False:
            enable_compilation_cache(None if compilation_cache in (None, True) else compilation_cache)
        check_dtype(dtype)  # a bad one is named before loading
        from jserve.runtime import backends

        dummy = engine_config.load_format == "dummy"
        quantized = engine_config.quantization is not None or (not dummy and read_quantization(model) is not None)
        backends.prebuild(engine_config.backend, quantized_weights=quantized,  # built while the model loads
                          quantized_kv=engine_config.kv_cache_dtype in ("int8", "fp8"),
                          lora=engine_config.enable_lora)
        where = dict(revision=revision, download_dir=download_dir, gguf_file=gguf_file)
        self.path = model_files(model, **where) if dummy else resolve_model(
            model, dtype=dtype or "auto", keep_quantized=engine_config.quantization == "gguf", **where)
        engine_config, self.mesh, shardings = _mesh_restore(engine_config, shardings, self.path)
        # Dummy weights have no dtype of their own: bfloat16 unless asked otherwise, on any device.
        self.dtype = "bfloat16" if dummy and check_dtype(dtype) == "auto" else served_dtype(self.path, dtype)
        params = self._load_weights(engine_config, shardings, dummy)
        if tokenizer is not None:  # the model's EOS ids and the given tokenizer's
            self.tokenizer = load_tokenizer(tokenizer, download_dir=download_dir)
            self.generation_config = {**self.generation_config, "eos_token_ids": sorted(
                set(self.config.eos_token_ids) | set(self.tokenizer.eos_token_ids))}
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        engine_config = resolve_max_model_len(engine_config, self.config)
        self.max_model_len = engine_config.max_model_len
        eos = self.generation_config.get("eos_token_ids") or list(self.tokenizer.eos_token_ids)
        draft = _load_draft(engine_config, self.tokenizer, dtype)
        self.engine = build_engine(self.config, params, self.tokenizer, eos, engine_config, self.quantization,
                                   draft=draft, pooling=declared_pooling(self.path))
        self.runner = self.engine.runner
        self._next_id = 0
        self._closed = False

    def _load_weights(self, engine_config: Any, shardings: Any, dummy: bool) -> dict[str, Any]:
        """The weights of `self.path` in `self.dtype` (random ones for a dummy model); sets the
        config, generation config, tokenizer and quantization record."""
        from jserve.model.checkpoint import load_checkpoint
        from jserve.text.tokenizer import Tokenizer

        if dummy:  # random weights of the config's shapes (build_engine lays them out for a mesh)
            self.config, params, self.generation_config, self.tokenizer = _dummy_model(self.path, self.dtype)
            self.quantization = None
            return params
        # Cast while restoring: a float32 checkpoint served in bfloat16 never holds both copies.
        self.config, params, self.generation_config = load_checkpoint(self.path, shardings=shardings,
                                                                      dtype=self.dtype)
        params, self.quantization = _quantization(self.path, self.config, params, self.generation_config,
                                                  engine_config)
        self.tokenizer = Tokenizer.load(self.path)
        return params

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list; each prompt is text, token ids, or
        `{"prompt": text}` / `{"prompt_token_ids": ids}`. Returns one RequestOutput per prompt.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the LLM needs `enable_lora=True`."""
        self._require_task("generate")
        items = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(items))
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(items)
        if len(loras) != len(items):
            raise ValueError(f"{len(loras)} lora_requests for {len(items)} prompts")
        return self._run([self._encode(item) for item in items], params, loras)

    def embed(self, prompts: PromptType | Sequence[PromptType], *, dimensions: int | None = None) -> list[Any]:
        """Embed one prompt or a list (as `generate` takes them) with an embedding model (task
        "embed"): one `PoolingOutput` per prompt, its `embedding` a float32 vector (cut to
        `dimensions` where the model allows Matryoshka sizes)."""
        from jserve.engine.embed_engine import PoolingParams

        self._require_task("embed")
        items = _as_prompt_list(prompts)
        return self._run([self._encode(item) for item in items], [PoolingParams(dimensions)] * len(items))

    def token_logprobs(self, token_ids: Sequence[Sequence[int]], *, top_k: int = 0) -> list[Any]:
        """Score token sequences on the serving path (the engine's prompt-logprob steps): one
        `jserve.engine.scoring.TokenLogprobs` per sequence, its `logprobs` float32 [len - 1], each
        token's logprob given its prefix (and with `top_k`, the k likeliest next tokens). Named
        apart from vLLM's `LLM.score` (a cross-encoder's text-pair scores, as /v1/score)."""
        from jserve.engine import scoring

        self._require_task("generate")
        seqs = scoring.check_sequences(token_ids, self.config.vocab_size, self.max_model_len)
        outs = self._run([(None, s) for s in seqs], [scoring.scoring_params(top_k)] * len(seqs))
        return [scoring.from_output(o, top_k) for o in outs]

    def _require_task(self, task: str) -> None:
        if self._closed:
            raise RuntimeError("this LLM is closed (LLM.close): load the model again to use it")
        served = getattr(self.engine, "task", "generate")
        if served != task:
            raise ValueError(f"this model is loaded for task {served!r}, not {task!r}: load it with "
                             f"LLM(..., task={task!r})")

    def _run(self, encoded: list, params: list, loras: list | None = None) -> list:
        """Add each (text, token ids) with its params (and LoRA adapter) and step until all are
        done; their outputs."""
        request_ids = []
        try:
            for (text, tokens), p, lora in zip(encoded, params, loras or [None] * len(params)):
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                extra = {} if lora is None else {"lora_request": lora}
                self.engine.add_request(rid, tokens, p, prompt=text, **extra)
                request_ids.append(rid)
        except ValueError:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, Any] = {}
        while len(results) < len(request_ids):
            steps = self.engine.num_steps
            outputs = self.engine.step()
            for out in outputs:
                if out.finished:
                    results[out.request_id] = out
            if not outputs and self.engine.num_steps == steps:
                raise RuntimeError(f"the engine made no progress: {self.engine.stats()}")
        return [results[rid] for rid in request_ids]

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list) and generate; `tools`
        (OpenAI function tools) are shown to templates that render them."""
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], Mapping) else list(messages)
        prompts = []
        for conv in conversations:
            for m in conv:
                if not isinstance(m, Mapping) or "role" not in m:
                    raise ValueError(f"each chat message needs a 'role' and 'content', got {m!r}")
            extra = {"tools": list(tools)} if tools else {}
            text = self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt, **extra)
            prompts.append({"prompt": text,
                            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params)

    def stats(self) -> dict[str, Any]:
        """Engine counters: preemptions, compilations after warm-up, pages in use / cached, ..."""
        return self.engine.stats()

    def update_weights(self, params: Any, *, policy: str | None = None, donate: bool = False) -> dict[str, Any]:
        """Serve new weights from now on, without a reload or a recompilation: a pytree of arrays
        (numpy, or JAX on any devices or mesh) in jserve's checkpoint names (flat, or a model state
        with "layers") or Hugging Face's, resharded onto the serving mesh, cast to the served
        dtype and re-quantized if the model is served quantized; the prefix cache is dropped.
        `policy`: requests in flight (drain / abort / continue; `jserve.engine.sleep`). `donate`:
        the source's device buffers may be consumed. Returns the update's timings (seconds)."""
        self.engine.update_weights(params, policy=policy, donate=donate)
        return dict(self.engine.last_weight_update)

    def sleep(self, level: int = 1) -> None:
        """Give the accelerator's memory back (vLLM's name): level 1 moves the weights to host
        memory (pinned where the backend has it) and frees the KV pages; level 2 frees the
        weights too (the next `update_weights`, or `wake_up`, which then reloads the checkpoint,
        brings them back). `generate` raises until `wake_up`."""
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Serve again after `sleep`, with no compilation (`tags`: "weights", "kv_cache"; None:
        both). Weights that level 2 dropped, with none given since, are reloaded from the model."""
        from jserve.engine.sleep import TAGS
        from jserve.runtime.param_swap import Residency

        if "weights" in (TAGS if tags is None else tags) and Residency.of(self.runner).params_state == "dropped":
            self.engine.update_weights(self._reload_weights())
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.engine.sleep_level)

    def _reload_weights(self) -> dict[str, Any]:
        """The model's weights again, on the host (or drawn again for a dummy model)."""
        from jserve.engine.weights import load_weights
        from jserve.model.dummy import dummy_params

        if self.engine.config.load_format == "dummy":
            return dummy_params(self.config, self.dtype)
        return load_weights(self.path, self.dtype)

    def close(self) -> None:
        """Free the model now: stop the background compilation thread and delete the weights' and
        KV pages' device buffers (the draft model's too), instead of leaving them to a later
        garbage collection (an engine sits in reference cycles). `generate` and `chat` then
        raise; closing twice is harmless. `with LLM(...) as llm:` closes at the block's end."""
        for runner in (self.runner, *self.engine.draft_runners()):
            runner.close(free_memory=True)
        self._closed = True

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _encode(self, item: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(item, str):
            return item, self.tokenizer.encode(item)
        if isinstance(item, Mapping):
            if "prompt_token_ids" in item:
                return item.get("prompt"), _check_ids(item["prompt_token_ids"])
            if "prompt" in item and isinstance(item["prompt"], str):
                return item["prompt"], self.tokenizer.encode(item["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' (str) or 'prompt_token_ids', got keys {list(item)}")
        return None, _check_ids(item)


def _mesh_restore(engine_config: Any, shardings: Any, path: Path) -> tuple[Any, Any, Any]:
    """(the settings with their `jax.sharding.Mesh`, that mesh or None, the shardings weights
    restore into: each weight's over the mesh, or `shardings` as given without one)."""
    if engine_config.mesh is None:
        return engine_config, None, shardings
    from jserve.model.checkpoint import read_model_config
    from jserve.runtime.sharding import head_layout, make_mesh, mesh_sizes, restore_sharding

    if shardings is not None:
        raise ValueError("give either mesh or shardings, not both")
    mesh = make_mesh(engine_config.mesh)
    layout = head_layout(read_model_config(path)[0], mesh_sizes(mesh)["tp"])
    return (dataclasses.replace(engine_config, mesh=mesh), mesh,
            lambda name, shape: restore_sharding(mesh, name, shape, layout))


def _dummy_model(path: Path, dtype: str):
    """(config, random params, generation dict, tokenizer) for `load_format="dummy"`: the config's
    shapes in `dtype`, its own tokenizer when the folder has one, else the default model's (with a
    warning: ids past the config's vocabulary are refused)."""
    import json
    import logging

    from jserve.model.checkpoint import read_model_config, resolve_model
    from jserve.model.dummy import dummy_params
    from jserve.text.tokenizer import Tokenizer

    config, _ = read_model_config(path)
    params = dummy_params(config, dtype)
    try:
        tokenizer = Tokenizer.load(path)
    except (ValueError, OSError):
        logging.getLogger(__name__).warning("%s has no tokenizer: using the default model's", path)
        tokenizer = Tokenizer.load(resolve_model(None))
    eos = []
    if (path / "config.json").is_file():
        raw = json.loads((path / "config.json").read_text()).get("eos_token_id")
        eos = [raw] if isinstance(raw, int) else list(raw or [])
    return config, params, {"eos_token_ids": [t for t in eos if 0 <= t < config.vocab_size]}, tokenizer


def _load_draft(settings, tokenizer, dtype: str | None):
    """The draft model's (config, params) for speculative decoding with method "draft_model", or
    None. Any checkpoint `resolve_model` takes (a quantized one too: a draft's quality changes
    the acceptance rate, never the output, so no quality gate applies); its tokenizer must be the
    target's. ValueError naming the draft otherwise."""
    from jserve.model import quant
    from jserve.model.checkpoint import load_checkpoint, resolve_model, served_dtype
    from jserve.text.tokenizer import Tokenizer

    spec = settings.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    path = resolve_model(spec.model, dtype=dtype or "auto", keep_quantized=spec.quantization == "gguf")
    draft_tokenizer = Tokenizer.load(path)
    probe = "Speculative decoding: 12 drafts, 3 accepted; café, naïve, 東京 {\"key\": [1, 2]}"
    if draft_tokenizer.encode(probe) != tokenizer.encode(probe) or draft_tokenizer.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r}: its tokenizer differs from the target model's "
                         f"(a draft must share the vocabulary)")
    config, params, _ = load_checkpoint(path, dtype=served_dtype(path, dtype))
    if spec.quantization in quant.SCHEMES:
        import numpy as np

        host = {k: v if quant.is_quantized(v) else np.asarray(v) for k, v in params.items()}
        params = quant.quantize_params(config, host, quant.QuantSpec.parse(spec.quantization, None))
    return config, params


def _quantization(path: Path, config, params: dict, generation: Mapping[str, Any], settings) -> tuple[dict, Any]:
    """Quantize at load if asked, then apply the quality gate: (params, the quantization record
    with its report, or None for a float model)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jserve.engine import quality_gate
    from jserve.model import quant, quant_record

    record = generation.get("quantization")
    if (record is not None or settings.quantization is not None) and settings.mesh is not None:
        raise ValueError("quantized weights on a device mesh are not supported yet: serve them on one device "
                         "(no mesh)")
    how = f"Evaluate it against its float source (stored in the checkpoint): jserve eval --model {path} --save"
    if record is not None and not record.get("source"):  # AWQ / GPTQ: the float model is elsewhere
        how = (f"Evaluate it against the float model it was quantized from: jserve eval --model {path} "
               f"--reference <that model> --save")
    if settings.quantization in quant.SCHEMES:
        if record is not None:
            raise ValueError(f"{path} is already quantized ({record['label']}); quantization="
                             f"{settings.quantization!r} applies to float checkpoints")
        spec = quant.QuantSpec.parse(settings.quantization, settings.quantization_group_size)
        report_file = quant_record.quality_report_path(path, spec.label())
        how = (f"Evaluate it once (stored in {report_file}): jserve eval --model {path} --quantization "
               f"{spec.scheme}" + (f" --group-size {spec.group_size}" if spec.group_size else "") + " --save")
        host = {k: v if quant.is_quantized(v) else np.asarray(v) for k, v in params.items()}
        params = quant.quantize_params(config, host, spec)
        record = quant_record.quantization_record(spec.label(), spec.scheme, spec.to_json(), params,
                                                  source=str(path))
        record["report"] = quant_record.read_load_report(path, spec.label())
        params = {k: jax.tree.map(jnp.asarray, v) for k, v in params.items()}
    elif settings.quantization == "gguf" and record is None:
        raise ValueError(f"quantization='gguf' needs a .gguf model with quantized tensors; {path} holds float weights")
    quality_gate.check(record, gate=settings.quality_gate, max_kl=settings.quality_max_kl,
                       min_top1=settings.quality_min_top1, how_to_evaluate=how)
    return params, record


def _check_ids(ids: Any) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"prompt token ids must be a list of integers, got {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"prompt token ids must be integers, got {t!r}")
        out.append(int(t))
    return out


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if isinstance(prompts, Sequence) and prompts:
        return list(prompts)
    raise ValueError(f"prompts must be a string, token ids, or a non-empty list of them, got {prompts!r}")


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"give one SamplingParams or a list of {n} (one per prompt), got {len(params)}")
    return params
