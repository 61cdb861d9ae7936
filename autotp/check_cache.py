"""The checker's findings, and whole ``autotp plan`` answers, kept on disk between runs of the
``autotp`` command.

``autotp plan llama`` spends most of its time after the imports in :func:`autotp.check_plan`
(a ``torch.export`` of the model and the per-rank shape proof of each attention block), and the
answer is the same every time for the same model, plan, tp size and code. The command line keeps
it in ``$AUTOTP_CACHE_DIR`` (default ``$XDG_CACHE_HOME/autotp``, else ``~/.cache/autotp``), one
small JSON file per question; ``AUTOTP_CACHE_DIR=off`` turns it off.

The key holds everything the findings depend on: the model's class and config, the plan (each
style with its options), tp, and the versions of torch, transformers and autotp's own code (a
hash of its source files, so an edited checkout never reads an old answer). Only the command line
turns the cache on (:func:`enabled`), and not inside a pytest run unless ``AUTOTP_CACHE_DIR`` is
set: the library's callers and the tests always run the checker.

:func:`cached_output` keeps what a successful ``autotp plan`` printed, keyed by its arguments, the
config file it read (if any), the versions of torch and transformers (read from the installed
packages' metadata, without importing them) and autotp's source hash: a second ``autotp plan
llama`` prints it without importing torch (under half a second, where the first run spends about
five seconds importing torch and transformers alone). A run with ``--plan FILE`` is not kept (the
file may import code this key cannot see).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

_ON = False  # set by enabled(): only the command line reads and writes the cache
_CODE_HASH: str | None = None


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Read and write the cache inside (the ``autotp`` command's run)."""
    global _ON
    before, _ON = _ON, True
    try:
        yield
    finally:
        _ON = before


def directory() -> Path | None:
    """Where findings are kept, or None when the cache is off."""
    if not _ON:
        return None
    setting = os.environ.get("AUTOTP_CACHE_DIR")
    if setting is None and "PYTEST_CURRENT_TEST" in os.environ:
        return None  # tests exercise the checker itself
    if setting is not None and setting.strip().lower() in ("", "off", "0", "no"):
        return None
    if setting:
        return Path(setting)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autotp"


def source_hash() -> str:
    """A hash of autotp's and the handwritten plans' source files (read once per process)."""
    global _CODE_HASH
    if _CODE_HASH is None:
        digest = hashlib.sha256()
        package = Path(__file__).resolve().parent
        for root in (package, package.parent / "handwritten_plans"):
            for path in sorted(root.rglob("*.py")):
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
        _CODE_HASH = digest.hexdigest()
    return _CODE_HASH


def _key(model, plan_text: str, tp_size: int) -> str | None:
    """The cache key of checking ``plan`` on ``model`` at ``tp_size``; None for a model without a
    transformers config (a plain module's shapes are not in any config)."""
    import torch
    import transformers

    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    shapes = sorted((name, tuple(p.shape)) for name, p in model.named_parameters())
    text = json.dumps({
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": config.to_json_string(use_diff=False),
        "shapes": hashlib.sha256(repr(shapes).encode()).hexdigest(),
        "plan": plan_text,
        "tp": tp_size,
        "versions": [torch.__version__, transformers.__version__, source_hash()],
    }, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def cached_findings(model, plan_text: str, tp_size: int, compute: Callable[[], list], finding: type) -> list:
    """``compute()`` (the checker's findings, dataclasses of type ``finding``), or the answer kept
    for the same question. ``plan_text`` is the plan as :func:`autotp.plan.describe_plan` writes it
    (the caller's: this module imports nothing of torch, so ``autotp --help`` stays fast)."""
    Finding = finding
    where = directory()
    key = _key(model, plan_text, tp_size) if where is not None else None
    if key is None:
        return compute()
    path = where / f"findings-{key}.json"
    try:
        return [Finding(**entry) for entry in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        pass
    findings = compute()
    try:
        where.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps([vars(f) for f in findings]))
        partial.replace(path)  # atomic: a parallel run reads the whole file or none
    except OSError:  # a read-only home: the answer is still right, only not kept
        pass
    return findings


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def output_key(arguments: dict, model: str) -> str | None:
    """The key of an ``autotp plan`` run with ``arguments`` (its parsed options) on ``model`` (a
    name, or a config path whose bytes join the key); None when the cache is off."""
    if directory() is None:
        return None
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    config = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    text = json.dumps({"arguments": arguments, "config": config, "source": source_hash(),
                       "versions": [_version("torch"), _version("transformers")]}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def cached_output(key: str | None) -> dict | None:
    """What a run with this key printed (``{"stdout", "stderr", "status"}``), or None."""
    where = directory()
    if key is None or where is None:
        return None
    try:
        kept = json.loads((where / f"output-{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and {"stdout", "stderr", "status"} <= kept.keys() else None


def keep_output(key: str | None, stdout: str, stderr: str, status: int) -> None:
    """Keep what a successful run printed (atomically; a read-only cache directory keeps nothing)."""
    where = directory()
    if key is None or where is None or status != 0:
        return
    path = where / f"output-{key}.json"
    try:
        where.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"stdout": stdout, "stderr": stderr, "status": status}))
        partial.replace(path)
    except OSError:
        pass
