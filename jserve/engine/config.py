"""`EngineConfig`: the one list of engine settings.

Each setting is named, typed, documented and defaulted here, once; `LLM(**settings)` takes them
by name, and the command line's engine flags (`add_engine_args`) are made from the same fields
(vLLM's flag names where vLLM has one). Pure Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Callable

from jserve.core.scheduler import SchedulerConfig
from jserve.core.speculative import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8", "fp8")  # vLLM's --kv-cache-dtype; "auto": the weights'
BACKEND_NAMES = ("native", "xla", "xla-reference")  # jserve.runtime.backends.NAMES
BACKEND_ALIASES = ("cpu", "tpu", "gpu", "reference", "cpu_pallas")  # jserve.runtime.backends.ALIASES
QUANTIZATIONS = ("int8", "int4", "fp8", "gguf")  # at load; "gguf": a GGUF file's own quantized weights
QUALITY_GATES = ("enforce", "warn", "off")
LOAD_FORMATS = ("auto", "dummy")
TASKS = ("auto", "generate", "embed")
POOLING_TYPES = ("last", "mean", "cls")  # jserve.model.pooling.POOLING_TYPES
LORA_DTYPES = ("auto", "float32", "bfloat16")  # the native fused layers read float32 or bfloat16 stacks
# Where `jserve serve` defaults otherwise than the offline LLM: a server is ready once the largest
# shapes compile, the others compile while it serves (--no-lazy-buckets compiles them all first);
# it overlaps steps wherever that applies (`async_scheduling` None; --no-async-scheduling: never).
# On a CPU it runs two decode steps a call instead (`num_scheduler_steps` None: `decode_steps_for`).
SERVE_DEFAULTS = {"lazy_buckets": True, "async_scheduling": None, "num_scheduler_steps": None}
CPU_DECODE_STEPS = 2  # `num_scheduler_steps` None on a CPU: see `EngineConfig.decode_steps_for`
DEFAULT_MAX_MODEL_LEN = 8192  # the cap on a model's own context length when none is given


def parse_bytes(text: str) -> int:
    """'16GiB', '80GB', '512MiB', '1e9' -> bytes."""
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 16GiB, 80GB, 512MiB)")
    return int(float(m.group(1)) * units[m.group(2).lower()])


def _setting(default: Any, help: str, *, flag: str | None = "", parse: Callable | None = None,
             choices: tuple | None = None, old_flag: str | None = None) -> Any:
    """A field with its command-line flag ("": from its name; None: no flag) and help; `old_flag`,
    an older spelling still accepted, with a warning."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "parse": parse,
                                                        "choices": choices, "old_flag": old_flag})


class _OldFlag(argparse.Action):
    """Stores like "store", and warns (once per parse) when the older spelling was used."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == self.metadata_old_flag:
            import logging

            logging.getLogger("jserve").warning("%s is deprecated: use %s", option_string, self.option_strings[0])
        setattr(namespace, self.dest, values)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (see each field's help, also shown by `jserve serve --help`)."""

    max_model_len: int | None = _setting(
        None, f"context length (prompt + output); default the model's, at most {DEFAULT_MAX_MODEL_LEN}",
        parse=int)
    max_num_seqs: int | None = _setting(None, "sequences per step (the largest decode batch); default the "
                                               "platform's (platform_defaults): 16 on a CPU, 256 on a TPU, "
                                               "256 on a GPU (1024 with 70 GiB or more)", parse=int)
    max_num_batched_tokens: int | None = _setting(
        None, "tokens computed per step (the largest prefill chunk); default the platform's: 512 on a "
              "CPU, 512 on a TPU v5e (1024 on a v6e), 2048 on a GPU (8192 with 70 GiB or more)", parse=int)
    enable_prefix_caching: bool = _setting(True, "reuse the KV pages of a cached prompt prefix")
    page_size: int | None = _setting(None, "tokens per KV page (default: the backend's, 64 on the native "
                                           "CPU backend, else 16)", parse=int)
    num_pages: int | None = _setting(None, "KV pages (default: from the memory budget)", parse=int)
    kv_cache_bytes: int | None = _setting(None, "explicit KV budget per device, e.g. 1GiB (default on a "
                                                "CPU: 512 MiB)", parse=parse_bytes)
    kv_offload_bytes: int | None = _setting(
        None, "a host-memory KV tier of this many bytes (in all, split between dp groups), e.g. 8GiB: "
              "prefix-cache pages are copied there as they go idle, and a prefix hit the device no longer "
              "holds reloads them instead of recomputing (needs prefix caching; not with a draft model or "
              "several processes)",
        parse=parse_bytes)
    kv_offload_dir: str | None = _setting(
        None, "keep --kv-offload-bytes' pool in a file in this folder (created if missing; the file is "
              "removed when the engine stops) instead of host memory: a disk tier, memory-mapped, so the "
              "kernel's page cache keeps the recently used pages in RAM and the pool may exceed it")
    hybrid_pages: bool = _setting(
        True, "for a model with sliding and full layers (Gemma 2 / 3): the sliding layers' K/V in pages of "
              "their own, given back behind the window, the KV memory split between the two pools so that "
              "both hold as many sequences of --max-model-len tokens (not with a host KV tier, a draft model "
              "or embeddings: those keep one pool)")
    memory_fraction: float = _setting(0.9, "of accelerator memory for the engine, when neither "
                                           "--num-pages nor --kv-cache-bytes is given", parse=float)
    seed: int = _setting(0, "seeds requests that give none")
    backend: Any = _setting(None, "how steps run: native (C++ kernels on a CPU), xla (XLA with the "
                                  "platform's Pallas attention kernel: Mosaic on a TPU or GPU, the Pallas "
                                  "interpreter on a CPU), xla-reference (XLA with dense attention); "
                                  "default: native on a CPU, else xla. The older --attention-backend "
                                  "names (cpu, tpu, gpu, reference, cpu_pallas) are aliases for one "
                                  "release", choices=BACKEND_NAMES + BACKEND_ALIASES,
                            old_flag="--attention-backend")
    kv_cache_dtype: str = _setting("auto", "KV page dtype (auto: the weights'); bfloat16 halves the KV "
                                           "bytes, int8 and fp8 (float8_e4m3fn codes with a float32 scale "
                                           "per token and KV head) about halve them again",
                                   choices=KV_CACHE_DTYPES)
    num_scheduler_steps: int | None = _setting(
        1, "decode steps per device call while only decodes run (multi-step decode: a stream receives "
           "that many tokens at a time). None (the default of `jserve serve`): 2 on a CPU, where the "
           "host's work between steps takes the step's cores, else 1; 1 wherever async scheduling, "
           "speculative decoding or batch invariance is asked, or with a mesh", parse=int)
    async_scheduling: bool | None = _setting(False, "overlap steps (vLLM's name): plan and dispatch step N+1 "
                                                    "before reading step N's samples, which feed N+1's decode "
                                                    "rows on the device, so the device never waits for the host "
                                                    "between steps; a step with penalties, a grammar or prompt "
                                                    "logprobs runs after the one before it is read. One device "
                                                    "group, one process. None: on wherever it applies (the "
                                                    "default of `jserve serve`, as vLLM's), else off")
    speculative_config: Any = _setting(
        None, 'speculative decoding, a JSON object as vLLM takes it: {"method": "ngram", '
              '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": '
              '"draft_model", "model": "DRAFT", "num_speculative_tokens": 4}; also "disable_by_batch_size", '
              '"min_acceptance", "acceptance_window", "backoff_steps" (jserve.core.speculative)', parse=str)
    mesh: Any = _setting(None, "device mesh, e.g. tp=4 or dp=2,tp=4, a dict or a jax.sharding.Mesh "
                               "(default: one device)")
    warmup: bool = _setting(True, "compile every bucket before serving (instead of on first use)", flag=None)
    lazy_buckets: bool = _setting(False, "at warm-up compile only the largest shape of each step, which serves "
                                         "any request, and the other buckets on a background thread; until one "
                                         "is ready, its calls run in the next larger compiled bucket (counted as "
                                         "jserve_bucket_fallbacks in /metrics). On by default for `jserve "
                                         "serve` (ready in seconds); off for the offline LLM, which compiles "
                                         "every bucket first")
    weight_update_policy: str = _setting("drain", "requests in flight when new weights arrive (update_weights) or "
                                                  "the engine sleeps: drain (finish them first, holding new ones), "
                                                  "abort them, or continue (finish on the new weights: off-policy "
                                                  "for a trainer; sleep drains)",
                                         choices=("drain", "abort", "continue"))
    load_format: str = _setting("auto", "auto: the model's weights; dummy: random weights of its config's shapes "
                                        "(vLLM's name: speed and memory without the weights; the text is "
                                        "meaningless)", choices=LOAD_FORMATS)
    quantization: str | None = _setting(
        None, "quantize a float checkpoint's weights at load: int8 (per channel), int4 (groups, see "
              "--quantization-group-size), fp8 (e4m3, per channel); gguf: serve a .gguf file's own "
              "quantized weights as they are. A quantized checkpoint (jserve convert --quantize) needs "
              "none", choices=QUANTIZATIONS)
    quantization_group_size: int | None = _setting(None, "group size at load: int4's 32 (default), 64 or 128; "
                                                         "int8 per channel by default, or 32, 64, 128",
                                                   parse=int)
    quality_gate: str = _setting("enforce", "serve a quantized model only if its stored quality report "
                                            "passes the thresholds (enforce), warn and serve anyway (warn), "
                                            "or skip the check (off)", choices=QUALITY_GATES)
    quality_max_kl: float | None = _setting(None, "the gate's largest mean KL divergence from the float "
                                                  "model (default: per scheme, jserve.engine.quality_gate)",
                                            parse=float)
    quality_min_top1: float | None = _setting(None, "the gate's smallest top-1 agreement with the float model "
                                                    "(default: per scheme)", parse=float)
    task: str = _setting("auto", "generate: a text generation model; embed: an embedding model "
                                 "(/v1/embeddings, /v1/score, /rerank; LLM.embed), its final hidden states "
                                 "pooled; auto: embed where the checkpoint declares a pooling "
                                 "(sentence-transformers files, e.g. Qwen3-Embedding's), else generate",
                         choices=TASKS)
    pooling: str | None = _setting(None, "task embed: how a prompt's hidden states become one vector: last "
                                         "(token), mean or cls (first token); default: the checkpoint's, "
                                         "else last", choices=POOLING_TYPES)
    pooling_normalize: str = _setting("auto", "task embed: L2-normalise each vector (true / false); auto: "
                                              "the checkpoint's (a sentence-transformers Normalize module), "
                                              "else true", choices=("auto", "true", "false"))
    enable_lora: bool = _setting(False, "serve LoRA adapters (PEFT folders or Hub ids) over the base model, "
                                        "mixed in one batch: a request names one as its model")
    max_loras: int = _setting(1, "LoRA adapters resident on the device at once (a step mixes any of them; "
                                 "each costs max_loras * rank * (in + out) per token and linear)", parse=int)
    max_lora_rank: int = _setting(16, "the largest LoRA rank served (smaller ranks are padded to it)", parse=int)
    lora_dtype: str = _setting("auto", "the LoRA slots' dtype: auto (the model's float weights'), float32 or "
                                       "bfloat16 (half the bytes a step reads for its adapters; the "
                                       "deltas still sum in float32)", choices=LORA_DTYPES)
    max_cpu_loras: int | None = _setting(None, "LoRA adapters kept read in host memory (least recently used "
                                               "dropped; default max_loras)", parse=int)
    int8_activations: bool = _setting(True, "native CPU backend, quantized weights: from a few rows on "
                                            "(decode batches, prefill) quantize each matmul's input to int8 "
                                            "per block of 32 and use integer dot products (AVX512-VNNI, or AVX2: "
                                            "int4 from one row); "
                                            "off: dequantize the weights to float32 at every batch size")
    batch_invariant: bool = _setting(False, "a request's tokens and logprobs bitwise the same whatever it is "
                                            "batched with, chunked or cached (vLLM's VLLM_BATCH_INVARIANT): "
                                            "the native CPU backend's one code path per token, no fused decode")

    def __post_init__(self):
        steps = self.num_scheduler_steps
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise ValueError(f"num_scheduler_steps must be an integer >= 1 or None, got {steps!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size", "num_pages",
                     "kv_cache_bytes", "kv_offload_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.memory_fraction, (int, float)) or not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if isinstance(self.backend, str) and self.backend not in BACKEND_NAMES + BACKEND_ALIASES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES} (or the older {BACKEND_ALIASES}), "
                             f"got {self.backend!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.quantization_group_size is not None and (
                self.quantization not in ("int4", "int8") or self.quantization_group_size not in (32, 64, 128)):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128 with quantization 'int4' or 'int8', "
                             f"got {self.quantization_group_size!r} with quantization={self.quantization!r}")
        # Parsed once here (a dict or JSON text in, a SpeculativeConfig kept), naming a bad key or value.
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.speculative_config is not None and self.mesh is not None:
            raise ValueError("speculative decoding runs on one device for now: give no mesh, or no "
                             "speculative_config")
        if self.speculative_config is not None and steps not in (1, None):
            raise ValueError(f"speculative decoding and multi-step decode (num_scheduler_steps="
                             f"{self.num_scheduler_steps}) do not combine: give one of them")
        if self.async_scheduling and (self.speculative_config is not None or steps not in (1, None)):
            raise ValueError("async_scheduling overlaps single steps: give no speculative_config and "
                             f"num_scheduler_steps=1 with it (got {self.num_scheduler_steps})")
        if self.kv_offload_bytes is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_bytes: the host KV tier holds prefix-cache pages; it needs "
                             "enable_prefix_caching")
        if self.kv_offload_dir is not None and self.kv_offload_bytes is None:
            raise ValueError(f"kv_offload_dir {self.kv_offload_dir!r} is where the KV tier's pool lives: give "
                             "its size too (kv_offload_bytes)")
        if self.kv_offload_bytes is not None and getattr(self.speculative_config, "method", None) == "draft_model":
            raise ValueError("kv_offload_bytes does not combine with a draft model yet (its pages would need "
                             "the same reloads)")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.load_format == "dummy" and self.quantization is not None:
            raise ValueError("load_format 'dummy' makes float weights: give no quantization with it")
        if self.quality_gate not in QUALITY_GATES:
            raise ValueError(f"quality_gate must be one of {QUALITY_GATES}, got {self.quality_gate!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {POOLING_TYPES} or None, got {self.pooling!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")
        if self.pooling_normalize not in ("auto", "true", "false"):
            raise ValueError(f"pooling_normalize must be 'auto', 'true' or 'false', got {self.pooling_normalize!r}")
        if self.batch_invariant and self.enable_lora:
            raise ValueError("batch_invariant and enable_lora do not combine yet: the LoRA deltas run on XLA's "
                             "dots, whose reduction order follows the step's shape")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("quality_max_kl", "quality_min_top1"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be a non-negative number or None, got {value!r}")

    @classmethod
    def from_settings(cls, **settings: Any) -> "EngineConfig":
        """The config from settings by name; ValueError naming one that is not a setting."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in settings if k not in names]
        if unknown:
            raise ValueError(f"unknown engine setting {unknown[0]!r}; the settings are: {', '.join(names)}")
        return cls(**settings)

    def with_platform_defaults(self, platform: str, device_kind: str = "",
                               device_memory: int | None = None) -> "EngineConfig":
        """The config with `max_num_seqs` and `max_num_batched_tokens` that were left None set to
        `platform_defaults`', and `num_scheduler_steps` to `decode_steps_for` (a native backend
        counts as a CPU)."""
        if self.backend in ("native", "cpu"):
            platform = "cpu"
        config = dataclasses.replace(self, num_scheduler_steps=self.decode_steps_for(platform))
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None:
            return config
        seqs, tokens = platform_defaults(platform, device_kind, device_memory)
        tokens = self.max_num_batched_tokens or tokens
        return dataclasses.replace(config, max_num_batched_tokens=tokens,
                                   max_num_seqs=self.max_num_seqs or min(seqs, tokens))

    def decode_steps_for(self, platform: str) -> int:
        """`num_scheduler_steps` as given, or for None: `CPU_DECODE_STEPS` on a CPU, one stream of
        steps on one device, where neither async scheduling, speculative decoding nor batch
        invariance (whose bits follow one step's program) is asked. A CPU step shares its cores
        with the host's work between steps (scheduling, the call's dispatch, sampling,
        streaming), which several steps a call pay once; on a TPU or GPU that work runs beside
        the device's, and async scheduling hides it there."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        if (platform == "cpu" and self.mesh is None and self.speculative_config is None
                and not self.async_scheduling and not self.batch_invariant):
            return CPU_DECODE_STEPS
        return 1

    def scheduler_config(self, dp: int = 1, max_model_len: int | None = None) -> SchedulerConfig:
        """The scheduler's knobs; with `dp` groups, each group's share of seqs and tokens."""
        if self.max_num_seqs is None or self.max_num_batched_tokens is None or self.num_scheduler_steps is None:
            raise ValueError("max_num_seqs, max_num_batched_tokens and num_scheduler_steps are settled first "
                             "(EngineConfig.with_platform_defaults)")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) % dp:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of dp ({dp})")
        return SchedulerConfig(max_num_seqs=self.max_num_seqs // dp,
                               max_num_batched_tokens=self.max_num_batched_tokens // dp,
                               max_model_len=max_model_len or self.max_model_len,
                               enable_prefix_caching=self.enable_prefix_caching,
                               num_scheduler_steps=self.num_scheduler_steps)


_LARGE_GPUS = ("h100", "h200", "h20", "gh200", "b100", "b200", "gb200", "mi300", "mi325", "mi355")


def platform_defaults(platform: str, device_kind: str = "", device_memory: int | None = None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for a device: a CPU's fit two cores; a TPU's and a
    GPU's are vLLM's for its API server (`EngineArgs.get_batch_defaults`): by TPU generation, and
    by GPU memory (70 GiB or more, A100s excepted, batch more). `device_memory` is what JAX's
    allocator may use (75 % of an H100's 80 GiB by default), so the large GPUs are also known by name."""
    if platform == "tpu":
        kind = device_kind.lower()
        return 256, 1024 if ("v6" in kind or "trillium" in kind) else 512
    if platform == "gpu":
        kind = device_kind.lower()
        big = (any(name in kind for name in _LARGE_GPUS) or (device_memory or 0) >= 70 * 2**30) and "a100" not in kind
        return (1024, 8192) if big else (256, 2048)
    return 16, 512


def add_engine_args(parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()) -> None:
    """One flag per setting of `EngineConfig` (its dest the setting's name), in a group."""
    group = parser.add_argument_group("engine")
    names = []
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        if meta["flag"] is None or f.name in exclude:
            continue
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = dict(dest=f.name, default=f.default, help=meta["help"])
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta["parse"] or (int if isinstance(f.default, int) else str)
            if meta["choices"]:
                kwargs["choices"] = list(meta["choices"])
        flags = [flag]
        if meta["old_flag"]:
            flags.append(meta["old_flag"])
            kwargs["action"] = _OldFlag
        action = group.add_argument(*flags, **kwargs)
        action.metadata_old_flag = meta["old_flag"]
        names.append(f.name)
    parser.set_defaults(engine_settings=tuple(names))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The settings `add_engine_args` parsed, by name (for `LLM(**engine_kwargs(args))`)."""
    return {name: getattr(args, name) for name in getattr(args, "engine_settings", ())}
