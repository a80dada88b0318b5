"""``dcr keygen``, ``dcr sign``, ``dcr init`` and ``dcr append``: making keys, creating a log and
appending versions to it."""

from __future__ import annotations

from pathlib import Path

import typer

from dcr_log.cli.app import (
    CACHE_HELP,
    SIGN_HELP,
    cache_dir_option,
    err,
    json_option,
    progress_bar,
    say_left,
    say_result,
    signing_key_option,
    version_left,
)
from dcr_log.errors import UsageError

# The library is imported inside each command (numpy, pyarrow, zstandard...: `dcr --help` and
# `dcr --version` need none of it).


def keygen(key: Path = typer.Argument(..., metavar="KEY", help="private key file to create (and KEY.pub)"),
           as_json: bool = json_option()) -> None:
    """Create an ed25519 signing key: KEY (private, mode 0600) and KEY.pub (its public key)."""
    from dcr_log.signing import SigningKey, public_text

    k = SigningKey.generate()
    say_left(lambda: _keygen_left(key))
    pub = k.save(key)
    say_result(as_json, {"key": str(key), "public_key_file": str(pub), "public_key": public_text(k.public),
                         "key_id": k.key_id},
               f"{public_text(k.public)}  key id {k.key_id}; public key in {pub}")


def _keygen_left(key: Path) -> str:
    pub = Path(f"{key}.pub")
    if not key.exists():
        return "no key written"
    if not pub.exists():
        return f"{key} written without {pub}: delete {key} and run dcr keygen again"
    return f"key {key} and {pub} written"


def sign(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
         key: Path = typer.Option(..., "--key", metavar="KEY", help="ed25519 private key file"),
         version: int | None = typer.Option(
             None, "--version", metavar="V", help="only this version (default every version)"),
         as_json: bool = json_option()) -> None:
    """Sign existing versions with KEY (a new key of a rotation, or a log written unsigned)."""
    from dcr_log.log.deltalog import DeltaLog

    k = signing_key_option(key)
    dlog = DeltaLog.open(log)
    versions = dlog.versions() if version is None else [version]
    signed: list[int] = []
    say_left(lambda: f"{len(signed)} of {len(versions)} versions signed: run dcr sign again "
                  "(signing a version again is harmless)")
    for v in versions:
        dlog.sign(v, k)
        signed.append(v)
    say_result(as_json, {"signed": versions, "key_id": k.key_id},
               f"signed {len(versions)} versions with key {k.key_id}")


FILES_HELP = ("carry the checkpoint directory's other files (config, tokenizer, ...: every regular "
              "file at its top level but the weights and dot files); default: when there are any. "
              "--no-files carries none (append: the previous version's are kept)")


def _checkpoint_files(from_: Path, wanted: bool | None) -> dict[str, Path] | None:
    """The files ``--from`` carries: None when none are to be carried (not a directory, or
    --no-files), else the directory's files (possibly none)."""
    if wanted is False:
        return None
    if not from_.is_dir():
        if wanted:
            raise UsageError(f"--files needs a checkpoint directory; {from_} is a file")
        return None
    from dcr_log.write.files import collect_files

    skipped: list[str] = []
    found = collect_files(from_, skipped)
    if skipped:  # (a model whose loader reads them, e.g. sentence-transformers' 1_Pooling, needs them)
        err.print(f"dcr: note: directories in {from_} are not carried (only its top-level files are): "
                  f"{', '.join(skipped)}", markup=False)
    return found


QUANTIZE_HELP = ("fp8-block: log the checkpoint as block-scaled FP8 for an FP8 rollout engine (e4m3 linear "
                 "weights with fp32 W_scale_inv per 128x128 block, dcr_log.quant; config.json gains its "
                 "quantization_config)")
SCALE_POLICY_HELP = ("with --quantize: keep (a block keeps the previous version's scale while it fits: fewer "
                     "changed words) or fresh (every scale recomputed)")


def _quantizer(quantize: str | None, policy: str):
    if quantize is None:
        return None
    if quantize != "fp8-block":
        raise UsageError(f"--quantize must be fp8-block, not {quantize!r}")
    from dcr_log.quant import Fp8BlockQuantizer

    return Fp8BlockQuantizer(policy=policy)


def _quantized(quantizer, state: dict, previous: dict | None = None) -> dict:
    """The checkpoint's state in the quantizer's FP8 form (torch tensors sharing the words)."""
    import warnings

    from dcr_log.state import to_torch

    with warnings.catch_warnings():  # the checkpoint's words are mapped read-only; they are only read
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        prev = None if previous is None else {n: to_torch(b) for n, b in previous.items()}
        return quantizer.quantize_state({n: to_torch(b) for n, b in state.items()}, previous=prev)


def _with_quantization_config(quantizer, carried: dict | None) -> dict | None:
    """config.json, if carried, with the quantizer's quantization_config: the engine loads the
    FP8 weights as the pre-quantized checkpoint they are."""
    import json

    if quantizer is None or not carried or "config.json" not in carried:
        return carried
    source = carried["config.json"]
    data = source if isinstance(source, bytes | bytearray) else Path(source).read_bytes()
    try:
        config = json.loads(data)
    except ValueError:
        raise UsageError("config.json is not JSON: cannot add its quantization_config") from None
    config["quantization_config"] = quantizer.quantization_config()
    return {**carried, "config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}


# dcr_log.write.sharded.DEFAULT_FEATURES, said here without importing the writer (a test checks
# the two agree)
FEATURES_DEFAULT = "rans-encoding,sum-digests"


def _features(text: str) -> tuple[str, ...]:
    from dcr_log.format import KNOWN_FEATURES

    names = () if text.strip() in ("", "none") else tuple(f.strip() for f in text.split(","))
    unknown = sorted(set(names) - KNOWN_FEATURES)
    if unknown or "" in names:
        raise UsageError(f"--features: unknown {', '.join(map(repr, unknown or ['']))}; known: "
                         f"{', '.join(sorted(KNOWN_FEATURES))} (or none)")
    return names


def _files_json(commit) -> dict:
    if commit.files is None:
        return {}
    return {"files": len(commit.files), "file_bytes": sum(f.size for f in commit.files)}


def _files_said(commit) -> str:
    if commit.files is None:
        return ""
    return f", {len(commit.files)} files ({sum(f.size for f in commit.files)} bytes)"


def init(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
         from_: Path = typer.Option(..., "--from", metavar="CKPT", help="checkpoint: .safetensors or a directory"),
         files: bool | None = typer.Option(None, "--files/--no-files", help=FILES_HELP + "; "
                                              "--files makes a log that carries files even if there are none yet"),
         cache: str | None = typer.Option(None, "--cache", metavar="DIR", help=CACHE_HELP),
         sign_key: Path | None = typer.Option(None, "--sign", metavar="KEY", help=SIGN_HELP),
         features: str = typer.Option(
             FEATURES_DEFAULT, "--features", metavar="NAMES",
             help="the log's format features, comma-separated ('none': a plain format-1 log; ulp-encoding: "
                  "pcodec-coded records, as logs before rans-encoding; FORMAT.md section 14); files is added "
                  "by --files"),
         quantize: str | None = typer.Option(None, "--quantize", metavar="fp8-block", help=QUANTIZE_HELP),
         scale_policy: str = typer.Option("keep", "--scale-policy", metavar="keep|fresh", help=SCALE_POLICY_HELP),
         as_json: bool = json_option()) -> None:
    """Create LOG; version 0 is the full state of the checkpoint (and its files: the log then
    carries every version's files)."""
    from dcr_log.checkpoint import load_checkpoint
    from dcr_log.write.writer import LogWriter, default_writer_id

    key = signing_key_option(sign_key)
    chosen = _features(features)
    quantizer = _quantizer(quantize, scale_policy)
    state = load_checkpoint(from_)
    if quantizer is not None:
        state = _quantized(quantizer, state)
    carried = _with_quantization_config(quantizer, _checkpoint_files(from_, files))
    if carried is not None and not carried and files is None:
        carried = None  # a directory of weights only: a log without files, unless --files
    if carried is None and files:
        carried = {}
    writer_id = default_writer_id()
    say_left(lambda: version_left(log, 0, writer_id))
    with progress_bar("init", sum(t.nbytes for t in state.values())) as advance:
        writer = LogWriter.create(log, state, progress=advance, cache_dir=cache_dir_option(cache),
                                  signing_key=key, files=carried, writer_id=writer_id, features=chosen)
    say_left(lambda: "version 0 committed")
    commit = writer.log.commit(0)
    say_result(as_json, {"version": 0, "tensors": len(commit.tensors), "bytes": commit.delta_bytes,
                         "state_digest": f"{commit.state_digest:016x}", **_files_json(commit)},
               f"version 0: {len(commit.tensors)} tensors, {commit.delta_bytes} bytes{_files_said(commit)}")


def append(log: str = typer.Argument(..., metavar="LOG", help="log directory or URL"),
           from_: Path = typer.Option(..., "--from", metavar="CKPT", help="checkpoint: .safetensors or a directory"),
           files: bool | None = typer.Option(None, "--files/--no-files", help=FILES_HELP),
           cache: str | None = typer.Option(None, "--cache", metavar="DIR", help=CACHE_HELP),
           check_cache: bool = typer.Option(
               False, "--check-cache",
               help="hash every cached baseline word before trusting it, even where the last "
                    "append on this machine sealed the cache since the last boot"),
           sign_key: Path | None = typer.Option(None, "--sign", metavar="KEY", help=SIGN_HELP),
           allow_layout_change: bool = typer.Option(
               False, "--allow-layout-change",
               help="accept a checkpoint whose tensor table differs from the latest version's "
                    "(a tensor added, removed, renamed, reshaped or retyped); refused without it"),
           quantize: str | None = typer.Option(None, "--quantize", metavar="fp8-block", help=QUANTIZE_HELP),
           scale_policy: str = typer.Option("keep", "--scale-policy", metavar="keep|fresh", help=SCALE_POLICY_HELP),
           as_json: bool = json_option()) -> None:
    """Append the checkpoint's state as the next version, stored as a delta (and, in a log
    that carries files, the directory's files: the whole set, a file left out is dropped).
    A checkpoint of another tensor table (another model) is refused unless
    --allow-layout-change.

    The baseline (the latest version's state) comes from the local cache that init and append
    keep, checked against the commit's digests; without one the log is replayed. Words the
    last append sealed since this machine's last boot are not hashed again (--check-cache
    hashes them).
    """
    from dcr_log.checkpoint import load_checkpoint
    from dcr_log.log.deltalog import DeltaLog
    from dcr_log.write.writer import LogWriter, default_writer_id

    key = signing_key_option(sign_key)
    dlog = DeltaLog.open(log)
    if files and not dlog.has_files:
        raise UsageError(f"{log} was created without the feature 'files': its versions carry no "
                         "files (the feature is chosen by dcr init)")
    quantizer = _quantizer(quantize, scale_policy)
    state = load_checkpoint(from_)
    carried = _with_quantization_config(quantizer, _checkpoint_files(from_, files))
    if quantizer is not None:
        from dcr_log.quant import SCALE_SUFFIX

        previous = None
        if quantizer.policy == "keep":  # the scales the latest version holds (small tensors)
            names = {t.name for t in dlog.commit(dlog.latest_version()).tensors if t.name.endswith(SCALE_SUFFIX)}
            previous = dlog.materialize(tensors=names) if names else None
        state = _quantized(quantizer, state, previous)
    if carried and not dlog.has_files:
        err.print(f"dcr: note: {log} carries no files (created without them): "
                  f"{len(carried)} files of {from_} not logged", markup=False)
        carried = None
    say_left(lambda: f"version {dlog.latest_version() + 1} not committed")
    writer_id = default_writer_id()
    writer = LogWriter.open(dlog, cache_dir=cache_dir_option(cache), signing_key=key, writer_id=writer_id,
                            check_cache=check_cache)
    version = writer.version + 1
    say_left(lambda: version_left(log, version, writer_id))
    with progress_bar("append", sum(t.nbytes for t in state.values())) as advance:
        commit = writer.append(state, progress=advance, files=carried if dlog.has_files else None,
                               allow_layout_change=allow_layout_change)
    say_left(lambda: f"version {commit.version} committed")
    pct = 100.0 * commit.stats.changed_elements / max(commit.stats.total_elements, 1)
    say_result(as_json, {"version": commit.version, "parent": commit.parent,
                         "changed_elements": commit.stats.changed_elements,
                         "total_elements": commit.stats.total_elements, "changed_pct": pct,
                         "bytes": commit.delta_bytes, "state_digest": f"{commit.state_digest:016x}",
                         **_files_json(commit)},
               f"version {commit.version}: {commit.stats.changed_elements} changed ({pct:.3f}%), "
               f"{commit.delta_bytes} bytes{_files_said(commit)}")
