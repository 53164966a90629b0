"""Write a converted model as a complete Hub repo folder, atomically and tensor by tensor.

The folder is built in a hidden staging folder beside the output and moved into place only after
every stage passed, so an interrupted or failed run never leaves a folder that looks complete.
Weights are streamed: each tensor is read (``safe_open``), cast, written into the current shard and
dropped, so exporting an 8B model never holds more than one shard beyond the source in memory.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from glob import escape as glob_escape
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from . import published
from .errors import CCAError
from .hub import no_safetensors
from .multimodal import folder_part

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_size(text: str) -> int:
    number, unit = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)\s*", text).groups()
    return int(float(number) * _UNITS[unit])


class OutputLock:
    """``.NAME.lock`` beside the output, held for the whole run: a second run into the same output is refused
    instead of silently replacing the first one's work. The OS releases it if the process dies."""

    def __init__(self, output: Path):
        self.output = output.resolve()
        self.path = self.output.parent / f".{self.output.name}.lock"
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        import fcntl

        self.output.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise CCAError(f"another cca-convert run is writing {self.output} (it holds {self.path}); wait for it "
                               "to finish or choose another --output") from None
            try:  # the holder unlinks the file when it finishes: a lock on that old file protects nothing
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            try:
                self.path.unlink()
            except OSError:
                pass
            os.close(self.fd)  # closing releases the lock
            self.fd = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class Staging:
    """A hidden folder beside ``output`` that becomes ``output`` on :meth:`commit`."""

    def __init__(self, output: Path):
        self.output = output.resolve()
        self.path = self.output.parent / f".{self.output.name}.partial-{os.getpid()}"

    def __enter__(self) -> Staging:
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.removed = self.remove_dead_leftovers()
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir()
        return self

    def remove_dead_leftovers(self) -> list[Path]:
        """Staging/old folders of this output left by runs that were killed (kill -9, power loss): their PID is
        gone. A live PID's folder is another run's work in progress and is left alone. Returns what was removed."""
        removed = []
        for kind in ("partial", "old"):
            for folder in self.output.parent.glob(f".{glob_escape(self.output.name)}.{kind}-*"):
                pid = folder.name.rsplit("-", 1)[-1]
                if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder)
        return removed

    def commit(self) -> None:
        old = self.output.parent / f".{self.output.name}.old-{os.getpid()}"
        if self.output.exists():
            self.output.rename(old)
        self.path.rename(self.output)
        shutil.rmtree(old, ignore_errors=True)
        self.undeleted = old if old.exists() else None  # e.g. files owned by another user inside the old output

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)  # gone after commit; removed on failure


def base_weight_files(base_dir: Path) -> list[Path]:
    index = base_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [base_dir / n for n in names]
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise CCAError(no_safetensors(base_dir))
    return files


def _text_names(folder: Path):
    """name -> the text model's name (None: left out) for a multimodal checkpoint's weights; identity otherwise."""
    part = folder_part(folder)
    return part.text_name if part else (lambda name: name)


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers of ``folder`` (no weights read), by the text model's names
    (``multimodal``); a missing, truncated or unparsable file is a CCAError naming it."""
    from safetensors import SafetensorError, safe_open

    shapes, text_name = {}, _text_names(folder)
    for path in base_weight_files(folder):
        if not path.is_file():
            raise CCAError(f"{path}: weight file listed in the index is missing; download the model again")
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if (text := text_name(name)) is not None:
                        shapes[text] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise CCAError(f"{path}: not a readable safetensors file ({str(exc).strip() or type(exc).__name__}); the "
                           "download is truncated or corrupt: download it again") from None
    return shapes


def export_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """The exported repo's size: the weights at the export dtype, plus code, tokenizer and card."""
    return sum(math.prod(shape) for shape in shapes.values()) * dtype.itemsize + 64 * 2**20


def stream_base_tensors(base_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's tensors by the text model's names (a multimodal checkpoint's other parts left out)."""
    text_name = _text_names(base_dir)
    for path in base_weight_files(base_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if (text := text_name(name)) is not None:
                    yield text, f.get_tensor(name)


def checkpoint_tensor_names(base_dir: Path) -> list[str]:
    """Every tensor name of the base's files, as stored."""
    names = []
    for path in base_weight_files(base_dir):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def base_tensor_names(base_dir: Path) -> list[str]:
    text_name = _text_names(base_dir)
    return [text for name in checkpoint_tensor_names(base_dir) if (text := text_name(name)) is not None]


def model_shapes(config) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the converted model for ``config``: the stock class's, which every method keeps
    (built on the meta device from a copy of the config, so that nothing of the build sticks to the job's config)."""
    import copy

    import transformers

    from .families import FAMILIES

    with torch.device("meta"):
        model = getattr(transformers, FAMILIES[config.model_type].causal_lm)(copy.deepcopy(config))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def check_tensor_names(names: list[str], config, where: str) -> None:
    expected = set(model_shapes(config))
    have = set(names) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    # MoE expert weights are stored per expert and fused by transformers' own conversion at load (which then
    # checks them); every other name must match exactly.
    missing = sorted(n for n in expected - have if ".experts." not in n)
    unexpected = sorted(n for n in have - expected if ".experts." not in n)
    if missing or unexpected:
        raise CCAError(
            f"{where}: weights do not match the architecture (missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )


def write_shards(
    tensors: Iterator[tuple[str, torch.Tensor]], folder: Path, *, dtype, max_shard_bytes: int, total: int, skip=()
) -> list[str]:
    """Write ``model-0000i-of-0000n.safetensors`` + index; returns the shard file names."""
    weight_map: dict[str, int] = {}
    current, current_bytes, total_bytes = {}, 0, 0
    tmp_names = []

    def flush():
        nonlocal current, current_bytes
        if current:
            name = f"shard-{len(tmp_names):05d}.tmp"
            save_file(current, folder / name, metadata={"format": "pt"})
            tmp_names.append(name)
            current, current_bytes = {}, 0

    for name, tensor in tqdm(tensors, total=total, desc="writing weights", unit="tensor", leave=False):
        if name in skip:
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensor = tensor.detach().to("cpu").contiguous()
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_shard_bytes:
            flush()
        current[name] = tensor
        current_bytes += size
        total_bytes += size
        weight_map[name] = len(tmp_names)
    flush()

    count = len(tmp_names)
    final = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    for tmp, name in zip(tmp_names, final):
        (folder / tmp).rename(folder / name)
        (folder / name).chmod(0o644)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return final


def copy_code_and_tokenizer(base_dir: Path, folder: Path, family, method,
                            context: int | None = None) -> list[str]:
    """The published code of ``method`` (a ``methods.Method``) and the source's tokenizer files; returns the tokenizer ``auto_map`` entries dropped
    because they point at code the export does not ship (see ``drop_foreign_auto_map``). ``context``: the converted
    config's ``max_position_embeddings``, which the tokenizer's ``model_max_length`` is set to."""
    published.write_code(folder, family, method)
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file():
            shutil.copyfile(base_dir / name, folder / name)
    if context:
        set_model_max_length(folder / "tokenizer_config.json", context)
    return drop_foreign_auto_map(folder / "tokenizer_config.json")


def set_model_max_length(path: Path, context: int) -> None:
    """The tokenizer claims the context the config claims: a base's ``model_max_length: 2048`` kept in an export that
    reads 16384 tokens makes every long input warn ("will result in indexing errors") and ``truncation=True`` cut at
    2048. No ``model_max_length``, or transformers' "no limit" (1e30), is left as it is."""
    if not path.is_file():
        return
    try:
        config = json.loads(path.read_text())
    except ValueError:
        return
    current = config.get("model_max_length") if isinstance(config, dict) else None
    if isinstance(current, (int, float)) and current < 1e20 and current != context:
        config["model_max_length"] = context
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def drop_foreign_auto_map(path: Path) -> list[str]:
    """Remove the ``auto_map`` entries of a tokenizer config that name code the repo does not hold (a module of
    another repo, ``org/repo--module.Class``, or one whose ``module.py`` is not in the folder): shipped as they are,
    they would send every user's ``trust_remote_code`` to code nobody reviewed with this export."""
    if not path.is_file():
        return []
    try:
        config = json.loads(path.read_text())
    except ValueError:
        return []
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict):
        return []

    def shipped(ref) -> bool:
        return isinstance(ref, str) and "--" not in ref and (path.parent / f"{ref.rsplit('.', 1)[0]}.py").is_file()

    dropped, kept = [], {}
    for key, value in auto_map.items():
        refs = value if isinstance(value, list) else [value]
        if all(r is None or shipped(r) for r in refs):
            kept[key] = value
        else:
            dropped.append(f"{key}: {value}")
    if dropped:
        if kept:
            config["auto_map"] = kept
        else:
            del config["auto_map"]
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return dropped


def write_generation_config(base_dir: Path, folder: Path, config) -> None:
    from transformers import GenerationConfig

    if (base_dir / "generation_config.json").is_file():
        shutil.copyfile(base_dir / "generation_config.json", folder / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(folder)
