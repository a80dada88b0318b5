"""vLLM: a log's versions applied in place into a running vLLM engine.

Two ways in, one mechanism:

- ``VllmReceiver.open(llm, log, journal_path)`` for an offline ``vllm.LLM`` (any number of
  tensor-parallel workers): it drives the worker extension below on every worker with
  ``llm.collective_rpc``;
- ``WorkerExtension``, given to vLLM as ``worker_extension_cls=`` (``ENGINE_KWARGS``), for
  servers and RL frameworks that drive vLLM's workers themselves: ``collective_rpc("dcr_open",
  ...)``, ``"dcr_stage"``, ``"dcr_apply"``, ``"dcr_version"``, ``"dcr_close"``. Each worker
  receives its own slice, with vLLM's tensor-parallel group as the digest group.

Placement (where each checkpoint element lives in the engine) is discovered through the
engine's whole load pipeline: vLLM's in-place reload (``Worker.reload_weights``: its
``load_weights``, then the ``process_weights_after_loading`` of every layer, copied back into
the tensors the engine computes with). A blocked or permuted post-load layout (vLLM CPU's MoE
prepack, and its block-FP8 linear kernel's VNNI prepack of the e4m3 weights: per 32 output
rows, ``[K/2, 32, 2]``; the scales stay as loaded) is found like a fused or sliced one, and
stored compactly (placement.py).

What the integration changes in the engine (``keep_weights_in_place``, installed when this
module is imported, which ``worker_extension_cls`` does in every worker before the model
loads): on the CPU platform, vLLM packs every unquantized linear weight into a oneDNN (or
sgl-kernel) handle after loading and leaves an empty parameter behind, and the logits
projection computes from a packed copy of its weight. Neither can be updated in place, so
the integration makes those layers compute with ``torch.nn.functional.linear`` on their own
weight. That keeps every weight a live tensor (the refit writes only the changed elements)
at the cost of torch's GEMM instead of oneDNN's on CPU (tools/bench_vllm.py measures it).
Nothing changes on other platforms: where a post-load step transforms values (a quantization)
the parameter is *residual* and is rebuilt through the same reload pipeline.

After every apply the engine's prefix cache holds keys and values computed with the old
weights: ``VllmReceiver.apply`` resets it; callers of the worker extension call
``llm.reset_prefix_cache()`` (or the server's equivalent) themselves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dcr_log.errors import LineageError, PlacementError, UsageError

EXTENSION = "dcr_log.engines.vllm.WorkerExtension"
# What to pass to vllm.LLM (or the server's engine arguments) for a receiving engine.
ENGINE_KWARGS = {"worker_extension_cls": EXTENSION}

_PATCHED = False


def keep_weights_in_place() -> bool:
    """Make vLLM's CPU linear layers compute with their own weight parameter (see the module
    docstring). Idempotent; a no-op (False) where vLLM is not installed. Must run before the
    engine loads its model (importing this module does it)."""
    global _PATCHED
    if _PATCHED:
        return True
    try:
        import torch
        from vllm.model_executor.layers import utils as vllm_utils
    except ImportError:
        return False
    original = vllm_utils.dispatch_cpu_unquantized_gemm

    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is not None and not weight.is_meta and weight.ndim == 2:
            layer.cpu_linear = torch.nn.functional.linear  # reads layer.weight at every call
            return
        original(layer, remove_weight)

    dispatch_keeping_weight.__wrapped__ = original  # type: ignore[attr-defined]
    vllm_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    _PATCHED = True
    return True


keep_weights_in_place()


# -- the engine's tensors and load pipeline --------------------------------------------------

def engine_tensors(model: Any) -> dict[str, Any]:
    """Every parameter and buffer of a vLLM model, one name per tensor object (a tied weight
    appears once)."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t
    return out


def _emptied(model: Any) -> list[str]:
    """Parameters left empty by vLLM's post-load processing (packed into a kernel handle)."""
    return [n for n, p in model.named_parameters() if p.numel() == 0 and p.ndim == 1]


def pipeline_loader(worker: Any) -> Callable[[Iterable[tuple[str, Any]]], None]:
    """vLLM's own in-place reload on ``worker``: load_weights, then every layer's post-load
    processing, copied back into the tensors the engine computes with."""
    def load(weights: Iterable[tuple[str, Any]]) -> None:
        model = worker.model_runner.get_model()
        try:
            worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        except BaseException:
            _undo_layerwise_reload(model)
            raise
        _redo_expert_prepack(model)
    return load


def _undo_layerwise_reload(model: Any) -> None:
    """A reload that failed part way (a weight of the wrong shape) leaves the layers it had not
    reached on the meta device, and the engine unable to run. Put their tensors back (the
    values are the caller's to restore: discovery gives every word back)."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        return
    for layer in model.modules():
        info = layerwise.LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        if info.kernel_tensors is not None:
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def _redo_expert_prepack(model: Any) -> None:
    """Finish what vLLM's in-place reload leaves undone: it skips the experts kernel's own
    post-load step on a weight update (``process_weights_after_loading`` of the modular
    kernel's ``fused_experts``; on CPU, the grouped-GEMM prepack of w13 and w2), which leaves
    the experts in checkpoint layout under a kernel that reads the blocked one. Redo it and
    copy the result into the tensors the engine holds (their storage stays put)."""
    import torch
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsModular
    except ImportError:
        return
    base_step = FusedMoEExpertsModular.process_weights_after_loading
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or type(experts).process_weights_after_loading is base_step:
            continue
        kept = {n: p for n, p in module.named_parameters(recurse=False)}
        with torch.no_grad():
            experts.process_weights_after_loading(module)
            for name, old in kept.items():
                new = getattr(module, name)
                if new is old:
                    continue
                if new.shape != old.shape or new.dtype != old.dtype:
                    raise PlacementError(f"vLLM's expert post-load step changes {name!r} from "
                                         f"{tuple(old.shape)} to {tuple(new.shape)} on a reload: "
                                         "this engine cannot be refit in place")
                old.data.copy_(new)
                module.register_parameter(name, old)


def _tp() -> tuple[Any, int, int]:
    """vLLM's tensor-parallel group as a gloo group (None for one worker), this worker's rank
    in it and its size."""
    from vllm.distributed import parallel_state
    tp = parallel_state.get_tp_group()
    return (tp.cpu_group if tp.world_size > 1 else None), tp.rank_in_group, tp.world_size


# -- the worker side -------------------------------------------------------------------------

@dataclass
class OpenReport:
    """What ``dcr_open`` did on one worker."""

    rank: int
    version: int
    discovered: bool
    discovery_seconds: float
    pieces: int
    blocks: int
    residual: list[str]
    placement_path: str


class _WorkerState:
    def __init__(self, worker: Any, log_location: str, journal_path: str, version: int | None,
                 placement_path: str | None, verify: str, trust: Any):
        from dcr_log.log.deltalog import DeltaLog
        from dcr_log.receiver import Receiver, open_storage

        model = worker.model_runner.get_model()
        self.log = DeltaLog.open(log_location, trust=trust)
        group, rank, size = _tp()
        suffix = f"tp{rank}-of-{size}" if size > 1 else ""
        journal = Path(journal_path) / suffix if suffix else Path(journal_path)
        emptied = _emptied(model)
        if emptied:
            raise PlacementError(
                f"vLLM left {len(emptied)} parameters empty after loading ({emptied[0]!r}, ...): "
                f"their weights live in packed kernel handles no refit can reach. Start the engine "
                f"with worker_extension_cls={EXTENSION!r} (dcr_log.engines.vllm.ENGINE_KWARGS), "
                "which keeps them in place")
        self.loader = pipeline_loader(worker)
        tensors = engine_tensors(model)
        self.tensors = tensors
        self.tensor_layout = open_storage(tensors).layout()  # to know a saved placement is for them
        self.placement_file = Path(placement_path) if placement_path else \
            journal.parent / f"{journal.name}.placement.json"
        self.discovered, self.discovery_seconds = False, 0.0
        candidates = [version] if version is not None else self._candidates(journal)
        tried = []
        for v in candidates:
            placement = self._placement_for(self.log.commit(v))
            rx = Receiver.open(tensors, journal_path=journal, placement=placement, loader=self.loader,
                               group=group, rediscover=self._rediscover, trust=trust)
            try:
                rx.bind(self.log, v, verify=verify)
            except LineageError:
                rx.close()
                if version is not None:
                    raise
                tried.append(v)
                continue
            except BaseException:
                rx.close()
                raise
            self.rx = rx
            break
        else:
            raise LineageError(f"the engine holds none of versions {tried} of the log (state digests "
                               "differ): pass the version it was started from")
        self.report = OpenReport(rank, v, self.discovered, self.discovery_seconds,
                                 sum(len(ps) for ps in placement.pieces.values()),
                                 sum(1 for ps in placement.pieces.values() for p in ps if p.dims),
                                 sorted(placement.residual), str(self.placement_file))

    def _candidates(self, journal: Path) -> list[int]:
        """Versions the engine may hold, most likely first: the journal's (a receiver reopened in
        the same engine, or an engine restarted from the version the journal last committed),
        the version it had in flight, then the log's latest."""
        from dcr_log.receiver import Journal
        found: list[int] = []
        if journal.exists():
            peek = Journal.open(journal)
            try:
                st = peek.state()
                found = [v for v in (st.version, st.inflight) if v is not None]
            finally:
                peek.close()
        start, latest = self.log.start(), self.log.latest_version()
        return [v for v in dict.fromkeys(found + [latest]) if start <= v <= latest]

    def _placement_for(self, commit: Any):
        """The saved placement when it was found for this table, else one discovered now
        (through the engine's reload pipeline; the engine's words are given back) and saved."""
        import time

        from dcr_log.engines.discovery import discover
        from dcr_log.receiver.storage.placement import Placement
        path = self.placement_file
        if path.exists():
            try:
                placement = Placement.load(path)
                placement.check(table=commit, params=self.tensor_layout)
                return placement
            except PlacementError:
                pass
        t0 = time.perf_counter()
        placement = discover(self.loader, commit, self.tensors)
        self.discovery_seconds += time.perf_counter() - t0
        self.discovered = True
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        placement.save(tmp)
        os.replace(tmp, path)
        return placement

    def _rediscover(self, table: Any):
        from dcr_log.engines.discovery import discover
        return discover(self.loader, table, self.tensors)


class WorkerExtension:
    """Methods vLLM adds to each of its workers (``worker_extension_cls``), called on every
    tensor-parallel worker at once with ``collective_rpc``. ``self`` is the vLLM worker."""

    def dcr_open(self, log: str, journal_path: str, version: int | None = None,
                 placement_path: str | None = None, verify: str = "full", trust: Any = None) -> dict:
        """Open (discovering or loading the placement) and bind at the version the engine holds."""
        self.dcr_close()
        st = _WorkerState(self, str(log), str(journal_path), version, placement_path, verify, trust)
        self._dcr_state: _WorkerState | None = st
        return asdict(st.report)

    def _dcr(self) -> _WorkerState:
        st = getattr(self, "_dcr_state", None)
        if st is None:
            raise UsageError("no dcr receiver is open on this worker: call dcr_open first")
        return st

    def dcr_stage(self, version: int | None = None, verify: str = "sample") -> dict:
        """Fetch, check and decode the next version (or ``version``) while the engine serves."""
        st = self._dcr()
        return asdict(st.rx.stage(st.log, version, verify=verify))

    def dcr_apply(self, to: int | None = None, verify: str | None = None, staged: bool = False) -> list[int]:
        """Write: the staged version (``staged=True``), else every version up to ``to``."""
        st = self._dcr()
        if staged:
            return st.rx.apply()
        return st.rx.apply(st.log, to=to, verify=verify)

    def dcr_version(self) -> int | None:
        return self._dcr().rx.version

    def dcr_close(self) -> None:
        st = getattr(self, "_dcr_state", None)
        if st is not None:
            self._dcr_state = None
            st.rx.close()


# -- the offline LLM side --------------------------------------------------------------------

class VllmReceiver:
    """A receiver for an offline ``vllm.LLM`` started with ``**ENGINE_KWARGS``: every call
    runs on every worker (``llm.collective_rpc``)."""

    def __init__(self, llm: Any, reports: list[dict]):
        self.llm = llm
        self.open_reports = reports

    @staticmethod
    def open(llm: Any, log: Any, journal_path: str | os.PathLike, version: int | None = None,
             placement_path: str | os.PathLike | None = None, verify: str = "full",
             trust: Any = None) -> VllmReceiver:
        """``log``: the log's location (a DeltaLog gives its own). ``journal_path``: a
        directory for the receivers' journals (one per tensor-parallel rank) and their saved
        placements. ``version``: the version the engine was started from (default: the
        journal's, else the latest, checked by state digest)."""
        location = getattr(getattr(log, "store", None), "url", log)
        reports = _rpc(llm, "dcr_open", log=str(location), journal_path=str(journal_path),
                       version=version, placement_path=None if placement_path is None else str(placement_path),
                       verify=verify, trust=trust)
        return VllmReceiver(llm, reports)

    @property
    def version(self) -> int | None:
        versions = set(_rpc(self.llm, "dcr_version"))
        if len(versions) != 1:
            raise LineageError(f"the engine's workers hold different versions: {sorted(versions)}")
        return versions.pop()

    def stage(self, version: int | None = None, verify: str = "sample") -> list[dict]:
        return _rpc(self.llm, "dcr_stage", version=version, verify=verify)

    def apply(self, to: int | None = None, verify: str | None = None, staged: bool = False) -> list[int]:
        """Apply (the staged version with ``staged=True``), then reset the prefix cache."""
        try:
            done = _rpc(self.llm, "dcr_apply", to=to, verify=verify, staged=staged)
        finally:
            self.llm.reset_prefix_cache()
        return done[0]

    def follow(self, interval: float = 1.0, stop: Callable[[], bool] | None = None,
               until: int | None = None, verify: str | None = None) -> list[int]:
        """Apply every new version as it appears, until ``stop()`` or version ``until``."""
        import time
        stop = stop or (lambda: False)
        applied: list[int] = []
        while not stop():
            applied += self.apply(verify=verify)
            if until is not None and (self.version or 0) >= until:
                break
            deadline = time.monotonic() + interval
            while not stop() and time.monotonic() < deadline:
                time.sleep(min(0.05, interval))
        return applied

    def close(self) -> None:
        _rpc(self.llm, "dcr_close")

    def __enter__(self) -> VllmReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rpc(llm: Any, method: str, **kwargs) -> list:
    return llm.collective_rpc(method, kwargs=kwargs)
